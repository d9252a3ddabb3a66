"""The one-call entry point: IS weights, rejection mask, veto and every metric.

:func:`compute_rollout_correction_stats` forms the valid tokens and log rho = log pi_train - log pi_rollout once,
then applies every criterion of ``core/criteria.py`` in order (:class:`~.criterion.Criterion`: IS weights, rejection,
veto, divergence criteria, the second-moment mask), then adds the pipeline's own counts and the gradient share.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, NamedTuple

import torch

from .criteria import CRITERIA
from .criterion import SEQ_N, TOK_N, CorrectionState
from .impact import gradient_share_stats, length_stats
from .metrics import ALL_SEQ_N, INPUT_TOK_N, INVALID_TOK_N, KEPT_TOK_N, MISSING_SEQ_N, finalize_stats, offpolicy_stats
from .params import CorrectionParams
from .stats import ReduceFn, RolloutStats, count, count_rows


class RolloutCorrection(NamedTuple):
    """Result of :func:`compute_rollout_correction_stats` (device tensors only, no host sync).

    Attributes:
        is_weights: w_t, detached, zero on padding, 1 on samples without pi_rollout; ``None`` without IS.   (B, T)
        modified_response_mask: the tokens kept (every rejection ANDed in), in the input mask's dtype.   (B, T)
        stats: the reducible statistics (:func:`~.metrics.finalize_stats` turns them into metrics).
        advantage_mask: 0/1 in the mask's dtype, multiplies the advantage in every mode, the token kept in the
            loss's count (M2PO's trust-region mask, DPPO's mask: every criterion that zeroes advantages, combined);
            ``None``: nothing to zero.   (B, T)
    """

    is_weights: torch.Tensor | None  # (B, T), detached, zero on padding; 1 on samples without pi_rollout
    modified_response_mask: torch.Tensor  # (B, T), same dtype as the input mask
    stats: RolloutStats
    advantage_mask: torch.Tensor | None = None  # (B, T) 0/1 or None


def rows_without(mask: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """The invalid-sequence rule: ``mask`` minus every row with a ``bad`` token among its masked ones.

    Args:
        mask: the tokens, any dtype (read as bool).   (B, T)
        bad: the tokens that invalidate their row.   (B, T) bool

    Returns:
        The remaining tokens.   (B, T) bool
    """
    mask = mask.bool()  # (B, T)
    return mask & ~(mask & bad).any(1, keepdim=True)  # (B, T)


def finite_rows_mask(mask: torch.Tensor, *log_probs: torch.Tensor) -> torch.Tensor:
    """``mask`` minus every row with a non-finite value of any of ``log_probs`` on one of its masked tokens (a
    NaN/+-inf log-prob invalidates its whole sequence, :func:`rows_without`).

    Args:
        mask: the tokens, any dtype.   (B, T)
        *log_probs: log-probs whose finiteness is required.   (B, T) each

    Returns:
        The remaining tokens.   (B, T) bool
    """
    finite = torch.ones_like(mask, dtype=torch.bool)  # (B, T)
    for lp in log_probs:
        finite = finite & torch.isfinite(lp)  # (B, T)
    return rows_without(mask, ~finite)  # (B, T)


def rollout_usable_mask(rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                        rollout_seen: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens that stay in the loss whatever pi_train is: the response mask minus every sample whose pi_rollout is
    non-finite on one of its tokens (such a sample is rejected; a sample without pi_rollout stays).

    Args:
        rollout_log_prob: log pi_rollout.   (B, T)
        response_mask: the completion tokens, any dtype.   (B, T)
        rollout_seen: the samples whose pi_rollout is known; ``None``: all.   (B,) bool

    Returns:
        The usable tokens.   (B, T) bool
    """
    usable = finite_rows_mask(response_mask, rollout_log_prob)  # (B, T)
    if rollout_seen is not None:  # a sample without pi_rollout stays
        usable = usable | (response_mask.bool() & ~rollout_seen.bool().unsqueeze(1))  # (B, T)
    return usable  # (B, T)


