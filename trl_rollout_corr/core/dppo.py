"""DPPO's trust region: a binary token mask on a divergence between pi_theta and pi_rollout, by the advantage's sign.

DPPO (Divergence Proximal Policy Optimization; Qi, Zhou, Liu, Pang, Du, Lin & Lee, "Rethinking the Trust Region in
LLM Reinforcement Learning", arXiv:2602.04879) replaces PPO's ratio clip by a mask on a direct divergence between the
current policy and the behaviour policy, evaluated on the sampled token only ("binary": the sampled token against
the rest of the vocabulary). With p_t = pi_theta(a_t) and q_t = pi_old(a_t) (here q_t = pi_rollout(a_t): bypass mode,
pi_old := pi_rollout, prime-rl's setting) and A_t the advantage:

* **Binary-TV** (``rollout_dppo="binary_tv"``): Delta_t = p_t - q_t, and

      masked_t = 1[A_t > 0] * 1[Delta_t > delta_high] + 1[A_t < 0] * 1[Delta_t < -delta_low]

  (verl ``compute_policy_loss_dppo_tv``; prime-rl ``default_loss_fn``: the same strict inequalities, thresholds
  ``dppo_mask_high`` / ``dppo_mask_low``);
* **Binary-KL** (``rollout_dppo="binary_kl"``): D_t = KL(Bernoulli(q_t) || Bernoulli(p_t))
  = q_t (log q_t - log p_t) + (1 - q_t) log((1 - q_t + 1e-8) / (1 - p_t + 1e-8)), and

      masked_t = 1[A_t > 0] * 1[p_t > q_t] * 1[D_t > delta_high] + 1[A_t < 0] * 1[p_t < q_t] * 1[D_t > delta_low]

  (verl ``compute_policy_loss_dppo_kl``, its 1e-8 included; the KL is large either way the probability moves, so
  the direction condition keeps the update that moves against the advantage's push).

A token with A_t = 0 is never masked (its advantage is 0 already). A masked token's advantage is set to 0 and the
token stays in the loss's token count: the field's losses multiply the per-token term by the mask and aggregate
over the unmasked response mask (verl ``pg_losses * valid_mask`` over ``response_mask``; prime-rl ``keep_mask *
advantages * ratio`` summed over the loss mask). With the policy-gradient loss of bypass mode (``use_policy_gradient``
and token IS, w_t = min(p_t / q_t, C)) the gradient is the field's, -(1 - masked_t) w_t A_t grad log pi_theta(a_t):
verl's DPPO loss -A_t sg(min(r_t, C)) log pi_theta with r_t = pi_theta / pi_old (C = ``clip_ratio_c``; 1e4 in verl's
DPPO example, i.e. no truncation), prime-rl's -(1 - masked_t) A_t r_t (no truncation, plus its own
kl_tau (log r_t)^2 term, which this package does not add).

In bypass mode the pipeline sees pi_theta (detached) at every micro-batch's loss (``config/plan.py``: the correction
is computed in the loss, or at generation time only where one optimizer step consumes the generation batch, when
pi_theta there is pi_theta at every loss), so the mask follows the policy as it moves.

**Decoupled mode** (``bypass_mode=False``, verl's setting): DPPO is the policy loss between pi_theta and pi_old
(q_t = pi_old(a_t)), registered in ``core/losses.py`` (``dppo_tv``, ``dppo_kl``: :func:`~.losses.policy_loss_terms`)
and applied by the trainer at each micro-batch's loss; this package's correction on pi_old vs pi_rollout (IS weight
w_t, rejection) runs in the pipeline as for PPO and multiplies it. The gradient is verl's,

    -A_t (1 - masked_t) sg(min(pi_theta/pi_old, C)) w_t grad log pi_theta(a_t)

with C = ``rollout_dppo_clip_ratio_c`` (verl's ``clip_ratio_c``; default 1e4 as in verl's DPPO example, i.e. no
truncation). The pipeline's criterion does nothing in decoupled mode (``RolloutCorrectionConfig.params()`` leaves
DPPO out of the pipeline); :func:`decoupled_dppo_stats` gives the same ``rollout_dppo_*`` metrics from the loss.
Where pi_old = pi_theta (one optimizer step per generation batch, ``config/plan.py``) the mask never fires and
r_t = 1: decoupled DPPO is then plain policy gradient with the IS weight.

Pure tensor functions; no TRL import.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .criterion import TOK_N, CorrectionField, CorrectionState, Criterion, StatFloats, none_if_unset, stat_key
from .stats import METRIC_PREFIX as PREFIX
from .stats import RolloutStats, count, extreme_or_zero, masked_max, masked_sum, safe_div

DPPO_DIVERGENCES = ("binary_tv", "binary_kl")
"""The divergences: DPPO-Binary-TV (the probability difference) and DPPO-Binary-KL (the Bernoulli KL)."""
DEFAULT_THRESHOLDS = {"binary_tv": 0.15, "binary_kl": 0.05}
"""delta_low = delta_high where unset: verl's DPPO example (``examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh``,
the paper's authors' recipe in verl: 0.15 for dppo_tv, 0.05 for dppo_kl). prime-rl's default is 0.2 (TV)."""
BINARY_KL_EPS = 1e-8
"""verl's 1e-8 in log((1 - q + eps) / (1 - p + eps)): finite where p or q is 1."""


