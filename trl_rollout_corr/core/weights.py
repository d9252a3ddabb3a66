"""Truncated importance-sampling weights (TIS), token and sequence level.

Notation (seeds): rho_t = pi_train(a_t|s_t) / pi_rollout(a_t|s_t), with pi_train = pi_old in decoupled
mode and pi_theta (detached) in bypass mode; m_t the response mask; C = ``rollout_is_threshold``.

References:
    * Espeholt et al., "IMPALA: Scalable Distributed Deep-RL with Importance Weighted Actor-Learner Architectures",
      ICML 2018, arXiv:1802.01561: truncated importance weights, min(rho, C).
    * Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", blog, 2025
      (https://fengyao.notion.site/off-policy-rl): truncated IS (TIS) against the sampler/trainer mismatch.
    * Hilton, Cobbe & Schulman, "Batch size-invariance for policy optimization", NeurIPS 2022, arXiv:2110.00641:
      decoupled PPO, the proximal policy pi_old apart from the behaviour policy pi_rollout (decoupled mode).
    * Ling Team, "Every Step Evolves" (Ring-1T), arXiv:2510.18855: IcePop, the ``"mask"`` bound with [0.5, 5].
    * Liu, Li et al., "When Speed Kills Stability", blog, 2025: sequence-level IS.
"""

from __future__ import annotations

from typing import Any

import torch

from .criterion import (SEQ_N, TOK_N, CorrectionField, CorrectionState, Criterion, StatFloats, none_if_unset,
                        require_positive, stat_key)
from .family import declare_family, family_metrics, finalize_family, weight_family_stats
from .stats import METRIC_PREFIX as PREFIX
from .stats import (SAFETY_BOUND, ReduceFn, count, count_rows, masked_sum, per_sequence_mean, safe_div,
                    stat_constant)

IS_LEVELS = ("token", "sequence")
IS_BOUNDS = ("truncate", "mask")
"""What happens to a weight outside [C_lower, C]: clipped to the bound (TIS) or set to 0 (masked IS, TRL's
``*_mask`` modes: the token stays in the loss's token count with weight 0)."""


def sequence_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The log of the sequence ratio, unclamped: log prod_t rho_t = sum_t m_t log rho_t.

    Args:
        log_ratio: log rho_t, (B, T).
        response_mask: m_t, (B, T) bool; padding is left out of the sum.

    Returns:
        (B,) tensor, one log ratio per sequence.
    """
    return torch.where(response_mask, log_ratio, torch.zeros_like(log_ratio)).sum(1)


def safe_is_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str) -> torch.Tensor:
    """Safety-bounded, padding-zeroed, *untruncated* weights.

        token:    w_t = m_t * exp(clamp(log rho_t, -20, 20))
        sequence: w_t = m_t * exp(clamp(sum_s m_s log rho_s, -20, 20))   (one weight broadcast per sequence)

    Args:
        log_ratio: log rho_t, (B, T).
        response_mask: m_t, (B, T) bool.
        level: ``"token"`` or ``"sequence"``.

    Returns:
        (B, T) weights, 0 on padding.

    Raises:
        ValueError: ``level`` is not an IS level.
    """
    if level == "token":
        bounded = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (B, T)
    elif level == "sequence":
        bounded = sequence_log_ratio(log_ratio, response_mask).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (B,)
        bounded = bounded.unsqueeze(1).expand_as(log_ratio)  # (B, T)
    else:
        raise ValueError(f"rollout_is must be one of {IS_LEVELS} or None, got {level!r}.")
    return torch.exp(bounded) * response_mask  # (B, T)


def batch_normalize_weights(
    weights: torch.Tensor,
    response_mask: torch.Tensor,
    level: str,
    reduce_fn: ReduceFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Divide truncated weights by their batch mean so that E[w~] = 1.

        token:    w~_t = w_t / ( sum_{i,t} w_{i,t} m_{i,t} / sum_{i,t} m_{i,t} )
        sequence: w~_i = w_i / ( (1/B) sum_j wbar_j ),  wbar_j = per-sequence masked mean of w_j

    Normalization is skipped (factor 1) when the mean is <= 1e-8.

    Args:
        weights: the bounded weights w, (B, T).
        response_mask: m_t, (B, T) bool.
        level: ``"token"`` or ``"sequence"`` (the mean over tokens, or over the sequences with a valid token).
        reduce_fn: sums the (total, count) pair across processes, making the mean global; ``None``: local.

    Returns:
        weights: the normalized weights, (B, T).
        mean: the batch mean, 0-dim float64; returned also where it was <= 1e-8 and not applied.
    """
    if level == "token":
        totals = torch.stack([masked_sum(weights, response_mask), count(response_mask)])  # (2,)
    else:
        has_tokens = response_mask.any(1)  # (B,)
        seq_means = per_sequence_mean(weights, response_mask)  # (B,)
        totals = torch.stack([masked_sum(seq_means, has_tokens), count(has_tokens)])  # (2,)
    if reduce_fn is not None:
        totals = reduce_fn(totals, "sum")
    mean = totals[0] / totals[1].clamp(min=1)  # 0-dim
    # > vs >=: a float64 mean of float32 weights is never exactly 1e-8, so the two are the same test
    factor = torch.where(mean > 1e-8, mean, torch.ones_like(mean))  # 0-dim  # pragma: no mutate
    return weights / factor, mean  # a 0-dim factor keeps the weights' dtype