def compute_rollout_correction_stats(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    params: CorrectionParams | None = None,
    *,
    reduce_fn: ReduceFn | None = None,
    rollout_seen: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    **fields: Any,
) -> RolloutCorrection:
    """Host-sync-free form of :func:`compute_rollout_correction_and_rejection_mask`.

    The correction is ``params`` (``config.params()`` of a :class:`~trl_rollout_corr.RolloutCorrectionConfig`), or
    its fields given as keywords (``rollout_is="token", rollout_is_threshold=2.0, ...``), not both.

    log rho_t = log pi_train(a_t) - log pi_rollout(a_t), pi_train = ``old_log_prob`` (pi_old in decoupled
    mode, pi_theta detached in bypass mode). Tokens whose log-probs are NaN/+-inf on a valid position make
    their whole sequence invalid: it is rejected and counted in ``invalid_logprob_fraction``.
    ``reduce_fn`` makes batch normalization use the global batch across processes.
    ``rollout_rs_criteria`` (divergence criteria, see :mod:`.divergence`) are ANDed with ``rollout_rs`` and the veto.
    ``rollout_seen`` (B,) marks the samples whose pi_rollout is known; the others (a sampler whose distribution
    could not be seen) stay uncorrected: weight 1, nothing rejected, left out of every statistic, and counted in
    ``missing_rollout_logprobs_fraction``.
    ``rollout_is_bound="mask"`` sets a weight outside [C_lower, C] to 0 instead of clipping it (TRL's ``*_mask``
    modes): the token stays in the mask (and in a loss's token count); counted in ``rollout_is_masked_fraction``.
    ``rollout_m2_threshold`` (tau) masks the tokens with the largest (log rho)^2 until the batch's mean of the rest
    is <= tau (:mod:`.second_moment`; global across processes with ``reduce_fn``); with ``rollout_m2_scope=
    "trust_region"`` (M2PO's final algorithm, arXiv:2510.01161) only the tokens on the active side of PPO's trust
    region (A_t > 0 and rho_t > 1, or A_t < 0 and rho_t < 1; ``advantages`` (B,) or (B, T) required) are candidates,
    and the masked ones come back as 0 in ``advantage_mask`` instead of leaving the mask (they stay in the loss's
    token count).
    ``advantages`` (B,) or (B, T), TRL's A before any correction, also gives ``grad_share_pinned`` and
    ``grad_share_masked``: the share of sum |A_t| over the trained tokens carried by tokens whose IS weight was clipped
    to a bound, and by tokens whose gradient the correction removed (:mod:`.impact`). The mismatch per completion
    length and the per-sequence T*KL are always computed (:func:`.impact.length_stats`).

    Args:
        old_log_prob: (B, T) log pi_train(a_t).
        rollout_log_prob: (B, T) log pi_rollout(a_t).
        response_mask: (B, T) 0/1 the completion tokens.
        params: the correction (``config.params()``), or ``None`` with the fields as keywords.
        reduce_fn: the all-reduce across processes for the batch-scope statistics (``None``: this process).
        rollout_seen: (B,) bool, the samples whose pi_rollout is known; ``None``: all.
        advantages: (B,) or (B, T) TRL's A, for the criteria that read it and the gradient share.
        **fields: the correction's fields, where ``params`` is ``None``.

    Returns:
        :class:`RolloutCorrection`: ``is_weights`` (B, T) or ``None``, ``modified_response_mask`` (B, T),
        ``stats`` (device scalars), ``advantage_mask`` (B, T) or ``None``.
    """
    p = _params(params, fields)
    for criterion in CRITERIA:
        criterion.check_call(p, advantages)
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(
            "old_log_prob, rollout_log_prob and response_mask must have the same (B, T) shape, got "
            f"{tuple(old_log_prob.shape)}, {tuple(rollout_log_prob.shape)} and {tuple(response_mask.shape)}."
        )
    input_mask = response_mask.bool()  # (B, T)
    with torch.no_grad():
        seen = input_mask.new_ones(input_mask.shape[0]) if rollout_seen is None else rollout_seen.bool()  # (B,)
        corrected = input_mask & seen.unsqueeze(1)  # (B, T)
        uncorrected = input_mask & ~seen.unsqueeze(1)  # (B, T) no pi_rollout: left as the sampler gave it
        train = old_log_prob.detach().float()  # (B, T)
        rollout = rollout_log_prob.detach().float()  # (B, T)
        finite = torch.isfinite(train) & torch.isfinite(rollout)  # (B, T)
        invalid_tok = corrected & ~finite  # (B, T)
        valid = rows_without(corrected, ~finite)  # (B, T) invalid sequences leave the batch (isfinite once)
        train = torch.where(finite, train, torch.zeros_like(train))  # (B, T)
        rollout = torch.where(finite, rollout, torch.zeros_like(rollout))  # (B, T)
        stats = offpolicy_stats(train, rollout, valid)
        state = CorrectionState(train_log_prob=train, rollout_log_prob=rollout, valid=valid, stats=stats,
                                mask_dtype=response_mask.dtype, reduce_fn=reduce_fn, advantages=advantages)
        stats.update(length_stats(state.log_ratio, valid))
        for criterion in CRITERIA:  # each reads the state and combines its result into it (reject, zero, weight)
            criterion.apply(p, state)
        keep = state.keep | uncorrected  # (B, T)
        stats.sums.update({
            INPUT_TOK_N: count(input_mask),
            INVALID_TOK_N: count(invalid_tok),
            TOK_N: count(valid),
            SEQ_N: count_rows(valid),
            ALL_SEQ_N: count_rows(input_mask),
            MISSING_SEQ_N: count_rows(uncorrected),
            KEPT_TOK_N: count(keep),
        })
        advantage_mask = state.advantage_mask  # (B, T) or None
        if advantages is not None:  # "does it hurt?": the share of |A| the correction pinned or dropped
            dropped = ~keep | state.weight_zeroed  # (B, T)
            if advantage_mask is not None:
                dropped = dropped | ~advantage_mask.bool()  # (B, T) the zeroed advantages
            stats.update(gradient_share_stats(advantages, input_mask, state.pinned & ~dropped, dropped))
        is_weights = state.is_weights  # (B, T) or None
        if is_weights is not None:
            is_weights = torch.where(uncorrected, torch.ones_like(is_weights), is_weights * valid)  # (B, T)
        modified = keep.to(response_mask.dtype)  # (B, T)
    return RolloutCorrection(is_weights, modified, stats, advantage_mask)