def dppo_divergence(train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, divergence: str) -> torch.Tensor:
    """The per-token divergence DPPO's mask compares with its thresholds (float64, on every position).

    Args:
        train_log_prob: (B, T) log p_t = log pi_theta(a_t) (bypass mode: pi_train).
        rollout_log_prob: (B, T) log q_t = log pi_rollout(a_t).
        divergence: ``"binary_tv"`` (Delta_t = p_t - q_t, signed) or ``"binary_kl"`` (D_t = KL(Bern(q_t) ||
            Bern(p_t)) >= 0).

    Returns:
        (B, T) float64: Delta_t (TV) or D_t (KL); a log-prob > 0 (float noise above p = 1) is read as 0, so p, q lie
        in [0, 1] and D_t is finite.

    Raises:
        ValueError: ``divergence`` is not one of ``DPPO_DIVERGENCES``.
    """
    log_p = train_log_prob.detach().double().clamp(max=0.0)  # (B, T) a log-prob > 0 (float noise) read as 0
    log_q = rollout_log_prob.detach().double().clamp(max=0.0)  # (B, T)
    p, q = log_p.exp(), log_q.exp()  # (B, T) each
    if divergence == "binary_tv":
        return p - q  # (B, T)
    if divergence == "binary_kl":
        return q * (log_q - log_p) + (1 - q) * torch.log((1 - q + BINARY_KL_EPS) / (1 - p + BINARY_KL_EPS))  # (B, T)
    raise ValueError(f"rollout_dppo must be one of {DPPO_DIVERGENCES} or None, got {divergence!r}.")


