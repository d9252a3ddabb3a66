"""A process of tests/runtime/test_distributed_exit.py (the teardown abort of
trl_rollout_corr/runtime/distributed_exit.py).

Usage: python gloo_exit_worker.py {drained|bare} gather              (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)
       python gloo_exit_worker.py {drained|bare} waiter MARKER PORT  (one process)

``drained`` imports trl_rollout_corr, as a training script does (that registers the exit hook); ``bare`` does not.
The switch interval is raised so the main thread keeps the GIL unless it blocks, from its last statement into the
interpreter's finalization: the race a busy machine loses now and then, lost every time.

``gather``: gloo collectives whose last references gloo's worker threads drop as the interpreter exits (without the
hook one rank or both abort in about half the launches, measured). ``waiter``: a one-process gloo group and a Python
thread that wakes 50 ms after the main thread is done and needs the GIL: it writes MARKER only if someone releases the
GIL at exit before the interpreter finalizes (deterministic: what the hook does for gloo's threads).
"""

import sys
import threading
import time

variant, mode = sys.argv[1], sys.argv[2]
if variant == "drained":
    import trl_rollout_corr  # noqa: F401  (registers the exit hook)

import torch  # noqa: E402  (after the package, as in a training script)
import torch.distributed as dist  # noqa: E402


def gather() -> None:
    dist.init_process_group("gloo")
    sys.setswitchinterval(2.0)
    print("started", flush=True)  # (printing releases the GIL: nothing is printed after the last collective)
    works = []
    for i in range(16):
        outputs = [torch.empty(1000) for _ in range(dist.get_world_size())]
        works.append(dist.all_gather(outputs, torch.full((1000,), float(i)), async_op=True))
    works[-1].wait()
    del works, outputs  # the Python side lets go: gloo's worker threads now hold the last references


def waiter(marker: str, port: str) -> None:
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")

    def wake_and_mark() -> None:
        time.sleep(0.05)  # the main thread is at exit by now, holding the GIL
        with open(marker, "w") as fh:
            fh.write("ran")
        threading.Event().wait()

    sys.setswitchinterval(5.0)
    threading.Thread(target=wake_and_mark, daemon=True).start()


if mode == "gather":
    gather()
else:
    waiter(*sys.argv[3:5])
