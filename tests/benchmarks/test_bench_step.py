"""benchmarks/bench_step.py's regression check: the printed verdict from given timings (no timing is measured or
asserted here)."""

from benchmarks import bench_step


def runs(*pairs):
    return [{"step_s": wall, "cpu_s": cpu} for wall, cpu in pairs]


def test_the_decoupled_step_is_flagged_above_the_threshold_and_not_below():
    results = {bench_step.BASELINE: runs((1.0, 1.0), (1.0, 1.0), (2.0, 2.0)),
               bench_step.WATCHED: runs((0.98, 0.78), (0.97, 0.80), (1.9, 1.5))}  # wall 0.97 (median), CPU 0.78
    wall, cpu = bench_step.watch_lines(results, accumulation=1)
    assert "wall" in wall and "median 0.970" in wall and "FLAG" in wall
    assert "CPU time" in cpu and "median 0.780" in cpu and "FLAG" not in cpu and "ok" in cpu
    assert "0.980, 0.970, 0.950" in wall  # each repeat paired with the baseline run of the same repeat


def test_the_check_is_skipped_when_the_generation_batch_is_split():
    (line,) = bench_step.watch_lines({}, accumulation=4)
    assert "skipped" in line and "FLAG" not in line


def test_the_watched_pair_is_among_the_default_variants():
    assert {bench_step.WATCHED, bench_step.BASELINE} <= set(bench_step.VARIANTS)
    assert bench_step.WATCH_THRESHOLD == 0.85
