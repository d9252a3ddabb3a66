"""Run N worker processes, J at a time: the one runner of every driver that starts a fresh interpreter per run
(issue 53): the demo's ``run_all`` (``demo/truncation.py``: the probe and the GRPO runs) and the experiments
``mismatch_bench.py``, ``monitor_scenarios.py`` and ``vllm_truncation.py``. ``experiments/mismatch_train.py`` forks
its runs from a process that already imported torch and TRL instead (``run_all`` there), to skip ~40 s of imports
per run.

Each job's stdout and stderr go to its ``log`` file when it names one, else stdout is discarded and stderr is kept in
a temporary file (not a pipe: a chatty worker cannot block on a full pipe buffer) whose tail is printed on failure.
Each worker leads its own process group; when the pool stops early (``on_done`` raised, e.g. the demo's failed
worker, or Ctrl-C), every still-running worker's group (the worker and what it started, e.g. vLLM's engine process)
gets SIGTERM, and the group of a worker still alive 10 s later gets SIGKILL (``stop``).
"""

from __future__ import annotations

import os
import signal
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
    stderr_tail)`` as each ends (``done``: how many have ended). Returns label -> exit code for every job (the
    labels must differ). If ``on_done`` raises (or the wait is interrupted), the workers still running are stopped
    (``stop``) before the exception propagates; the jobs not yet started never start."""
    if not isinstance(parallel, int) or parallel < 1:
        raise ValueError(f"parallel={parallel!r}: the number of runs at a time (--jobs) must be an integer >= 1")
    todo, running, codes = list(jobs), [], {}
    labels = [job.label for job in todo]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"Job.label {repeated} repeated: each job needs its own label (it keys the exit codes)")
    with tempfile.TemporaryDirectory() as scratch:
        try:
            while todo or running:
                while todo and len(running) < parallel:
                    job = todo.pop(0)
                    out_path = job.log or os.path.join(scratch, f"{len(codes) + len(running)}.stderr")
                    if job.log:
                        os.makedirs(os.path.dirname(os.path.abspath(job.log)), exist_ok=True)
                    with open(out_path, "w") as out:
                        proc = subprocess.Popen(job.cmd, env=job.env, stdin=subprocess.DEVNULL,
                                                stdout=out if job.log else subprocess.DEVNULL, stderr=out,
                                                start_new_session=True)  # its own group: stop() reaches its children
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
        finally:  # empty unless on_done raised or the wait was interrupted: stop the workers still running
            stop([proc for proc, *_ in running])
    return codes


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the worker leads its group (start_new_session): its pid is the group's id
    except ProcessLookupError:  # the whole group has exited already
        pass


def stop(procs: list[subprocess.Popen], grace_seconds: float = 10.0) -> None:
    """SIGTERM each worker's process group, wait up to ``grace_seconds`` for the workers, SIGKILL the groups of
    those still alive then."""
    for proc in procs:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.time() + grace_seconds
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
