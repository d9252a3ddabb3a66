"""TRL's and verl's names for the correction, accepted as they mean there and translated to this package's fields.

**TRL 1.16's own vLLM correction** (``vllm_importance_sampling_*``)

TRL's ``GRPOTrainer`` (``vllm_importance_sampling_*``, read in ``_generate_and_score_completions``) computes, with
pi_old from a no-grad forward and pi_rollout from vLLM, d_t = m_t (log pi_old - log pi_rollout) and

* ``token_*``:    rho_t = exp(d_t);           ``sequence_*``: rho = exp(sum_t d_t), one per sequence;
* ``*_truncate``: w = clamp(rho, C_min, C_max); ``*_mask``: w = rho * 1[C_min <= rho <= C_max];

and multiplies each token's policy loss by w (not the KL term), leaving every token in the loss's token count. Here
that is decoupled mode with ``rollout_is`` = the level, ``rollout_is_bound`` = truncate | mask,
``rollout_is_threshold`` = C_max and ``rollout_is_threshold_lower`` = C_min; pi_old = pi_theta before the step,
from a forward where pi_theta moves within the generation batch (:mod:`trl_rollout_corr.config.plan`), as TRL's.

One difference, deliberate: TRL gives a token whose pi_rollout is NaN the weight 1 (``nan_to_num``); here a sample
with a non-finite log-prob leaves the loss and is counted in ``invalid_logprob_fraction``.

**verl's rollout-correction names**

Checked against volcengine/verl at commit ``b178a3c`` (b178a3cd56f58b2d502255daba591e92833930a7, 2026-01-29),
and for the IcePop additions against verl-project/verl at commit ``1dda039`` (2026-08-22; IcePop landed in PR #5722):
the preset factories of
``verl/trainer/config/algorithm.py:RolloutCorrectionConfig``, the ``rollout_rs`` options of
``verl/trainer/ppo/rollout_corr_helper.py:compute_rollout_rejection_mask`` and its ``rollout_is_threshold`` parser
(``_parse_rollout_is_threshold``).

* **Presets**: :data:`VERL_PRESETS` maps each verl factory name to the fields it sets (verl spelling: a criterion
  string in ``rollout_rs`` with its ``rollout_rs_threshold``, and ``loss_type`` as ``use_policy_gradient``).
  Names shared with this package (``decoupled_token_is``, ``decoupled_seq_is``, ``decoupled_seq_is_rs``,
  ``decoupled_geo_rs``, ``disabled``) keep this package's meaning; they agree with verl's except
  ``decoupled_geo_rs``, which here also vetoes (``rollout_token_veto_threshold=1e-4``; for verl's, switch it off:
  ``None`` in :class:`RolloutCorrectionConfig`, ``"none"`` from the trainer config, a YAML recipe or the CLI).
* **``rollout_rs`` criteria strings** (``"token_k1"``, ``"seq_mean_k3,seq_max_k2"``, ...): translated into this
  package's ``rollout_rs_criteria`` / ``rollout_rs_criteria_threshold`` by :func:`translate_rollout_rs`. verl
  compares k1 = -log r with ``log(lower)`` and ``log(upper)`` (rollout_corr_helper.py, lines 271-308), i.e. its
  ``"lower_upper"`` band bounds pi_rollout / pi_train; this package's k1 band bounds r = pi_train / pi_rollout, so a
  verl band ``"a_b"`` becomes ``"1/b_1/a"`` (the same for the symmetric bands verl's presets use). A single
  threshold is broadcast to every criterion, as verl does.
* **IcePop** (verl's ``decoupled_token_icepop`` / ``bypass_pg_token_icepop``, this package's ``icepop``): the
  token IS weight is rho_t * 1[C_lower <= rho_t <= C], zero outside the band, and the token stays in the loss's
  token count (``response_mask`` is not modified): ``rollout_is="token"``, ``rollout_is_bound="mask"``,
  C_lower = 0.5, C = 5 (:data:`ICEPOP`). Ling Team, "Every Step Evolves" (Ring-1T, arXiv:2510.18855).
* **``"lower_upper"`` IS thresholds**: verl's ``rollout_is_threshold="0.5_5.0"`` means IcePop with those bounds;
  :func:`parse_is_threshold` reads it as ``rollout_is_threshold=5.0``, ``rollout_is_threshold_lower=0.5``,
  ``rollout_is_bound="mask"``. A number, or a string holding one (``"2.0"``), stays TIS (truncation).
"""

from __future__ import annotations

import warnings
from typing import Any

