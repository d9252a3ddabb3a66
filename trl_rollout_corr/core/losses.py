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

Both trainers go through the same three steps, in this module: :func:`batch_correction` (the synchronous trainer's
(B, T) batch: the pipeline, then the mode rule) or the pipeline and :func:`mode_correction` (the asynchronous
trainer's rows and flat terms) give a :class:`Correction`; :func:`loss_patch` turns it into TRL's advantages and
anchor (the one loss patch). Nothing here calls back into a trainer: the cross-process reduce is a plain
``reduce_fn`` (:func:`~.stats.process_all_reduce`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .dppo import dppo_mask
from .params import CorrectionParams
from .pipeline import compute_rollout_correction_stats
from .stats import ReduceFn, RolloutStats
from .truncation import truncated_support_logprobs, truncation_stats

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

    Args:
        bypass_mode: pi_old := pi_rollout (no pi_old forward).
        use_policy_gradient: bypass mode's policy-gradient loss instead of PPO-clip.

    Returns:
        :data:`PI_ROLLOUT`, :data:`PI_THETA` or :data:`PI_OLD`.
    """
    if not bypass_mode:
        return PI_OLD
    return PI_THETA if use_policy_gradient else PI_ROLLOUT


def weights_advantage(anchor: str) -> bool:
    """Whether the IS weight multiplies the advantage, A' = w A: for every anchor but pi_rollout (whose ratio already
    is rho).

    Args:
        anchor: :func:`loss_anchor`'s result.

    Returns:
        ``anchor != PI_ROLLOUT``.
    """
    return anchor != PI_ROLLOUT


def corrected_loss_mask(completion_mask: torch.Tensor, tool_mask: torch.Tensor | None,
                        keep: torch.Tensor) -> torch.Tensor:
    """TRL's ``tool_mask`` slot with the rejection mask folded in:  (tool_mask or 1) * keep.   (B, T)

    TRL's loss mask is ``completion_mask * tool_mask``; ``keep`` <= that mask, so the product is the kept mask.

    Args:
        completion_mask: TRL's completion mask (its dtype and device for the ones without a tool mask).   (B, T)
        tool_mask: TRL's tool mask (0 on tool output), or None.   (B, T)
        keep: the correction's kept mask.   (B, T)

    Returns:
        m' = (tool_mask or 1) * keep, for TRL's ``tool_mask`` slot.   (B, T)
    """
    base = tool_mask if tool_mask is not None else torch.ones_like(completion_mask)  # (B, T)
    return base * keep  # (B, T)


def weighted_advantages(advantages: torch.Tensor, is_weights: torch.Tensor | None,
                        sequence_level: bool) -> torch.Tensor:
    """A' = A * stopgrad(w): (B,) or (B, 1) advantages times (B, T) IS weights.

    Args:
        advantages: TRL's A.   (B,), (B, 1) or (B, T)
        is_weights: w, 0 on padding (None: no weight).   (B, T)
        sequence_level: one weight per row: A' keeps the (B, 1) shape (w's row maximum, its one value).

    Returns:
        A' = A * stopgrad(w): (B, 1) (sequence weights on (B,) or (B, 1) advantages) or (B, T); ``advantages``
        unchanged when ``is_weights`` is None.
    """
    if is_weights is None:
        return advantages
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)  # (B, 1) or (B, T)
    w = is_weights.detach().to(adv.dtype)  # (B, T)
    if sequence_level and adv.size(1) == 1:
        w = w.amax(dim=1, keepdim=True)  # (B, 1) the sequence weight (padding is 0, weights are > 0)
    return adv * w  # (B, 1) or (B, T)


def zeroed_advantages(advantages: torch.Tensor, advantage_mask: torch.Tensor | None) -> torch.Tensor:
    """A'' = A' * z with z in {0, 1}: M2PO's trust-region mask (arXiv:2510.01161) sets the advantage of the tokens it
    takes to 0, in every mode (bypass PPO included), and leaves them in the loss's token count: with A'' = 0 every
    TRL loss type's policy term for the token is 0, its normalizer unchanged.

    Args:
        advantages: A'.   (B,), (B, 1) or (B, T)
        advantage_mask: z (None: no mask).   (B, T)

    Returns:
        A'' = A' * stopgrad(z) (B, T); ``advantages`` unchanged when ``advantage_mask`` is None.
    """
    if advantage_mask is None:
        return advantages
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)  # (B, 1) or (B, T)
    return adv * advantage_mask.detach().to(adv.dtype)  # (B, T)


def vespo_sampler_ratio(is_weights: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The per-token sampler ratio VESPO's phi consumes:  w_t = min(rho_t, C), rho_t = pi_old / pi_rollout.   (B, T)

    Exactly 1 on rejected and padding tokens (TRL sums its log over every position). TRL's own vLLM correction
    hands VESPO the same quantity (``token_truncate``), from its pi_old forward.

    Args:
        is_weights: w = min(rho, C).   (B, T)
        keep: the kept mask.   (B, T)

    Returns:
        w on kept tokens, 1 elsewhere, float32, detached.   (B, T)
    """
    return torch.where(keep.bool(), is_weights.detach().float(), 1.0)  # (B, T)


