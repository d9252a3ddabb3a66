"""RolloutCorrectionMonitor: quiet on healthy runs, early on a collapse; each alert quiet and speaking; windows in
optimizer steps; once per episode; stop with a checkpoint, CSV/PNG, state across resume; the CLI/YAML switch.

The recorded traces in tests/data were made by ``experiments/monitor_scenarios.py`` (demo's tiny reverse task,
64 x 8 completions per step, lr 3e-4, logging every step); whether a run is healthy or collapsing is judged by the
policy's own held-out reward stored with it (``eval_curve``), independently of the monitor.
"""

import csv
import json
import logging
import os

import pytest

from tests.support.trainer_utils import make_trainer
from trl_rollout_corr import RolloutCorrectionMonitor
from trl_rollout_corr import RolloutCorrectionConfig
from trl_rollout_corr.monitor import advice
from experiments.replay import aggregate, replay
from trl_rollout_corr.monitor.rules import ALERTS, AlertRules
from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
HEALTHY = ["monitor_stale4_ppo_is_bypass.json", "monitor_stale4_decoupled_token_is.json",
           "monitor_int8_decoupled_token_is.json"]
COLLAPSE = "monitor_wq3_ppo_is_bypass.json"


def load(name):
    with open(os.path.join(DATA, name)) as f:
        trace = json.load(f)
    trace["rows"] = [dict(zip(trace["columns"], r)) for r in trace["rows"]]
    return trace


# ---------------------------------------------------------------- recorded runs replayed (seeded, fast)
@pytest.mark.parametrize("every", [1, 5, 10])
@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_recorded_runs_stay_quiet(name, every):
    trace = load(name)
    curve = trace["eval_curve"]
    assert curve[-1][1] > curve[0][1] + 0.1  # the policy really improved: a healthy run
    rows = aggregate(trace["rows"], every)
    monitor = replay(rows, bypass=trace["bypass"], rollout_lag=trace["lag"], stop_on_alert=True)
    assert monitor.alerts == []
    assert monitor.rules.last_step == 150  # never stopped


@pytest.mark.parametrize("every", [1, 5, 10])
def test_collapsing_recorded_run_stops_by_step_40_and_recommends_no_unconfirmed_preset(every):
    trace = load(COLLAPSE)
    curve = dict(trace["eval_curve"])
    assert curve[20] < 0.5 * curve[0]  # the policy really collapsed (held-out reward)
    monitor = replay(aggregate(trace["rows"], every), correction=RolloutCorrectionConfig.ppo_is_bypass(),
                     rollout_lag=0, stop_on_alert=True)
    assert [a["alert"] for a in monitor.alerts] == ["policy_collapse"]
    assert monitor.alerts[0]["step"] <= 40 and monitor.rules.last_step == monitor.alerts[0]["step"]
    message = monitor.alerts[0]["message"]
    assert "entropy" in message and "kl=" in message and "%" in message
    # a synchronous engine (a persistent gap): no remedy is confirmed, so the metric and the page, no preset or mode
    assert "persistent" not in advice.REMEDIES
    assert "rollout_corr/kl" in message and "docs/evidence.md" in message and "S1" in message
    assert "rollout_correction_preset" not in message and "vllm_importance_sampling_mode" not in message


STALE_REGIME = ("T = 49 tokens", "per-token KL 6e-3-1.1e-2", "T * KL 0.3-0.5", "465k-parameter model",
                "not confirmed at long completions", "not measured on a GPU", "mismatch_train S2, experiment C",
                "experiments/dppo_stale.py, experiment G", "per-token KL 5.1e-3-8.3e-3, T * KL 0.25-0.41")
#: what a run on neither confirmed stale setting is told to switch to: both, dppo_kl_bypass first (experiment G)
SWITCH = ("Switch to it: rollout_correction_preset=dppo_kl_bypass (or rollout_correction_preset=ppo_is_bypass, "
          "equally confirmed)")


