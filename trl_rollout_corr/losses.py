"""Policy losses with rollout correction (pure tensor functions, no TRL import).

pi_old is the PPO anchor: the trainer's recomputed log-probs in decoupled mode, pi_rollout in bypass
mode. ``mask`` is the loss mask *after* rejection and veto, so rejected tokens leave every term and
every token count below.
"""

from __future__ import annotations

import torch

SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def ppo_clip_per_token_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    is_weights: torch.Tensor | None = None,
    delta: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip times a stop-grad IS weight.

    r_t = pi_theta / pi_old;  l_t = -w_t * min(r_t A, clip(r_t, 1-eps_low, 1+eps_high) A)
    (decoupled: w = min(pi_old / pi_rollout, C); bypass: pi_old = pi_rollout and w = 1).
    ``delta`` caps r_t from above (TRL's two-sided clipping). Returns ``(l (B, T), r (B, T))``.
    """
    ratio = torch.exp(per_token_logps - old_per_token_logps)  # (B, T)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)  # (B, T)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)  # (B, T)
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)  # (B, 1) or (B, T)
    per_token_loss = -torch.min(unclipped * adv, clipped * adv)  # (B, T)
    if is_weights is not None:
        per_token_loss = per_token_loss * is_weights.detach()  # (B, T)
    return per_token_loss, ratio


def policy_gradient_per_token_loss(
    per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    is_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE with a stop-grad IS weight:  l_t = -stopgrad(w_t) * log pi_theta(a_t) * A.   (B, T)

    w = min(pi_theta / pi_rollout, C) (token or sequence), 1 when no IS level is set.
    """
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)  # (B, 1)
    per_token_loss = -per_token_logps * adv  # (B, T)
    if is_weights is not None:
        per_token_loss = per_token_loss * is_weights.detach()  # (B, T)
    return per_token_loss


def kl_penalty(per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi_theta || pi_ref): exp(ref - logp) - (ref - logp) - 1.   (B, T)"""
    diff = ref_per_token_logps - per_token_logps  # (B, T)
    return torch.exp(diff) - diff - 1


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    *,
    max_completion_length: int,
    gradient_accumulation_steps: int,
    token_normalizer: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce (B, T) per-token losses to the GA-scaled scalar, with rejected tokens out of every count.

    grpo:    sum_i [ sum_t l m / sum_t m ] / #(sequences with a kept token) / GA
    bnpo:    sum l m / sum m / GA
    dr_grpo: sum l m / (B * max_completion_length) / GA
    dapo:    sum l m / token_normalizer  (the caller passes the GA-scaled, per-process kept-token count)
    A batch with nothing kept gives an exact 0 that still depends on the graph (no NaN, no missing grads).
    """
    mask = mask.to(per_token_loss.dtype)  # (B, T)
    masked = per_token_loss * mask  # (B, T)
    if loss_type == "grpo":
        tokens = mask.sum(-1)  # (B,)
        per_seq = masked.sum(-1) / tokens.clamp(min=1.0)  # (B,)
        return per_seq.sum() / (tokens > 0).sum().clamp(min=1) / gradient_accumulation_steps
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / gradient_accumulation_steps
    if loss_type == "dr_grpo":
        return masked.sum() / (per_token_loss.size(0) * max_completion_length) / gradient_accumulation_steps
    if loss_type == "dapo":
        if token_normalizer is None:
            raise ValueError("loss_type='dapo' needs token_normalizer (the kept-token count).")
        return masked.sum() / token_normalizer.clamp(min=1.0)
    raise ValueError(f"loss_type={loss_type!r} is not supported with rollout correction; use one of {SUPPORTED_LOSS_TYPES}.")