def safe_anchor(anchor: torch.Tensor, fallback: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``anchor`` where it is finite on a kept token, ``fallback`` (detached pi_theta) elsewhere.   (B, T)

    Masked positions still enter TRL's elementwise loss before the mask multiplies it: a NaN/inf there would
    turn ``0 * nan`` into NaN. Values on kept tokens are unchanged.

    Args:
        anchor: log pi_old or log pi_rollout.   (B, T)
        fallback: log pi_theta (detached here).   (B, T)
        mask: the kept tokens (any dtype, nonzero = kept).   (B, T)

    Returns:
        The anchor TRL's ratio reads, finite everywhere ``fallback`` is.   (B, T)
    """
    ok = torch.isfinite(anchor) & mask.bool()  # (B, T)
    return torch.where(ok, anchor, fallback.detach())  # (B, T)


class Correction(NamedTuple):
    """What the correction changes in one batch, as TRL's loss consumes it (all detached; (B, T) for the synchronous
    trainer, the flat terms' shape for the asynchronous one).

    Attributes:
        keep: kept mask (the loss mask's dtype): 0 on a rejected or vetoed token.
        is_weights: w = min(rho, C), multiplies A (None: no IS weight on the advantage, e.g. bypass PPO).
        anchor: log pi_old for TRL's ratio r = pi_theta / pi_old (None: pi_theta detached, r = 1).
        sampler_ratio: VESPO's ``importance_sampling_ratio`` (decoupled mode only), else None.
        advantage_mask: 0/1, multiplies A in every mode, the token kept in the count (M2PO), else None.
    """

    keep: torch.Tensor
    is_weights: torch.Tensor | None
    anchor: torch.Tensor | None
    sampler_ratio: torch.Tensor | None
    advantage_mask: torch.Tensor | None = None


def mode_correction(anchor_mode: str, keep: torch.Tensor, is_weights: torch.Tensor | None,
                    advantage_mask: torch.Tensor | None, *, rollout_anchor: torch.Tensor,
                    old_anchor: torch.Tensor | None, vespo: bool = False) -> Correction:
    """The mode rule (:func:`loss_anchor`) applied to the pipeline's result: which anchor TRL's ratio gets and whether
    w multiplies A.

    Args:
        anchor_mode: ``loss_anchor(bypass_mode, use_policy_gradient)``: ``PI_ROLLOUT``, ``PI_THETA`` or ``PI_OLD``.
        keep: the kept mask.   (B, T) or the terms' shape, as every tensor here
        is_weights: w = min(rho, C) (None: the correction has no IS weight).
        advantage_mask: M2PO's trust-region mask (None: none).
        rollout_anchor: log pi_rollout as bypass PPO's anchor (on a truncated support shifted by log M, so that
            r = pi_theta^trunc / pi_rollout).
        old_anchor: log pi_old in decoupled mode when a forward gave it; None: pi_theta detached (r = 1).
        vespo: TRL's ``loss_type="vespo"``: in decoupled mode its phi consumes w as the sampler ratio, A unweighted.

    Returns:
        The :class:`Correction`: bypass PPO: anchor pi_rollout, no weight on A (r already is rho); bypass policy
        gradient: anchor None (r = 1, the gradient -w A grad log pi_theta), w on A; decoupled: anchor ``old_anchor``,
        w on A (VESPO: w as ``sampler_ratio``, exactly 1 on rejected tokens).
    """
    if anchor_mode == PI_ROLLOUT:  # bypass PPO: the IS weight feeds the metrics only
        return Correction(keep, None, rollout_anchor, None, advantage_mask)
    if anchor_mode == PI_THETA:  # bypass policy gradient
        return Correction(keep, is_weights, None, None, advantage_mask)
    if vespo and is_weights is not None:  # phi consumes the ratio; A is not weighted
        return Correction(keep, None, old_anchor, vespo_sampler_ratio(is_weights, keep), advantage_mask)
    return Correction(keep, is_weights, old_anchor, None, advantage_mask)


def batch_correction(train_logps: torch.Tensor, rollout_logps: torch.Tensor, loss_mask: torch.Tensor,
                     params: CorrectionParams, *, anchor_mode: str, forward_anchor: bool, vespo: bool,
                     advantages: torch.Tensor | None, rollout_seen: torch.Tensor | None = None,
                     support: tuple[torch.Tensor, torch.Tensor] | None = None, renormalize: bool = False,
                     reduce_fn: ReduceFn | None = None) -> tuple[Correction, RolloutStats]:
    """The synchronous trainer's correction of one (B, T) batch: rho = pi_train / pi_rollout through the pipeline
    (:func:`~.pipeline.compute_rollout_correction_stats`), then :func:`mode_correction`.

    Args:
        train_logps: log pi_train, detached: pi_old (decoupled: the plan's forward, or pi_theta detached when
            pi_old = pi_theta) or pi_theta (bypass).   (B, T)
        rollout_logps: log pi_rollout.   (B, T)
        loss_mask: TRL's loss mask (completion mask times tool mask).   (B, T)
        params: the correction (``RolloutCorrectionConfig.params()``).
        anchor_mode: ``loss_anchor(bypass_mode, use_policy_gradient)``.
        forward_anchor: decoupled mode with pi_old from a forward: the anchor is ``train_logps`` (else None).
        vespo: TRL's ``loss_type == "vespo"``.
        advantages: TRL's A before any correction (M2PO's trust region, ``grad_share_*``).   (B,)
        rollout_seen: whether the sampler's distribution was seen per sample (None: all).   (B,)
        support: a truncating sampler's ``(log_mass, in_support)``, the kept mass log M and the sampled token's
            membership of the kept set (None: the sampler does not truncate).   (B, T) each
        renormalize: rho uses pi_train renormalized over the kept set: log pi_train - log M on it.
        reduce_fn: makes a batch statistic global across processes (None: this process).

    Returns:
        The :class:`Correction` ((B, T) tensors) and its statistics (the truncation's, then the pipeline's).
    """
    stats = RolloutStats()
    ratio_logps = train_logps  # (B, T)
    if support is not None:
        log_mass, in_support = support  # (B, T), (B, T)
        stats.update(truncation_stats(log_mass, in_support, loss_mask))
        if renormalize:
            ratio_logps = truncated_support_logprobs(train_logps, log_mass, in_support)  # (B, T)
    result = compute_rollout_correction_stats(ratio_logps, rollout_logps, loss_mask, params, reduce_fn=reduce_fn,
                                              rollout_seen=rollout_seen, advantages=advantages)
    stats.update(result.stats)
    keep = result.modified_response_mask.to(loss_mask.dtype)  # (B, T)
    correction = mode_correction(anchor_mode, keep, result.is_weights, result.advantage_mask,
                                 rollout_anchor=rollout_logps + (train_logps - ratio_logps),  # (B, T)
                                 old_anchor=train_logps if forward_anchor else None, vespo=vespo)
    return correction, stats


class LossPatch(NamedTuple):
    """TRL's advantages and anchor with the correction in them (:func:`loss_patch`).

    Attributes:
        advantages: A' = A * w * z: (B,), (B, 1) or (B, T); the terms' shape (1, M) for the async trainer.
        anchor: the log-prob TRL's ratio divides by, finite on every kept token; ``None``: TRL uses pi_theta
            detached.   (B, T) or (1, M)
    """

    advantages: torch.Tensor  # A' = A * w * z: (B,), (B, 1) or (B, T); the terms' shape for the async trainer
    anchor: torch.Tensor | None  # finite on every kept token; None: TRL uses pi_theta detached


def loss_patch(advantages: torch.Tensor, correction: Correction, pi_theta: torch.Tensor, kept: torch.Tensor,
               sequence_level: bool) -> LossPatch:
    """The one patch of TRL's loss inputs both trainers apply:  A' = A * stopgrad(w) * z  and the anchor made safe.

    Args:
        advantages: TRL's A: (B,) or (B, 1) (synchronous), (1, M) (asynchronous, one per flat term).
        correction: from :func:`batch_correction` or :func:`mode_correction`; its tensors (B, T) or (1, M).
        pi_theta: log pi_theta (detached where used): the anchor's fallback.   (B, T) or (1, M)
        kept: the tokens that stay in the loss (loss mask times ``keep``), any dtype.   (B, T) or (1, M)
        sequence_level: the IS weight is one per sequence (``rollout_is="sequence"``): A keeps its (B, 1) shape.

    Returns:
        :class:`LossPatch`: :func:`zeroed_advantages` of :func:`weighted_advantages`, and :func:`safe_anchor` of the
        correction's anchor on ``kept`` (None stays None).
    """
    patched = zeroed_advantages(weighted_advantages(advantages, correction.is_weights, sequence_level),
                                correction.advantage_mask)  # (B,), (B, 1) or (B, T)
    anchor = None if correction.anchor is None else safe_anchor(correction.anchor, pi_theta, kept)  # (B, T)
    return LossPatch(patched, anchor)


# ---------------------------------------------------------------------------------------------- policy losses
# A policy loss replaces the PPO ratio-clip term between pi_theta and pi_old (decoupled mode), layered on TRL's
# loss: TRL's anchor is pi_theta detached (r_t = exp(log pi_theta - sg(log pi_theta)) = 1, so every TRL loss type's
# clip is inactive and its per-token gradient is -A''_t grad log pi_theta(a_t)), and the policy loss hands back the
# detached per-token coefficient c_t that multiplies the advantage:  A''_t = A_t * c_t * w_t, with w_t this package's
# IS weight on pi_old vs pi_rollout. One function per loss, registered by name in POLICY_LOSSES (verl's
# ``register_policy_loss`` pattern); the gradient equals verl's loss -A_t sg(c_t) w_t log pi_theta(a_t) aggregated
# by TRL's loss type (the loss *value* is TRL's -A''_t r_t, not verl's, which carries log pi_theta).
POLICY_LOG_RATIO_BOUND = 20.0
"""verl clamps log(pi_theta / pi_old) to [-20, 20] before exponentiating (core_algos ``dppo_tv`` / ``dppo_kl``)."""


class PolicyLossTerms(NamedTuple):
    """A policy loss's per-token result (all detached).

    Attributes:
        coefficient: c_t >= 0, multiplies A (0 on masked and invalid tokens).   (B, T) float64
        masked: the tokens the loss's trust region took out (a subset of ``valid``).   (B, T) bool
    """

    coefficient: torch.Tensor
    masked: torch.Tensor


PolicyLossFn = Callable[..., PolicyLossTerms]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}
"""The policy losses by name: ``register_policy_loss`` adds one; :func:`policy_loss_terms` looks one up."""


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a policy loss ``fn(theta_log_prob, old_log_prob, valid, advantages, *, low, high, clip_ratio_c) ->
    PolicyLossTerms`` under ``name`` in :data:`POLICY_LOSSES` (verl's ``register_policy_loss`` pattern).

    Args:
        name: the loss's name (``RolloutCorrectionConfig.policy_loss`` names it).

    Returns:
        The decorator (it returns ``fn`` unchanged).

    Raises:
        ValueError: ``name`` registered twice.
    """

    def register(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice ({POLICY_LOSSES[name].__name__}, "
                             f"{fn.__name__}): give the new one another name.")
        POLICY_LOSSES[name] = fn
        return fn

    return register


def truncated_policy_ratio(theta_log_prob: torch.Tensor, old_log_prob: torch.Tensor, valid: torch.Tensor,
                           clip_ratio_c: float) -> torch.Tensor:
    """sg(min(r_t, C)), r_t = pi_theta(a_t) / pi_old(a_t) with log r_t clamped to [-20, 20] (verl); 0 off ``valid``.

    Args:
        theta_log_prob: log pi_theta (detached here).   (B, T)
        old_log_prob: log pi_old.   (B, T)
        valid: the tokens in the loss (bool).   (B, T)
        clip_ratio_c: C > 0, the truncation (verl's ``clip_ratio_c``).

    Returns:
        min(r_t, C) on ``valid``, 0 elsewhere, float64, detached.   (B, T)
    """
    log_r = (theta_log_prob.detach().double() - old_log_prob.detach().double())  # (B, T)
    log_r = torch.where(valid, log_r, 0.0).clamp(-POLICY_LOG_RATIO_BOUND, POLICY_LOG_RATIO_BOUND)  # (B, T) finite
    return torch.where(valid, log_r.exp().clamp(max=clip_ratio_c), 0.0)  # (B, T)


def _dppo_terms(divergence: str, theta_log_prob: torch.Tensor, old_log_prob: torch.Tensor, valid: torch.Tensor,
                advantages: torch.Tensor, low: float, high: float, clip_ratio_c: float) -> PolicyLossTerms:
    """Decoupled DPPO: c_t = (1 - masked_t) * sg(min(pi_theta / pi_old, C)), masked_t DPPO's binary mask
    (:func:`~.dppo.dppo_mask`) with p_t = pi_theta(a_t), q_t = pi_old(a_t)."""
    ok = valid.bool() & torch.isfinite(theta_log_prob) & torch.isfinite(old_log_prob)  # (B, T)
    safe_old = torch.where(ok, old_log_prob.detach(), theta_log_prob.detach())  # (B, T) finite where pi_theta is
    masked, _, _, _ = dppo_mask(theta_log_prob.detach(), safe_old, ok, advantages, divergence, low, high)  # (B, T)
    ratio_c = truncated_policy_ratio(theta_log_prob, safe_old, ok, clip_ratio_c)  # (B, T)
    return PolicyLossTerms(torch.where(masked, 0.0, ratio_c), masked)  # (B, T), (B, T)


@register_policy_loss("dppo_tv")
def dppo_tv_policy_loss(theta_log_prob: torch.Tensor, old_log_prob: torch.Tensor, valid: torch.Tensor,
                        advantages: torch.Tensor, *, low: float, high: float, clip_ratio_c: float) -> PolicyLossTerms:
    """DPPO-Binary-TV as the policy loss between pi_theta and pi_old (verl ``compute_policy_loss_dppo_tv``):

        grad L = -sum_t A_t (1 - masked_t) sg(min(r_t, C)) w_t grad log pi_theta(a_t) / (TRL's normalizer),
        masked_t = 1[A_t > 0] 1[p_t - q_t > delta_high] + 1[A_t < 0] 1[p_t - q_t < -delta_low],

    p_t = pi_theta(a_t), q_t = pi_old(a_t), r_t = p_t / q_t, w_t the IS weight on pi_old vs pi_rollout.

    Args:
        theta_log_prob: log pi_theta (detached here).   (B, T)
        old_log_prob: log pi_old.   (B, T)
        valid: the tokens in the loss.   (B, T)
        advantages: A.   (B,), (B, 1) or (B, T)
        low, high: delta_low, delta_high in (0, 1].
        clip_ratio_c: C > 0.

    Returns:
        :class:`PolicyLossTerms`: c_t and masked_t.
    """
    return _dppo_terms("binary_tv", theta_log_prob, old_log_prob, valid, advantages, low, high, clip_ratio_c)


@register_policy_loss("dppo_kl")
def dppo_kl_policy_loss(theta_log_prob: torch.Tensor, old_log_prob: torch.Tensor, valid: torch.Tensor,
                        advantages: torch.Tensor, *, low: float, high: float, clip_ratio_c: float) -> PolicyLossTerms:
    """DPPO-Binary-KL as the policy loss between pi_theta and pi_old (verl ``compute_policy_loss_dppo_kl``): as
    :func:`dppo_tv_policy_loss` with masked_t = 1[A_t > 0] 1[p_t > q_t] 1[D_t > delta_high] + 1[A_t < 0] 1[p_t < q_t]
    1[D_t > delta_low], D_t = KL(Bern(q_t) || Bern(p_t)) (:func:`~.dppo.dppo_divergence`).

    Args:
        theta_log_prob: log pi_theta (detached here).   (B, T)
        old_log_prob: log pi_old.   (B, T)
        valid: the tokens in the loss.   (B, T)
        advantages: A.   (B,), (B, 1) or (B, T)
        low, high: delta_low, delta_high > 0 (nats).
        clip_ratio_c: C > 0.

    Returns:
        :class:`PolicyLossTerms`: c_t and masked_t.
    """
    return _dppo_terms("binary_kl", theta_log_prob, old_log_prob, valid, advantages, low, high, clip_ratio_c)


def policy_loss_terms(name: str, theta_log_prob: torch.Tensor, old_log_prob: torch.Tensor, valid: torch.Tensor,
                      advantages: torch.Tensor, *, low: float, high: float, clip_ratio_c: float) -> PolicyLossTerms:
    """The registered policy loss ``name``'s terms (:data:`POLICY_LOSSES`).

    Args:
        name: a registered loss (``"dppo_tv"``, ``"dppo_kl"``).
        theta_log_prob, old_log_prob: log pi_theta, log pi_old.   (B, T)
        valid: the tokens in the loss.   (B, T)
        advantages: A.   (B,), (B, 1) or (B, T)
        low, high, clip_ratio_c: the loss's bounds.

    Returns:
        :class:`PolicyLossTerms`.   (B, T)

    Raises:
        ValueError: ``name`` is not registered (the error lists the names).
    """
    if name not in POLICY_LOSSES:
        raise ValueError(f"policy loss must be one of {sorted(POLICY_LOSSES)}, got {name!r}.")
    return POLICY_LOSSES[name](theta_log_prob, old_log_prob, valid, advantages, low=low, high=high,
                               clip_ratio_c=clip_ratio_c)


def policy_loss_advantages(advantages: torch.Tensor, terms: PolicyLossTerms,
                           is_weights: torch.Tensor | None) -> torch.Tensor:
    """A''_t = A_t * sg(c_t) * sg(w_t), in A's dtype, for TRL's loss with anchor pi_theta detached (r_t = 1).

    Args:
        advantages: A.   (B,), (B, 1) or (B, T)
        terms: the policy loss's :class:`PolicyLossTerms`.   (B, T)
        is_weights: w_t on pi_old vs pi_rollout (None: 1).   (B, T)

    Returns:
        A''.   (B, T)
    """
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)  # (B, 1) or (B, T)
    coefficient = terms.coefficient.detach()  # (B, T) float64
    if is_weights is not None:
        coefficient = coefficient * is_weights.detach().double()  # (B, T)
    return adv * coefficient.to(adv.dtype)  # (B, T)