def _params(params: CorrectionParams | None, fields: dict[str, Any]) -> CorrectionParams:
    """``params``, or the correction spelled as keyword fields (one of the two)."""
    if params is None:
        return CorrectionParams(**fields)
    if not isinstance(params, CorrectionParams):
        raise TypeError(f"params must be a CorrectionParams (RolloutCorrectionConfig.params()), got "
                        f"{type(params).__name__}; or give the correction's fields as keywords (rollout_is='token', "
                        "...).")
    if fields:
        raise TypeError(f"compute_rollout_correction_stats got params and the fields {sorted(fields)}: pass one of "
                        "the two (dataclasses.replace(params, ...) changes a field).")
    return params


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_seen: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    **fields: Any,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """IS weights, rejection/veto mask and metrics in one call (verl's helper of the same name, called as verl calls
    it: the three tensors, then the correction's fields as keyword arguments).

    The fields are every criterion's (``core/criteria.py``, ``CorrectionParams``; its signature lists them, derived
    from the list, with the core's defaults: no IS unless ``rollout_is`` is given), e.g.

    * IS (``rollout_is`` token|sequence): w = min(exp(clamp(log rho, -20, 20)), C) * m (``rollout_is_bound``
      "truncate", with ``rollout_is_threshold_lower`` also clipped from below) or rho * 1[C_lower <= rho <= C] * m
      ("mask"), optionally divided by its batch mean; detached.
    * RS (``rollout_rs`` token|sequence|geometric): keep iff C_lower <= statistic <= C_upper.
    * veto: drop a sequence if any valid token has rho_t < C_veto (unclamped, log space).
    * second-moment mask (``rollout_m2_threshold`` tau): mask the largest (log rho_t)^2 until their mean is <= tau;
      ``rollout_m2_scope="trust_region"`` (M2PO's final algorithm, arXiv:2510.01161; needs ``advantages``) only on
      the trust region's active side.

    A token whose advantage a criterion zeroes (``RolloutCorrection.advantage_mask``) comes back as weight 0 in
    ``is_weights`` (all ones where ``rollout_is`` is None), not removed from the mask.

    Args:
        old_log_prob: (B, T) log pi_train(a_t) (pi_old in decoupled mode, pi_theta in bypass mode).
        rollout_log_prob: (B, T) log pi_rollout(a_t).
        response_mask: (B, T) 0/1 the completion tokens.
        rollout_seen: (B,) bool, the samples whose pi_rollout is known (the others stay uncorrected: weight 1,
            kept, out of the statistics); ``None``: all.
        advantages: (B,) or (B, T) TRL's A, for the criteria that read it.
        **fields: the correction's fields (keyword arguments only).

    Returns:
        is_weights: (B, T) or ``None``.
        modified_response_mask: (B, T) in ``response_mask``'s dtype.
        metrics: ``rollout_corr/<name>`` -> float. For training loops use :func:`compute_rollout_correction_stats`,
        which stays on device.

    Raises:
        TypeError: a keyword that is no correction field.
        ValueError: ``rollout_rs`` without ``rollout_rs_threshold``, or an invalid call of a criterion.
    """
    unknown = sorted(set(fields) - set(CorrectionParams.__dataclass_fields__))
    if unknown:
        raise TypeError(f"compute_rollout_correction_and_rejection_mask got {unknown}, which are no correction "
                        f"fields; the fields (keyword arguments): {', '.join(CorrectionParams.__dataclass_fields__)}.")
    if fields.get("rollout_rs") is not None and fields.get("rollout_rs_threshold") is None:
        raise ValueError("rollout_rs_threshold is required when rollout_rs is set (e.g. 2.0 for token/sequence, "
                         "1.001 for geometric).")
    result = compute_rollout_correction_stats(old_log_prob, rollout_log_prob, response_mask, CorrectionParams(**fields),
                                              rollout_seen=rollout_seen, advantages=advantages)
    weights = result.is_weights  # (B, T) or None
    if result.advantage_mask is not None:  # the trust-region zeros, as a weight (the token stays in the mask)
        mask = result.advantage_mask.to(torch.float32)  # (B, T)
        weights = mask * response_mask.to(mask.dtype) if weights is None else weights * mask.to(weights.dtype)
    return weights, result.modified_response_mask, finalize_stats(result.stats)


def _verl_signature() -> inspect.Signature:
    """The entry point's signature with the correction's fields spelled out (from ``CorrectionParams``, so from
    ``CRITERIA``), keyword-only, with the core's defaults: what ``help()`` and ``inspect.signature`` show."""
    own = inspect.signature(compute_rollout_correction_and_rejection_mask, eval_str=False)
    kept = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
              for f in dataclasses.fields(CorrectionParams)]
    return own.replace(parameters=kept + params)


compute_rollout_correction_and_rejection_mask.__signature__ = _verl_signature()
