"""A finished multi-process CPU run exits 0: gloo's worker threads get the GIL before the interpreter finalizes.

The abort this prevents ("terminate called without an active exception", SIGABRT, exit -6, after all the work and
the results were done), read here from core dumps (torch 2.13.0+cpu, CPython 3.11;
``tests/runtime/test_distributed_exit.py``):

1. gloo runs each collective on a worker thread (``c10d::ProcessGroupGloo::runLoop``, threads named
   ``pt_gloo_runloop``). The caller's ``wait()`` returns when the work is done; the worker drops *its* reference to
   the work a moment later.
2. When that is the last reference to a tensor that has a Python object (an ``all_gather`` output the caller has
   already let go, as accelerate's and TRL's gathers do), the worker must take the GIL to free it
   (``c10::TensorImpl::decref_pyobject``).
3. If the main thread has meanwhile reached ``Py_FinalizeEx``, CPython ends the worker with ``pthread_exit``; the
   forced unwind crosses the work's ``noexcept`` destructor (``~AsyncAllgatherWork``) and libstdc++ calls
   ``std::terminate``.

``dist.destroy_process_group()`` does not close the window: the gloo worker threads outlive it (and the group, which
DDP's reducer still holds). The window is the main thread's switch interval: a script that exits within ~5 ms of its
last collective (or a busy machine) hits it now and then; with the switch interval raised it hits every run. The bug is
torch's (its decref guard checks ``Py_IsInitialized``, still true while finalizing: pytorch/pytorch#190489).

The fix here: an ``atexit`` hook (atexit functions run before CPython marks the interpreter finalizing) that, when
gloo worker threads exist, releases the GIL for ``GLOO_DRAIN_SECONDS`` so that a worker waiting to free a tensor does
so while the interpreter is whole. Registered when this package is imported; it costs nothing in a process without
gloo threads, and ``GLOO_DRAIN_SECONDS`` at the exit of one that has them.
"""

from __future__ import annotations

import atexit
import os
import sys
import time

# Seconds the exit hook releases the GIL for. A waiting worker takes the GIL as soon as it is released and frees a
# tensor in microseconds; the margin is for a busy machine's scheduler (2 shared cores in CI).
GLOO_DRAIN_SECONDS = 0.2

_registered = False


def gloo_worker_threads() -> int:
    """Threads of this process that belong to gloo (``pt_gloo_runloop``, ``gloo_tcp_loop``), from ``/proc`` (Linux).

    Elsewhere (no ``/proc``): 1 while ``torch.distributed`` is initialized, else 0."""
    task_dir = "/proc/self/task"
    if not os.path.isdir(task_dir):
        dist = sys.modules.get("torch.distributed")
        return int(dist is not None and dist.is_available() and dist.is_initialized())
    count = 0
    for tid in os.listdir(task_dir):
        try:
            with open(os.path.join(task_dir, tid, "comm")) as fh:
                count += "gloo" in fh.read()
        except OSError:  # the thread ended while listing
            continue
    return count


def drain_gloo_workers() -> None:
    """Release the GIL for ``GLOO_DRAIN_SECONDS`` if gloo worker threads exist (the exit hook's body)."""
    if sys.modules.get("torch.distributed") is None:  # gloo never loaded: nothing to wait for
        return
    if gloo_worker_threads():
        time.sleep(GLOO_DRAIN_SECONDS)  # sleeping releases the GIL: waiting workers free their tensors now


def drain_gloo_workers_at_exit() -> None:
    """Register ``drain_gloo_workers`` to run at interpreter exit (once per process)."""
    global _registered
    if not _registered:
        atexit.register(drain_gloo_workers)
        _registered = True
