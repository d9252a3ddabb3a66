"""Divergence-based rejection (k1/k2/k3 x token/sum/mean/max) against a float64 Python re-derivation."""

import math

import pytest
import torch

from tests.core.test_core_reference import make_batch
from trl_rollout_corr import RolloutCorrectionConfig, compute_rollout_correction_and_rejection_mask
from trl_rollout_corr.core.divergence import DIVERGENCE_CRITERIA, parse_divergence_criteria


def ref_k(log_r, estimator):
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r * log_r
    b = max(-20.0, min(20.0, log_r))
    return math.exp(b) - 1.0 - b


def ref_divergence(old, rollout, mask, specs):
    """specs: list of (name, lower, upper). Returns (keep mask, metrics) from plain-Python loops."""
    n, t = len(old), len(old[0])
    keep = [[bool(mask[i][j]) for j in range(t)] for i in range(n)]
    tok_n = sum(1 for i in range(n) for j in range(t) if mask[i][j])
    seq_n = sum(1 for i in range(n) if any(mask[i]))
    metrics = {}
    for name, lower, upper in specs:
        est = name[-2:]
        agg = name.split("_")[1] if name.startswith("seq_") else "token"
        rejected = [[False] * t for _ in range(n)]
        samples = []
        for i in range(n):
            ks = [ref_k(old[i][j] - rollout[i][j], est) for j in range(t) if mask[i][j]]
            idx = [j for j in range(t) if mask[i][j]]
            if not ks:
                continue
            if agg == "token":
                values = list(zip(idx, ks))
                samples += ks
            else:
                stat = {"sum": sum(ks), "mean": sum(ks) / len(ks), "max": max(ks) if ks else 0.0}[agg]
                values = [(j, stat) for j in idx]
                samples.append(stat)
            for j, stat in values:
                if est == "k1":
                    log_ratio = max(-20.0, min(20.0, -stat))
                    ok = math.log(lower) <= log_ratio <= math.log(upper)
                else:
                    ok = stat <= upper
                if not ok:
                    rejected[i][j] = True
                    keep[i][j] = False
        prefix = f"rollout_corr/rollout_rs_{name}_"
        metrics[prefix + "mean"] = sum(samples) / len(samples) if samples else 0.0
        metrics[prefix + "max"] = max(samples) if samples else 0.0
        metrics[prefix + "masked_fraction"] = sum(map(sum, rejected)) / tok_n if tok_n else 0.0
        metrics[prefix + "seq_masked_fraction"] = sum(1 for r in rejected if any(r)) / seq_n if seq_n else 0.0
    return keep, metrics


SPECS = {
    "token_k1": "0.7_1.4", "token_k2": "0.08", "token_k3": "0.05",
    "seq_sum_k1": "0.7_1.5", "seq_sum_k2": "0.3", "seq_sum_k3": "0.2",
    "seq_mean_k1": "1.1", "seq_mean_k2": "0.05", "seq_mean_k3": "0.04",
    "seq_max_k2": "0.2", "seq_max_k3": "0.15",
}


@pytest.mark.parametrize("name", DIVERGENCE_CRITERIA)
@pytest.mark.parametrize("seed", [0, 1])
def test_each_criterion_matches_the_reference(name, seed):
    old, rollout, mask = make_batch(seed, spread=0.4)
    (crit,) = parse_divergence_criteria(name, SPECS[name])
    _, kept, metrics = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_rs_criteria=name, rollout_rs_criteria_threshold=SPECS[name])
    want_keep, want = ref_divergence(old.double().tolist(), rollout.double().tolist(), mask.tolist(),
                                     [(name, crit.lower, crit.upper)])
    assert kept.bool().tolist() == want_keep
    for key, value in want.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert 0 < metrics[f"rollout_corr/rollout_rs_{name}_masked_fraction"] < 1  # thresholds bite on this data


def test_several_criteria_must_all_pass():
    old, rollout, mask = make_batch(3, spread=0.4)
    names = "token_k1,seq_max_k2,seq_mean_k3"
    thresholds = f"{SPECS['token_k1']},{SPECS['seq_max_k2']},{SPECS['seq_mean_k3']}"
    specs = [(c.name, c.lower, c.upper) for c in parse_divergence_criteria(names, thresholds)]
    _, kept, metrics = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_rs_criteria=names, rollout_rs_criteria_threshold=thresholds)
    want_keep, want = ref_divergence(old.double().tolist(), rollout.double().tolist(), mask.tolist(), specs)
    assert kept.bool().tolist() == want_keep
    for key, value in want.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    n_tok = mask.sum().item()
    assert metrics["rollout_corr/rejected_token_fraction"] == pytest.approx(1 - kept.sum().item() / n_tok)


@pytest.mark.parametrize("criterion,level,lower,upper", [("token_k1", "token", 0.8, 1.3),
                                                         ("seq_sum_k1", "sequence", 0.8, 1.3),
                                                         ("seq_mean_k1", "geometric", 0.85, 1.15)])
