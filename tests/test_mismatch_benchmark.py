"""The mismatch table and its advice (docs/benchmarks.md) are the benchmark's, and the monitor advises only what it
measured.

``benchmarks/results/mismatch_results.csv`` is the output of ``python benchmarks/mismatch_bench.py`` (the command
and run time are on that page). These tests read it and check: the page's table and its "which preset for which
mismatch" lines are exactly what the benchmark's own functions generate from it; every scenario has TRL's default,
the floor and the ceiling, with >= 5 seeds per row; and each remedy the monitor names is one the benchmark measured to
help for that kind of mismatch.
"""

import math
import os

import pytest

from bench_utils import doc_block, load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "mismatch_results.csv")


def bench():
    return load_benchmark("mismatch_bench")


@pytest.fixture(scope="module")
def rows():
    return bench().read_rows(RESULTS)


def test_docs_table_and_advice_are_generated_from_the_results(rows):
    mb = bench()
    assert doc_block("mismatch-table", "docs/benchmarks.md") == mb.markdown(rows)
    assert doc_block("mismatch-advice", "docs/benchmarks.md") == mb.recommendations(rows)


def test_every_scenario_has_trls_default_the_floor_and_the_ceiling_with_five_seeds(rows):
    scenarios = dict.fromkeys(r["scenario"] for r in rows)
    assert len(scenarios) >= 3
    for scenario in scenarios:
        methods = {r["method"]: r for r in rows if r["scenario"] == scenario}
        assert {"on_policy", "uncorrected", "trl_default"} <= set(methods), scenario
        for r in methods.values():
            assert r["n_seeds"] >= 5 and len(r["per_seed"].split()) == r["n_seeds"], (scenario, r["method"])


def test_recomputed_statistics_match_the_csv(rows):
    """The CSV's means, intervals and gap shares follow from its per-seed values (an independent recomputation)."""
    from statistics import fmean, stdev

    t975 = {4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
    for r in rows:
        xs = [float(x) for x in r["per_seed"].split()]
        assert fmean(xs) == pytest.approx(r["reward_mean"], abs=1e-3)
        assert t975[len(xs) - 1] * stdev(xs) / math.sqrt(len(xs)) == pytest.approx(r["reward_ci95"], abs=1e-3)
        block = {b["method"]: b for b in rows if b["scenario"] == r["scenario"]}
        if r["method"] not in ("on_policy", "uncorrected"):
            floor = fmean(float(x) for x in block["uncorrected"]["per_seed"].split())
            ceiling = fmean(float(x) for x in block["on_policy"]["per_seed"].split())
            assert (fmean(xs) - floor) / (ceiling - floor) == pytest.approx(r["gap_closed"], abs=2e-3)
            assert r["gap_closed_lo"] <= r["gap_closed"] + 1e-3 and r["gap_closed"] <= r["gap_closed_hi"] + 1e-3


# ---------------------------------------------------------------- the monitor's advice is the benchmark's
def test_each_remedy_the_monitor_names_is_what_its_scenario_recommends(rows):
    from trl_rollout_corr.monitor.advice import REMEDIES

    mb = bench()
    for remedy in REMEDIES.values():
        assert remedy.method == mb.recommended(rows, remedy.scenario), remedy
        # and the setting the message gives is that method's configuration in the benchmark
        preset, extra = mb.METHODS[remedy.method]
        spelled = dict(kv.split("=") for kv in [remedy.setting])
        assert spelled == ({"rollout_correction_preset": preset} if preset else
                           {k: v for k, v in extra.items() if k.startswith("vllm_importance")})


def load_trace(name):
    import json

    with open(os.path.join(ROOT, "tests", "data", name)) as f:
        trace = json.load(f)
    trace["rows"] = [{k: v for k, v in zip(trace["columns"], r) if v is not None} for r in trace["rows"]]
    return trace


# the benchmark's runs, exported with `python benchmarks/mismatch_bench.py --export_trace SCENARIO:METHOD:SEED:PATH`
COLLAPSING = ["mismatch_stale4_decoupled_geo_rs_seed0.json", "mismatch_wq3_ppo_is_bypass_seed0.json"]
HEALTHY = ["mismatch_stale4_ppo_is_bypass_seed0.json", "mismatch_vllm_sync8_ppo_is_bypass_seed0.json"]


@pytest.mark.parametrize("name", COLLAPSING)
def test_on_the_benchmarks_collapsing_runs_the_monitor_names_the_measured_remedy(name):
    from trl_rollout_corr import RolloutCorrectionConfig
    from trl_rollout_corr.monitor.advice import remedies_for
    from trl_rollout_corr.monitor.replay import replay

    trace = load_trace(name)
    curve = [reward for _, reward in trace["eval_curve"]]
    assert min(curve[1:]) < 0.5 * curve[0]  # the policy really collapsed (its own held-out reward)
    correction = RolloutCorrectionConfig.from_dict(trace["correction"])
    monitor = replay(trace["rows"], correction=correction, rollout_lag=trace["lag"])
    collapse = [a for a in monitor.alerts if a["alert"] == "policy_collapse"]
    assert collapse, monitor.alerts
    (remedy,) = remedies_for(trace["lag"])
    assert remedy.config() != correction and remedy.setting in collapse[0]["message"]


@pytest.mark.parametrize("name", HEALTHY)
def test_on_the_benchmarks_healthy_runs_the_monitor_stays_quiet(name):
    from trl_rollout_corr import RolloutCorrectionConfig
    from trl_rollout_corr.monitor.replay import replay

    trace = load_trace(name)
    curve = [reward for _, reward in trace["eval_curve"]]
    assert curve[-1] > curve[0] + 0.1  # the policy really improved
    correction = RolloutCorrectionConfig.from_dict(trace["correction"])
    assert replay(trace["rows"], correction=correction, rollout_lag=trace["lag"]).alerts == []