# ------------------------------------------------------------------ TRL
TRL_MODES = {  # TRL's vllm_importance_sampling_mode: (rollout_is, rollout_is_bound)
    "token_truncate": ("token", "truncate"),
    "token_mask": ("token", "mask"),
    "sequence_truncate": ("sequence", "truncate"),
    "sequence_mask": ("sequence", "mask"),
}
TRL_DEFAULT_MODE = "sequence_mask"  # TRL 1.16's defaults: correction on, sequence_mask, clip_max 3, clip_min None
TRL_DEFAULT_CLIP_MAX = 3.0
TRL_DEFAULT: dict[str, Any] = dict(rollout_is="sequence", rollout_is_bound="mask",
                                   rollout_is_threshold=TRL_DEFAULT_CLIP_MAX)
# the default where TRL's own (sequence_mask) cannot apply: loss_type="vespo", for which TRL accepts only its token
# modes (RolloutCorrGRPOConfig._default_correction; every other loss gets TRL's default)
DEFAULT_TOKEN_MODE = "token_truncate"
TRL_IS_FIELDS = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                 "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
                 "vllm_importance_sampling_cap")


def translate_trl_correction(correction: bool | None = None, mode: str | None = None, clip_max: float | None = None,
                             clip_min: float | None = None, cap: float | None = None) -> dict[str, Any]:
    """This package's correction fields for TRL's ``vllm_importance_sampling_*`` values (``None``: TRL's default).

    ``correction=False`` is no correction (the ``disabled`` preset). TRL's ``clip_max=None`` (no upper bound) is
    spelled ``inf`` here, since ``None`` means "TRL's default, 3.0". ``cap`` is TRL's deprecated ``clip_max``.
    """
    if correction is not None and not isinstance(correction, bool):
        raise ValueError(f"vllm_importance_sampling_correction must be True or False, got {correction!r}.")
    if cap is not None:
        warnings.warn("vllm_importance_sampling_cap is deprecated in TRL (removed in v2.0.0): use "
                      "vllm_importance_sampling_clip_max.", FutureWarning, stacklevel=3)
        if clip_max is not None and clip_max != cap:
            raise ValueError(f"vllm_importance_sampling_cap={cap!r} and vllm_importance_sampling_clip_max="
                             f"{clip_max!r}: cap is the deprecated name of clip_max; set clip_max only.")
        clip_max = cap
    if correction is False:
        return dict(rollout_is=None)
    mode = TRL_DEFAULT_MODE if mode is None else mode
    if mode not in TRL_MODES:
        raise ValueError(f"vllm_importance_sampling_mode={mode!r}: TRL's modes are {', '.join(TRL_MODES)}.")
    clip_max = TRL_DEFAULT_CLIP_MAX if clip_max is None else clip_max
    if clip_min is not None and clip_min >= clip_max:
        raise ValueError(f"vllm_importance_sampling_clip_min ({clip_min}) must be less than "
                         f"vllm_importance_sampling_clip_max ({clip_max}), as in TRL.")
    level, bound = TRL_MODES[mode]
    return dict(rollout_is=level, rollout_is_bound=bound, rollout_is_threshold=float(clip_max),
                rollout_is_threshold_lower=None if clip_min is None else float(clip_min))


# ------------------------------------------------------------------ verl
_GEO = "0.999_1.001"  # verl's default geometric band
_K3 = 0.01  # verl's default k3 bound

ICEPOP: dict[str, Any] = dict(rollout_is="token", rollout_is_bound="mask", rollout_is_threshold=5.0,
                              rollout_is_threshold_lower=0.5)
"""IcePop as verl (``decoupled_token_icepop``, PR #5722) defines it: w_t = rho_t * 1[0.5 <= rho_t <= 5], the token
kept in the loss's count."""

