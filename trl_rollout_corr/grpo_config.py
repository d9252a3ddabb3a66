"""RolloutCorrGRPOConfig: TRL's ``GRPOConfig`` plus the rollout-correction fields, flat and CLI/YAML-parsable."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from ._trl import kept_token_normalizer_losses
from .config import RolloutCorrectionConfig
from .correction_fields import RolloutCorrectionFields
from .plan import PI_OLD_SOURCES, CorrectionPlan, check_composition, plan_correction

# TRL fields the correction plan depends on: a change re-checks the composition and the plan
_PLAN_INPUTS = ("loss_type", "importance_sampling_level", "pi_old_source", "gradient_accumulation_steps",
                "steps_per_generation", "num_iterations")
# TRL's own vLLM IS correction: each field and what this package spells it as
_TRL_IS_FIELDS = {
    "vllm_importance_sampling_mode": "rollout_is='token'|'sequence' (truncate) or rollout_rs='token'|'sequence' (mask), "
                                     "or a preset such as rollout_correction_preset='decoupled_token_is'",
    "vllm_importance_sampling_clip_max": "rollout_is_threshold (truncation C) or rollout_rs_threshold (mask bound)",
    "vllm_importance_sampling_clip_min": "rollout_rs_threshold_lower (lower mask bound)",
    "vllm_importance_sampling_cap": "rollout_is_threshold (truncation C) or rollout_rs_threshold (mask bound)",
}


@dataclass
class RolloutCorrGRPOConfig(RolloutCorrectionFields, GRPOConfig):
    """``GRPOConfig`` plus the rollout-correction fields (flat, CLI/YAML-parsable).

    Resolution order: ``rollout_correction_config`` (a saved config: directory, file or Hub repo id), else
    ``rollout_correction_preset``, else the ``RolloutCorrectionConfig`` defaults; then every correction field
    set here (not ``None``) overrides it. Use the string ``"none"`` to switch ``rollout_is``/``rollout_rs`` off
    explicitly. The resolved config is ``args.rollout_correction``; where pi_old comes from and where the correction
    is computed is ``args.correction_plan()`` (see :mod:`trl_rollout_corr.plan`). Every combination that the
    correction cannot compute exactly fails here, naming the field.
    """

    pi_old_source: str = field(default="auto", metadata={
        "help": "Where decoupled mode's pi_old comes from: auto (a no-grad forward per generation batch only when "
                "pi_theta moves within it or a generation-batch statistic needs one), forward (always that forward) "
                "or free (never: pi_theta detached; an error where that would change the result)."})
    truncated_support_correction: bool | None = field(default=None, metadata={
        "help": "Apply top-k/top-p/min-p to the training logits before the ratio with pi_rollout (default: on when "
                "any of them is set)."})
    vllm_importance_sampling_correction: bool = field(
        default=False, metadata={"help": "TRL's own vLLM IS correction; must stay False (this package corrects)."})
    # TRL's own correction's settings: unset here (an error when set: they would be ignored)
    vllm_importance_sampling_mode: str | None = field(default=None, metadata={
        "help": "TRL's own vLLM IS mode: not used here (an error when set); use rollout_is / rollout_rs."})
    vllm_importance_sampling_clip_max: float | None = field(default=None, metadata={
        "help": "TRL's own vLLM IS bound: not used here (an error when set); use rollout_is_threshold / "
                "rollout_rs_threshold."})
    vllm_dtype: str | None = field(default=None, metadata={
        "help": "dtype of the colocated vLLM engine (float32 | bfloat16 | float16 | auto). Default: TRL's behaviour "
                "(vLLM's 'auto', which runs a float32 checkpoint in bfloat16)."})
    vllm_sync_interval: int = field(default=1, metadata={
        "help": "Sync the vLLM engine's weights every k optimizer steps (k > 1: a stale engine, k-1 steps behind at "
                "most, as an asynchronous engine; fewer syncs)."})
    vllm_server_control_token_file: str | None = field(default=None, metadata={
        "help": "Server mode: a file holding the server's control token (`trl-rollout-corr vllm-serve` writes one per "
                "port under ~/.cache/trl_rollout_corr, which a trainer on the same machine finds by itself; "
                "TRL_ROLLOUT_CORR_CONTROL_TOKEN also works). The token itself never goes into the config."})
    vllm_weight_sync_dir: str | None = field(default=None, metadata={
        "help": "Server mode on CPU: directory for the weight file handed to the server (default /dev/shm); the "
                "server must see the same path."})

    _RC_TRL_CONFIG = GRPOConfig
    _RC_PLAN_INPUTS = _PLAN_INPUTS

    def __post_init__(self) -> None:
        if self.vllm_importance_sampling_correction:
            raise ValueError(
                "vllm_importance_sampling_correction=True would correct the same mismatch twice (TRL's own IS and this "
                "package's). Leave it False and pick a rollout correction preset or the rollout_* fields instead.")
        for name, equivalent in _TRL_IS_FIELDS.items():
            if getattr(self, name) is not None:
                raise ValueError(f"{name}={getattr(self, name)!r} is TRL's own vLLM correction, which this trainer "
                                 f"replaces (it would be ignored). Unset it and use {equivalent}.")
        self._rc_begin_post_init()
        super().__post_init__()
        self._rc_end_post_init()

    def _check_own_fields(self) -> None:
        if self.vllm_dtype not in (None, "auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"vllm_dtype={self.vllm_dtype!r} is not supported; use float32, bfloat16, float16, auto "
                             "or leave it unset (TRL's behaviour).")
        if not isinstance(self.vllm_sync_interval, int) or self.vllm_sync_interval < 1:
            raise ValueError(f"vllm_sync_interval={self.vllm_sync_interval!r} must be an integer >= 1 (1 = sync the "
                             "vLLM engine every optimizer step).")
        if self.vllm_sync_interval > 1 and self.vllm_enable_sleep_mode:
            raise ValueError("vllm_sync_interval > 1 with vllm_enable_sleep_mode=True: sleep mode discards the engine's "
                             "weights and TRL re-pushes the current ones on wake-up, so the engine cannot stay stale. "
                             "Use one of the two.")
        if self.pi_old_source not in PI_OLD_SOURCES:
            raise ValueError(f"pi_old_source={self.pi_old_source!r}: use one of {', '.join(PI_OLD_SOURCES)}.")

    def _check_resolved(self, resolved: RolloutCorrectionConfig) -> None:
        check_composition(resolved, self.loss_type, self.importance_sampling_level)
        plan_correction(resolved, pi_old_source=self.pi_old_source, loss_type=self.loss_type,
                        gradient_accumulation_steps=self.gradient_accumulation_steps,
                        steps_per_generation=self.steps_per_generation, num_iterations=self.num_iterations,
                        kept_token_normalizer_losses=kept_token_normalizer_losses())  # raises where it is not exact

    def _refuse_change(self, name: str, value: Any) -> None:
        if (name in _TRL_IS_FIELDS and value is not None) or (name == "vllm_importance_sampling_correction" and value):
            raise ValueError(f"{name}={value!r}: TRL's own vLLM correction is replaced by this package's (it would be "
                             f"ignored or correct twice). Use {_TRL_IS_FIELDS.get(name, 'a rollout correction preset')}.")

    def correction_plan(self) -> CorrectionPlan:
        """Where pi_old comes from and where the correction is computed, for the current field values."""
        return plan_correction(
            self.rollout_correction, pi_old_source=self.pi_old_source, loss_type=self.loss_type,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            steps_per_generation=self.steps_per_generation, num_iterations=self.num_iterations,
            kept_token_normalizer_losses=kept_token_normalizer_losses())
