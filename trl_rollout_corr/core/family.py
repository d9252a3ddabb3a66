"""Weight-family statistics: the reducible statistics of a weight or ratio statistic and their closed-form metrics.

Two criteria log a weight family: the IS weights (``rollout_is_<name>``, :mod:`.weights`) and the rejection
statistic (``rollout_rs_<name>``, :mod:`.rejection`). Conventions (see :mod:`.metrics`): token-weighted masked means;
``*_std`` / ``*_eff_sample_size`` use the values clamped to [lower, upper], std = sqrt(max(E[c^2] - E[c]^2, 0)),
ESS = 1 / E[(c / (E[c] + 1e-8))^2]; ``seq_*`` are over per-sequence masked means, unbiased (n-1) std;
sequence/geometric ``*_max`` = exp(min(log_max, 20)). Pure PyTorch: no TRL import.
"""

from __future__ import annotations

import math

import torch

from .criterion import StatFloats, stat_key
from .stats import METRIC_PREFIX as PREFIX
from .stats import (SAFETY_BOUND, RolloutStats, count, extreme_or_zero, masked_max, masked_min, masked_sum,
                    per_sequence_mean, safe_div)

WEIGHT_FAMILY_METRICS = (
    "mean", "std", "min", "max", "eff_sample_size", "ratio_fraction_high", "ratio_fraction_low",
    "seq_mean", "seq_std", "seq_min", "seq_max", "seq_max_deviation", "seq_fraction_high", "seq_fraction_low",
)
"""Logged per family as ``<family>_<name>``."""
FAMILY_SUMS = ("tok_n", "seq_n", "w_sum", "c_shift_sum", "c_shift_sq_sum", "seq_shift_sum", "seq_shift_sq_sum",
               "seq_high_n", "seq_low_n", "high_n", "low_n", "frac_den")
FAMILY_MAXES = ("seq_max", "seq_max_deviation", "max")
FAMILY_MINS = ("seq_min", "min")


def declare_family(prefix: str, owner: str) -> tuple[str, ...]:
    """Declare the statistics of the family ``prefix`` (``"rollout_is"``, ``"rollout_rs"``) for module ``owner``;
    returns their names; and the metric names it logs are ``family_metrics(prefix)``."""
    return tuple(stat_key(f"{prefix}.{k}", owner) for k in (*FAMILY_SUMS, *FAMILY_MAXES, *FAMILY_MINS))


def family_metrics(prefix: str) -> tuple[str, ...]:
    """The metric names (without the prefix) of the family ``prefix``."""
    return tuple(f"{prefix}_{name}" for name in WEIGHT_FAMILY_METRICS)


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
        "tok_n": count(mask),
        "seq_n": count(seq_valid),
        "w_sum": masked_sum(values, mask),
        "c_shift_sum": masked_sum(shifted, mask),
        "c_shift_sq_sum": masked_sum(shifted * shifted, mask),
        "seq_shift_sum": masked_sum(seq_shift, seq_valid),
        "seq_shift_sq_sum": masked_sum(seq_shift * seq_shift, seq_valid),
        "seq_high_n": count(seq_valid & (seq_means > upper)),
        "seq_low_n": count(seq_valid & (seq_means < lower)),
    }
    maxes = {"seq_max": masked_max(seq_means, seq_valid), "seq_max_deviation": masked_max(seq_shift.abs(), seq_valid)}
    mins = {"seq_min": masked_min(seq_means, seq_valid)}
    if level == "token":
        sums["high_n"] = count(mask & (values > upper))
        sums["low_n"] = count(mask & (values < lower))
        sums["frac_den"] = sums["tok_n"]
        maxes["max"] = masked_max(values, mask)
        mins["min"] = masked_min(values, mask)
    else:
        seq_log = log_stat[:, 0] if log_stat.shape[-1] > 0 else log_stat.new_zeros(log_stat.shape[0])  # (B,)
        sums["high_n"] = count(seq_valid & (seq_log > math.log(upper)))
        sums["low_n"] = count(seq_valid & (seq_log < math.log(lower)))
        sums["frac_den"] = sums["seq_n"]
        maxes["max"] = torch.exp(masked_max(seq_log, seq_valid).clamp(max=SAFETY_BOUND))
        mins["min"] = torch.exp(masked_min(seq_log, seq_valid).clamp(max=SAFETY_BOUND))  # finite even at +1e4
    p = prefix + "."
    return RolloutStats(
        sums={p + k: v for k, v in sums.items()},
        maxes={p + k: v for k, v in maxes.items()},
        mins={p + k: v for k, v in mins.items()},
    )



def finalize_family(prefix: str, f: StatFloats) -> dict[str, float]:
    """The metrics ``rollout_corr/<prefix>_<name>`` (every name of ``WEIGHT_FAMILY_METRICS``) of one family, from
    the reduced statistics; nothing where the family did not run."""
    if not f.has(prefix + ".tok_n"):
        return {}
    g = lambda tag, k: getattr(f, tag)(f"{prefix}.{k}")  # noqa: E731
    tok_n, seq_n = g("sum", "tok_n"), g("sum", "seq_n")
    mean_c_shift = safe_div(g("sum", "c_shift_sum"), tok_n)
    var = max(safe_div(g("sum", "c_shift_sq_sum"), tok_n) - mean_c_shift**2, 0.0)
    mean_c = mean_c_shift + 1.0
    mean_c_sq = safe_div(g("sum", "c_shift_sq_sum") + 2.0 * g("sum", "c_shift_sum"), tok_n) + 1.0
    ess = 1.0 / (mean_c_sq / (mean_c + 1e-8) ** 2) if tok_n > 0 else 0.0
    seq_shift_mean = safe_div(g("sum", "seq_shift_sum"), seq_n)
    seq_var = safe_div(max(g("sum", "seq_shift_sq_sum") - seq_n * seq_shift_mean**2, 0.0), seq_n - 1)  # n-1: unbiased
    out = {
        "mean": safe_div(g("sum", "w_sum"), tok_n),
        "std": math.sqrt(var) if tok_n > 1 else 0.0,
        "min": extreme_or_zero(g("min", "min"), seq_n),
        "max": extreme_or_zero(g("max", "max"), seq_n),
        "eff_sample_size": ess,
        "ratio_fraction_high": safe_div(g("sum", "high_n"), g("sum", "frac_den")),
        "ratio_fraction_low": safe_div(g("sum", "low_n"), g("sum", "frac_den")),
        "seq_mean": seq_shift_mean + 1.0 if seq_n > 0 else 0.0,
        "seq_std": math.sqrt(seq_var),
        "seq_min": extreme_or_zero(g("min", "seq_min"), seq_n),
        "seq_max": extreme_or_zero(g("max", "seq_max"), seq_n),
        "seq_max_deviation": extreme_or_zero(g("max", "seq_max_deviation"), seq_n),
        "seq_fraction_high": safe_div(g("sum", "seq_high_n"), seq_n),
        "seq_fraction_low": safe_div(g("sum", "seq_low_n"), seq_n),
    }
    return {f"{PREFIX}{prefix}_{k}": v for k, v in out.items()}