def test_a_stale_engine_is_told_the_confirmed_remedy_with_its_regime():
    geo = RolloutCorrectionConfig.from_preset("decoupled_geo_rs")
    message = replay(load(COLLAPSE)["rows"], correction=geo, rollout_lag=4).alerts[0]["message"]
    assert "lag 4" in message and "For a stale engine, dppo_kl_bypass and ppo_is_bypass were each confirmed" in message
    assert SWITCH in message and "+0.065 [+0.032, +0.097]" in message
    # experiment G's numbers for both, and that the two were not compared with each other
    for text in ("+0.076 [+0.040, +0.112]", "+0.035 [-0.002, +0.071] on 10 held-out seeds, one-sided p 0.030",
                 "+0.030 [-0.001, +0.060]", "not compared with each other"):
        assert text in message, text
    for text in STALE_REGIME:
        assert text in message, text
    assert "No correction is confirmed" not in message and "persistent" not in message and "If this" not in message
    # experiment A: the same remedy measured WORSE than TRL's default with a precision gap on top, said after it
    assert message.index("Switch to it") < message.index("But where the engine ALSO samples at another precision")
    assert "-0.100 [-0.145, -0.054]" in message and "-0.087 [-0.166, -0.009]" in message
    assert "-0.081 [-0.119, -0.043]" in message and "-0.043 [-0.067, -0.018]" in message  # experiment B
    assert "dppo_kl_bypass was not measured with a precision gap" in message  # bypass too, not measured there
    for preset in ("ppo_is_bypass", "dppo_kl_bypass"):
        bypass = RolloutCorrectionConfig.from_preset(preset)
        already = replay(load(COLLAPSE)["rows"], correction=bypass, rollout_lag=4).alerts[0]["message"]
        assert "this run already uses" in already and "But where the engine ALSO samples" in already


def test_a_synchronous_engine_is_recommended_nothing():
    geo = RolloutCorrectionConfig.from_preset("decoupled_geo_rs")
    message = replay(load(COLLAPSE)["rows"], correction=geo, rollout_lag=0).alerts[0]["message"]
    assert advice.remedies_for(0) == []
    assert "No correction is confirmed to help with a persistent precision gap" in message
    assert "S1" in message and "cost nothing" in message and "T = 49" in message
    assert "rollout_correction_preset" not in message and "Switch to it" not in message  # no preset recommended
    # experiment D (held out): bypass and token_truncate trained worse than TRL's default with a dense gap
    assert "ppo_is_bypass and TRL's token_truncate trained significantly WORSE" in message
    assert "keep TRL's default for a persistent gap" in message and "S1D" in message
    assert "a stale engine" not in message


def test_an_unknown_lag_names_the_stale_remedy_only_if_the_engine_is_stale():
    geo = RolloutCorrectionConfig.from_preset("decoupled_geo_rs")
    message = replay(load(COLLAPSE)["rows"], correction=geo, rollout_lag=None).alerts[0]["message"]
    assert "rollout_lag" in message and advice.remedies_for(None) == [advice.REMEDIES["stale"]]
    assert "If this is a stale engine, dppo_kl_bypass and ppo_is_bypass were each confirmed" in message
    assert "For a stale engine" not in message
    # the remedy appears once, after the condition; the persistent kind still gets no preset
    assert message.count(SWITCH) == 1 and message.count("rollout_correction_preset=ppo_is_bypass") == 1
    assert message.index("If this is a stale engine") < message.index("rollout_correction_preset=dppo_kl_bypass")
    assert "No correction is confirmed to help with a persistent precision gap" in message


@pytest.mark.parametrize("preset,other", [("ppo_is_bypass", "dppo_kl_bypass"), ("dppo_kl_bypass", "ppo_is_bypass")])
def test_a_run_already_on_the_remedy_is_told_what_remains(preset, other):
    """A run on EITHER confirmed stale setting (experiment G confirmed both, not against each other) is on the remedy:
    told what remains, with its own setting and the other as confirmed as well, never to switch."""
    remedy = advice.REMEDIES["stale"]
    assert remedy.settings == ("rollout_correction_preset=dppo_kl_bypass", "rollout_correction_preset=ppo_is_bypass")
    bypass = RolloutCorrectionConfig.from_preset(preset)
    assert remedy.on(bypass) == f"rollout_correction_preset={preset}"
    assert remedy.config(f"rollout_correction_preset={preset}") == bypass
    assert remedy.on(RolloutCorrectionConfig.from_preset("dppo_tv_bypass")) is None  # not confirmed held out
    rows = load(COLLAPSE)["rows"]
    on_remedy = replay(rows, correction=bypass, rollout_lag=4).alerts[0]["message"]
    assert "this run already uses" in on_remedy and "learning rate" in on_remedy and "T = 49" in on_remedy
    assert ("already uses what was confirmed to train better than TRL's default in experiments/mismatch_train.py"
            in on_remedy)
    assert (f"rollout_correction_preset={preset} (confirmed as well: rollout_correction_preset={other}; the two were "
            "not compared with each other)") in on_remedy
    assert "Switch to it" not in on_remedy and "No correction is confirmed" not in on_remedy
    unknown = replay(rows, correction=bypass, rollout_lag=None).alerts[0]["message"]
    assert "If this is a stale engine, this run already uses" in unknown and "Switch to it" not in unknown
    assert "No correction is confirmed to help with a persistent precision gap" in unknown


