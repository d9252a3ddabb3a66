"""Truncated importance-sampling weights (TIS), token and sequence level.

Notation (seeds): rho_t = pi_train(a_t|s_t) / pi_rollout(a_t|s_t), with pi_train = pi_old in decoupled
mode and pi_theta (detached) in bypass mode; m_t the response mask; C = ``rollout_is_threshold``.
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
    """log prod_t rho_t = sum_t m_t * log rho_t, unclamped.  (B,)"""
    return torch.where(response_mask, log_ratio, torch.zeros_like(log_ratio)).sum(1)


def safe_is_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str) -> torch.Tensor:
    """Safety-bounded, padding-zeroed, *untruncated* weights.  (B, T)

    token:    w_t = m_t * exp(clamp(log rho_t, -20, 20))
    sequence: w_t = m_t * exp(clamp(sum_s m_s log rho_s, -20, 20))   (one weight broadcast per sequence)
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
    The mean is global over ranks when ``reduce_fn`` is given; normalization is skipped (factor 1)
    when the mean is <= 1e-8. Returns ``(normalized weights (B, T), factor (0-dim, float64))``.
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
    """The bounded IS weight from the safety-bounded rho (zero on padding stays zero).   (B, T)

    truncate: w = clamp(rho, C_lower, C)                 (C_lower = None: min(rho, C), the seeds' TIS)
    mask:     w = rho * 1[C_lower <= rho <= C]           (C_lower = None: 0; TRL's ``*_mask`` modes)
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
    """Bounded IS weights from rho at token or sequence level.

    1. safety bound: exp(clamp(log rho, -20, 20)) (token) or exp(clamp(sum_t log rho_t, -20, 20)) (sequence)
    2. zero padding (x m)
    3. bound (:func:`bound_weights`): truncate w = min(rho, C) (TIS; with C_lower: clamp(rho, C_lower, C)), or
       mask w = rho * 1[C_lower <= rho <= C]
    4. optional batch normalization (see :func:`batch_normalize_weights`)
    Returns ``(weights (B, T) detached, safe unbounded weights (B, T) for metrics, batch-norm mean or None)``.
    """
    response_mask = response_mask.bool()
    with torch.no_grad():
        safe = safe_is_weights(log_ratio.detach(), response_mask, rollout_is)  # (B, T)
        weights = bound_weights(safe, rollout_is_threshold, rollout_is_threshold_lower, rollout_is_bound)  # (B, T)
        norm_mean = None
        if rollout_is_batch_normalize:
            weights, norm_mean = batch_normalize_weights(weights, response_mask, rollout_is, reduce_fn)
    return weights, safe, norm_mean
