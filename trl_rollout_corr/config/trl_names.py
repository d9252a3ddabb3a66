"""TRL's own vLLM correction, accepted as it means in TRL 1.16 and translated to this package's fields.

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
"""

from __future__ import annotations

import warnings
from typing import Any

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
