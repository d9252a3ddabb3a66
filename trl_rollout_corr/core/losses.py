"""How the correction enters TRL's own loss (pure tensor functions, no TRL import).

The trainer does not re-implement TRL's policy losses. It hands TRL's ``_compute_loss`` a shallow copy of the
micro-batch in which

* the loss mask is shrunk:  m'_t = m_t * keep_t  (``tool_mask``; TRL's loss mask, not the attention mask), so
  rejected / vetoed tokens leave the loss and every count TRL forms from the mask;
* the advantage carries the IS weight:  A'_t = A * stopgrad(w_t)  with w_t = min(rho_t, C) > 0 (or 1 without IS).
  Every TRL loss type but VESPO is positively homogeneous in A per token (PPO-clip ``-min(r A, clip(r) A)``, CISPO
  ``-sg(min(r, eps)) A log pi``, SAPO ``-f_sign(A)(r) A``, LUSPO/GSPO the clip form): for w > 0,
  l(r, A w) = w l(r, A), and every sign test on A (clip metrics, SAPO's temperature, TRL's off-policy mask) is
  unchanged, so the IS weight multiplies each token's policy loss, detached, and not the KL or entropy terms. A
  sequence-level weight keeps A's (B, 1) shape, so GSPO's per-sequence ratio and TRL's per-sequence metrics keep
  their meaning;
* VESPO instead gets the truncated sampler ratio as TRL's own vLLM correction gives it (``importance_sampling_ratio``,
  per token), which its gamma weight phi turns into one weight per sequence: phi(pi_theta/pi_old * prod_t w_t);
* the PPO anchor ``old_per_token_logps`` is pi_old (decoupled), pi_rollout (bypass) or pi_theta detached
  (pi_old = pi_theta, policy gradient), with non-finite or masked entries replaced so no NaN/inf reaches the graph;
* ``num_items_in_batch`` (the token normalizer of ``dapo``/``cispo``/``vespo``) counts kept tokens.
"""

from __future__ import annotations

import torch

PI_ROLLOUT, PI_OLD, PI_THETA = "pi_rollout", "pi_old", "pi_theta"
"""The three anchors of TRL's PPO ratio r = pi_theta / anchor (see :func:`loss_anchor`)."""


def loss_anchor(bypass_mode: bool, use_policy_gradient: bool) -> str:
    """Which log-prob anchors TRL's ratio r_t = pi_theta / anchor, by mode (the rule both trainers apply):

    * bypass, PPO-clip:  anchor = pi_rollout, so r_t = pi_theta / pi_rollout already is the IS ratio rho_t; the IS
      weight w_t is not applied again (it feeds the metrics only);
    * bypass, policy gradient:  anchor = pi_theta (detached): r_t = 1 and the gradient is -w_t A grad log pi_theta,
      with w_t = min(pi_theta / pi_rollout, C) on the advantage;
    * decoupled:  anchor = pi_old: r_t = pi_theta / pi_old, and A'_t = w_t A with w_t = min(pi_old / pi_rollout, C).

    The IS weight multiplies the advantage exactly when the anchor is not pi_rollout (:func:`weights_advantage`).
    """
    if not bypass_mode:
        return PI_OLD
    return PI_THETA if use_policy_gradient else PI_ROLLOUT


def weights_advantage(anchor: str) -> bool:
    """Whether the IS weight multiplies the advantage, A' = w A: for every anchor but pi_rollout (whose ratio already
    is rho)."""
    return anchor != PI_ROLLOUT


def corrected_loss_mask(completion_mask: torch.Tensor, tool_mask: torch.Tensor | None,
                        keep: torch.Tensor) -> torch.Tensor:
    """TRL's ``tool_mask`` slot with the rejection mask folded in:  (tool_mask or 1) * keep.   (B, T)

    TRL's loss mask is ``completion_mask * tool_mask``; ``keep`` <= that mask, so the product is the kept mask.
    """
    base = tool_mask if tool_mask is not None else torch.ones_like(completion_mask)  # (B, T)
    return base * keep  # (B, T)


def weighted_advantages(advantages: torch.Tensor, is_weights: torch.Tensor | None,
                        sequence_level: bool) -> torch.Tensor:
    """A' = A * stopgrad(w): (B,) or (B, 1) advantages times (B, T) IS weights.

    Sequence-level weights (one value per row, 0 on padding) keep the (B, 1) shape. Returns ``advantages``
    unchanged when there are no weights.
    """
    if is_weights is None:
        return advantages
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)  # (B, 1) or (B, T)
    w = is_weights.detach().to(adv.dtype)  # (B, T)
    if sequence_level and adv.size(1) == 1:
        w = w.amax(dim=1, keepdim=True)  # (B, 1) the sequence weight (padding is 0, weights are > 0)
    return adv * w  # (B, 1) or (B, T)


def zeroed_advantages(advantages: torch.Tensor, advantage_mask: torch.Tensor | None) -> torch.Tensor:
    """A'' = A' * z with z in {0, 1} (B, T): M2PO's trust-region mask (arXiv:2510.01161) sets the advantage of the
    tokens it takes to 0, in every mode (bypass PPO included), and leaves them in the loss's token count: with
    A'' = 0 every TRL loss type's policy term for the token is 0, its normalizer unchanged. ``advantages`` (B,),
    (B, 1) or (B, T); returns them unchanged when there is no mask, else (B, T)."""
    if advantage_mask is None:
        return advantages
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)  # (B, 1) or (B, T)
    return adv * advantage_mask.detach().to(adv.dtype)  # (B, T)


def vespo_sampler_ratio(is_weights: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The per-token sampler ratio VESPO's phi consumes:  w_t = min(rho_t, C), rho_t = pi_old / pi_rollout.   (B, T)

    Exactly 1 on rejected and padding tokens (TRL sums its log over every position). TRL's own vLLM correction
    hands VESPO the same quantity (``token_truncate``), from its pi_old forward.
    """
    return torch.where(keep.bool(), is_weights.detach().float(), 1.0)  # (B, T)


def safe_anchor(anchor: torch.Tensor, fallback: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``anchor`` where it is finite on a kept token, ``fallback`` (detached pi_theta) elsewhere.   (B, T)

    Masked positions still enter TRL's elementwise loss before the mask multiplies it: a NaN/inf there would
    turn ``0 * nan`` into NaN. Values on kept tokens are unchanged.
    """
    ok = torch.isfinite(anchor) & mask.bool()  # (B, T)
    return torch.where(ok, anchor, fallback.detach())  # (B, T)