def dppo_mask(train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, valid: torch.Tensor,
              advantages: torch.Tensor, divergence: str, low: float, high: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPPO's binary trust-region mask (module docstring): the tokens whose advantage is set to 0.

    Args:
        train_log_prob: (B, T) log p_t = log pi_theta(a_t).
        rollout_log_prob: (B, T) log q_t = log pi_rollout(a_t).
        valid: (B, T) bool, the tokens it may mask.
        advantages: (B,), (B, 1) or (B, T), A_t.
        divergence: ``"binary_tv"`` or ``"binary_kl"``.
        low: delta_low, the bound on the side A_t < 0 (p_t falling).
        high: delta_high, the bound on the side A_t > 0 (p_t rising).

    Returns:
        masked: (B, T) bool, masked_t (a subset of ``valid`` and of A_t != 0).
        positive: (B, T) bool, valid tokens with A_t > 0.
        negative: (B, T) bool, valid tokens with A_t < 0.
        value: (B, T) float64, |Delta_t| (TV) or D_t (KL): the divergence's size, for the statistics.
    """
    adv = advantages.detach()
    adv = adv.reshape(-1, 1) if adv.dim() == 1 else adv  # (B, 1) or (B, T)
    adv = adv.expand_as(valid)  # (B, T)
    positive = valid & (adv > 0)  # (B, T)
    negative = valid & (adv < 0)  # (B, T)
    d = dppo_divergence(train_log_prob, rollout_log_prob, divergence)  # (B, T)
    if divergence == "binary_tv":
        masked = (positive & (d > high)) | (negative & (d < -low))  # (B, T)
        return masked, positive, negative, d.abs()
    rising = train_log_prob > rollout_log_prob  # (B, T) p_t > q_t
    falling = train_log_prob < rollout_log_prob  # (B, T) p_t < q_t
    masked = (positive & rising & (d > high)) | (negative & falling & (d > low))  # (B, T)
    return masked, positive, negative, d


def dppo_thresholds(divergence: str, low: float | None, high: float | None) -> tuple[float, float]:
    """(delta_low, delta_high): each as given, else the divergence's default (``DEFAULT_THRESHOLDS``).

    Args:
        divergence: ``"binary_tv"`` or ``"binary_kl"``.
        low, high: ``rollout_dppo_mask_low`` / ``_high``, or ``None``.

    Returns:
        (delta_low, delta_high).
    """
    default = DEFAULT_THRESHOLDS[divergence]
    return (default if low is None else low), (default if high is None else high)


# ---------------------------------------------------------------------------------------------------- the criterion
DPPO_MASKED_TOK_N = stat_key("mask.dppo_masked_tok_n", __name__)
"""Valid tokens whose advantage DPPO's mask set to 0."""
DPPO_MASKED_POS_TOK_N = stat_key("dppo.masked_pos_tok_n", __name__)
DPPO_MASKED_NEG_TOK_N = stat_key("dppo.masked_neg_tok_n", __name__)
DPPO_VALUE_SUM = stat_key("dppo.value_sum", __name__)
"""Sum of |Delta_t| (TV) or D_t (KL) over the valid tokens."""
DPPO_VALUE_MAX = stat_key("dppo.value_max", __name__)
"""Max of |Delta_t| (TV) or D_t (KL) over the valid tokens (max-reduced; -inf where none)."""
DPPO_TOK_N = stat_key("dppo.tok_n", __name__)
"""Decoupled mode: the tokens the policy loss saw, summed over micro-batches (the shares' denominator)."""
DEFAULT_CLIP_RATIO_C = 1e4
"""C of decoupled DPPO's sg(min(pi_theta/pi_old, C)) where unset: verl's DPPO example's ``clip_ratio_c`` (no
truncation in practice)."""
POLICY_LOSS_NAMES = {"binary_tv": "dppo_tv", "binary_kl": "dppo_kl"}
"""``rollout_dppo`` -> the policy loss registered in ``core/losses.py`` (verl's loss-mode names)."""
DPPO_METRICS = ("rollout_dppo_masked_fraction", "rollout_dppo_masked_fraction_pos", "rollout_dppo_masked_fraction_neg",
                "rollout_dppo_divergence_mean", "rollout_dppo_divergence_max")


class DivergenceTrustRegion(Criterion):
    """DPPO's trust region (arXiv:2602.04879): on the tokens whose probability moved past delta in the advantage's
    direction (Binary-TV: p - q; Binary-KL: KL(Bern(q) || Bern(p)) with p moving the advantage's way), the advantage
    is set to 0 and the token stays in the loss's count. Bypass mode: here, q = pi_rollout, p = pi_theta; decoupled
    mode: the policy loss ``dppo_tv`` / ``dppo_kl`` of ``core/losses.py`` (q = pi_old), the trainer applying it.

    Attributes:
        fields: ``rollout_dppo`` (divergence), ``rollout_dppo_mask_low`` / ``_high`` (delta_low, delta_high),
            ``rollout_dppo_clip_ratio_c`` (C, decoupled mode).
        metrics: :data:`DPPO_METRICS`.
    """

    name = "dppo"
    fields = (
        CorrectionField("rollout_dppo", "str | None", None,
                        "DPPO's trust region (arXiv:2602.04879; bypass mode: against pi_rollout; decoupled mode: "
                        "the policy loss against pi_old): binary_tv (mask A > 0 tokens with p_theta - p_old > "
                        "high, A < 0 tokens with it < -low) | binary_kl (the Bernoulli KL instead, in the "
                        "advantage's direction); the masked tokens' advantage is 0, kept in the "
                        "count. Default off.", "str | None"),
        CorrectionField("rollout_dppo_mask_low", "float | None", None,
                        "DPPO's bound on the A < 0 side (default: 0.15 binary_tv, 0.05 binary_kl, verl's DPPO "
                        "example; prime-rl's dppo_mask_low is 0.2).", "float | str | None"),
        CorrectionField("rollout_dppo_mask_high", "float | None", None,
                        "DPPO's bound on the A > 0 side (default: 0.15 binary_tv, 0.05 binary_kl; prime-rl's "
                        "dppo_mask_high is 0.2).", "float | str | None"),
        CorrectionField("rollout_dppo_clip_ratio_c", "float | None", None,
                        "Decoupled DPPO only (bypass_mode=False): C in sg(min(pi_theta/pi_old, C)), verl's "
                        "clip_ratio_c (default 1e4, verl's DPPO example: no truncation). Bypass mode truncates with "
                        "rollout_is_threshold instead.", "float | str | None"),
    )
    metrics = DPPO_METRICS
    switches = {"rollout_dppo": ("rollout_dppo_mask_low", "rollout_dppo_mask_high", "rollout_dppo_clip_ratio_c")}

    def check(self, cfg: Any) -> None:
        """The divergence's name, its thresholds (TV: in (0, 1]; KL: finite > 0; unset: the divergence's default,
        written back), C (decoupled mode only; default 1e4), and no ``rollout_rs_exclude_from_baseline``.

        Args:
            cfg: the ``RolloutCorrectionConfig`` being validated.

        Raises:
            ValueError: naming the field and the fix.
        """
        cfg.rollout_dppo = none_if_unset(cfg.rollout_dppo)
        for name in ("rollout_dppo_mask_low", "rollout_dppo_mask_high", "rollout_dppo_clip_ratio_c"):
            setattr(cfg, name, none_if_unset(getattr(cfg, name)))
        if cfg.rollout_dppo is None:
            if (cfg.rollout_dppo_mask_low is not None or cfg.rollout_dppo_mask_high is not None
                    or cfg.rollout_dppo_clip_ratio_c is not None):
                raise ValueError("rollout_dppo_mask_low / rollout_dppo_mask_high / rollout_dppo_clip_ratio_c are set "
                                 "but rollout_dppo is None, so they would be ignored: set rollout_dppo ('binary_tv' "
                                 "or 'binary_kl') or unset them.")
            return
        if cfg.rollout_dppo not in DPPO_DIVERGENCES:
            raise ValueError(f"rollout_dppo must be 'binary_tv' (DPPO-Binary-TV, the probability difference) or "
                             f"'binary_kl' (DPPO-Binary-KL), or None; got {cfg.rollout_dppo!r}.")
        cfg.rollout_dppo_mask_low, cfg.rollout_dppo_mask_high = dppo_thresholds(
            cfg.rollout_dppo, cfg.rollout_dppo_mask_low, cfg.rollout_dppo_mask_high)
        tv = cfg.rollout_dppo == "binary_tv"
        for name in ("rollout_dppo_mask_low", "rollout_dppo_mask_high"):
            value = getattr(cfg, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or math.isnan(value) or value <= 0 or math.isinf(value) or (tv and value > 1):
                bound = ("in (0, 1] (a probability difference; e.g. 0.15, verl's DPPO example, or prime-rl's 0.2)"
                         if tv else "a finite number > 0 (a KL in nats; e.g. 0.05, verl's DPPO example)")
                raise ValueError(f"{name} must be {bound} with rollout_dppo={cfg.rollout_dppo!r}, got {value!r}.")
        c = cfg.rollout_dppo_clip_ratio_c
        if cfg.bypass_mode:
            if c is not None:
                raise ValueError(f"rollout_dppo_clip_ratio_c={c!r} with bypass_mode=True: bypass DPPO truncates its "
                                 "weight min(pi_theta/pi_rollout, C) with rollout_is_threshold. Unset "
                                 "rollout_dppo_clip_ratio_c, or set bypass_mode=False (decoupled DPPO).")
        else:
            c = DEFAULT_CLIP_RATIO_C if c is None else c
            number = isinstance(c, (int, float)) and not isinstance(c, bool)
            if not number or math.isnan(c) or c <= 0 or math.isinf(c):
                raise ValueError(f"rollout_dppo_clip_ratio_c must be a finite number > 0 (C in sg(min(pi_theta/pi_old, "
                                 f"C)); e.g. 1e4, verl's DPPO example), got {c!r}.")
            cfg.rollout_dppo_clip_ratio_c = float(c)
        if cfg.rollout_rs_exclude_from_baseline:
            raise ValueError(f"rollout_rs_exclude_from_baseline=True with rollout_dppo={cfg.rollout_dppo!r}: DPPO's "
                             "mask is decided on the sign of the advantages, which leaving the rejected samples out of "
                             "the baselines changes after the correction ran, so the two cannot both be exact. Use one "
                             "of them (rollout_rs_exclude_from_baseline=False, or rollout_dppo=None).")

    def check_call(self, p: Any, advantages: torch.Tensor | None) -> None:
        """Refuse an unknown divergence, and a call without the advantages (the mask reads their sign).

        Args:
            p: the call's ``CorrectionParams``.
            advantages: (B,) or (B, T), or ``None``.

        Raises:
            ValueError: naming the field, or asking for ``advantages``.
        """
        if p.rollout_dppo is None:
            return
        if p.rollout_dppo not in DPPO_DIVERGENCES:
            raise ValueError(f"rollout_dppo must be one of {DPPO_DIVERGENCES} or None, got {p.rollout_dppo!r}.")
        if advantages is None:
            raise ValueError(f"rollout_dppo={p.rollout_dppo!r} needs the advantages (the mask is on the side the "
                             "advantage pushes: A > 0 with p_theta rising, A < 0 with it falling): pass "
                             "advantages=(B,) or (B, T).")

    def zeroes_advantages(self, cfg: Any) -> bool:
        """Whether DPPO is on (it zeroes the masked tokens' advantages).

        Args:
            cfg: the validated ``RolloutCorrectionConfig``.

        Returns:
            ``True`` where ``rollout_dppo`` is set.
        """
        return cfg.rollout_dppo is not None

    def apply(self, p: Any, state: CorrectionState) -> None:
        """DPPO's mask on the state's pi_train (pi_theta, bypass) and pi_rollout; the masked tokens' advantages go to
        0 (``state.zero_advantages``), and the counts by sign and the divergence's sum and max to the statistics.

        Args:
            p: the call's ``CorrectionParams``.
            state: the pipeline's :class:`CorrectionState`.
        """
        if p.rollout_dppo is None:
            return
        low, high = dppo_thresholds(p.rollout_dppo, p.rollout_dppo_mask_low, p.rollout_dppo_mask_high)
        valid = state.valid  # (B, T)
        masked, positive, negative, value = dppo_mask(state.train_log_prob, state.rollout_log_prob, valid,
                                                      state.advantages, p.rollout_dppo, low, high)  # (B, T) each
        sums = state.stats.sums
        sums[DPPO_MASKED_TOK_N] = count(masked)
        sums[DPPO_MASKED_POS_TOK_N] = count(masked & positive)
        sums[DPPO_MASKED_NEG_TOK_N] = count(masked & negative)
        sums[DPPO_VALUE_SUM] = masked_sum(value, valid)
        state.stats.maxes[DPPO_VALUE_MAX] = masked_max(value, valid)
        state.zero_advantages(masked)  # (B, T)

    def finalize(self, f: StatFloats) -> dict[str, float]:
        """The masked shares (all, A > 0, A < 0: each over the valid tokens, so the two sides add up to the whole)
        and the divergence's mean and max over the valid tokens.

        Args:
            f: the reduced statistics.

        Returns:
            ``{"rollout_corr/rollout_dppo_*": float}`` where DPPO ran, else ``{}``.
        """
        if not ((f.has(TOK_N) or f.has(DPPO_TOK_N)) and f.has(DPPO_MASKED_TOK_N)):
            return {}
        # every key below is written together with DPPO_MASKED_TOK_N (apply, decoupled_dppo_stats): a missing one
        # is a bug and raises KeyError, no silent 0.0
        tok_n = f.sum(DPPO_TOK_N) if f.has(DPPO_TOK_N) else f.sum(TOK_N)
        return {
            PREFIX + "rollout_dppo_masked_fraction": safe_div(f.sum(DPPO_MASKED_TOK_N), tok_n),
            PREFIX + "rollout_dppo_masked_fraction_pos": safe_div(f.sum(DPPO_MASKED_POS_TOK_N), tok_n),
            PREFIX + "rollout_dppo_masked_fraction_neg": safe_div(f.sum(DPPO_MASKED_NEG_TOK_N), tok_n),
            PREFIX + "rollout_dppo_divergence_mean": safe_div(f.sum(DPPO_VALUE_SUM), tok_n),
            PREFIX + "rollout_dppo_divergence_max": extreme_or_zero(f.max(DPPO_VALUE_MAX), tok_n),
        }


DPPO = DivergenceTrustRegion()


def decoupled_dppo_stats(theta_log_prob: torch.Tensor, old_log_prob: torch.Tensor, valid: torch.Tensor,
                         advantages: torch.Tensor, divergence: str, low: float, high: float) -> RolloutStats:
    """Decoupled DPPO's ``rollout_dppo_*`` statistics of one micro-batch (p_t = pi_theta, q_t = pi_old), the keys the
    criterion's :meth:`DivergenceTrustRegion.finalize` reads, with their own token count (:data:`DPPO_TOK_N`).

    Args:
        theta_log_prob: log pi_theta, detached.   (B, T)
        old_log_prob: log pi_old.   (B, T)
        valid: the tokens in the loss (bool).   (B, T)
        advantages: A.   (B,), (B, 1) or (B, T)
        divergence: ``"binary_tv"`` or ``"binary_kl"``.
        low, high: delta_low, delta_high.

    Returns:
        ``RolloutStats`` (0-dim float64 device tensors; no host sync).
    """
    ok = valid.bool() & torch.isfinite(theta_log_prob) & torch.isfinite(old_log_prob)  # (B, T)
    safe_old = torch.where(ok, old_log_prob.detach(), theta_log_prob.detach())  # (B, T)
    masked, positive, negative, value = dppo_mask(theta_log_prob.detach(), safe_old, ok, advantages, divergence,
                                                  low, high)  # (B, T) each
    return RolloutStats(sums={DPPO_TOK_N: count(ok), DPPO_MASKED_TOK_N: count(masked),
                              DPPO_MASKED_POS_TOK_N: count(masked & positive),
                              DPPO_MASKED_NEG_TOK_N: count(masked & negative),
                              DPPO_VALUE_SUM: masked_sum(value, ok)},
                        maxes={DPPO_VALUE_MAX: masked_max(value, ok)})