@pytest.mark.parametrize("preset", ["decoupled_geo_rs", "dppo_tv_bypass", "trl_default"])
def test_a_run_on_neither_remedy_is_told_to_switch_with_both_named(preset):
    """A run on neither confirmed stale setting (dppo_tv_bypass was not confirmed on held-out seeds) is told to switch,
    dppo_kl_bypass first and ppo_is_bypass as equally confirmed."""
    correction = RolloutCorrectionConfig.from_preset(preset)
    assert advice.REMEDIES["stale"].on(correction) is None
    message = replay(load(COLLAPSE)["rows"], correction=correction, rollout_lag=4).alerts[0]["message"]
    assert SWITCH in message and "this run already uses" not in message


def with_lag0(rows, lag0_kl):
    """The recorded collapse with a constant ``rollout_corr/lag_0/kl`` (its EMA is then exactly that value)."""
    return [{**r, advice.LAG0_KEY: lag0_kl} for r in rows]


@pytest.mark.parametrize("lag", [4, None])
def test_a_measured_lag0_gap_at_the_bound_withholds_the_stale_remedy(lag):
    """Pre-registration 16 (issue 37): a run logging rollout_corr/lag_0/kl at or above LAG0_CAUTION_KL (the smallest
    gap at which bypass was measured worse and held out; equal to lag0_caution_kl() of the committed results,
    tests/experiments/test_mismatch_train.py) is not told to switch to bypass (dppo_kl_bypass, ppo_is_bypass); the
    message quotes its lag-0 KL, the bound and the measured cost (ppo_is_bypass's; dppo_kl_bypass was not measured
    there); a run already on either is told what it was measured against; below the bound, the remedy is said with
    both numbers; no metric, no lag-0 text."""
    bound = advice.LAG0_CAUTION_KL
    assert 5e-4 < bound < 1e-2 and advice.LAG0_KEY == "rollout_corr/lag_0/kl"
    rows = load(COLLAPSE)["rows"]
    geo = RolloutCorrectionConfig.from_preset("decoupled_geo_rs")
    bypass = RolloutCorrectionConfig.ppo_is_bypass()
    dppo = RolloutCorrectionConfig.from_preset("dppo_kl_bypass")
    for gap in (bound, 3 * bound):  # at the bound (the EMA of a constant is exact) and above it
        message = replay(with_lag0(rows, gap), correction=geo, rollout_lag=lag).alerts[0]["message"]
        assert f"smoothed rollout_corr/lag_0/kl = {gap:.3g} per token, at or above {bound:.3g}" in message
        assert "So bypass (dppo_kl_bypass, ppo_is_bypass) is not advised" in message
        assert "-0.100 [-0.145, -0.054]" in message and "ppo_is_bypass trained significantly WORSE" in message
        assert "(dppo_kl_bypass, bypass as well, was not measured with such a gap)" in message
        assert "Switch to it" not in message and "rollout_correction_preset=ppo_is_bypass" not in message
        assert "rollout_correction_preset=dppo_kl_bypass" not in message
        for on in (bypass, dppo):
            on_bypass = replay(with_lag0(rows, gap), correction=on, rollout_lag=lag).alerts[0]["message"]
            assert "is not advised, and this run uses it" in on_bypass and "sequence_mask" in on_bypass
            assert f"this run uses it ({advice.REMEDIES['stale'].on(on)})" in on_bypass
            assert "already uses what was confirmed" not in on_bypass
            # what TRL's asynchronous trainer itself measured (S4), to the run on its default only
            assert advice.ASYNC_S4_FOUND in on_bypass and "rollout_correction_preset=trl_default" in on_bypass
        assert "trl_default" not in message
    below = replay(with_lag0(rows, 0.98 * bound), correction=geo, rollout_lag=lag).alerts[0]["message"]
    assert SWITCH in below and "not advised" not in below
    below_on_bypass = replay(with_lag0(rows, 0.98 * bound), correction=bypass, rollout_lag=lag).alerts[0]["message"]
    assert "async_mismatch" not in below_on_bypass  # below the bound S4 is not quoted
    assert f"lag_0/kl = {0.98 * bound:.3g} per token, below {bound:.3g}" in below
    assert advice.LAG0_BELOW_FOUND in below and "not significant (-0.012 [-0.049, +0.025]" in below
    assert below.index("But where the engine ALSO") < below.index("Here this run's engine differs")
    plain = replay(rows, correction=geo, rollout_lag=lag).alerts[0]["message"]
    assert "lag_0" not in plain and SWITCH in plain
    # the persistent kind's text (lag None) is the same whatever the lag-0 gap
    assert ("No correction is confirmed to help with a persistent precision gap" in message) == (lag is None)


