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

import torch

from .stats import ReduceFn, count, masked_sum, per_sequence_mean

SAFETY_BOUND = 20.0
"""Log-space clamp before any ``exp``: exp(+-20) ~ 4.85e8 / 2.06e-9, finite in every float dtype."""

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