def test_k1_criteria_equal_the_seed_levels(criterion, level, lower, upper):
    old, rollout, mask = make_batch(5, spread=0.3)
    _, by_level, _ = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_rs=level, rollout_rs_threshold=upper, rollout_rs_threshold_lower=lower)
    _, by_criterion, _ = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_rs_criteria=criterion, rollout_rs_criteria_threshold=f"{lower}_{upper}")
    assert torch.equal(by_level, by_criterion)
    assert 0 < by_level.sum() < mask.sum()


def test_criteria_combine_with_seed_rs_and_veto():
    old, rollout, mask = make_batch(7, spread=0.5)
    common = dict(rollout_rs="token", rollout_rs_threshold=2.0, rollout_token_veto_threshold=0.5)
    _, seed_only, _ = compute_rollout_correction_and_rejection_mask(old, rollout, mask, **common)
    _, div_only, _ = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_rs_criteria="seq_max_k3", rollout_rs_criteria_threshold="0.1")
    _, both, _ = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_rs_criteria="seq_max_k3", rollout_rs_criteria_threshold="0.1", **common)
    assert torch.equal(both, seed_only * div_only)


def test_extreme_log_ratios_give_finite_metrics():
    old = torch.tensor([[-1.0, -60.0, -1.0], [-1e4, -1.0, -2.0]])
    rollout = torch.tensor([[-51.0, -1.0, -1.0], [-1.0, -1e4, -2.0]])
    mask = torch.ones(2, 3)
    names = ",".join(DIVERGENCE_CRITERIA)
    thresholds = ",".join(SPECS[n] for n in DIVERGENCE_CRITERIA)
    _, kept, metrics = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_rs_criteria=names, rollout_rs_criteria_threshold=thresholds)
    assert all(math.isfinite(v) for v in metrics.values())
    assert kept.sum() == 0


def test_empty_batch_reports_zeros():
    z = torch.zeros(2, 3)
    _, kept, metrics = compute_rollout_correction_and_rejection_mask(
        z, z, z, rollout_rs_criteria="seq_max_k2", rollout_rs_criteria_threshold="0.1")
    assert kept.sum() == 0
    assert metrics["rollout_corr/rollout_rs_seq_max_k2_max"] == 0.0
    assert metrics["rollout_corr/rollout_rs_seq_max_k2_masked_fraction"] == 0.0


@pytest.mark.parametrize("criteria,thresholds,match", [
    ("token_k4", "1.0", "unknown criteria"),
    ("seq_max_k1", "2.0", "unknown criteria"),
    ("token_k1,token_k2", "2.0", "1 value.*2 criteria"),
    ("token_k1", None, "needs rollout_rs_criteria_threshold"),
    ("token_k1", "2.0_0.5", "lower 2.0 > upper 0.5"),
    ("seq_max_k2", "0.1_0.2", "single upper bound"),
    ("token_k2", "-1", "finite numbers > 0"),
    ("token_k2", "abc", "not a number"),
    (None, "0.1", "rollout_rs_criteria is empty"),
    ("token_k1,token_k1", "2,2", "twice"),
])
def test_bad_criteria_fail_at_construction_with_the_field_named(criteria, thresholds, match):
    with pytest.raises(ValueError, match=match):
        RolloutCorrectionConfig(rollout_rs_criteria=criteria, rollout_rs_criteria_threshold=thresholds)


def test_config_accepts_yaml_lists_and_round_trips():
    cfg = RolloutCorrectionConfig.from_yaml(
        "rollout_rs_criteria: [token_k1, seq_max_k2]\nrollout_rs_criteria_threshold: ['0.5_2.0', 0.02]\n")
    assert cfg.rollout_rs_criteria == "token_k1,seq_max_k2"
    assert cfg.rollout_rs_criteria_threshold == "0.5_2.0,0.02"
    assert RolloutCorrectionConfig.from_json_string(cfg.to_json_string()) == cfg
    assert cfg.masks_tokens and cfg.is_enabled


@pytest.mark.parametrize("preset", ["decoupled_token_is", "pg_is"])
def test_criteria_from_the_trainer_config_reach_the_logs(tmp_path, preset):
    from tests.support.trainer_utils import make_trainer
    from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine

    trainer, logs = make_trainer(tmp_path, preset=preset, max_steps=3,
                                 rollout_sampler=EmulatedRolloutEngine("stale", lag=1),
                                 rollout_rs_criteria="token_k1,seq_max_k3",
                                 rollout_rs_criteria_threshold="0.999_1.001,1e-6")
    trainer.train()
    assert trainer.rollout_correction.rollout_rs_criteria == "token_k1,seq_max_k3"
    log = [entry for entry in logs.logs if "loss" in entry][-1]  # the sampler lags: the criteria bite
    for name in ("token_k1", "seq_max_k3"):
        for suffix in ("mean", "max", "masked_fraction", "seq_masked_fraction"):
            assert math.isfinite(log[f"rollout_corr/rollout_rs_{name}_{suffix}"])
    assert log["rollout_corr/rollout_rs_seq_max_k3_seq_masked_fraction"] > 0
    assert math.isfinite(log["loss"])
