"""A finished multi-process gloo run exits 0 through normal interpreter teardown
(trl_rollout_corr/runtime/distributed_exit.py).

The abort is a race (gloo's worker thread frees a tensor as the interpreter finalizes): measured with the switch
interval raised, 2-rank torchrun launches of the same collectives without a print (an earlier form of ``gather``)
aborted in 4 of 4 without the hook and 0 of 8 with it; ``gloo_exit_worker.py bare gather`` as it is (it prints once,
which releases the GIL before the collectives) aborted in 2 of 4 launches without a launcher: too few to assert on.
The deterministic check is the ``waiter`` one: at exit the package's hook
releases the GIL to the threads waiting for it, before the interpreter finalizes; without the package nothing does.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = str(Path(__file__).resolve().parents[1] / "support" / "gloo_exit_worker.py")
ROOT = str(Path(__file__).resolve().parents[2])


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _start(args: list[str], **env: str) -> subprocess.Popen:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.Popen([sys.executable, WORKER, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **env})


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    return proc.wait(timeout=180), proc.stdout.read()


def test_a_finished_gloo_run_exits_0_once_the_package_is_imported(tmp_path):
    port = _free_port()
    ranks = [_start(["drained", "gather"], RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
             for rank in range(2)]
    markers = {variant: tmp_path / f"{variant}.marker" for variant in ("bare", "drained")}
    waiters = {variant: _start([variant, "waiter", str(marker), _free_port()]) for variant, marker in markers.items()}
    for variant, proc in waiters.items():
        rc, out = _finish(proc)
        assert rc == 0, (variant, out)
    # the hook let the waiting thread run before the interpreter finalized; without the package nothing did
    assert markers["drained"].exists() and not markers["bare"].exists(), {v: m.exists() for v, m in markers.items()}
    results = [_finish(proc) for proc in ranks]
    assert [rc for rc, _ in results] == [0, 0], results
    assert all("started" in out and "terminate called" not in out for _, out in results), results