VERL_PRESETS: dict[str, dict[str, Any]] = {
    "bypass_ppo_clip": dict(rollout_is=None, bypass_mode=True),
    "bypass_ppo_clip_geo_rs": dict(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=_GEO,
                                   bypass_mode=True),
    "bypass_ppo_clip_k3_rs": dict(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=_K3,
                                  bypass_mode=True),
    "bypass_pg_is": dict(rollout_is="sequence", rollout_is_threshold=2.0, bypass_mode=True, use_policy_gradient=True),
    "bypass_pg_geo_rs": dict(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=_GEO, bypass_mode=True,
                             use_policy_gradient=True),
    "bypass_pg_geo_rs_seq_tis": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
                                     rollout_rs_threshold=_GEO, bypass_mode=True, use_policy_gradient=True),
    "bypass_pg_geo_rs_token_tis": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
                                       rollout_rs_threshold=_GEO, bypass_mode=True, use_policy_gradient=True),
    "decoupled_geo_rs_seq_tis": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
                                     rollout_rs_threshold=_GEO),
    "decoupled_geo_rs_token_tis": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
                                       rollout_rs_threshold=_GEO),
    "decoupled_k3_rs": dict(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=_K3),
    "decoupled_k3_rs_seq_tis": dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3",
                                    rollout_rs_threshold=_K3),
    "decoupled_k3_rs_token_tis": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3",
                                      rollout_rs_threshold=_K3),
    # verl-project/verl 1dda039 (PR #5722): exact token IcePop, response_mask unchanged
    "decoupled_token_icepop": dict(ICEPOP),
    "bypass_pg_token_icepop": dict(ICEPOP, bypass_mode=True, use_policy_gradient=True),
}
# verl's factory arguments, as this package's fields (rs_threshold keeps verl's meaning: it is translated)
VERL_ARGUMENTS = {"threshold": "rollout_is_threshold", "is_threshold": "rollout_is_threshold",
                  "threshold_lower": "rollout_is_threshold_lower", "rs_threshold": "rollout_rs_threshold"}


def is_band_string(value: Any) -> bool:
    """Whether ``value`` is verl's ``"lower_upper"`` spelling of an IS threshold (``"0.5_5.0"``)."""
    return isinstance(value, str) and "_" in value.strip()


def parse_is_threshold(value: Any) -> tuple[Any, float | None]:
    """verl's ``rollout_is_threshold`` as ``(upper, lower)``: ``"lower_upper"`` -> ``(upper, lower)`` (IcePop: the
    caller sets ``rollout_is_bound="mask"``); a number or a numeric string -> ``(float, None)``; anything else is
    returned unchanged (the caller's validation names it)."""
    if not isinstance(value, str):
        return value, None
    spec = value.strip()
    try:
        if "_" not in spec:
            return float(spec), None
        lower, upper = (float(x) for x in spec.split("_", 1))
    except ValueError:
        raise ValueError(f"rollout_is_threshold={value!r}: use a number (TIS upper bound C, e.g. 2.0) or verl's "
                         "'lower_upper' IcePop band (e.g. '0.5_5.0').") from None
    return upper, lower


def is_criteria_string(value: Any) -> bool:
    """Whether ``value`` is a verl ``rollout_rs`` criteria string (``"token_k1"``, ``"seq_mean_k3,seq_max_k2"``)."""
    from ..core.divergence import DIVERGENCE_CRITERIA

    if not isinstance(value, str) or not value.strip():
        return False
    return all(part.strip() in DIVERGENCE_CRITERIA for part in value.split(","))


def translate_rollout_rs(rollout_rs: str, threshold: Any) -> tuple[str, str]:
    """verl's ``rollout_rs`` / ``rollout_rs_threshold`` as this package's ``rollout_rs_criteria`` /
    ``rollout_rs_criteria_threshold`` (k1 bands flipped from pi_rollout/pi_train to pi_train/pi_rollout)."""
    names = [part.strip() for part in rollout_rs.split(",")]
    if threshold is None:
        raise ValueError(f"rollout_rs={rollout_rs!r} needs rollout_rs_threshold (verl's spelling: 'lower_upper' for k1 "
                         "criteria, an upper bound for k2/k3, one per criterion or one for all).")
    specs = [s.strip() for s in str(threshold).split(",")] if isinstance(threshold, str) else [str(threshold)]
    if len(specs) == 1:
        specs = specs * len(names)
    if len(specs) != len(names):
        raise ValueError(f"rollout_rs={rollout_rs!r} has {len(names)} criteria but rollout_rs_threshold={threshold!r} "
                         f"{len(specs)} values: give one per criterion or one for all.")
    ours = []
    for name, spec in zip(names, specs):
        if name.endswith("k1") and "_" in spec:
            try:
                lower, upper = (float(x) for x in spec.split("_", 1))
            except ValueError:
                raise ValueError(f"rollout_rs_threshold {spec!r} for {name} is not 'lower_upper'.") from None
            if not (0 < lower <= upper):
                raise ValueError(f"rollout_rs_threshold {spec!r} for {name}: need 0 < lower <= upper.")
            ours.append(f"{1.0 / upper!r}_{1.0 / lower!r}")
        else:
            ours.append(spec)
    return ",".join(names), ",".join(ours)
