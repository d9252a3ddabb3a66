"""Rejection sampling (token / sequence / geometric) and the catastrophic-token veto.

Both only modify the response mask; neither touches the IS weights. rho_t = pi_train / pi_rollout.

References:
    * Liu, Li, Fu, Wang, Liu & Shen, "When Speed Kills Stability: Demystifying RL Collapse from the
      Training-Inference Mismatch", blog, September 2025
      (https://yingru.notion.site/When-Speed-Kills-Stability-271211a558b7808d8b12d403fd15edda): sequence-level
      masking / rejection and the geometric-mean ratio (Geo-RS). No arXiv id.
    * verl's rollout correction (volcengine/verl ``docs/algo/rollout_corr.md``, ``docs/algo/rollout_corr_math.md``,
      ``verl/trainer/ppo/rollout_corr_helper.py``): the ``rollout_rs`` levels, their bands and the veto.
    * Zheng et al., "Group Sequence Policy Optimization", arXiv:2507.18071: the same geometric mean of rho_t as
      GSPO's length-normalized sequence ratio (GSPO clips it; here it decides rejection).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .criterion import (SEQ_N, TOK_N, CorrectionField, CorrectionState, Criterion, StatFloats, require_positive,
                        stat_key)
from .family import declare_family, family_metrics, finalize_family, weight_family_stats
from .stats import METRIC_PREFIX as PREFIX
from .stats import count, count_rows, safe_div
from .weights import SAFETY_BOUND, sequence_log_ratio

RS_LEVELS = ("token", "sequence", "geometric")


def rejection_bounds(upper: float, lower: float | None) -> tuple[float, float]:
    """The RS acceptance band.

    Args:
        upper: C_upper (``rollout_rs_threshold``).
        lower: C_lower (``rollout_rs_threshold_lower``), or ``None`` for 1 / C_upper.

    Returns:
        lower: C_lower.
        upper: C_upper.
    """
    return (1.0 / upper if lower is None else lower), upper


def rejection_log_statistic(log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str) -> torch.Tensor:
    """Unclamped log of the RS statistic.

        token:     log rho_t
        sequence:  sum_t m_t log rho_t                 (log of prod_t rho_t)
        geometric: (1/|T|) sum_t m_t log rho_t         (log of the geometric mean of rho_t)

    Args:
        log_ratio: log rho_t, (B, T).
        response_mask: m_t, (B, T) bool.
        level: ``"token"``, ``"sequence"`` or ``"geometric"``.

    Returns:
        (B, T) values, per token or each sequence's value broadcast over its row.

    Raises:
        ValueError: ``level`` is not one of ``RS_LEVELS``.
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

    statistic = exp(clamp(log_stat, -20, 20)) with log_stat from ``rejection_log_statistic``. Token level
    rejects single tokens; sequence and geometric levels reject whole sequences (Liu, Li et al., "When Speed Kills
    Stability", 2025; verl's ``rollout_rs``).

    Args:
        log_ratio: log rho_t = log pi_train - log pi_rollout, (B, T); detached here.
        response_mask: m_t, (B, T); any dtype, read as bool.
        rollout_rs: ``"token"``, ``"sequence"`` or ``"geometric"``.
        rollout_rs_threshold: C_upper.
        rollout_rs_threshold_lower: C_lower, or ``None`` for 1 / C_upper.

    Returns:
        keep: the keep-mask, (B, T) bool, False on padding.
        safe_stat: the safety-bounded statistic, (B, T).
        log_stat: the unclamped log statistic, (B, T).

    Raises:
        ValueError: ``rollout_rs`` is not one of ``RS_LEVELS``.
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

    Compared in log space on the **unclamped** ratio: log rho_t < log C_veto (verl's
    ``rollout_token_veto_threshold``).

    Args:
        log_ratio: log rho_t, (B, T); detached here.
        response_mask: m_t, (B, T); any dtype, read as bool.
        rollout_token_veto_threshold: C_veto (> 0), typically 1e-4 .. 1e-6.

    Returns:
        keep: the keep-mask, (B, T) bool; False on every token of a vetoed sequence and on padding.
        catastrophic: the valid tokens with rho_t < C_veto, (B, T) bool.
    """
    response_mask = response_mask.bool()
    with torch.no_grad():
        catastrophic = (log_ratio.detach() < math.log(rollout_token_veto_threshold)) & response_mask  # (B, T)
        vetoed = catastrophic.any(1, keepdim=True)  # (B, 1)
        keep = response_mask & ~vetoed  # (B, T)
    return keep, catastrophic


# ---------------------------------------------------------------------------------------------------- the criteria
RS_REJECTED_TOK_N = stat_key("mask.rs_rejected_tok_n", __name__)
"""Valid tokens rejection sampling rejected."""
RS_REJECTED_SEQ_N = stat_key("mask.rs_rejected_seq_n", __name__)
declare_family("rollout_rs", __name__)  # the statistic family's statistics rollout_rs.<name>
RS_MASK_METRICS = ("rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction")
CATASTROPHIC_TOK_N = stat_key("mask.catastrophic_tok_n", __name__)
"""Valid tokens with rho_t < C_veto."""
VETOED_SEQ_N = stat_key("mask.vetoed_seq_n", __name__)
VETO_METRICS = ("rollout_is_veto_fraction", "rollout_is_catastrophic_token_fraction")


class RejectionSampling(Criterion):
    """Rejection sampling (Liu, Li et al., "When Speed Kills Stability", 2025; verl's ``rollout_rs``): keep iff
    C_lower <= statistic <= C_upper, the statistic rho_t (token), prod_t rho_t (sequence) or its geometric mean
    (geometric; GSPO's length-normalized ratio, arXiv:2507.18071). A rejected token leaves the loss and its count.

    Attributes:
        fields: ``rollout_rs`` (level), ``rollout_rs_threshold`` (C_upper), ``rollout_rs_threshold_lower``
            (C_lower, default 1 / C_upper).
        metrics: the ``rollout_rs_*`` statistic family and ``rollout_rs_masked_fraction`` /
            ``rollout_rs_seq_masked_fraction``.
    """

    name = "rejection"
    fields = (
        CorrectionField("rollout_rs", "str | None", None, "RS level: token | sequence | geometric | none.",
                        "str | None"),
        CorrectionField("rollout_rs_threshold", "float | None", None, "RS upper bound.", "float | str | None"),
        CorrectionField("rollout_rs_threshold_lower", "float | None", None,
                        "RS lower bound ('none': 1/upper, also where a preset sets one).", "float | str | None"),
    )
    metrics = (*family_metrics("rollout_rs"), *RS_MASK_METRICS)
    switches = {"rollout_rs": ("rollout_rs_threshold", "rollout_rs_threshold_lower")}

    def check(self, cfg: Any) -> None:
        """The level is token | sequence | geometric | None; a level needs its upper bound C_upper > 0, and
        0 < C_lower <= C_upper where a lower bound is given; no bound without a level.

        Args:
            cfg: the ``RolloutCorrectionConfig`` being validated.

        Raises:
            ValueError: naming the field and the fix.
        """
        if cfg.rollout_rs is not None and cfg.rollout_rs not in RS_LEVELS:
            raise ValueError(
                f"rollout_rs must be one of 'token', 'sequence', 'geometric' or None, got {cfg.rollout_rs!r}.")
        if cfg.rollout_rs is not None:
            if cfg.rollout_rs_threshold is None:
                raise ValueError(f"rollout_rs={cfg.rollout_rs!r} needs rollout_rs_threshold (the upper bound): "
                                 "set it, e.g. 2.0 for token/sequence or 1.001 for geometric.")
            require_positive("rollout_rs_threshold", cfg.rollout_rs_threshold,
                             "e.g. 2.0 (token/sequence) or 1.001 (geometric)")
            if cfg.rollout_rs_threshold_lower is not None:
                require_positive("rollout_rs_threshold_lower", cfg.rollout_rs_threshold_lower,
                                 "or leave it None for 1/rollout_rs_threshold")
                if cfg.rollout_rs_threshold_lower > cfg.rollout_rs_threshold:
                    raise ValueError(
                        f"rollout_rs_threshold_lower ({cfg.rollout_rs_threshold_lower}) must be <= "
                        f"rollout_rs_threshold ({cfg.rollout_rs_threshold}): swap them or leave the lower bound None.")
        elif cfg.rollout_rs_threshold is not None or cfg.rollout_rs_threshold_lower is not None:
            raise ValueError("rollout_rs_threshold / rollout_rs_threshold_lower are set but rollout_rs is None, so "
                             "they would be ignored: set rollout_rs ('token', 'sequence' or 'geometric') or unset the "
                             "thresholds.")

    def removes_tokens(self, cfg: Any) -> bool:
        """Whether rejection sampling is on (``rollout_rs`` set).

        Args:
            cfg: the validated ``RolloutCorrectionConfig``.

        Returns:
            ``True`` where it can reject tokens.
        """
        return cfg.rollout_rs is not None

    def apply(self, p: Any, state: CorrectionState) -> None:
        """Reject the tokens whose statistic leaves [C_lower, C_upper] (``state.reject``) and add the ``rollout_rs``
        weight family's statistics and the rejected counts.

        Args:
            p: the call's ``CorrectionParams``.
            state: the pipeline's :class:`~.criterion.CorrectionState`.
        """
        if p.rollout_rs is None:
            return
        log_ratio, valid = state.log_ratio, state.valid  # (B, T) each
        lower, upper = rejection_bounds(p.rollout_rs_threshold, p.rollout_rs_threshold_lower)
        rs_keep, safe_stat, log_stat = compute_rollout_rejection_mask(log_ratio, valid, p.rollout_rs, upper,
                                                                      lower)  # (B, T) each
        state.stats.update(weight_family_stats("rollout_rs", safe_stat, log_stat, valid, p.rollout_rs, lower, upper))
        rs_rejected = valid & ~rs_keep  # (B, T)
        state.stats.sums[RS_REJECTED_TOK_N] = count(rs_rejected)
        state.stats.sums[RS_REJECTED_SEQ_N] = count_rows(rs_rejected)
        state.reject(~rs_keep)  # (B, T)

    def finalize(self, f: StatFloats) -> dict[str, float]:
        """The ``rollout_rs_*`` family and the masked fractions (of the valid tokens, of the sequences) where RS ran.

        Args:
            f: the reduced statistics.

        Returns:
            ``{"rollout_corr/rollout_rs_*": float}``.
        """
        metrics = finalize_family("rollout_rs", f)
        if f.has(TOK_N) and f.has(RS_REJECTED_TOK_N):
            metrics[PREFIX + "rollout_rs_masked_fraction"] = safe_div(f.sum(RS_REJECTED_TOK_N, 0.0), f.sum(TOK_N, 0.0))
            metrics[PREFIX + "rollout_rs_seq_masked_fraction"] = safe_div(f.sum(RS_REJECTED_SEQ_N, 0.0),
                                                                          f.sum(SEQ_N, 0.0))
        return metrics


class CatastrophicTokenVeto(Criterion):
    """The catastrophic-token veto (verl's ``rollout_token_veto_threshold``): reject a whole sequence if any valid
    token has rho_t < C_veto (unclamped, in log space).

    Attributes:
        fields: ``rollout_token_veto_threshold`` (C_veto).
        metrics: ``rollout_is_veto_fraction``, ``rollout_is_catastrophic_token_fraction``.
    """

    name = "veto"
    fields = (
        CorrectionField("rollout_token_veto_threshold", "float | None", None,
                        "Veto a sequence if any rho < this ('none' switches a preset's veto off).",
                        "float | str | None"),
    )
    metrics = VETO_METRICS

    def check(self, cfg: Any) -> None:
        """C_veto > 0 where set.

        Args:
            cfg: the ``RolloutCorrectionConfig`` being validated.

        Raises:
            ValueError: naming ``rollout_token_veto_threshold`` and the fix.
        """
        if cfg.rollout_token_veto_threshold is not None:
            require_positive("rollout_token_veto_threshold", cfg.rollout_token_veto_threshold,
                             "typically 1e-4 .. 1e-6, or None")

    def removes_tokens(self, cfg: Any) -> bool:
        """Whether the veto is on (``rollout_token_veto_threshold`` set).

        Args:
            cfg: the validated ``RolloutCorrectionConfig``.

        Returns:
            ``True`` where it can reject sequences.
        """
        return cfg.rollout_token_veto_threshold is not None

    def apply(self, p: Any, state: CorrectionState) -> None:
        """Reject every token of a sequence with a valid rho_t < C_veto (:func:`compute_veto_mask`; ``state.reject``)
        and count the catastrophic tokens and vetoed sequences.

        Args:
            p: the call's ``CorrectionParams``.
            state: the pipeline's :class:`~.criterion.CorrectionState`.
        """
        if p.rollout_token_veto_threshold is None:
            return
        veto_keep, catastrophic = compute_veto_mask(state.log_ratio, state.valid,
                                                    p.rollout_token_veto_threshold)  # (B, T) each
        state.stats.sums[CATASTROPHIC_TOK_N] = count(catastrophic)
        state.stats.sums[VETOED_SEQ_N] = count_rows(catastrophic)
        state.reject(~veto_keep)  # (B, T)

    def finalize(self, f: StatFloats) -> dict[str, float]:
        """``rollout_is_veto_fraction`` (of the sequences) and ``rollout_is_catastrophic_token_fraction`` (of the valid
        tokens); 0.0 where the veto is off.

        Args:
            f: the reduced statistics.

        Returns:
            ``{"rollout_corr/rollout_is_veto_fraction": float, ...}``, or ``{}`` where the pipeline did not run.
        """
        if not f.has(TOK_N):
            return {}
        # without the veto its metrics are 0.0
        return {PREFIX + "rollout_is_veto_fraction": safe_div(f.sum(VETOED_SEQ_N, 0.0), f.sum(SEQ_N, 0.0)),
                PREFIX + "rollout_is_catastrophic_token_fraction": safe_div(f.sum(CATASTROPHIC_TOK_N, 0.0),
                                                                            f.sum(TOK_N, 0.0))}


REJECTION = RejectionSampling()
VETO = CatastrophicTokenVeto()