def test_the_lag0_gap_never_alerts_on_its_own():
    """rollout_corr/lag_0/kl shapes the collapse advice only: a huge lag-0 gap on a healthy trace raises nothing."""
    for name in HEALTHY:  # huge either way: were it read as kl, -0.5 would raise negative_kl
        for gap in (0.5, -0.5):
            assert replay(with_lag0(load(name)["rows"], gap), rollout_lag=4).alerts == []


def test_collapse_advice_follows_what_is_known_about_the_engine(monkeypatch):
    """A kind without a remedy (the stale one here, removed) gets what the benchmark found and no preset."""
    rows = load(COLLAPSE)["rows"]
    bypass = RolloutCorrectionConfig.ppo_is_bypass()
    monkeypatch.delitem(advice.REMEDIES, "stale")
    stale_msg = replay(rows, correction=bypass, rollout_lag=4).alerts[0]["message"]
    assert "lag 4" in stale_msg and "No correction is confirmed to help with a stale engine" in stale_msg
    assert "persistent" not in stale_msg and "S1" not in stale_msg and "learning rate" in stale_msg
    assert "rollout_correction_preset" not in stale_msg
    unknown = replay(rows, correction=bypass, rollout_lag=None).alerts[0]["message"]
    assert "rollout_lag" in unknown and "a stale engine or a persistent precision gap" in unknown


def test_collapse_without_a_correction_advises_one():
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    from trl_rollout_corr import RolloutCorrectionConfig

    monitor = RolloutCorrectionMonitor(write_csv=False, write_plot=False)
    args = SimpleNamespace(output_dir=".", rollout_correction=RolloutCorrectionConfig.from_preset("disabled"))
    monitor.on_train_begin(args, TrainerState(), TrainerControl())
    assert monitor.rules.corrected is False and monitor.rules.bypass is False
    for row in load(COLLAPSE)["rows"]:
        monitor.on_log(args, TrainerState(global_step=int(row["step"])), TrainerControl(), logs=row)
    assert "No rollout correction is active" in monitor.alerts[0]["message"]
    args.rollout_correction = RolloutCorrectionConfig.from_preset("ppo_is_bypass")
    monitor.on_train_begin(args, TrainerState(), TrainerControl())
    assert monitor.rules.corrected is True and monitor.rules.bypass is True and monitor.alerts == []  # fresh run


def test_switched_off_collapse_rule_stays_quiet_on_the_collapse():
    monitor = replay(load(COLLAPSE)["rows"], bypass=True, reward_drop=None)
    assert monitor.alerts == []


# ---------------------------------------------------------------- synthetic rows: each alert quiet and speaking
def ramp(step, start, end, a, b):
    """a before ``start``, b after ``end``, linear in between."""
    t = min(max((step - start) / (end - start), 0.0), 1.0)
    return a + t * (b - a)


