"""The formulas at their edges: thresholds hit exactly, bounds below the safety clamp, defaults, messages, dtypes,
a global batch across ranks, ties in the sampler's truncation. Each case is computed by hand in the test."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from trl_rollout_corr import compute_rollout_correction_and_rejection_mask as correct
from trl_rollout_corr.core import compute_rollout_correction_stats, compute_rollout_correction_weights, finalize_stats
from trl_rollout_corr.core.divergence import parse_divergence_criteria
from trl_rollout_corr.core.rejection import compute_rollout_rejection_mask, compute_veto_mask, rejection_log_statistic
from trl_rollout_corr.core.truncation import (SamplingTruncation, finalize_truncation, truncated_logits,
                                              truncated_support_logprobs, truncation_stats)
from trl_rollout_corr.core.weights import batch_normalize_weights, safe_is_weights

P = "rollout_corr/"


def close(tensor, values, rel=1e-6):
    """``tensor`` equals the nested list ``values`` up to a relative tolerance (float64 comparison)."""
    torch.testing.assert_close(tensor.double(), torch.tensor(values, dtype=torch.float64), rtol=rel, atol=0)
    return True


def log_ratios(*values):
    """(1, T) pi_train, pi_rollout with log rho_t = values (float32), every token valid."""
    lr = torch.tensor([values], dtype=torch.float32)
    return lr, torch.zeros_like(lr), torch.ones_like(lr)


# ---------------------------------------------------------------------------------------------- bounds hit exactly
def test_rejection_keeps_a_statistic_equal_to_either_bound():
    upper = 2.0
    log_c = math.log(upper)
    train, rollout, mask = log_ratios(log_c, -log_c, log_c + 1e-3, -log_c - 1e-3)
    _, m, _ = correct(train, rollout, mask, rollout_rs="token", rollout_rs_threshold=upper)
    assert m.tolist() == [[1, 1, 0, 0]]  # keep iff 1/C <= rho <= C, bounds included


def test_default_lower_bound_is_one_over_upper():
    keep, _, _ = compute_rollout_rejection_mask(torch.tensor([[-math.log(4.0), -math.log(4.0) - 1e-3, math.log(4.0)]]),
                                                torch.ones(1, 3, dtype=torch.bool), "token", 4.0)
    assert keep.tolist() == [[True, False, True]]
    keep, _, _ = compute_rollout_rejection_mask(torch.tensor([[-math.log(4.0)]]), torch.ones(1, 1, dtype=torch.bool),
                                                "token", 4.0, 0.5)
    assert keep.tolist() == [[False]]  # an explicit lower bound wins


def test_veto_is_strict_at_its_threshold():
    threshold = 0.25
    log_rho = torch.tensor([[math.log(threshold), 0.0], [math.log(threshold) - 1e-3, 0.0]])  # (2, 2)
    keep, catastrophic = compute_veto_mask(log_rho, torch.ones(2, 2, dtype=torch.bool), threshold)
    assert catastrophic.tolist() == [[False, False], [True, False]] and keep.tolist() == [[True, True], [False, False]]


def test_rejection_below_the_safety_bound_uses_the_bounded_statistic():
    # log rho = -25 is clamped to -20 before the comparison: kept with a lower bound of 1e-10 (log -23.0)
    keep, stat, log_stat = compute_rollout_rejection_mask(torch.tensor([[-25.0, 25.0]]),
                                                          torch.ones(1, 2, dtype=torch.bool), "token", 1e10, 1e-10)
    assert keep.tolist() == [[True, True]]
    assert close(stat, [[math.exp(-20.0), math.exp(20.0)]])
    assert log_stat.tolist() == [[-25.0, 25.0]]  # the metrics get the unclamped statistic


def test_is_weights_are_bounded_below_and_above_by_the_safety_clamp():
    mask = torch.ones(1, 2, dtype=torch.bool)
    safe = safe_is_weights(torch.tensor([[-50.0, 50.0]]), mask, "token")
    assert close(safe, [[math.exp(-20.0), math.exp(20.0)]])
    safe = safe_is_weights(torch.tensor([[-30.0, -20.0]]), mask, "sequence")  # the sum, -50, clamped to -20
    assert close(safe, [[math.exp(-20.0)] * 2])


def test_sequence_and_geometric_statistics_by_hand():
    lr = torch.tensor([[0.2, 0.4, 9.0], [1.0, 0.0, 0.0]])  # padding at (0, 2) and (1, 1..2)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert close(rejection_log_statistic(lr, mask, "sequence"), [[0.6] * 3, [1.0] * 3])
    assert close(rejection_log_statistic(lr, mask, "geometric"), [[0.3] * 3, [1.0] * 3])
    assert rejection_log_statistic(lr, mask, "token") is lr


# ---------------------------------------------------------------------------------------------- defaults, messages
def test_public_defaults_are_token_level_c2_without_normalization():
    train, rollout, mask = log_ratios(2.0, 0.5, -1.0)
    weights, _, norm = compute_rollout_correction_weights(train - rollout, mask.bool())
    assert norm is None
    assert close(weights, [[2.0, math.exp(0.5), math.exp(-1.0)]])
    w, _, _ = correct(train, rollout, mask, rollout_is="token")
    assert close(w, [[2.0, math.exp(0.5), math.exp(-1.0)]])
    result = compute_rollout_correction_stats(train, rollout, mask, rollout_is="token")
    assert close(result.is_weights, [[2.0, math.exp(0.5), math.exp(-1.0)]])


@pytest.mark.parametrize("call,message", [
    (lambda: correct(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3)),
     r"^old_log_prob, rollout_log_prob and response_mask must have the same \(B, T\) shape, got \(2, 3\), \(2, 4\) "
     r"and \(2, 3\)\.$"),
    (lambda: correct(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), rollout_rs="token"),
     r"^rollout_rs_threshold is required when rollout_rs is set \(e\.g\. 2\.0 for token/sequence, 1\.001 for "
     r"geometric\)\.$"),
    (lambda: safe_is_weights(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), "geometric"),
     r"^rollout_is must be one of \('token', 'sequence'\) or None, got 'geometric'\.$"),
    (lambda: rejection_log_statistic(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), "tokens"),
     r"^rollout_rs must be one of \('token', 'sequence', 'geometric'\) or None, got 'tokens'\.$"),
])
def test_error_messages_name_the_cause(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_parsed_divergence_criteria_are_accepted_as_they_are():
    train, rollout, mask = log_ratios(0.0, 2.0, -2.0)
    criteria = parse_divergence_criteria("token_k2", "0.5")  # k2 = 0.5 * (log rho)^2 <= 0.5 keeps |log rho| <= 1
    _, m_parsed, _ = correct(train, rollout, mask, rollout_rs_criteria=criteria)
    _, m_named, _ = correct(train, rollout, mask, rollout_rs_criteria="token_k2", rollout_rs_criteria_threshold="0.5")
    assert m_parsed.tolist() == m_named.tolist() == [[1, 0, 0]]


# ---------------------------------------------------------------------------------------------- batch normalization
def test_batch_normalization_uses_the_global_batch_across_ranks():
    """A second rank holding weights [4, 4] (token level): the mean is over all five tokens, not this rank's three."""
    def reduce_with_other_rank(tensor, op):
        assert op == "sum"
        return tensor + torch.tensor([8.0, 2.0], dtype=tensor.dtype)  # the other rank's (sum of weights, tokens)

    train, rollout, mask = log_ratios(0.0, 0.0, math.log(4.0))  # weights 1, 1, 4 (C = 5)
    result = compute_rollout_correction_stats(train, rollout, mask, rollout_is="token", rollout_is_threshold=5.0,
                                              rollout_is_batch_normalize=True, reduce_fn=reduce_with_other_rank)
    mean = (1 + 1 + 4 + 8) / 5
    assert close(result.is_weights, [[1 / mean, 1 / mean, 4 / mean]])
    assert finalize_stats(result.stats)[P + "rollout_is_batch_norm_factor"] == pytest.approx(mean)
    assert result.is_weights.dtype == torch.float32


