"""Run N worker processes, J at a time: the one runner of the experiments that start a fresh interpreter per run
(``mismatch_bench.py``, ``monitor_scenarios.py``, ``vllm_truncation.py``; issue 53). ``mismatch_train.py`` forks
its runs from a process that already imported torch and TRL instead (``run_all`` there), to skip ~40 s of imports
per run.

Each job's stdout and stderr go to its ``log`` file when it names one, else stdout is discarded and stderr is kept in
a temporary file (not a pipe: a chatty worker cannot block on a full pipe buffer) whose tail is printed on failure.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass
class Job:
    """One worker process: ``cmd`` run with ``env``; ``label`` names it in the progress lines."""

    cmd: list[str]
    label: str
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    log: str | None = None  # stdout and stderr to this file (kept); None: stderr's tail printed on failure


def tail(path: str, chars: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


def report(job: Job, returncode: int, seconds: float, done: int, stderr_tail: str) -> None:
    """The default progress line: ``[n] label seconds``, or ``FAILED label`` and the end of its output."""
    if returncode == 0:
        print(f"[{done}] {job.label} {seconds:.0f} s", flush=True)
    else:
        print(f"FAILED {job.label} (exit {returncode}):\n{stderr_tail}", flush=True)


def run_processes(jobs: Iterable[Job], parallel: int, on_done: Callable[..., None] = report,
                  poll_seconds: float = 0.5) -> dict[str, int]:
    """Start ``jobs`` in order, at most ``parallel`` running at once; call ``on_done(job, returncode, seconds, done,
    stderr_tail)`` as each ends (``done``: how many have ended). Returns label -> exit code for every job."""
    if not isinstance(parallel, int) or parallel < 1:
        raise ValueError(f"parallel={parallel!r}: the number of runs at a time (--jobs) must be an integer >= 1")
    todo, running, codes = list(jobs), [], {}
    with tempfile.TemporaryDirectory() as scratch:
        while todo or running:
            while todo and len(running) < parallel:
                job = todo.pop(0)
                out_path = job.log or os.path.join(scratch, f"{len(codes) + len(running)}.stderr")
                if job.log:
                    os.makedirs(os.path.dirname(os.path.abspath(job.log)), exist_ok=True)
                with open(out_path, "w") as out:
                    proc = subprocess.Popen(job.cmd, env=job.env, stdin=subprocess.DEVNULL,
                                            stdout=out if job.log else subprocess.DEVNULL, stderr=out)
                running.append((proc, job, out_path, time.time()))
            time.sleep(poll_seconds)
            for item in list(running):
                proc, job, out_path, t0 = item
                if proc.poll() is None:
                    continue
                running.remove(item)
                codes[job.label] = proc.returncode
                on_done(job, proc.returncode, time.time() - t0, len(codes),
                        tail(out_path) if proc.returncode else "")
    return codes