def rows_of(n=60, reward=(0.6, 0.6), entropy=(1.0, 1.0), **extra):
    out = []
    for s in range(1, n + 1):
        r = {"step": s, "reward": ramp(s, 20, 40, *reward), "entropy": ramp(s, 20, 40, *entropy),
             "rollout_corr/kl": 0.02, "rollout_corr/rollout_is_eff_sample_size": 0.95,
             "rollout_corr/rollout_is_ratio_fraction_high": 0.01, "rollout_corr/rejected_token_fraction": 0.0}
        r.update({k: (v(s) if callable(v) else v) for k, v in extra.items()})
        out.append(r)
    return out


def fired(rows, every=1, **kw):
    return [(a["step"], a["alert"]) for a in replay(aggregate(rows, every), **kw).alerts]


@pytest.mark.parametrize("case,expected", [
    ({"reward": (0.6, 0.4), "entropy": (1.0, 1.6)}, ["policy_collapse"]),       # -33% + entropy up
    ({"reward": (0.6, 0.4), "entropy": (1.0, 0.8)}, []),                        # -33%, entropy falls: not a collapse
    ({"reward": (0.6, 0.2), "entropy": (1.0, 0.8)}, ["policy_collapse"]),       # -67%: the severe drop on its own
    ({"reward": (0.6, 0.7), "entropy": (1.0, 1.6)}, []),                        # entropy up, reward holds
    ({"reward": (0.6, 0.5), "entropy": (1.0, 1.6)}, []),                        # -17%: a dip, not a collapse
    ({"reward": (0.6, 0.4), "entropy": (1.0, 0.8),                              # -33% + ESS collapse
      "rollout_corr/rollout_is_eff_sample_size": lambda s: ramp(s, 20, 40, 0.95, 0.1)},
     ["ess_collapse", "policy_collapse"]),
])
def test_policy_collapse_quiet_and_speaking(case, expected):
    assert sorted({name for _, name in fired(rows_of(**case))}) == expected


# smoothing_steps=1: a = 1/2 per step, so after k steps of `bad` following `good`, ema = bad + (good - bad) / 2^k;
# the condition first holds at step 20 + k and, with 5 steps of patience, fires at step 20 + k + 4.
@pytest.mark.parametrize("alert,key,bad,good,k", [
    ("all_rejected", "rollout_corr/rejected_token_fraction", 0.97, 0.6, 3),    # 0.97 - 0.37/8 = 0.924 >= 0.9
    ("ess_collapse", "rollout_corr/rollout_is_eff_sample_size", 0.15, 0.6, 2),  # 0.15 + 0.45/4 = 0.263 <= 0.3
    ("weights_pinned", "rollout_corr/rollout_is_ratio_fraction_high", 0.5, 0.1, 1),  # 0.5 - 0.4/2 = 0.3 >= 0.3
    ("negative_kl", "rollout_corr/kl", -0.01, -5e-4, 1),                      # -0.01 + 0.0095/2 <= -0.001
])
def test_correction_failure_alerts_quiet_and_speaking(alert, key, bad, good, k):
    rows = rows_of(**{key: lambda s: bad if s > 20 else good})
    assert fired(rows, smoothing_steps=1) == [(20 + k + 4, alert)]
    assert fired(rows_of(**{key: good})) == []
    assert fired(rows) and fired(rows)[0][0] >= 20 + k + 4  # the default, slower smoothing: not earlier


def test_mismatch_levels_never_trigger():
    rows = rows_of(**{"rollout_corr/kl": 5.0, "rollout_corr/k3_kl": 5.0, "rollout_corr/chi2_token": 1e3})
    assert fired(rows, rollout_lag=0) == [] and fired(rows, bypass=True, rollout_lag=0) == []


def test_windows_are_optimizer_steps_not_log_lines():
    rows = rows_of(reward=(0.6, 0.2), entropy=(1.0, 1.6))
    firsts = {every: fired(rows, every)[0][0] for every in (1, 2, 5, 10)}
    assert all(abs(step - firsts[1]) < every + 1 for every, step in firsts.items()), firsts
    # a short blip (2 steps) does not last the 5-step patience, whatever the logging interval
    blip = rows_of(**{"rollout_corr/rejected_token_fraction": lambda s: 1.0 if s in (30, 31) else 0.0})
    assert fired(blip, 1, smoothing_steps=1) == [] and fired(blip, 2, smoothing_steps=1) == []