def test_batch_normalization_of_a_single_valid_token_gives_weight_one():
    weights = torch.tensor([[1.5, 0.0]])
    normalized, mean = batch_normalize_weights(weights, torch.tensor([[True, False]]), "token")
    assert normalized.tolist() == [[1.0, 0.0]] and mean.item() == 1.5 and normalized.dtype == torch.float32
    normalized, mean = batch_normalize_weights(weights, torch.tensor([[True, False]]), "sequence")
    assert normalized.tolist() == [[1.0, 0.0]] and mean.item() == 1.5


def test_samples_without_pi_rollout_keep_weight_one_after_normalization():
    train = torch.tensor([[math.log(2.0), math.log(2.0)], [0.0, 0.0]])
    rollout = torch.tensor([[0.0, 0.0], [math.nan, math.nan]])
    result = compute_rollout_correction_stats(train, rollout, torch.ones(2, 2), rollout_is="token",
                                              rollout_is_threshold=4.0, rollout_is_batch_normalize=True,
                                              rollout_seen=torch.tensor([True, False]))
    assert result.is_weights.tolist() == [[1.0, 1.0], [1.0, 1.0]]  # 2 / mean 2; the unseen row: exactly 1


# ---------------------------------------------------------------------------------------------- truncation
def test_truncation_ties_follow_transformers_warpers():
    """Uniform logits over 8 tokens: every cumulative probability is exact, every top-k boundary a tie."""
    z = torch.zeros(1, 8)
    ids = torch.zeros(1, 1, dtype=torch.long)
    for truncation, warper in [(SamplingTruncation(top_p=0.75), TopPLogitsWarper(0.75)),
                               (SamplingTruncation(top_k=3), TopKLogitsWarper(3)),
                               (SamplingTruncation(top_k=1), TopKLogitsWarper(1)),
                               (SamplingTruncation(min_p=1.0), MinPLogitsWarper(1.0))]:
        ours = torch.isfinite(truncated_logits(z, truncation))
        theirs = torch.isfinite(warper(ids, z.clone()))
        assert torch.equal(ours, theirs), truncation
    assert torch.isfinite(truncated_logits(z, SamplingTruncation(top_p=0.75))).sum() == 6  # 0.125, 0.25 <= 0.25
    assert torch.isfinite(truncated_logits(z, SamplingTruncation(top_k=3))).sum() == 8  # ties at the k-th are kept
    two_levels = torch.tensor([[math.log(4.0), 0.0, 0.0, 0.0]])  # p = 4/7, 1/7 x 3
    assert torch.isfinite(truncated_logits(two_levels, SamplingTruncation(top_k=1))).tolist() == [[True] + [False] * 3]
    assert torch.isfinite(truncated_logits(two_levels, SamplingTruncation(min_p=0.25))).tolist() == [[True] * 4]
    kept = torch.isfinite(truncated_logits(two_levels, SamplingTruncation(min_p=0.26)))
    assert kept.tolist() == [[True] + [False] * 3]


