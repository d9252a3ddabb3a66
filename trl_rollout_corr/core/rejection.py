"""Rejection sampling (token / sequence / geometric) and the catastrophic-token veto.

Both only modify the response mask; neither touches the IS weights. rho_t = pi_train / pi_rollout.
"""

from __future__ import annotations

import math

import torch

from .weights import SAFETY_BOUND, sequence_log_ratio

RS_LEVELS = ("token", "sequence", "geometric")


def rejection_bounds(upper: float, lower: float | None) -> tuple[float, float]:
    """The RS acceptance band (C_lower, C_upper); C_lower defaults to 1 / C_upper."""
    return (1.0 / upper if lower is None else lower), upper


def rejection_log_statistic(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str) -> torch.Tensor:
    """Unclamped log of the RS statistic, broadcast to (B, T).

    token:     log rho_t
    sequence:  sum_t m_t log rho_t                 (log of prod_t rho_t)
    geometric: (1/|T|) sum_t m_t log rho_t         (log of the geometric mean of rho_t)
    """
    if level == "token":
        return log_ratio  # (B, T)
    seq_log = sequence_log_ratio(log_ratio, response_mask)  # (B,)
    if level == "geometric":
        seq_log = seq_log / response_mask.sum(1).clamp(min=1)  # (B,)
    elif level != "sequence":
        raise ValueError(f"rollout_rs must be one of {RS_LEVELS} or None, got {level!r}.")
    return seq_log.unsqueeze(1).expand_as(log_ratio)  # (B, T)


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str,
    rollout_rs_threshold: float,
    rollout_rs_threshold_lower: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep-mask of rejection sampling: keep iff  C_lower <= statistic <= C_upper.

    statistic = exp(clamp(log_stat, -20, 20)) with log_stat from :func:`rejection_log_statistic`;
    C_upper = ``rollout_rs_threshold``, C_lower = ``rollout_rs_threshold_lower`` or 1 / C_upper.
    Token level rejects single tokens; sequence and geometric levels reject whole sequences.
    Returns ``(keep (B, T) bool, safe statistic (B, T), unclamped log statistic (B, T))``; ``keep`` is
    False on padding.
    """
    response_mask = response_mask.bool()
    lower, upper = rejection_bounds(rollout_rs_threshold, rollout_rs_threshold_lower)
    with torch.no_grad():
        log_stat = rejection_log_statistic(log_ratio.detach(), response_mask, rollout_rs)  # (B, T)
        bounded = log_stat.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (B, T)
        keep = (bounded >= math.log(lower)) & (bounded <= math.log(upper)) & response_mask  # (B, T)
        safe_stat = torch.exp(bounded)  # (B, T)
    return keep, safe_stat, log_stat


def compute_veto_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_token_veto_threshold: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Catastrophic-token veto: reject a whole sequence if any valid token has rho_t < C_veto.

    Compared in log space on the **unclamped** ratio: log rho_t < log C_veto.
    Returns ``(keep (B, T) bool, catastrophic (B, T) bool)``.
    """
    response_mask = response_mask.bool()
    with torch.no_grad():
        catastrophic = (log_ratio.detach() < math.log(rollout_token_veto_threshold)) & response_mask  # (B, T)
        vetoed = catastrophic.any(1, keepdim=True)  # (B, 1)
        keep = response_mask & ~vetoed  # (B, T)
    return keep, catastrophic
