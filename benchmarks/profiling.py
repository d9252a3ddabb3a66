"""Counting host synchronizations requested by trl_rollout_corr's code (a measuring tool for bench_step.py and
tests/grpo/test_host_syncs.py; it patches ``torch.Tensor`` methods and ``torch`` functions while open, so it lives
outside the library).

On a GPU, every call that hands a device value to Python blocks until the device catches up.
:func:`count_host_syncs` wraps each such call that Python code can make and counts the calls whose caller lives in
``trl_rollout_corr`` (TRL's and transformers' own syncs are not ours to remove):

* ``Tensor.item``/``cpu``/``numpy``/``tolist``/``__bool__``/``__int__``/``__float__``/``__index__``/``nonzero``/
  ``equal``/``allclose``/``masked_select``/``unique``;
* ``torch.equal``/``nonzero``/``allclose``/``masked_select``/``unique``/``argwhere``, ``torch.where`` with one
  argument;
* indexing with a boolean mask (``x[mask]``, a ``nonzero`` inside), and assigning a tensor through one.

``tolist`` of a CPU tensor is not counted, so ``x.cpu().tolist()`` counts once (as on a GPU); every other call counts
even on a CPU-only machine: the count is what the same code would do on a GPU. Calls made while TRL's data collator
runs in package code (``trl_hooks/async_grpo_data.py``: CPU batches, before they reach the device) are not syncs
and are not counted. ``count_host_syncs(everywhere=True)`` counts every caller (TRL, transformers, accelerate too):
the total to compare with TRL's own trainer.

What it cannot see: syncs inside C++ operators called from Python (``bincount`` without ``minlength`` and
``repeat_interleave`` without ``output_size`` on CUDA, ``masked_scatter``, allocator retries), a torch function bound
before the counter opened (``from torch import equal``), ``x.to("cpu")`` (on a CPU machine it cannot be told from
``x.to(device)``, which is no sync on a GPU: use ``x.cpu()``), and whether a CPU tensor would be on the device on a
GPU (``tolist`` of a CPU tensor is not counted).
On a GPU, ``torch.cuda.set_sync_debug_mode("warn")`` sees every real sync.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Iterator

import torch

import trl_rollout_corr

_PACKAGE_DIR = os.path.dirname(os.path.abspath(trl_rollout_corr.__file__))
_EXCLUDED = tuple(os.path.join(_PACKAGE_DIR, name) for name in ("demo", "cli"))  # not the training path
_CPU_PIPELINE = (os.path.join(_PACKAGE_DIR, "trl_hooks", "async_grpo_data.py"),)  # collates CPU batches
_METHODS = ("item", "cpu", "numpy", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero", "equal",
            "allclose", "masked_select", "unique")
_FUNCTIONS = ("equal", "nonzero", "allclose", "masked_select", "unique", "argwhere")


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _blocks(name: str, tensor, args, kwargs) -> bool:
    """Whether this call of ``name`` hands a device value to the host."""
    if name == "tolist":
        return isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu"
    if name == "__getitem__":
        return _bool_index(args[0])
    if name == "__setitem__":
        return _bool_index(args[0]) and isinstance(args[1], torch.Tensor) and args[1].dim() > 0
    if name == "where":
        return len(args) + len(kwargs) == 1  # torch.where(condition): nonzero
    return True


def _in_cpu_pipeline(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith(_CPU_PIPELINE):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def count_host_syncs(everywhere: bool = False) -> Iterator[Counter]:
    """``with count_host_syncs() as syncs: ...`` then ``sum(syncs.values())``; keys are ``file:line function method``.

    Only calls from this package's code unless ``everywhere``; then other callers' keys start with ``ext:``.
    """
    counts: Counter = Counter()
    patched = [(torch.Tensor, name) for name in (*_METHODS, "__getitem__", "__setitem__")]
    patched += [(torch, name) for name in (*_FUNCTIONS, "where")]
    originals = {(owner, name): getattr(owner, name) for owner, name in patched}
    busy = []  # a wrapped call made by a wrapped call (torch's own Python) is the outer call's

    def wrap(owner, name, original):
        def wrapper(*args, **kwargs):
            if busy:
                return original(*args, **kwargs)
            first, rest = (args[0], args[1:]) if owner is torch.Tensor else (None, args)
            if _blocks(name, first, rest, kwargs):
                frame = sys._getframe(1)
                filename = frame.f_code.co_filename
                ours = filename.startswith(_PACKAGE_DIR) and not filename.startswith(_EXCLUDED)
                if (everywhere or ours) and not (ours and _in_cpu_pipeline(frame)):
                    prefix = "" if ours else "ext:"
                    counts[f"{prefix}{os.path.basename(filename)}:{frame.f_lineno} {frame.f_code.co_name} "
                           f"{'torch.' if owner is torch else ''}{name}"] += 1
            busy.append(1)
            try:
                return original(*args, **kwargs)
            finally:
                busy.pop()
        return wrapper

    for (owner, name), original in originals.items():
        setattr(owner, name, wrap(owner, name, original))
    try:
        yield counts
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)
