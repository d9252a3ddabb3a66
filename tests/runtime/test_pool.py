"""runtime/pool.py, the one runner of N worker processes J at a time (the demo's driver and the experiments'): the
bound holds, every job runs once, a failure's output reaches the report, a log file keeps stdout and stderr, an
``on_done`` that raises leaves no worker (nor a worker's child) behind, bad ``parallel`` and repeated labels are
refused."""

from __future__ import annotations

import sys
import time

import pytest

from trl_rollout_corr.runtime.pool import Job, run_processes

SLEEPER = "import sys, time; open(sys.argv[1], 'w').write(str(time.time())); time.sleep(0.4); " \
          "open(sys.argv[1], 'a').write(' ' + str(time.time()))"


def test_at_most_parallel_jobs_run_at_once_and_each_runs_once(tmp_path):
    paths = [tmp_path / f"{i}.txt" for i in range(5)]
    ended = []
    codes = run_processes([Job([sys.executable, "-c", SLEEPER, str(p)], p.name) for p in paths], 2,
                          on_done=lambda job, code, seconds, done, err: ended.append((job.label, code, done)),
                          poll_seconds=0.05)
    assert codes == {p.name: 0 for p in paths}
    assert sorted(label for label, _, _ in ended) == sorted(p.name for p in paths)
    assert [done for _, _, done in ended] == [1, 2, 3, 4, 5]
    spans = [tuple(map(float, p.read_text().split())) for p in paths]
    starts = sorted(s for s, _ in spans)
    # (the order of the children's own start stamps is not checked: under load a child's interpreter start-up can
    # reorder two jobs the pool started 0.05 s apart; a child's stamped span lies inside its real lifetime, so the
    # overlap count below is a valid bound)
    for t in starts:  # at every start, the jobs running then (started, not yet ended) number at most 2
        assert sum(1 for s, e in spans if s <= t < e) <= 2
    assert max(sum(1 for s, e in spans if s <= t < e) for t in starts) == 2  # and the pool did use 2


def test_a_failure_reports_its_stderr_and_the_others_still_run(tmp_path, capsys):
    fail = Job([sys.executable, "-c", "import sys; sys.stderr.write('x' * 100000 + 'the end'); sys.exit(3)"], "bad")
    ok = Job([sys.executable, "-c", "print('fine')"], "good")
    t0 = time.time()
    assert run_processes([fail, ok], 1, poll_seconds=0.05) == {"bad": 3, "good": 0}
    assert time.time() - t0 < 60  # 100 kB of stderr (more than a pipe's buffer) does not block the worker
    out = capsys.readouterr().out
    assert "FAILED bad (exit 3)" in out and out.split("FAILED bad (exit 3):\n")[1].split("\n")[0].endswith("the end")
    assert "[2] good" in out


def test_a_log_file_keeps_stdout_and_stderr(tmp_path):
    log = tmp_path / "sub" / "run.log"
    job = Job([sys.executable, "-c", "import sys; print('out'); sys.stderr.write('err\\n')"], "logged", log=str(log))
    assert run_processes([job], 1, on_done=lambda *a: None, poll_seconds=0.05) == {"logged": 0}
    assert log.read_text().split() == ["out", "err"] or sorted(log.read_text().split()) == ["err", "out"]


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not reaped by its new parent, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


# the sleeper writes its own pid and its child's (a sleeping grandchild of the pool, like vLLM's engine process)
SLEEPER_WITH_CHILD = ("import subprocess, sys, os, time; "
                      "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
                      "open(sys.argv[1] + '.tmp', 'w').write(f'{os.getpid()} {c.pid}'); "
                      "os.replace(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(120)")
# the failing job waits until the sleeper has written its pids, so the sleeper is running when the failure arrives
FAIL_AFTER = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.05)\nsys.exit(2)"


def test_an_on_done_that_raises_stops_the_running_workers_and_their_children(tmp_path):
    pids = tmp_path / "pids"
    jobs = [Job([sys.executable, "-c", SLEEPER_WITH_CHILD, str(pids)], "sleeper"),
            Job([sys.executable, "-c", FAIL_AFTER, str(pids)], "fails"),
            Job([sys.executable, "-c", "open(__import__('sys').argv[1], 'w')", str(tmp_path / "late")], "late")]

    def on_done(job, code, seconds, done, err):
        if code:
            raise RuntimeError(f"{job.label} failed")

    t0 = time.time()
    with pytest.raises(RuntimeError, match="fails failed"):
        run_processes(jobs, 2, on_done=on_done, poll_seconds=0.05)
    assert time.time() - t0 < 60  # the sleepers (120 s) were not waited for
    worker, child = map(int, pids.read_text().split())
    assert not alive(worker)
    deadline = time.time() + 10  # the child got SIGTERM with its group; give it a moment to exit
    while alive(child) and time.time() < deadline:
        time.sleep(0.05)
    assert not alive(child)
    assert not (tmp_path / "late").exists()  # the job not yet started never starts


def test_repeated_labels_are_refused():
    with pytest.raises(ValueError, match="Job.label \\['a'\\] repeated"):
        run_processes([Job(["true"], "a"), Job(["true"], "a")], 1)


@pytest.mark.parametrize("parallel", [0, -1, 1.5])
def test_bad_parallel_is_refused_naming_the_option(parallel):
    with pytest.raises(ValueError, match="--jobs"):
        run_processes([], parallel)