def test_smoothing_is_a_step_weighted_ema_started_as_a_running_mean():
    rules = AlertRules(smoothing_steps=5)
    for step, value in ((1, 0.0), (2, 1.0), (3, 1.0), (20, 0.0)):
        rules.update(step, {"reward": value})
        if step == 2:
            assert rules.ema["reward"] == pytest.approx(0.5)  # a = max(1 - 2^(-1/5), 1/2) = 1/2
        if step == 3:
            assert rules.ema["reward"] == pytest.approx(0.5 + (1 / 3) * 0.5)  # a = 1/3
    a = 1 - 2 ** (-17 / 5)  # 0.905 > 17/20
    assert rules.ema["reward"] == pytest.approx((2 / 3) * (1 - a))


def test_a_sparsely_logged_signal_is_blended_by_the_steps_since_its_own_last_value():
    """lag_0/kl logged at steps 2 and 30 only, reward every step: at step 30 the gap's EMA moves by
    a = max(1 - 2^(-28/5), 28/29) = 28/29 (28 steps since its value at step 2; its first row covers steps 1-2),
    not by the reward's a = 1 - 2^(-1/5) of a one-step row; a saved state keeps it, an older state without the
    per-signal steps still loads (as if each signal were in every row)."""
    key = "rollout_corr/lag_0/kl"
    rules = AlertRules(smoothing_steps=5)
    for step in range(2, 31):
        row = {"reward": 0.5}
        if step in (2, 30):
            row[key] = 1e-2 if step == 2 else 2e-3
        rules.update(step, row)
    a = max(1 - 2 ** (-28 / 5), 28 / 29)
    assert rules.ema["kl_lag0"] == pytest.approx(1e-2 + a * (2e-3 - 1e-2))
    restored = AlertRules(smoothing_steps=5)
    restored.load_state(rules.state())
    restored.update(60, {key: 0.0, "reward": 0.5})
    a60 = max(1 - 2 ** (-30 / 5), 30 / 59)
    assert restored.ema["kl_lag0"] == pytest.approx(rules.ema["kl_lag0"] * (1 - a60))
    old = {k: v for k, v in rules.state().items() if k != "seen"}  # a checkpoint from before the per-signal steps
    legacy = AlertRules(smoothing_steps=5)
    legacy.load_state(old)
    legacy.update(31, {key: 0.0})
    assert legacy.ema["kl_lag0"] == pytest.approx(rules.ema["kl_lag0"] * (1 - max(1 - 2 ** (-1 / 5), 1 / 30)))


def test_alerts_fire_once_per_episode_and_rearm():
    key = "rollout_corr/rejected_token_fraction"
    rows = rows_of(n=80, **{key: lambda s: 0.99 if 11 <= s <= 30 or s > 55 else 0.0})
    # ema = 0.99 (1 - 2^-k) >= 0.9 from k = 4 (steps 14 and 59), + 4 steps of patience; it clears at step 31
    assert fired(rows, smoothing_steps=1) == [(18, "all_rejected"), (63, "all_rejected")]


def test_stop_on_a_chosen_alert_only():
    rows = rows_of(**{"rollout_corr/rollout_is_ratio_fraction_high": 0.5, "rollout_corr/kl": -0.01})
    monitor = replay(rows, stop_on_alert=["negative_kl"], negative_kl_tolerance=None)
    assert [a["alert"] for a in monitor.alerts] == ["weights_pinned"] and monitor.rules.last_step == 60
    monitor = replay(rows, stop_on_alert=["negative_kl"])
    assert {a["alert"] for a in monitor.alerts} == {"weights_pinned", "negative_kl"}
    assert monitor.rules.last_step == 15


@pytest.mark.parametrize("kwargs,match", [({"reward_drop": -1}, "reward_drop"),
                                          ({"ess_threshold": 1.5}, "ess_threshold"),
                                          ({"patience_steps": 0}, "patience_steps"),
                                          ({"smoothing_steps": 2.5}, "smoothing_steps"),
                                          ({"rollout_lag": -1}, "rollout_lag"),
                                          ({"stop_on_alert": ["k3_kl"]}, "unknown alert"),
                                          ({"stop_on_alert": "yes"}, "stop_on_alert")])
def test_bad_monitor_settings_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutCorrectionMonitor(**kwargs)


