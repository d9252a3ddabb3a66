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

import math

import torch

from .stats import METRIC_PREFIX as PREFIX
from .stats import STAT_DTYPE, RolloutStats, masked_max, masked_min, masked_sum, per_sequence_mean
from .divergence import finalize_divergence
from .lag import finalize_lag
from .truncation import finalize_truncation
from .weights import SAFETY_BOUND, sequence_log_ratio

WEIGHT_FAMILY_METRICS = (
    "mean", "std", "min", "max", "eff_sample_size", "ratio_fraction_high", "ratio_fraction_low",
    "seq_mean", "seq_std", "seq_min", "seq_max", "seq_max_deviation", "seq_fraction_high", "seq_fraction_low",
)
OFFPOLICY_METRICS = (
    "training_ppl", "rollout_ppl", "training_log_ppl", "rollout_log_ppl", "log_ppl_diff", "log_ppl_abs_diff",
    "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "kl", "k3_kl", "chi2_token", "chi2_seq",
    "max_prob_diff", "max_prob_diff_max", "mean_prob_diff",
)
VETO_METRICS = ("rollout_is_veto_fraction", "rollout_is_catastrophic_token_fraction")
RS_MASK_METRICS = ("rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction")
IS_MASK_METRICS = ("rollout_is_masked_fraction", "rollout_is_seq_masked_fraction")
M2_METRICS = ("rollout_m2", "rollout_m2_kept", "rollout_m2_masked_fraction")
M2_TRUST_REGION_METRICS = ("rollout_m2_trust_region_fraction", "rollout_m2_trust_region",
                           "rollout_m2_trust_region_kept")
"""``rollout_m2_scope="trust_region"`` only: the share of valid tokens on the trust region's active side, and their
mean (log rho)^2 before and after the mask (the bound applies to the latter)."""
ALWAYS_METRICS = ("invalid_logprob_fraction", "rejected_token_fraction", "missing_rollout_logprobs_fraction")
BATCH_NORM_METRICS = ("rollout_is_batch_norm_factor",)
WEIGHT_FAMILIES = ("rollout_is", "rollout_rs")
"""The weight families: each logs ``<family>_<name>`` for every name of WEIGHT_FAMILY_METRICS."""


def weight_family_stats(
    prefix: str,
    values: torch.Tensor,
    log_stat: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    lower: float,
    upper: float,
) -> RolloutStats:
    """Statistics of one weight family (``rollout_is`` or ``rollout_rs``).

    ``values`` (B, T): the safety-bounded weights / statistic (before truncation or masking);
    ``log_stat`` (B, T): its unclamped log (used for sequence/geometric max, min and fractions);
    thresholds: ratio_fraction_high counts values > upper, _low values < lower.
    """
    mask = response_mask.bool()  # (B, T)
    seq_valid = mask.any(-1)  # (B,)
    clamped = values.clamp(lower, upper)  # (B, T)
    shifted = clamped - 1.0  # (B, T) shift by the expected value keeps E[c^2]-E[c]^2 precise
    seq_means = per_sequence_mean(values, mask)  # (B,)
    seq_shift = seq_means - 1.0  # (B,)
    sums = {
        "tok_n": mask.sum(dtype=STAT_DTYPE),
        "seq_n": seq_valid.sum(dtype=STAT_DTYPE),
        "w_sum": masked_sum(values, mask),
        "c_shift_sum": masked_sum(shifted, mask),
        "c_shift_sq_sum": masked_sum(shifted * shifted, mask),
        "seq_shift_sum": masked_sum(seq_shift, seq_valid),
        "seq_shift_sq_sum": masked_sum(seq_shift * seq_shift, seq_valid),
        "seq_high_n": (seq_valid & (seq_means > upper)).sum(dtype=STAT_DTYPE),
        "seq_low_n": (seq_valid & (seq_means < lower)).sum(dtype=STAT_DTYPE),
    }
    maxes = {"seq_max": masked_max(seq_means, seq_valid), "seq_max_deviation": masked_max(seq_shift.abs(), seq_valid)}
    mins = {"seq_min": masked_min(seq_means, seq_valid)}
    if level == "token":
        sums["high_n"] = (mask & (values > upper)).sum(dtype=STAT_DTYPE)
        sums["low_n"] = (mask & (values < lower)).sum(dtype=STAT_DTYPE)
        sums["frac_den"] = sums["tok_n"]
        maxes["max"] = masked_max(values, mask)
        mins["min"] = masked_min(values, mask)
    else:
        seq_log = log_stat[:, 0] if log_stat.shape[-1] > 0 else log_stat.new_zeros(log_stat.shape[0])  # (B,)
        sums["high_n"] = (seq_valid & (seq_log > math.log(upper))).sum(dtype=STAT_DTYPE)
        sums["low_n"] = (seq_valid & (seq_log < math.log(lower))).sum(dtype=STAT_DTYPE)
        sums["frac_den"] = sums["seq_n"]
        maxes["max"] = torch.exp(masked_max(seq_log, seq_valid).clamp(max=SAFETY_BOUND))
        mins["min"] = torch.exp(masked_min(seq_log, seq_valid).clamp(max=SAFETY_BOUND))  # finite even at +1e4
    p = prefix + "."
    return RolloutStats(
        sums={p + k: v for k, v in sums.items()},
        maxes={p + k: v for k, v in maxes.items()},
        mins={p + k: v for k, v in mins.items()},
    )


