"""Second-moment masking (M2PO): bound the batch's mean squared log-ratio by masking its largest terms.

Two scopes (``rollout_m2_scope``):

* ``"all"`` (AReaL's ``m2_threshold``, areal/trainer/ppo/actor.py ``_apply_m2po_masking``): every valid token is a
  candidate and a masked token is rejected (it leaves the loss and its token count);
* ``"trust_region"`` (M2PO's final algorithm, Zheng, Zhao & Chen, "Prosperity before Collapse: How Far Can
  Off-Policy RL Reach with Stale Data on LLMs?", arXiv:2510.01161, ICLR 2026, Algorithm 1): only the tokens on the
  active side of PPO's trust region are candidates, C = {t : A_t > 0 and rho_t > 1, or A_t < 0 and rho_t < 1}, the
  bound applies to their mean, and a masked token keeps its place in the loss's token count (its advantage is set
  to 0: the loss keeps the original valid-token denominator). :func:`trust_region_second_moment_mask`.

With v_t = (log rho_t)^2 on the valid tokens of the batch (all processes), M2 = mean_t v_t estimates the second
moment of the log-ratio between pi_train and pi_rollout. If M2 <= tau every token is kept; otherwise the tokens with
the largest v are masked until the mean of the rest is <= tau:

    keep_t = 1[v_t < t*],   t* = sup { t : mean(v_s | v_s < t) <= tau }

The mean of {v < t} never decreases as t grows (each value added is >= all values already in), so t* is one of the
values v_j and the kept set is the longest prefix of the sorted values whose mean is <= tau; values equal to t* are
masked together (an order-free tie rule). t* is found by bisection on t with one all-reduce of (sum, count) per
step, so the threshold is global across processes and never needs a sort or a host sync.

Reference: Zheng et al., "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?"
(M2PO, arXiv:2510.01161), which masks tokens by their contribution to the second moment with tau = 0.04.
"""

from __future__ import annotations

import torch

from .stats import ReduceFn

M2_SCOPES = ("all", "trust_region")
"""Which tokens the second-moment mask may remove: every valid one (AReaL's ``m2_threshold``: rejected) or those on
the active side of PPO's trust region (M2PO's final Algorithm 1: advantage set to 0, kept in the count)."""
BISECTION_STEPS = 64
"""Halvings of [0, max v]: float64 resolution of the threshold for any v <= 4e2 (|log rho| <= 20)."""


def second_moment_mask(log_ratio: torch.Tensor, valid: torch.Tensor, tau: float,
                       reduce_fn: ReduceFn | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens kept by the second-moment bound, and the squared log-ratios it used.   (B, T) bool, (B, T) float64

    keep_t = valid_t * 1[v_t < t*] with v_t = clamp(log rho_t, -20, 20)^2 and t* as in the module docstring (all of
    ``valid`` when its mean v is already <= tau). ``reduce_fn`` makes every sum and the maximum global.
    """
    v = torch.where(valid, log_ratio.detach().double().clamp(-20.0, 20.0) ** 2, 0.0)  # (B, T)

    def total(stat: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return stat if reduce_fn is None else reduce_fn(stat, op)

    def mean_below(t: torch.Tensor) -> torch.Tensor:
        below = valid & (v < t)  # (B, T)
        sums = total(torch.stack([torch.where(below, v, 0.0).sum(), below.sum(dtype=torch.float64)]))  # (2,)
        return sums[0] / sums[1].clamp(min=1.0)  # 0-dim

    hi = total(v.max() if v.numel() else v.new_zeros(()), "max") * (1 + 1e-12) + 1e-300  # 0-dim, > every v
    lo = torch.zeros_like(hi)  # 0-dim: mean of the empty set, 0 <= tau
    fits = mean_below(hi) <= tau  # 0-dim: nothing to mask
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        ok = mean_below(mid) <= tau
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    keep = valid & (fits | (v < lo))  # (B, T)
    return keep, v


def trust_region_tokens(log_ratio: torch.Tensor, valid: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """The valid tokens on the active side of PPO's trust region.   (B, T) bool

    C_t = valid_t * (1[A_t > 0] * 1[log rho_t > 0] + 1[A_t < 0] * 1[log rho_t < 0]): the tokens whose PPO ratio would
    be clipped if it left [1 - eps, 1 + eps] (A > 0 with rho > 1, A < 0 with rho < 1). ``advantages``: (B,), (B, 1)
    or (B, T); a zero advantage is on neither side.
    """
    adv = advantages.detach()
    adv = adv.reshape(-1, 1) if adv.dim() == 1 else adv  # (B, 1) or (B, T)
    adv = adv.expand_as(log_ratio)  # (B, T)
    lr = log_ratio.detach()  # (B, T)
    return valid & (((adv > 0) & (lr > 0)) | ((adv < 0) & (lr < 0)))  # (B, T)


def trust_region_second_moment_mask(log_ratio: torch.Tensor, valid: torch.Tensor, advantages: torch.Tensor,
                                    tau: float, reduce_fn: ReduceFn | None = None
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """M2PO's final mask (arXiv:2510.01161, Algorithm 1): the tokens whose advantage is set to 0.

    With C the trust-region tokens (:func:`trust_region_tokens`) and v_t = clamp(log rho_t, -20, 20)^2, rho_t =
    pi_train / pi_rollout (pi_train = pi_old in decoupled mode, pi_theta detached in bypass mode):

        zeroed_t = 1[t in C] * 1[v_t >= t*],   t* = sup { t : mean(v_s | s in C, v_s < t) <= tau }

    (nothing when mean_{s in C} v_s <= tau): the largest squared log-ratios of C go until the mean of the rest of C is
    <= tau, ties at the cut together (:func:`second_moment_mask` on C). Tokens outside C are never touched. The
    zeroed tokens stay in the loss's token count: the loss is (1/N) sum_t (1 - zeroed_t) l_t(A_t) over the N valid
    tokens, the paper's original denominator. ``reduce_fn`` makes the threshold global across processes.
    Returns ``(zeroed (B, T) bool, C (B, T) bool, v (B, T) float64)``.
    """
    region = trust_region_tokens(log_ratio, valid, advantages)  # (B, T)
    kept, v = second_moment_mask(log_ratio, region, tau, reduce_fn)  # (B, T) each; v is 0 outside C
    v = torch.where(valid, log_ratio.detach().double().clamp(-20.0, 20.0) ** 2, 0.0)  # (B, T) on every valid token
    return region & ~kept, region, v  # (B, T) each