# ---------------------------------------------------------------- one real run: stop, checkpoint, CSV/PNG, resume
def test_real_run_stops_with_a_checkpoint_csv_and_png_and_resume_does_not_rewarn(tmp_path, caplog):
    """A 3-bit sampler and a rejection band so tight that every token is rejected: all_rejected at step 1, stop."""
    out = tmp_path / "run"

    def build(max_steps):
        monitor = RolloutCorrectionMonitor(warmup_steps=0, patience_steps=1, stop_on_alert=True)
        trainer, logs = make_trainer(out, preset="decoupled_geo_rs", max_steps=max_steps, callbacks=[monitor],
                                     rollout_sampler=EmulatedRolloutEngine("wq3"), save_strategy="no",
                                     rollout_rs_threshold=1.0001)
        return trainer, monitor, logs

    trainer, monitor, _ = build(4)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert trainer.state.global_step == 1
    assert [a["alert"] for a in monitor.alerts] == ["all_rejected"]
    assert "RolloutCorrectionMonitor [all_rejected] at step 1" in caplog.text
    checkpoint = out / "checkpoint-1"
    assert (checkpoint / "trainer_state.json").exists()
    assert (checkpoint / "rollout_correction_config.json").exists()
    with open(out / "rollout_corr_metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [float(r["step"]) for r in rows] == [1.0] and float(rows[0]["rollout_corr/rejected_token_fraction"]) > 0.9
    assert os.path.getsize(out / "rollout_corr_metrics.png") > 1000

    resumed, monitor2, _ = build(3)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 3  # continued past the alert: the episode was already reported
    assert [a["alert"] for a in monitor2.alerts] == ["all_rejected"]  # restored history, nothing new
    assert "RolloutCorrectionMonitor [all_rejected]" not in caplog.text
    with open(out / "rollout_corr_metrics.csv") as fh:
        assert [float(r["step"]) for r in csv.DictReader(fh)] == [1.0, 2.0, 3.0]
    assert monitor2.open_episodes == ["all_rejected"]  # everything still rejected: still the same episode
    assert monitor2.rules.last_step == 3 and monitor2.rules.ema["rejected"] > 0.9


def test_resumed_replay_matches_an_uninterrupted_one():
    rows = load(COLLAPSE)["rows"]
    whole = replay(rows, bypass=True, rollout_lag=0)
    first = replay([r for r in rows if r["step"] <= 12], bypass=True, rollout_lag=0)
    second = RolloutCorrectionMonitor(rollout_lag=0, write_csv=False, write_plot=False)
    second._restore(json.loads(json.dumps(first.state())))  # what a checkpoint stores
    second.on_train_begin = lambda *a, **k: None  # keep the restored state (replay() calls it with a fresh state)
    second.rules.bypass = True
    replay([r for r in rows if r["step"] > 12], monitor=second, bypass=True)
    assert second.alerts == whole.alerts


# ---------------------------------------------------------------- the CLI / YAML switch
def parse(argv):
    from trl_rollout_corr.cli.main import parse_train_args

    return parse_train_args(["--use_cpu", "true", *argv])[3]


def test_cli_switch_builds_the_configured_monitor():
    args = parse(["--rollout_corr_monitor", "true",
                  "--rollout_corr_monitor_stop_on_alert", "policy_collapse,all_rejected",
                  "--rollout_corr_monitor_reward_drop", "0.3", "--rollout_corr_monitor_patience_steps", "3"])
    monitor = args.build(rollout_engine="stale", rollout_engine_lag=2)
    assert isinstance(monitor, RolloutCorrectionMonitor)
    assert monitor.config["stop_on_alert"] == ["policy_collapse", "all_rejected"]
    assert monitor.config["reward_drop"] == 0.3 and monitor.config["patience_steps"] == 3
    assert monitor.rules.rollout_lag == 2  # a stale emulated engine: its lag is known
    assert args.build(rollout_engine="wq3").rules.rollout_lag == 0 and args.build().rules.rollout_lag is None
    assert parse([]).build() is None  # off by default


def test_yaml_switch_with_a_list_and_a_null_threshold(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("rollout_corr_monitor: true\nrollout_corr_monitor_stop_on_alert: [all_rejected]\n"
                    "rollout_corr_monitor_pinned_fraction_threshold: null\nrollout_corr_monitor_lag: 0\n")
    monitor = parse(["--config", str(path)]).build()
    assert monitor.config["stop_on_alert"] == ["all_rejected"] and monitor.config["pinned_fraction_threshold"] is None
    assert monitor.rules.rollout_lag == 0
    path.write_text("rollout_corr_monitor: true\nrollout_corr_monitor_stop_on_alert: true\n")
    assert parse(["--config", str(path)]).build().config["stop_on_alert"] is True


@pytest.mark.parametrize("argv,match", [
    (["--rollout_corr_monitor_stop_on_alert", "k3_kl"], "rollout_corr_monitor_stop_on_alert has unknown alert"),
    (["--rollout_corr_monitor_ess_threshold", "2"], "rollout_corr_monitor_ess_threshold=2.0 is a fraction"),
    (["--rollout_corr_monitor_reward_drop", "-0.1"], "rollout_corr_monitor_reward_drop"),
    (["--rollout_corr_monitor_patience_steps", "0"], "rollout_corr_monitor_patience_steps"),
    (["--rollout_corr_monitor_lag", "-2"], "rollout_corr_monitor_lag"),
])
def test_cli_switch_rejects_bad_values_naming_the_field(argv, match):
    with pytest.raises(ValueError, match=match):
        parse(argv)


def test_alert_names_are_the_documented_ones():
    """The alerts the monitor raises are exactly the rows of the alert table in docs/monitor.md, in order."""
    import re

    from tests.support.bench_utils import doc_containing

    path, page = doc_containing("| alert | fires when")
    assert path.name == "monitor.md"
    table = page[page.index("| alert | fires when"):].split("\n\n")[0]
    documented = tuple(re.findall(r"^\| `(\w+)` \|", table, re.M))
    assert documented == ALERTS and len(ALERTS) == 5


def test_preset_recipes_switch_the_monitor_on():
    import glob

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    recipes = [p for p in glob.glob(os.path.join(root, "recipes", "*.yaml")) if not p.endswith("cpu_demo.yaml")]
    assert recipes
    for path in recipes:
        monitor = parse(["--config", path]).build()
        assert isinstance(monitor, RolloutCorrectionMonitor), path
        # the stale-engine row's recipe syncs its engine every 4 optimizer steps and tells the monitor so
        expected_lag = 4 if path.endswith(("ppo_is_bypass.yaml", "dppo_kl_bypass.yaml")) else 0
        assert monitor.rules.rollout_lag == expected_lag and monitor.config["stop_on_alert"] is False, path


# ---------------------------------------------------------------- fresh runs (seeds the thresholds never saw), ranks
@pytest.mark.parametrize("variant,seed", [("on_policy", 7), ("ppo_is_bypass", 11)])
def test_fresh_healthy_runs_stay_quiet(tmp_path, variant, seed):
    """The demo's run (warm-up + GRPO, stale engine lag 4 for ppo_is_bypass) with a seed no threshold was tuned on,
    shortened to 60 steps: the warn-only monitor it carries raises nothing while the held-out reward holds or rises."""
    from tests.support.trainer_utils import run_demo_worker as run_worker

    out = tmp_path / "run.json"
    run_worker(variant, seed, steps=60, lag=4, engine="stale", eval_every=30, out=str(out))
    result = json.loads(out.read_text())
    curve = dict(result["curve"])
    assert curve[60] >= curve[0] - 0.05, curve  # healthy: no collapse (judged by the policy's own held-out reward)
    assert result["alerts"] == []


def test_every_rank_decides_alike_and_stops_together(tmp_path):
    """Two processes, a rejection band nothing satisfies: both ranks' monitors raise all_rejected at step 1 and stop."""
    import subprocess
    import sys

    from tests.grpo.test_distributed import ROOT, WORKER, _free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_ROLLOUT_CORR_NO_VLLM": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    out = tmp_path / "out.json"
    correction = json.dumps(dict(rollout_is="none", rollout_rs="token", rollout_rs_threshold=1.0 + 1e-9,
                                 rollout_rs_threshold_lower=1.0))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(_free_port()), WORKER, str(out), "--per_device", "8", "--max_steps", "4",
                           "--stopping_monitor", "--correction", correction], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"out.json.rank{r}").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] == {"alerts": [[1, "all_rejected"]], "stopped_at": 1}
