"""Rollout-correction metrics as reducible statistics, and their closed-form finalization.

Conventions. "training" log-probs are pi_old in decoupled mode, pi_theta in bypass.
* weight-family means are token-weighted masked means (a sequence weight counts once per token);
* ``*_std`` / ``*_eff_sample_size`` use the weights clamped to [lower, upper];
  std = sqrt(max(E[c^2] - E[c]^2, 0)) over valid tokens, ESS = 1 / E[(c / (E[c] + 1e-8))^2];
* ``seq_*`` are over per-sequence masked means, unbiased (n-1) std;
* sequence/geometric ``*_max`` = exp(min(log_max, 20)), ``*_min`` = exp(min(log_min, 20)) (unclamped below);
* "sequences" are rows with at least one valid token; empty batches report 0.0 everywhere.
"""

from __future__ import annotations

import torch

from .criteria import CRITERIA
from .criterion import TOK_N, StatFloats, stat_key
from .family import WEIGHT_FAMILY_METRICS, weight_family_stats
from .stats import METRIC_PREFIX as PREFIX
from .stats import (RolloutStats, count, extreme_or_zero, masked_max, masked_min, masked_sum, per_sequence_mean,
                    safe_div)
from .group_baseline import finalize_baseline
from .impact import finalize_impact
from .lag import finalize_lag
from .truncation import finalize_truncation
from .weights import SAFETY_BOUND, sequence_log_ratio

__all__ = ["WEIGHT_FAMILY_METRICS", "weight_family_stats", "offpolicy_stats", "compute_offpolicy_metrics",
           "finalize_stats", "finalize_floats", "OFFPOLICY_METRICS", "ALWAYS_METRICS"]

INPUT_TOK_N = stat_key("mask.input_tok_n", __name__)
"""Tokens in the response mask."""
INVALID_TOK_N = stat_key("mask.invalid_tok_n", __name__)
"""Masked tokens with pi_rollout known and a non-finite log-prob."""
ALL_SEQ_N = stat_key("mask.all_seq_n", __name__)
"""Sequences with a token in the response mask."""
MISSING_SEQ_N = stat_key("mask.missing_seq_n", __name__)
"""Sequences without pi_rollout (left uncorrected)."""
KEPT_TOK_N = stat_key("mask.kept_tok_n", __name__)
"""Tokens left in the mask after every rejection."""
_OFFPOLICY_SUMS = ("tok_n", "seq_n", "training_ppl_sum", "rollout_ppl_sum", "training_log_ppl_sum",
                   "rollout_log_ppl_sum", "log_ppl_diff_sum", "log_ppl_abs_diff_sum", "ppl_ratio_sum", "kl_sum",
                   "k3_sum", "chi2_token_sum", "chi2_seq_sum", "max_prob_diff_sum", "mean_prob_diff_sum",
                   "log_ppl_diff_max", "max_prob_diff_max", "log_ppl_diff_min")
OFFPOLICY = {name: stat_key("offpolicy." + name, __name__) for name in _OFFPOLICY_SUMS}
"""The off-policy diagnostics' statistics (``offpolicy.<name>``: sums, and the ``*_max`` / ``*_min`` extremes)."""
OFFPOLICY_METRICS = (
    "training_ppl", "rollout_ppl", "training_log_ppl", "rollout_log_ppl", "log_ppl_diff", "log_ppl_abs_diff",
    "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "kl", "k3_kl", "chi2_token", "chi2_seq",
    "max_prob_diff", "max_prob_diff_max", "mean_prob_diff",
)
ALWAYS_METRICS = ("invalid_logprob_fraction", "rejected_token_fraction", "missing_rollout_logprobs_fraction")
"""The pipeline's own metrics, logged whatever the correction (each criterion's are ``Criterion.metrics``)."""


