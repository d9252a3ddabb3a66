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

from typing import Any

import torch

from .criterion import (TOK_N, CorrectionField, CorrectionState, Criterion, StatFloats, none_if_unset,
                        require_positive, stat_key)
from .stats import METRIC_PREFIX as PREFIX
from .stats import ReduceFn, count, masked_sum, safe_div

M2_SCOPES = ("all", "trust_region")
"""Which tokens the second-moment mask may remove: every valid one (AReaL's ``m2_threshold``: rejected) or those on
the active side of PPO's trust region (M2PO's final Algorithm 1: advantage set to 0, kept in the count)."""
BISECTION_STEPS = 64
"""Halvings of [0, max v]: float64 resolution of the threshold for any v <= 4e2 (|log rho| <= 20)."""


def second_moment_mask(log_ratio: torch.Tensor, valid: torch.Tensor, tau: float,
                       reduce_fn: ReduceFn | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens kept by the second-moment bound, and the squared log-ratios it used.   (B, T) bool, (B, T) float64

    keep_t = valid_t * 1[v_t < t*] with v_t = clamp(log rho_t, -20, 20)^2 and t* as in the module docstring (all of
    ``valid`` when its mean v is already <= tau).

    Args:
        log_ratio: (B, T) log rho_t = log pi_train - log pi_rollout.
        valid: (B, T) bool, the candidate tokens.
        tau: the bound on the mean of v over the kept tokens (> 0).
        reduce_fn: the all-reduce that makes every sum and the maximum global (``None``: this process).

    Returns:
        keep: (B, T) bool, the kept tokens (a subset of ``valid``).
        v: (B, T) float64, v_t on ``valid``, 0 elsewhere.
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
    be clipped if it left [1 - eps, 1 + eps] (A > 0 with rho > 1, A < 0 with rho < 1); a zero advantage is on neither
    side.

    Args:
        log_ratio: (B, T) log rho_t.
        valid: (B, T) bool.
        advantages: (B,), (B, 1) or (B, T).

    Returns:
        (B, T) bool, C_t.
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
    tokens, the paper's original denominator.

    Args:
        log_ratio: (B, T) log rho_t.
        valid: (B, T) bool.
        advantages: (B,), (B, 1) or (B, T), TRL's A.
        tau: the bound on the mean of v over the kept tokens of C (> 0).
        reduce_fn: the all-reduce that makes the threshold global across processes (``None``: this process).

    Returns:
        zeroed: (B, T) bool, the tokens whose advantage is set to 0 (a subset of C).
        region: (B, T) bool, C.
        v: (B, T) float64, v_t on every valid token.
    """
    region = trust_region_tokens(log_ratio, valid, advantages)  # (B, T)
    kept, v = second_moment_mask(log_ratio, region, tau, reduce_fn)  # (B, T) each; v is 0 outside C
    v = torch.where(valid, log_ratio.detach().double().clamp(-20.0, 20.0) ** 2, 0.0)  # (B, T) on every valid token
    return region & ~kept, region, v  # (B, T) each


# ---------------------------------------------------------------------------------------------------- the criterion
M2_MASKED_TOK_N = stat_key("mask.m2_masked_tok_n", __name__)
"""Valid tokens the second-moment mask took (rejected, or their advantage zeroed in the trust-region scope)."""
M2_V_SUM = stat_key("m2.v_sum", __name__)
"""Sum of v_t = (log rho_t)^2 over the valid tokens."""
M2_V_KEPT_SUM = stat_key("m2.v_kept_sum", __name__)
M2_REGION_TOK_N = stat_key("m2.region_tok_n", __name__)
"""Trust-region scope: valid tokens on the trust region's active side (the candidates)."""
M2_REGION_V_SUM = stat_key("m2.region_v_sum", __name__)
M2_REGION_V_KEPT_SUM = stat_key("m2.region_v_kept_sum", __name__)
M2_METRICS = ("rollout_m2", "rollout_m2_kept", "rollout_m2_masked_fraction")
M2_TRUST_REGION_METRICS = ("rollout_m2_trust_region_fraction", "rollout_m2_trust_region",
                           "rollout_m2_trust_region_kept")
"""``rollout_m2_scope="trust_region"`` only: the share of valid tokens on the trust region's active side, and their
mean (log rho)^2 before and after the mask (the bound applies to the latter)."""


class SecondMomentMask(Criterion):
    """The second-moment mask (M2PO, arXiv:2510.01161; AReaL's ``m2_threshold``): the largest (log rho_t)^2 go until
    the batch's mean of the rest is <= tau; scope ``"all"`` rejects them, ``"trust_region"`` zeroes their advantage
    (the token kept in the loss's count). The threshold is global over the generation batch (batch scope).

    Attributes:
        fields: ``rollout_m2_threshold`` (tau), ``rollout_m2_scope`` ("all" | "trust_region").
        metrics: ``rollout_m2``, ``rollout_m2_kept``, ``rollout_m2_masked_fraction`` and, with the trust-region
            scope, ``rollout_m2_trust_region_fraction`` / ``_trust_region`` / ``_trust_region_kept``.
    """

    name = "second_moment"
    fields = (
        CorrectionField("rollout_m2_threshold", "float | None", None,
                        "Second-moment mask (M2PO): mask the tokens with the largest (log rho)^2 until the batch's "
                        "mean (log rho)^2 is <= this tau (e.g. 0.04); default off. rollout_m2_scope picks the "
                        "candidates.", "float | str | None"),
        CorrectionField("rollout_m2_scope", "str", "all",
                        "Tokens the second-moment mask may take: all (AReaL's m2_threshold: any token, rejected; "
                        "default) | trust_region (M2PO's final algorithm: A > 0 with rho > 1 or A < 0 with rho < 1, "
                        "advantage set to 0, kept in the loss's token count).", "str | None"),
    )
    metrics = (*M2_METRICS, *M2_TRUST_REGION_METRICS)
    switches = {"rollout_m2_threshold": ("rollout_m2_scope",)}

    def check(self, cfg: Any) -> None:
        """tau > 0 where set, the scope all | trust_region (and only with tau), and no trust-region scope with
        ``rollout_rs_exclude_from_baseline`` (both need the advantages at different times).

        Args:
            cfg: the ``RolloutCorrectionConfig`` being validated (``rollout_m2_scope`` normalized in place).

        Raises:
            ValueError: naming the field and the fix.
        """
        if cfg.rollout_m2_threshold is not None:
            require_positive("rollout_m2_threshold", cfg.rollout_m2_threshold,
                             "the bound on the mean (log rho)^2, e.g. 0.04")
        cfg.rollout_m2_scope = none_if_unset(cfg.rollout_m2_scope) or "all"
        if cfg.rollout_m2_scope not in M2_SCOPES:
            raise ValueError(f"rollout_m2_scope must be 'all' (AReaL's second-moment mask: any token, rejected) or "
                             f"'trust_region' (M2PO's final algorithm: the trust region's active side, advantage set "
                             f"to 0), got {cfg.rollout_m2_scope!r}.")
        if cfg.rollout_m2_scope != "all" and cfg.rollout_m2_threshold is None:
            raise ValueError(f"rollout_m2_scope={cfg.rollout_m2_scope!r} is set but rollout_m2_threshold is None, so "
                             "it would be ignored: set rollout_m2_threshold (tau, e.g. 0.04) or leave rollout_m2_scope "
                             "at 'all'.")
        if self._trust_region(cfg) and cfg.rollout_rs_exclude_from_baseline:
            raise ValueError("rollout_rs_exclude_from_baseline=True with rollout_m2_scope='trust_region': M2PO's "
                             "trust region is decided on the sign of the advantages, which leaving the rejected "
                             "samples out of the baselines changes after the correction ran, so the two cannot both "
                             "be exact yet. Use one of them (rollout_rs_exclude_from_baseline=False, or "
                             "rollout_m2_scope='all').")

    def check_call(self, p: Any, advantages: torch.Tensor | None) -> None:
        """Refuse an unknown scope, and the trust-region scope without the advantages.

        Args:
            p: the call's ``CorrectionParams``.
            advantages: (B,) or (B, T), or ``None``.

        Raises:
            ValueError: what the call lacks and how to give it.
        """
        if p.rollout_m2_scope not in M2_SCOPES:
            raise ValueError(f"rollout_m2_scope must be one of {M2_SCOPES}, got {p.rollout_m2_scope!r}.")
        if self._trust_region(p) and advantages is None:
            raise ValueError("rollout_m2_scope='trust_region' needs the advantages (the trust region's active side "
                             "is A > 0 with rho > 1, A < 0 with rho < 1): pass advantages=(B,) or (B, T).")

    @staticmethod
    def _trust_region(p: Any) -> bool:
        return p.rollout_m2_threshold is not None and p.rollout_m2_scope == "trust_region"

    def removes_tokens(self, cfg: Any) -> bool:
        """Whether the mask rejects tokens (tau set, scope ``"all"``).

        Args:
            cfg: the validated ``RolloutCorrectionConfig``.

        Returns:
            ``True`` where it can reject tokens.
        """
        return cfg.rollout_m2_threshold is not None and cfg.rollout_m2_scope == "all"

    def zeroes_advantages(self, cfg: Any) -> bool:
        """Whether the mask zeroes advantages (tau set, scope ``"trust_region"``).

        Args:
            cfg: the validated ``RolloutCorrectionConfig``.

        Returns:
            ``True`` where it can zero a token's advantage.
        """
        return self._trust_region(cfg)

    def batch_scope(self, cfg: Any) -> str | None:
        """The threshold t* is global over the generation batch wherever tau is set.

        Args:
            cfg: the validated ``RolloutCorrectionConfig``.

        Returns:
            The statistic described, or ``None``.
        """
        if cfg.rollout_m2_threshold is not None:
            return "the second-moment mask's threshold (rollout_m2_threshold)"
        return None

    def apply(self, p: Any, state: CorrectionState) -> None:
        """Scope ``"all"``: reject the tokens above t* (:func:`second_moment_mask`; ``state.reject``); scope
        ``"trust_region"``: zero their advantage (:func:`trust_region_second_moment_mask`; ``state.zero_advantages``).
        Adds sum_t v_t before and after the mask and the masked counts to the statistics.

        Args:
            p: the call's ``CorrectionParams``.
            state: the pipeline's :class:`~.criterion.CorrectionState`.
        """
        if p.rollout_m2_threshold is None:
            return
        log_ratio, valid, sums = state.log_ratio, state.valid, state.stats.sums  # (B, T) each
        if self._trust_region(p):  # M2PO's final algorithm: zero the advantage, keep the token in the count
            zeroed, region, v = trust_region_second_moment_mask(log_ratio, valid, state.advantages,
                                                                p.rollout_m2_threshold, state.reduce_fn)  # (B, T) each
            sums[M2_MASKED_TOK_N] = count(zeroed)
            sums[M2_V_SUM] = masked_sum(v, valid)
            sums[M2_V_KEPT_SUM] = masked_sum(v, valid & ~zeroed)
            sums[M2_REGION_TOK_N] = count(region)
            sums[M2_REGION_V_SUM] = masked_sum(v, region)
            sums[M2_REGION_V_KEPT_SUM] = masked_sum(v, region & ~zeroed)
            state.zero_advantages(zeroed)  # (B, T) ORed with any other criterion's zeroed advantages
        else:
            m2_keep, v = second_moment_mask(log_ratio, valid, p.rollout_m2_threshold, state.reduce_fn)  # (B, T) each
            sums[M2_MASKED_TOK_N] = count(valid & ~m2_keep)
            sums[M2_V_SUM] = masked_sum(v, valid)
            sums[M2_V_KEPT_SUM] = masked_sum(v, m2_keep)
            state.reject(valid & ~m2_keep)  # (B, T)

    def finalize(self, f: StatFloats) -> dict[str, float]:
        """Mean (log rho)^2 before and after the mask, the masked fraction of the valid tokens and, with the
        trust-region scope, the candidates' share and their mean before and after.

        Args:
            f: the reduced statistics.

        Returns:
            ``{"rollout_corr/rollout_m2*": float}`` where the mask ran.
        """
        if not f.has(TOK_N):
            return {}
        metrics: dict[str, float] = {}
        tok_n, masked_n = f.sum(TOK_N, 0.0), f.sum(M2_MASKED_TOK_N, 0.0)
        if f.has(M2_MASKED_TOK_N):  # mean (log rho)^2 before / after, tokens masked
            metrics[PREFIX + "rollout_m2"] = safe_div(f.sum(M2_V_SUM, 0.0), tok_n)
            metrics[PREFIX + "rollout_m2_kept"] = safe_div(f.sum(M2_V_KEPT_SUM, 0.0), tok_n - masked_n)
            metrics[PREFIX + "rollout_m2_masked_fraction"] = safe_div(masked_n, tok_n)
        if f.has(M2_REGION_TOK_N):  # the trust-region scope: the candidates' share and mean before / after
            region_n = f.sum(M2_REGION_TOK_N, 0.0)
            metrics[PREFIX + "rollout_m2_trust_region_fraction"] = safe_div(region_n, tok_n)
            metrics[PREFIX + "rollout_m2_trust_region"] = safe_div(f.sum(M2_REGION_V_SUM, 0.0), region_n)
            metrics[PREFIX + "rollout_m2_trust_region_kept"] = safe_div(f.sum(M2_REGION_V_KEPT_SUM, 0.0),
                                                                        region_n - masked_n)
        return metrics


SECOND_MOMENT = SecondMomentMask()
