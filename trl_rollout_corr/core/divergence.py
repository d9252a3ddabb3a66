"""Divergence-based rejection: k1 / k2 / k3 criteria, per token or aggregated per sequence (sum, mean, max).

With log r_t = log pi_train(a_t) - log pi_rollout(a_t) on valid tokens (b_t = clamp(log r_t, -20, 20)):

    k1_t = -log r_t            k2_t = 1/2 (log r_t)^2            k3_t = exp(b_t) - 1 - b_t

Criteria (several may be combined; a token is kept only if every criterion keeps it):

    token_kX     the per-token value; rejects single tokens
    seq_sum_kX   sum_t m_t kX_t               \\
    seq_mean_kX  (1/|T|) sum_t m_t kX_t        } reject whole sequences
    seq_max_kX   max_t kX_t  (X in {2, 3})    /

k1 thresholds are bounds on the ratio exp(-statistic): ``"lower_upper"`` (e.g. ``"0.5_2.0"``) or a bare
``upper`` (lower = 1/upper); keep iff lower <= exp(-k1) <= upper, compared in clamped log space. So token_k1,
seq_sum_k1 and seq_mean_k1 equal the token, sequence and geometric RS levels. k2/k3 thresholds are one upper bound:
keep iff statistic <= upper.

Pure tensor functions; no TRL import.

References:
    * Schulman, "Approximating KL Divergence", blog, 2020 (http://joschu.net/blog/kl-approx.html): k1, k2, k3.
      Over tokens sampled from pi_rollout, k1 and k3 are unbiased estimates of KL(pi_rollout || pi_train) and k2 a
      biased one that agrees with it to second order. No arXiv id.
    * verl's rollout correction (volcengine/verl ``verl/trainer/ppo/rollout_corr_helper.py``,
      ``docs/algo/rollout_corr.md``): the criterion names and the ``"lower_upper"`` k1 bands
      (``trl_rollout_corr.config.compat`` translates verl's spelling).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .criterion import SEQ_N, TOK_N, CorrectionField, CorrectionState, Criterion, StatFloats, none_if_unset, stat_key
from .stats import (METRIC_PREFIX, STAT_DTYPE, RolloutStats, count, count_rows, masked_max, masked_sum,
                    per_sequence_mean, safe_div)
from .weights import SAFETY_BOUND

DIVERGENCE_CRITERIA = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)
DIVERGENCE_METRICS = ("mean", "max", "masked_fraction", "seq_masked_fraction")
"""Logged per configured criterion c as ``rollout_rs_<c>_<name>``."""
DIVERGENCE_STATS = ("n", "stat_sum", "rejected_tok_n", "rejected_seq_n", "stat_max")
"""Per criterion c, the statistics ``rs_div.<c>.<name>`` (``stat_max`` max-reduced, the others summed)."""


def divergence_key(criterion: str, stat: str) -> str:
    """The declared statistic ``rs_div.<criterion>.<stat>``.

    Args:
        criterion: one of ``DIVERGENCE_CRITERIA``.
        stat: one of ``DIVERGENCE_STATS``.

    Returns:
        The statistic's key.

    Raises:
        KeyError: a name nothing declared.
    """
    return _KEYS[criterion, stat]


_KEYS = {(c, k): stat_key(f"rs_div.{c}.{k}", __name__) for c in DIVERGENCE_CRITERIA for k in DIVERGENCE_STATS}


@dataclass(frozen=True)
class DivergenceCriterion:
    """One divergence criterion and its bounds.

    k1 keeps lower <= exp(-stat) <= upper; k2 and k3 keep stat <= upper.

    Attributes:
        name: one of ``DIVERGENCE_CRITERIA``, e.g. ``"token_k1"`` or ``"seq_max_k2"``.
        upper: the upper bound (of the ratio for k1, of the statistic for k2/k3).
        lower: the lower ratio bound of a k1 criterion; ``None`` for k2/k3.
    """

    name: str
    upper: float
    lower: float | None = None

    @property
    def estimator(self) -> str:
        """The estimator, from the name's suffix.

        Returns:
            ``"k1"``, ``"k2"`` or ``"k3"``.
        """
        return self.name[-2:]

    @property
    def aggregation(self) -> str:
        """How the per-token estimates aggregate.

        Returns:
            ``"token"`` (none), or ``"sum"``, ``"mean"`` or ``"max"`` over the sequence's valid tokens.
        """
        return self.name.split("_")[1] if self.name.startswith("seq_") else "token"


def _split(value: Any) -> list[str]:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (int, float)):
        return [str(value)]
    return [str(v).strip() for v in value]


def parse_divergence_criteria(criteria: str | Sequence[str] | None,
                              thresholds: str | float | Sequence[Any] | None) -> list[DivergenceCriterion]:
    """Parse ``rollout_rs_criteria`` / ``rollout_rs_criteria_threshold``.

    Args:
        criteria: comma-separated names (``"token_k1,seq_max_k2"``) or a list of them; ``None`` or empty: none.
        thresholds: one value per criterion, comma-separated or a list: k1 ``"lower_upper"`` or an upper
            (lower = 1/upper), k2/k3 an upper; a bare number for a single criterion.

    Returns:
        The criteria in the given order (empty when none are set).

    Raises:
        ValueError: naming the field and the fix, for unknown or repeated names, thresholds without criteria or
            criteria without thresholds, a count mismatch, values that are not finite positive numbers, a k1 band
            with lower > upper, or a ``lower_upper`` pair on a k2/k3 criterion.
    """
    if criteria is None or criteria == "" or criteria == []:
        if thresholds not in (None, "", []):
            raise ValueError("rollout_rs_criteria_threshold is set but rollout_rs_criteria is empty: set the criteria "
                             "(e.g. 'token_k1,seq_max_k2') or unset the thresholds.")
        return []
    names = _split(criteria)
    unknown = [n for n in names if n not in DIVERGENCE_CRITERIA]
    if unknown:
        raise ValueError(f"rollout_rs_criteria has unknown criteria {unknown}; choose from "
                         f"{', '.join(DIVERGENCE_CRITERIA)}.")
    if len(set(names)) != len(names):
        raise ValueError(f"rollout_rs_criteria lists a criterion twice: {names}.")
    if thresholds is None or thresholds == "":
        raise ValueError(f"rollout_rs_criteria={','.join(names)} needs rollout_rs_criteria_threshold, one value per "
                         "criterion, e.g. '0.5_2.0,0.02' (k1: ratio bounds 'lower_upper' or an upper; k2/k3: an "
                         "upper).")
    values = _split(thresholds)
    if len(values) != len(names):
        raise ValueError(f"rollout_rs_criteria_threshold has {len(values)} value(s) for {len(names)} criteria "
                         f"({','.join(names)}): give one per criterion, comma-separated.")
    parsed = []
    for name, text in zip(names, values):
        parts = text.split("_")
        try:
            numbers = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"rollout_rs_criteria_threshold {text!r} for {name} is not a number "
                             "(k1: 'lower_upper' or 'upper'; k2/k3: 'upper').") from None
        if len(numbers) > 2 or any(not math.isfinite(x) or x <= 0 for x in numbers):
            raise ValueError(f"rollout_rs_criteria_threshold {text!r} for {name} must be one or two finite numbers "
                             "> 0.")
        if name.endswith("k1"):
            lower, upper = (numbers[0], numbers[1]) if len(numbers) == 2 else (1.0 / numbers[0], numbers[0])
            if lower > upper:
                raise ValueError(f"rollout_rs_criteria_threshold {text!r} for {name}: lower {lower} > upper {upper}; "
                                 "write 'lower_upper' with lower <= upper.")
            parsed.append(DivergenceCriterion(name, upper, lower))
        else:
            if len(numbers) != 1:
                raise ValueError(f"rollout_rs_criteria_threshold {text!r} for {name}: k2/k3 criteria take a single "
                                 "upper bound (e.g. 0.02), not a 'lower_upper' pair.")
            parsed.append(DivergenceCriterion(name, numbers[0]))
    return parsed


def per_token_divergence(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """The per-token estimator: k1 = -log r, k2 = (log r)^2 / 2, k3 = exp(b) - 1 - b with b = clamp(log r, -20, 20).

    Args:
        log_ratio: log r_t = log pi_train - log pi_rollout, (B, T).
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        (B, T) values (padding not masked).
    """
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    bounded = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (B, T)
    return torch.exp(bounded) - 1.0 - bounded


def divergence_statistic(log_ratio: torch.Tensor, response_mask: torch.Tensor,
                         criterion: DivergenceCriterion) -> torch.Tensor:
    """The criterion's statistic: per token, or the row's sum / mean / max over its valid tokens.

    Args:
        log_ratio: log r_t, (B, T).
        response_mask: m_t, (B, T); any dtype, read as bool.
        criterion: which estimator and aggregation.

    Returns:
        (B, T) values, per token or each sequence's value broadcast over its row (0 for a row with no valid
            token under ``max``).
    """
    mask = response_mask.bool()
    k = per_token_divergence(log_ratio, criterion.estimator)  # (B, T)
    if criterion.aggregation == "token":
        return k
    if criterion.aggregation == "sum":
        row = torch.where(mask, k, torch.zeros_like(k)).sum(-1)  # (B,)
    elif criterion.aggregation == "mean":
        row = per_sequence_mean(k, mask)  # (B,)
    else:
        row = torch.where(mask, k, torch.full_like(k, -float("inf"))).amax(-1)  # (B,)
        row = torch.where(mask.any(-1), row, torch.zeros_like(row))
    return row.unsqueeze(-1).expand_as(k)  # (B, T)


def compute_divergence_rejection_mask(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, criteria: Sequence[DivergenceCriterion],
) -> tuple[torch.Tensor, RolloutStats]:
    """Keep-mask of all criteria (AND) and their device statistics.

    Per criterion c, the stats give ``rollout_rs_{c}_mean`` / ``_max`` (of the statistic over tokens for token
    criteria, over sequences for sequence criteria), ``_masked_fraction`` (valid tokens it rejects) and
    ``_seq_masked_fraction`` (sequences in which it rejects a token).

    Args:
        log_ratio: log r_t = log pi_train - log pi_rollout, (B, T); detached and taken in float64 here.
        response_mask: m_t, (B, T); any dtype, read as bool.
        criteria: the parsed criteria (``parse_divergence_criteria``).

    Returns:
        keep: the keep-mask, (B, T) bool, False on padding.
        stats: the sums and maxima that ``finalize_divergence`` turns into metrics once reduced.
    """
    mask = response_mask.bool()  # (B, T)
    keep = mask.clone()
    stats = RolloutStats()
    with torch.no_grad():
        log_ratio = log_ratio.detach().to(STAT_DTYPE)  # (B, T)
        seq_valid = mask.any(-1)  # (B,)
        for criterion in criteria:
            stat = divergence_statistic(log_ratio, mask, criterion)  # (B, T)
            if criterion.estimator == "k1":
                ratio_log = (-stat).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (B, T) log of the ratio statistic
                ok = (ratio_log >= math.log(criterion.lower)) & (ratio_log <= math.log(criterion.upper))
            else:
                ok = stat <= criterion.upper  # (B, T)
            rejected = mask & ~ok  # (B, T)
            keep &= ok
            key = functools.partial(divergence_key, criterion.name)
            if criterion.aggregation == "token":
                sample, sample_mask, n = stat, mask, count(mask)
            else:
                sample, sample_mask, n = stat[:, 0], seq_valid, count(seq_valid)
            stats.sums.update({
                key("n"): n,
                key("stat_sum"): masked_sum(sample, sample_mask),
                key("rejected_tok_n"): count(rejected),
                key("rejected_seq_n"): count_rows(rejected),
            })
            stats.maxes[key("stat_max")] = masked_max(sample, sample_mask)
    return keep & mask, stats


def finalize_divergence(floats: dict[str, float], tok_n: float, seq_n: float) -> dict[str, float]:
    """The metrics ``rollout_corr/rollout_rs_{c}_{mean,max,masked_fraction,seq_masked_fraction}``.

    Args:
        floats: the reduced statistics as floats, keyed ``"sum:..."`` / ``"max:..."``.
        tok_n: the number of valid tokens (the denominator of ``_masked_fraction``).
        seq_n: the number of sequences with a valid token (the denominator of ``_seq_masked_fraction``).

    Returns:
        One entry per metric of each criterion present in ``floats``.
    """
    metrics: dict[str, float] = {}
    f = StatFloats(floats)
    for name in DIVERGENCE_CRITERIA:
        key = functools.partial(divergence_key, name)
        if not f.has(key("n")):
            continue
        n = f.sum(key("n"))
        stat_max = f.max(key("stat_max"))
        metric = f"{METRIC_PREFIX}rollout_rs_{name}"
        metrics[f"{metric}_mean"] = safe_div(f.sum(key("stat_sum")), n)
        metrics[f"{metric}_max"] = stat_max if math.isfinite(stat_max) else 0.0
        metrics[f"{metric}_masked_fraction"] = safe_div(f.sum(key("rejected_tok_n")), tok_n)
        metrics[f"{metric}_seq_masked_fraction"] = safe_div(f.sum(key("rejected_seq_n")), seq_n)
    return metrics


# ---------------------------------------------------------------------------------------------------- the criterion
def as_criteria(criteria: Any, thresholds: Any) -> list[DivergenceCriterion]:
    """The criteria of a call: already-parsed criteria pass through; strings/lists of names are parsed with their
    thresholds (:func:`parse_divergence_criteria`).

    Args:
        criteria: ``DivergenceCriterion`` objects, or names (comma-separated or a list), or ``None``.
        thresholds: the thresholds for names (ignored for parsed criteria).

    Returns:
        The criteria, in order.
    """
    if criteria and not isinstance(criteria, str) and all(isinstance(c, DivergenceCriterion) for c in criteria):
        return list(criteria)
    return parse_divergence_criteria(criteria, thresholds)


class DivergenceRejection(Criterion):
    """Divergence rejection (Schulman's k1/k2/k3 estimators, "Approximating KL Divergence", 2020, per token or per
    sequence; verl's criteria): keep a token only if every configured criterion keeps it; ANDed with the other
    rejections.

    Attributes:
        fields: ``rollout_rs_criteria`` (names), ``rollout_rs_criteria_threshold`` (one bound per criterion).
        metrics: ``rollout_rs_<criterion>_{mean,max,masked_fraction,seq_masked_fraction}``.
    """

    name = "divergence"
    fields = (
        CorrectionField("rollout_rs_criteria", "str | None", None,
                        "Divergence RS criteria, comma-separated: token_k1..3, seq_sum_k1..3, seq_mean_k1..3, "
                        "seq_max_k2/k3.", "str | None", params_type="Any"),
        CorrectionField("rollout_rs_criteria_threshold", "str | None", None,
                        "One threshold per criterion, comma-separated: k1 'lower_upper' ratio bounds (or upper); "
                        "k2/k3 upper.", "str | None", params_type="Any"),
    )
    metrics = tuple(f"rollout_rs_{c}_{name}" for c in DIVERGENCE_CRITERIA for name in DIVERGENCE_METRICS)
    switches = {"rollout_rs_criteria": ("rollout_rs_criteria_threshold",)}

    def check(self, cfg: Any) -> None:
        """Store YAML lists and bare numbers in the comma-separated form, then parse them
        (:func:`parse_divergence_criteria`).

        Args:
            cfg: the ``RolloutCorrectionConfig`` being validated (both fields normalized in place).

        Raises:
            ValueError: naming the field and the fix.
        """
        for name in ("rollout_rs_criteria", "rollout_rs_criteria_threshold"):
            value = getattr(cfg, name)
            if isinstance(value, (list, tuple)):  # YAML lists are stored in the comma-separated form
                setattr(cfg, name, ",".join(str(v) for v in value))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                setattr(cfg, name, str(value))
            setattr(cfg, name, none_if_unset(getattr(cfg, name)))
        parse_divergence_criteria(cfg.rollout_rs_criteria, cfg.rollout_rs_criteria_threshold)  # raises with the fix

    def removes_tokens(self, cfg: Any) -> bool:
        """Whether a criterion is set.

        Args:
            cfg: the validated ``RolloutCorrectionConfig``.

        Returns:
            ``True`` where it can reject tokens.
        """
        return cfg.rollout_rs_criteria is not None

    def apply(self, p: Any, state: CorrectionState) -> None:
        """Reject the tokens some criterion rejects (:func:`compute_divergence_rejection_mask`; ``state.reject``)
        and add each criterion's statistics.

        Args:
            p: the call's ``CorrectionParams``.
            state: the pipeline's :class:`~.criterion.CorrectionState`.
        """
        criteria = as_criteria(p.rollout_rs_criteria, p.rollout_rs_criteria_threshold)
        if criteria:
            div_keep, div_stats = compute_divergence_rejection_mask(state.log_ratio, state.valid, criteria)
            state.stats.update(div_stats)
            state.reject(~div_keep)  # (B, T)

    def finalize(self, f: StatFloats) -> dict[str, float]:
        """Each configured criterion's metrics (:func:`finalize_divergence`).

        Args:
            f: the reduced statistics.

        Returns:
            ``{"rollout_corr/rollout_rs_<criterion>_*": float}``.
        """
        if not f.has(TOK_N):
            return {}
        return finalize_divergence(f.floats, f.sum(TOK_N, 0.0), f.sum(SEQ_N, 0.0))


DIVERGENCE = DivergenceRejection()