def offpolicy_stats(
    training_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> RolloutStats:
    """Off-policy diagnostics between pi_train and pi_rollout (log r_t = log pi_train - log pi_rollout).

    kl = E_t[log pi_rollout - log pi_train]; k3_kl = E_t[exp(r) - r - 1] with r safety-bounded;
    chi2_token = E_t[rho_t^2] - 1 (rho safety-bounded); chi2_seq = E_seq[exp(2 clamp(sum_t r_t))] - 1;
    per sequence: log_ppl = -mean_t log p, ppl = exp(log_ppl), log_ppl_diff = mean_t log p_rollout - mean_t log p_train,
    ppl_ratio = exp(log_ppl_diff); prob diffs |p_rollout - p_train| per token, max / mean per sequence.

    Args:
        training_log_prob: log pi_train.   (B, T)
        rollout_log_prob: log pi_rollout.   (B, T)
        response_mask: the tokens averaged over, any dtype.   (B, T)

    Returns:
        ``RolloutStats`` under the keys of :data:`OFFPOLICY` (float64 0-dim; no host sync).
    """
    mask = response_mask.bool()  # (B, T)
    seq_valid = mask.any(-1)  # (B,)
    train = training_log_prob.detach()  # (B, T)
    rollout = rollout_log_prob.detach()  # (B, T)
    log_ratio = train - rollout  # (B, T)
    bounded = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (B, T)
    mean_train = per_sequence_mean(train, mask)  # (B,)
    mean_rollout = per_sequence_mean(rollout, mask)  # (B,)
    log_ppl_diff = mean_rollout - mean_train  # (B,)
    seq_log = sequence_log_ratio(log_ratio, mask).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (B,)
    prob_diff = (torch.exp(rollout.clamp(max=0.0)) - torch.exp(train.clamp(max=0.0))).abs()  # (B, T) p <= 1
    seq_max_prob_diff = (torch.where(mask, prob_diff, torch.zeros_like(prob_diff)).amax(-1) if mask.shape[-1]
                         else mean_train * 0)  # (B,)
    # exp(-mean log p) can overflow for garbage inputs: bound it like every other exp.
    sums = {
        "tok_n": count(mask),
        "seq_n": count(seq_valid),
        "training_ppl_sum": masked_sum(torch.exp((-mean_train).clamp(max=SAFETY_BOUND * 4)), seq_valid),
        "rollout_ppl_sum": masked_sum(torch.exp((-mean_rollout).clamp(max=SAFETY_BOUND * 4)), seq_valid),
        "training_log_ppl_sum": masked_sum(-mean_train, seq_valid),
        "rollout_log_ppl_sum": masked_sum(-mean_rollout, seq_valid),
        "log_ppl_diff_sum": masked_sum(log_ppl_diff, seq_valid),
        "log_ppl_abs_diff_sum": masked_sum(log_ppl_diff.abs(), seq_valid),
        "ppl_ratio_sum": masked_sum(torch.exp(log_ppl_diff.clamp(-SAFETY_BOUND, SAFETY_BOUND)), seq_valid),
        "kl_sum": masked_sum(-log_ratio, mask),
        "k3_sum": masked_sum(torch.exp(bounded) - bounded - 1.0, mask),
        "chi2_token_sum": masked_sum(torch.exp(2.0 * bounded) - 1.0, mask),
        "chi2_seq_sum": masked_sum(torch.exp(2.0 * seq_log) - 1.0, seq_valid),
        "max_prob_diff_sum": masked_sum(seq_max_prob_diff, seq_valid),
        "mean_prob_diff_sum": masked_sum(per_sequence_mean(prob_diff, mask), seq_valid),
    }
    maxes = {
        "log_ppl_diff_max": masked_max(log_ppl_diff, seq_valid),
        "max_prob_diff_max": masked_max(seq_max_prob_diff, seq_valid),
    }
    mins = {"log_ppl_diff_min": masked_min(log_ppl_diff, seq_valid)}
    return RolloutStats(
        sums={OFFPOLICY[k]: v for k, v in sums.items()},
        maxes={OFFPOLICY[k]: v for k, v in maxes.items()},
        mins={OFFPOLICY[k]: v for k, v in mins.items()},
    )


def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Off-policy diagnostics as metrics (one host sync): :func:`offpolicy_stats`, finalized.

    Args:
        old_log_prob: log pi_train (pi_old in decoupled mode, pi_theta in bypass mode).   (B, T)
        rollout_log_prob: log pi_rollout.   (B, T)
        response_mask: the completion tokens, any dtype.   (B, T)

    Returns:
        ``{"rollout_corr/<name>": float}`` for the names of :data:`OFFPOLICY_METRICS`.
    """
    return finalize_stats(offpolicy_stats(old_log_prob, rollout_log_prob, response_mask))


def _finalize_offpolicy(f: StatFloats) -> dict[str, float]:
    g = lambda tag, k: getattr(f, tag)(OFFPOLICY[k])  # noqa: E731  tag: "sum", "max" or "min"
    tok_n, seq_n = g("sum", "tok_n"), g("sum", "seq_n")
    out = {
        "training_ppl": safe_div(g("sum", "training_ppl_sum"), seq_n),
        "rollout_ppl": safe_div(g("sum", "rollout_ppl_sum"), seq_n),
        "training_log_ppl": safe_div(g("sum", "training_log_ppl_sum"), seq_n),
        "rollout_log_ppl": safe_div(g("sum", "rollout_log_ppl_sum"), seq_n),
        "log_ppl_diff": safe_div(g("sum", "log_ppl_diff_sum"), seq_n),
        "log_ppl_abs_diff": safe_div(g("sum", "log_ppl_abs_diff_sum"), seq_n),
        "log_ppl_diff_max": extreme_or_zero(g("max", "log_ppl_diff_max"), seq_n),
        "log_ppl_diff_min": extreme_or_zero(g("min", "log_ppl_diff_min"), seq_n),
        "ppl_ratio": safe_div(g("sum", "ppl_ratio_sum"), seq_n),
        "kl": safe_div(g("sum", "kl_sum"), tok_n),
        "k3_kl": safe_div(g("sum", "k3_sum"), tok_n),
        "chi2_token": safe_div(g("sum", "chi2_token_sum"), tok_n),
        "chi2_seq": safe_div(g("sum", "chi2_seq_sum"), seq_n),
        "max_prob_diff": safe_div(g("sum", "max_prob_diff_sum"), seq_n),
        "max_prob_diff_max": extreme_or_zero(g("max", "max_prob_diff_max"), seq_n),
        "mean_prob_diff": safe_div(g("sum", "mean_prob_diff_sum"), seq_n),
    }
    return {PREFIX + k: v for k, v in out.items()}


def finalize_stats(stats: RolloutStats) -> dict[str, float]:
    """Turn (already reduced) statistics into metrics with one host sync.

    Args:
        stats: the statistics, reduced across processes where there are several (:meth:`RolloutStats.all_reduce`).

    Returns:
        ``{"rollout_corr/<name>": float}`` (:func:`finalize_floats`).
    """
    return finalize_floats(stats.to_floats())


def finalize_floats(floats: dict[str, float]) -> dict[str, float]:
    """:func:`finalize_stats` on the output of :meth:`RolloutStats.to_floats` (no device access): the off-policy
    diagnostics, each criterion's metrics (``Criterion.finalize``), the other families, the pipeline's own.

    Args:
        floats: ``{"sum:<name>" | "max:<name>" | "min:<name>": float}``.

    Returns:
        ``{"rollout_corr/<name>": float}``, only the families whose statistics are present.
    """
    f = StatFloats(floats)
    metrics: dict[str, float] = {}
    for criterion in CRITERIA:
        metrics.update(criterion.finalize(f))
    if f.has(OFFPOLICY["tok_n"]):
        metrics.update(_finalize_offpolicy(f))
    metrics.update(finalize_truncation(floats))
    metrics.update(finalize_lag(floats))
    metrics.update(finalize_baseline(floats))
    metrics.update(finalize_impact(floats))
    if f.has(TOK_N):
        input_n = f.sum(INPUT_TOK_N, 0.0)
        metrics[PREFIX + "invalid_logprob_fraction"] = safe_div(f.sum(INVALID_TOK_N, 0.0), input_n)
        metrics[PREFIX + "rejected_token_fraction"] = safe_div(input_n - f.sum(KEPT_TOK_N, 0.0), input_n)
        metrics[PREFIX + "missing_rollout_logprobs_fraction"] = safe_div(f.sum(MISSING_SEQ_N, 0.0),
                                                                         f.sum(ALL_SEQ_N, 0.0))
    return metrics