def bound_weights(safe: torch.Tensor, upper: float, lower: float | None = None,
                  bound: str = "truncate") -> torch.Tensor:
    """The bounded IS weight from the safety-bounded rho (zero on padding stays zero).

        truncate: w = clamp(rho, C_lower, C)                 (C_lower = None: min(rho, C), the seeds' TIS)
        mask:     w = rho * 1[C_lower <= rho <= C]           (C_lower = None: 0; TRL's ``*_mask`` modes, IcePop)

    Args:
        safe: the safety-bounded weights of ``safe_is_weights``, (B, T).
        upper: C.
        lower: C_lower, or ``None`` for no lower bound.
        bound: ``"truncate"`` or ``"mask"``.

    Returns:
        (B, T) bounded weights.

    Raises:
        ValueError: ``bound`` is not one of ``IS_BOUNDS``.
    """
    if bound == "truncate":
        weights = safe.clamp(max=upper)  # (B, T)
        return weights if lower is None else torch.where(safe > 0, weights.clamp(min=lower), weights)  # (B, T)
    if bound == "mask":
        inside = safe <= upper  # (B, T)
        if lower is not None:
            inside = inside & (safe >= lower)  # (B, T)
        return torch.where(inside, safe, torch.zeros_like(safe))  # (B, T)
    raise ValueError(f"rollout_is_bound must be one of {IS_BOUNDS}, got {bound!r}.")


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: float = 2.0,
    rollout_is_batch_normalize: bool = False,
    reduce_fn: ReduceFn | None = None,
    rollout_is_threshold_lower: float | None = None,
    rollout_is_bound: str = "truncate",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Bounded IS weights from rho at token or sequence level (truncated IS: IMPALA, arXiv:1802.01561; TIS).

    1. safety bound: exp(clamp(log rho, -20, 20)) (token) or exp(clamp(sum_t log rho_t, -20, 20)) (sequence)
    2. zero padding (x m)
    3. bound (``bound_weights``): truncate w = min(rho, C) (TIS; with C_lower: clamp(rho, C_lower, C)), or
       mask w = rho * 1[C_lower <= rho <= C]
    4. optional batch normalization (see ``batch_normalize_weights``)

    Args:
        log_ratio: log rho_t = log pi_train - log pi_rollout, (B, T); detached here.
        response_mask: m_t, (B, T); any dtype, read as bool.
        rollout_is: ``"token"`` or ``"sequence"``.
        rollout_is_threshold: C, the upper bound (``inf`` for none).
        rollout_is_batch_normalize: divide the bounded weights by their batch mean.
        reduce_fn: makes the batch mean global across processes; ``None``: local.
        rollout_is_threshold_lower: C_lower, or ``None``.
        rollout_is_bound: ``"truncate"`` (clip to [C_lower, C]) or ``"mask"`` (0 outside it).

    Returns:
        weights: the IS weights, (B, T), detached.
        safe: the safety-bounded, unbounded weights, (B, T), for the metrics.
        norm_mean: the batch mean of the normalization (0-dim), or ``None`` without it.

    Raises:
        ValueError: an unknown ``rollout_is`` or ``rollout_is_bound``.
    """
    response_mask = response_mask.bool()
    with torch.no_grad():
        safe = safe_is_weights(log_ratio.detach(), response_mask, rollout_is)  # (B, T)
        weights = bound_weights(safe, rollout_is_threshold, rollout_is_threshold_lower, rollout_is_bound)  # (B, T)
        norm_mean = None
        if rollout_is_batch_normalize:
            weights, norm_mean = batch_normalize_weights(weights, response_mask, rollout_is, reduce_fn)
    return weights, safe, norm_mean


# ---------------------------------------------------------------------------------------------------- the criterion
IS_NORM_MEAN_SUM = stat_key("rollout_is.norm_mean_sum", __name__)
"""Sum of the batch means the weights were divided by (one per call; ``rollout_is_batch_normalize``)."""
IS_NORM_N = stat_key("rollout_is.norm_n", __name__)
IS_MASKED_TOK_N = stat_key("mask.is_masked_tok_n", __name__)
"""Valid tokens whose weight ``rollout_is_bound="mask"`` set to 0."""
IS_MASKED_SEQ_N = stat_key("mask.is_masked_seq_n", __name__)
declare_family("rollout_is", __name__)  # the weight family's statistics rollout_is.<name>
IS_MASK_METRICS = ("rollout_is_masked_fraction", "rollout_is_seq_masked_fraction")
BATCH_NORM_METRICS = ("rollout_is_batch_norm_factor",)


class ImportanceWeights(Criterion):
    """Truncated or masked IS weights (TIS; IMPALA, arXiv:1802.01561; IcePop's mask, arXiv:2510.18855), token or
    sequence level, optionally batch-normalized: w = min(rho, C) (with C_lower: clamp(rho, C_lower, C)) or
    w = rho * 1[C_lower <= rho <= C], rho = pi_train / pi_rollout. Weights, never a rejection.

    Attributes:
        fields: ``rollout_is`` (level), ``rollout_is_threshold`` (C), ``rollout_is_batch_normalize``,
            ``rollout_is_threshold_lower`` (C_lower), ``rollout_is_bound`` ("truncate" | "mask").
        metrics: the ``rollout_is_*`` weight family, the masked fractions and the batch-normalization factor.
    """

    name = "is_weights"
    fields = (
        CorrectionField("rollout_is", "str | None", "token", "IS level: token | sequence | none.", "str | None",
                        params_default=None),
        CorrectionField("rollout_is_threshold", "float", 2.0,
                        "IS upper bound C (2.0 in the decoupled/bypass presets, 3.0 in TRL's default); verl's "
                        "'lower_upper' string (e.g. 0.5_5.0) is IcePop: weights outside the band set to 0.",
                        "float | str | None"),
        CorrectionField("rollout_is_batch_normalize", "bool", False,
                        "Normalize IS weights to mean 1 over each generation batch.", "bool | None"),
        CorrectionField("rollout_is_threshold_lower", "float | None", None,
                        "IS lower bound C_lower (default none; 'none' switches a preset's off).", "float | str | None"),
        CorrectionField("rollout_is_bound", "str", "truncate",
                        "IS weight outside [C_lower, C]: truncate (clip to the bound, default) | mask (set to 0; "
                        "TRL's *_mask modes).", "str | None"),
    )
    metrics = (*family_metrics("rollout_is"), *IS_MASK_METRICS, *BATCH_NORM_METRICS)
    switches = {"rollout_is": ("rollout_is_bound", "rollout_is_threshold_lower")}

    def check(self, cfg: Any) -> None:
        """The level is token | sequence | None, C > 0 (inf allowed), C_lower in (0, C), the bound truncate | mask,
        and the bound's fields only where a weight applies them.

        Args:
            cfg: the ``RolloutCorrectionConfig`` being validated (``rollout_is_bound`` normalized in place).

        Raises:
            ValueError: naming the field and the fix.
        """
        if cfg.rollout_is == "geometric":
            raise ValueError("rollout_is='geometric' is not an IS level: geometric aggregation is for rejection only. "
                             "Use rollout_rs='geometric' (with rollout_rs_threshold, e.g. 1.001) instead.")
        if cfg.rollout_is is not None and cfg.rollout_is not in IS_LEVELS:
            raise ValueError(f"rollout_is must be one of 'token', 'sequence' or None, got {cfg.rollout_is!r}.")
        require_positive("rollout_is_threshold", cfg.rollout_is_threshold, "e.g. 2.0, or inf for no upper bound",
                         allow_inf=True)
        cfg.rollout_is_bound = none_if_unset(cfg.rollout_is_bound) or "truncate"
        if cfg.rollout_is_bound not in IS_BOUNDS:
            raise ValueError(f"rollout_is_bound must be 'truncate' (clip the weight to its bounds) or 'mask' (set it "
                             f"to 0 outside them), got {cfg.rollout_is_bound!r}.")
        if cfg.rollout_is_threshold_lower is not None:
            require_positive("rollout_is_threshold_lower", cfg.rollout_is_threshold_lower,
                             "or None for no lower bound")
            if cfg.rollout_is_threshold_lower >= cfg.rollout_is_threshold:
                raise ValueError(f"rollout_is_threshold_lower ({cfg.rollout_is_threshold_lower}) must be < "
                                 f"rollout_is_threshold ({cfg.rollout_is_threshold}): lower it or leave it None.")
        is_bound_set = cfg.rollout_is_bound != "truncate" or cfg.rollout_is_threshold_lower is not None
        if cfg.rollout_is is None and is_bound_set:
            raise ValueError("rollout_is_bound / rollout_is_threshold_lower are set but rollout_is is None, so they "
                             "would be ignored: set rollout_is ('token' or 'sequence') or leave them at their "
                             "defaults.")
        if cfg.bypass_mode and not cfg.use_policy_gradient and cfg.rollout_is is not None and is_bound_set:
            raise ValueError("rollout_is_bound='mask' / rollout_is_threshold_lower with bypass_mode=True and "
                             "use_policy_gradient=False: bypass PPO applies no IS weight (its PPO ratio already is "
                             "pi_theta/pi_rollout), so they would change nothing but a metric. Leave them at their "
                             "defaults, or use decoupled mode (bypass_mode=False).")

    def batch_scope(self, cfg: Any) -> str | None:
        """``"rollout_is_batch_normalize"`` where the weights applied are divided by their generation batch's mean.

        Args:
            cfg: the validated ``RolloutCorrectionConfig``.

        Returns:
            The field's name, or ``None``.
        """
        if cfg.rollout_is is not None and cfg.rollout_is_batch_normalize and cfg.applies_is_weights:
            return "rollout_is_batch_normalize"
        return None

    def apply(self, p: Any, state: CorrectionState) -> None:
        """Multiply the state's weights by w_t (B, T) (:func:`compute_rollout_correction_weights`), mark the clipped
        (``pin``) or zeroed (``zero_weights``) tokens, and add the weight family's statistics.

        Args:
            p: the call's ``CorrectionParams``.
            state: the pipeline's :class:`~.criterion.CorrectionState`.
        """
        if p.rollout_is is None:
            return
        log_ratio, valid = state.log_ratio, state.valid  # (B, T) each
        is_weights, safe, norm_mean = compute_rollout_correction_weights(
            log_ratio, valid, p.rollout_is, p.rollout_is_threshold, p.rollout_is_batch_normalize, state.reduce_fn,
            p.rollout_is_threshold_lower, p.rollout_is_bound,
        )  # (B, T), (B, T), 0-dim or None
        seq_log = sequence_log_ratio(log_ratio, valid).unsqueeze(1).expand_as(log_ratio)  # (B, T)
        is_lower = p.rollout_is_threshold_lower
        is_lower = 1.0 / p.rollout_is_threshold if is_lower is None else is_lower
        state.stats.update(weight_family_stats(
            "rollout_is", safe, seq_log, valid, p.rollout_is, is_lower, p.rollout_is_threshold
        ))
        if p.rollout_is_bound == "mask":
            weight_zeroed = valid & (is_weights == 0)  # (B, T) masked (a valid rho is > 0; normalizing keeps 0)
            state.zero_weights(weight_zeroed)
            state.stats.sums[IS_MASKED_TOK_N] = count(weight_zeroed)  # (B, T) -> 0-dim
            state.stats.sums[IS_MASKED_SEQ_N] = count_rows(weight_zeroed)
        else:  # truncate: min(rho, C), and max(., C_lower) only when a lower bound is set
            pinned = safe > p.rollout_is_threshold  # (B, T)
            if p.rollout_is_threshold_lower is not None:
                pinned = pinned | (safe < p.rollout_is_threshold_lower)  # (B, T)
            state.pin(valid & pinned)  # (B, T)
        if norm_mean is not None:  # float64
            state.stats.sums[IS_NORM_MEAN_SUM] = norm_mean
            state.stats.sums[IS_NORM_N] = stat_constant(1.0, norm_mean)
        state.multiply_weights(is_weights)  # (B, T)

    def finalize(self, f: StatFloats) -> dict[str, float]:
        """The ``rollout_is_*`` metrics (family, masked fractions, batch-normalization factor) where IS ran.

        Args:
            f: the reduced statistics.

        Returns:
            ``{"rollout_corr/rollout_is_*": float}``.
        """
        metrics = finalize_family("rollout_is", f)
        if f.has(IS_NORM_MEAN_SUM):
            metrics[PREFIX + "rollout_is_batch_norm_factor"] = safe_div(f.sum(IS_NORM_MEAN_SUM), f.sum(IS_NORM_N, 0.0))
        if f.has(TOK_N) and f.has(IS_MASKED_TOK_N):  # weights set to 0 (tokens stay in the mask)
            tok_n, seq_n = f.sum(TOK_N, 0.0), f.sum(SEQ_N, 0.0)
            metrics[PREFIX + "rollout_is_masked_fraction"] = safe_div(f.sum(IS_MASKED_TOK_N, 0.0), tok_n)
            metrics[PREFIX + "rollout_is_seq_masked_fraction"] = safe_div(f.sum(IS_MASKED_SEQ_N, 0.0), seq_n)
        return metrics


IS_WEIGHTS = ImportanceWeights()
