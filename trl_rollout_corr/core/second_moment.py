"""Second-moment masking (M2PO-style): bound the batch's mean squared log-ratio by masking its largest terms.

With v_t = (log rho_t)^2 on the valid tokens of the batch (all processes), M2 = mean_t v_t estimates the second
moment of the log-ratio between pi_train and pi_rollout. If M2 <= tau every token is kept; otherwise the tokens with
the largest v are masked until the mean of the rest is <= tau:

    keep_t = 1[v_t < t*],   t* = sup { t : mean(v_s | v_s < t) <= tau }

The mean of {v < t} never decreases as t grows (each value added is >= all values already in), so t* is one of the
values v_j and the kept set is the longest prefix of the sorted values whose mean is <= tau; values equal to t* are
masked together (an order-free tie rule). t* is found by bisection on t with one all-reduce of (sum, count) per
step, so the threshold is global across processes and never needs a sort or a host sync.

Reference: Zheng et al., "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?"
(M2PO, 2025), which masks tokens by their contribution to the second moment with tau = 0.04.
"""

from __future__ import annotations

import torch

from .stats import ReduceFn

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