def test_truncation_statistics_by_hand_and_when_empty():
    log_mass = torch.log(torch.tensor([[0.5, 0.25, 1.0]]))
    in_support = torch.tensor([[True, False, True]])
    stats = truncation_stats(log_mass, in_support, torch.tensor([[1, 1, 0]]))
    floats = stats.to_floats()
    assert finalize_truncation(floats) == pytest.approx({P + "kept_mass_mean": 0.375, P + "kept_mass_min": 0.25,
                                                         P + "outside_support_fraction": 0.5})
    one = {"sum:trunc.n": 1.0, "sum:trunc.kept_mass_sum": 0.5, "sum:trunc.outside_n": 1.0,
           "min:trunc.kept_mass_min": 0.5}
    assert finalize_truncation(one) == {P + "kept_mass_mean": 0.5, P + "kept_mass_min": 0.5,
                                        P + "outside_support_fraction": 1.0}
    empty = {"sum:trunc.n": 0.0, "sum:trunc.kept_mass_sum": 0.0, "sum:trunc.outside_n": 0.0,
             "min:trunc.kept_mass_min": 9.0}
    assert finalize_truncation(empty) == {P + "kept_mass_mean": 0.0, P + "kept_mass_min": 0.0,
                                          P + "outside_support_fraction": 0.0}
    assert finalize_truncation({}) == {}


def test_truncated_support_logprobs_keeps_the_dtype_and_shifts_inside_the_support_only():
    full = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16)
    out = truncated_support_logprobs(full, torch.tensor([[-0.5, -0.5]]), torch.tensor([[True, False]]))
    assert out.dtype == torch.bfloat16 and out.tolist() == [[-0.5, -2.0]]


def test_the_divide_helper_and_the_empty_extreme():
    """core/stats.py's safe_div is every finalize step's divide (issue 53): num / den where den > 0, else the empty
    value (0.0, or NaN where a report tells "no data" from 0); extreme_or_zero hides the +-inf of an empty max/min."""
    from trl_rollout_corr.core.stats import extreme_or_zero, safe_div

    assert safe_div(3.0, 4.0) == 0.75 and safe_div(3.0, 0.0) == 0.0 and safe_div(3.0, -1.0) == 0.0
    assert math.isnan(safe_div(3.0, 0, float("nan"))) and safe_div(1.0, 8, float("nan")) == 0.125
    assert extreme_or_zero(-math.inf, 0.0) == 0.0 and extreme_or_zero(2.5, 1.0) == 2.5
    # an empty batch: every max / min metric reports 0.0, not the reduction's sentinel
    empty = compute_rollout_correction_stats(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3),
                                             rollout_is="token", rollout_is_threshold=2.0)
    metrics = finalize_stats(empty.stats)
    for name in ("rollout_is_max", "rollout_is_min", "rollout_is_seq_max", "log_ppl_diff_max", "t_kl_max"):
        assert metrics[P + name] == 0.0, name


def test_truncation_statistics_are_declared_keys():
    """The truncation statistics are declared with stat_key (one statistics protocol): a finalize step reads them
    by declared name, and a misspelt name raises instead of giving a missing metric."""
    from trl_rollout_corr.core.criterion import StatFloats, declared_stat_keys

    assert {"trunc.n", "trunc.kept_mass_sum", "trunc.outside_n", "trunc.kept_mass_min"} <= declared_stat_keys()
    stats = truncation_stats(torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 2))
    assert set(stats.sums) | set(stats.mins) <= declared_stat_keys()
    with pytest.raises(KeyError, match="trunc.kept_mass"):
        StatFloats(stats.to_floats()).sum("trunc.kept_mass")
    f = StatFloats(stats.to_floats())  # a min / max read by name too, with a default where absent
    assert f.min("trunc.kept_mass_min") == 1.0 and f.max("trunc.kept_mass_min", -2.0) == -2.0
    with pytest.raises(KeyError):
        f.max("trunc.kept_mass_min")