def offpolicy_stats(
    training_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> RolloutStats:
    """Off-policy diagnostics between pi_train and pi_rollout (log r_t = log pi_train - log pi_rollout).

    kl = E_t[log pi_rollout - log pi_train]; k3_kl = E_t[exp(r) - r - 1] with r safety-bounded;
    chi2_token = E_t[rho_t^2] - 1 (rho safety-bounded); chi2_seq = E_seq[exp(2 clamp(sum_t r_t))] - 1;
    per sequence: log_ppl = -mean_t log p, ppl = exp(log_ppl), log_ppl_diff = mean_t log p_rollout - mean_t log p_train,
    ppl_ratio = exp(log_ppl_diff); prob diffs |p_rollout - p_train| per token, max / mean per sequence.
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
        "tok_n": mask.sum(dtype=STAT_DTYPE),
        "seq_n": seq_valid.sum(dtype=STAT_DTYPE),
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
        sums={"offpolicy." + k: v for k, v in sums.items()},
        maxes={"offpolicy." + k: v for k, v in maxes.items()},
        mins={"offpolicy." + k: v for k, v in mins.items()},
    )


def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Off-policy diagnostics as ``{"rollout_corr/<name>": float}`` (one host sync)."""
    return finalize_stats(offpolicy_stats(old_log_prob, rollout_log_prob, response_mask))


def _div(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def _extreme(value: float, count: float) -> float:
    return value if count > 0 else 0.0


def _finalize_family(prefix: str, f: dict[str, float]) -> dict[str, float]:
    g = lambda tag, k: f[f"{tag}:{prefix}.{k}"]  # noqa: E731
    tok_n, seq_n = g("sum", "tok_n"), g("sum", "seq_n")
    mean_c_shift = _div(g("sum", "c_shift_sum"), tok_n)
    var = max(_div(g("sum", "c_shift_sq_sum"), tok_n) - mean_c_shift**2, 0.0)
    mean_c = mean_c_shift + 1.0
    mean_c_sq = _div(g("sum", "c_shift_sq_sum") + 2.0 * g("sum", "c_shift_sum"), tok_n) + 1.0
    ess = 1.0 / (mean_c_sq / (mean_c + 1e-8) ** 2) if tok_n > 0 else 0.0
    seq_shift_mean = _div(g("sum", "seq_shift_sum"), seq_n)
    seq_var = (
        max(g("sum", "seq_shift_sq_sum") - seq_n * seq_shift_mean**2, 0.0) / (seq_n - 1) if seq_n > 1 else 0.0
    )
    out = {
        "mean": _div(g("sum", "w_sum"), tok_n),
        "std": math.sqrt(var) if tok_n > 1 else 0.0,
        "min": _extreme(g("min", "min"), seq_n),
        "max": _extreme(g("max", "max"), seq_n),
        "eff_sample_size": ess,
        "ratio_fraction_high": _div(g("sum", "high_n"), g("sum", "frac_den")),
        "ratio_fraction_low": _div(g("sum", "low_n"), g("sum", "frac_den")),
        "seq_mean": seq_shift_mean + 1.0 if seq_n > 0 else 0.0,
        "seq_std": math.sqrt(seq_var),
        "seq_min": _extreme(g("min", "seq_min"), seq_n),
        "seq_max": _extreme(g("max", "seq_max"), seq_n),
        "seq_max_deviation": _extreme(g("max", "seq_max_deviation"), seq_n),
        "seq_fraction_high": _div(g("sum", "seq_high_n"), seq_n),
        "seq_fraction_low": _div(g("sum", "seq_low_n"), seq_n),
    }
    return {f"{PREFIX}{prefix}_{k}": v for k, v in out.items()}


def _finalize_offpolicy(f: dict[str, float]) -> dict[str, float]:
    g = lambda tag, k: f[f"{tag}:offpolicy.{k}"]  # noqa: E731
    tok_n, seq_n = g("sum", "tok_n"), g("sum", "seq_n")
    out = {
        "training_ppl": _div(g("sum", "training_ppl_sum"), seq_n),
        "rollout_ppl": _div(g("sum", "rollout_ppl_sum"), seq_n),
        "training_log_ppl": _div(g("sum", "training_log_ppl_sum"), seq_n),
        "rollout_log_ppl": _div(g("sum", "rollout_log_ppl_sum"), seq_n),
        "log_ppl_diff": _div(g("sum", "log_ppl_diff_sum"), seq_n),
        "log_ppl_abs_diff": _div(g("sum", "log_ppl_abs_diff_sum"), seq_n),
        "log_ppl_diff_max": _extreme(g("max", "log_ppl_diff_max"), seq_n),
        "log_ppl_diff_min": _extreme(g("min", "log_ppl_diff_min"), seq_n),
        "ppl_ratio": _div(g("sum", "ppl_ratio_sum"), seq_n),
        "kl": _div(g("sum", "kl_sum"), tok_n),
        "k3_kl": _div(g("sum", "k3_sum"), tok_n),
        "chi2_token": _div(g("sum", "chi2_token_sum"), tok_n),
        "chi2_seq": _div(g("sum", "chi2_seq_sum"), seq_n),
        "max_prob_diff": _div(g("sum", "max_prob_diff_sum"), seq_n),
        "max_prob_diff_max": _extreme(g("max", "max_prob_diff_max"), seq_n),
        "mean_prob_diff": _div(g("sum", "mean_prob_diff_sum"), seq_n),
    }
    return {PREFIX + k: v for k, v in out.items()}


def finalize_stats(stats: RolloutStats) -> dict[str, float]:
    """Turn (already reduced) statistics into ``{"rollout_corr/<name>": float}`` with one host sync."""
    return finalize_floats(stats.to_floats())


def finalize_floats(f: dict[str, float]) -> dict[str, float]:
    """:func:`finalize_stats` on the output of :meth:`RolloutStats.to_floats` (no device access)."""
    s = lambda k: f.get(f"sum:{k}", 0.0)  # noqa: E731
    metrics: dict[str, float] = {}
    for family in WEIGHT_FAMILIES:
        if f"sum:{family}.tok_n" in f:
            metrics.update(_finalize_family(family, f))
    if "sum:offpolicy.tok_n" in f:
        metrics.update(_finalize_offpolicy(f))
    if "sum:rollout_is.norm_mean_sum" in f:
        metrics[PREFIX + "rollout_is_batch_norm_factor"] = _div(s("rollout_is.norm_mean_sum"), s("rollout_is.norm_n"))
    metrics.update(finalize_truncation(f))
    metrics.update(finalize_lag(f))
    if "sum:mask.tok_n" in f:
        tok_n, seq_n = s("mask.tok_n"), s("mask.seq_n")
        metrics.update(finalize_divergence(f, tok_n, seq_n))
        metrics[PREFIX + "rollout_is_veto_fraction"] = _div(s("mask.vetoed_seq_n"), seq_n)
        metrics[PREFIX + "rollout_is_catastrophic_token_fraction"] = _div(s("mask.catastrophic_tok_n"), tok_n)
        metrics[PREFIX + "invalid_logprob_fraction"] = _div(s("mask.invalid_tok_n"), s("mask.input_tok_n"))
        metrics[PREFIX + "rejected_token_fraction"] = _div(s("mask.input_tok_n") - s("mask.kept_tok_n"),
                                                           s("mask.input_tok_n"))
        metrics[PREFIX + "missing_rollout_logprobs_fraction"] = _div(s("mask.missing_seq_n"), s("mask.all_seq_n"))
        if "sum:mask.is_masked_tok_n" in f:  # rollout_is_bound="mask": weights set to 0 (tokens stay in the mask)
            metrics[PREFIX + "rollout_is_masked_fraction"] = _div(s("mask.is_masked_tok_n"), tok_n)
            metrics[PREFIX + "rollout_is_seq_masked_fraction"] = _div(s("mask.is_masked_seq_n"), seq_n)
        if "sum:mask.m2_masked_tok_n" in f:  # second-moment mask: mean (log rho)^2 before / after, tokens masked
            metrics[PREFIX + "rollout_m2"] = _div(s("m2.v_sum"), tok_n)
            metrics[PREFIX + "rollout_m2_kept"] = _div(s("m2.v_kept_sum"), tok_n - s("mask.m2_masked_tok_n"))
            metrics[PREFIX + "rollout_m2_masked_fraction"] = _div(s("mask.m2_masked_tok_n"), tok_n)
        if "sum:m2.region_tok_n" in f:  # M2PO's trust-region scope: the candidates' share and mean before / after
            region_n = s("m2.region_tok_n")
            metrics[PREFIX + "rollout_m2_trust_region_fraction"] = _div(region_n, tok_n)
            metrics[PREFIX + "rollout_m2_trust_region"] = _div(s("m2.region_v_sum"), region_n)
            metrics[PREFIX + "rollout_m2_trust_region_kept"] = _div(s("m2.region_v_kept_sum"),
                                                                    region_n - s("mask.m2_masked_tok_n"))
        if "sum:mask.rs_rejected_tok_n" in f:
            metrics[PREFIX + "rollout_rs_masked_fraction"] = _div(s("mask.rs_rejected_tok_n"), tok_n)
            metrics[PREFIX + "rollout_rs_seq_masked_fraction"] = _div(s("mask.rs_rejected_seq_n"), seq_n)
    return metrics
