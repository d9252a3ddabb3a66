"""RolloutCorrGRPOConfig: TRL's ``GRPOConfig`` plus the rollout-correction fields, flat and CLI/YAML-parsable."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from ..config.correction import RolloutCorrectionConfig
from ..config.fields import RolloutCorrectionFields
from ..config.server_fields import VllmServerFields
from ..config.compat import DEFAULT_TOKEN_MODE, TRL_IS_FIELDS, TRL_MODES, translate_trl_correction
from ..config.plan import PI_OLD_SOURCES, CorrectionPlan, check_composition, plan_correction
from ..trl_hooks.grpo import KEPT_TOKEN_NORMALIZER_LOSSES

# TRL fields the correction plan depends on: a change re-checks the composition and the plan
_PLAN_INPUTS = ("loss_type", "importance_sampling_level", "pi_old_source", "gradient_accumulation_steps",
                "steps_per_generation", "num_iterations")


@dataclass
class RolloutCorrGRPOConfig(RolloutCorrectionFields, VllmServerFields, GRPOConfig):
    """``GRPOConfig`` plus the rollout-correction fields (flat, CLI/YAML-parsable).

    Default correction (no preset, no saved config, none of TRL's ``vllm_importance_sampling_*`` fields set): TRL
    1.16's own, the preset ``trl_default`` (``_RC_DEFAULT_PRESET``: sequence mask, C = 3); for
    ``loss_type="vespo"``, which TRL allows only its token modes, TRL's ``token_truncate`` with C = 3. TRL's own
    fields, when set, are translated instead (``trl_rollout_corr.config.compat``) and then read ``False`` / ``None``.

    Resolution order (``trl_rollout_corr.config.fields.resolve_correction``): ``rollout_correction_config``, else
    ``rollout_correction_preset``, else the default; every correction field set here (not ``None``) overrides it,
    ``"none"`` switches one off. The result is ``args.rollout_correction``, where pi_old comes from is
    ``args.correction_plan()``. A combination the correction cannot compute exactly raises ``ValueError`` naming the
    field: at construction, or for a field assigned later when the correction is next read or the trainer is built.

    Fields (keyword arguments; each field's ``help`` metadata, shown by ``--help``, says what it does):
    ``GRPOConfig``'s; the correction's flat fields (``config/fields.py``: ``rollout_correction_preset``,
    ``rollout_correction_config``, every ``RolloutCorrectionConfig`` field, default ``None`` = "not set here"); the
    server's (``config/server_fields.py``); and this class's own: ``pi_old_source``, ``truncated_support_correction``,
    TRL's ``vllm_importance_sampling_*`` (translated), ``vllm_dtype``, ``vllm_enforce_eager``, ``vllm_sync_interval``,
    ``vllm_server_request_timeout``.

    Raises:
        ValueError: naming the field and the fix.
    """

    pi_old_source: str = field(default="auto", metadata={
        "help": "Where decoupled mode's pi_old comes from: auto (a no-grad forward per generation batch only when "
                "pi_theta moves within it or a generation-batch statistic needs one), forward (always that forward) "
                "or free (never: pi_theta detached; an error where that would change the result)."})
    truncated_support_correction: bool | None = field(default=None, metadata={
        "help": "Apply top-k/top-p/min-p to the training logits before the ratio with pi_rollout (default: on when "
                "any of them is set)."})
    # TRL's own correction, in TRL's spelling: translated into the rollout_* fields (trl_rollout_corr.config.compat)
    # and
    # computed by this package; after construction they read False / None (what runs is in the rollout_* fields)
    vllm_importance_sampling_correction: bool | None = field(default=None, metadata={
        "help": "TRL's vLLM IS switch, as in TRL: False = no correction (preset disabled); True or unset = TRL's "
                "correction (mode below), unless a rollout correction preset or saved config is named."})
    vllm_importance_sampling_mode: str | None = field(default=None, metadata={
        "help": "TRL's IS mode (token_truncate | token_mask | sequence_truncate | sequence_mask, TRL's default), "
                "translated to rollout_is / rollout_is_bound."})
    vllm_importance_sampling_clip_max: float | None = field(default=None, metadata={
        "help": "TRL's C_max (default 3.0; inf for none), translated to rollout_is_threshold."})
    vllm_importance_sampling_clip_min: float | None = field(default=None, metadata={
        "help": "TRL's C_min (default none), translated to rollout_is_threshold_lower."})
    vllm_importance_sampling_cap: float | None = field(default=None, metadata={
        "help": "TRL's deprecated name of vllm_importance_sampling_clip_max."})
    vllm_dtype: str | None = field(default=None, metadata={
        "help": "dtype of the colocated vLLM engine (float32 | bfloat16 | float16 | auto). Default: TRL's behaviour "
                "(vLLM's 'auto', which runs a float32 checkpoint in bfloat16)."})
    vllm_enforce_eager: bool | None = field(default=None, metadata={
        "help": "Colocated vLLM engine: True runs it eagerly (no torch.compile, no CUDA graphs), False as TRL "
                "builds it (compiled). Default: eager on a CPU (the engine starts ~30 s sooner; measured slower per "
                "step at the toy size, docs/benchmarks.md), TRL's on a GPU. Server mode: pass --enforce-eager to "
                "the server instead."})
    vllm_sync_interval: int = field(default=1, metadata={
        "help": "Sync the vLLM engine's weights every k optimizer steps (k > 1: a stale engine, k-1 steps behind at "
                "most, as an asynchronous engine; fewer syncs)."})
    vllm_server_request_timeout: float | None = field(default=1800.0, metadata={
        "help": "Server mode: seconds the trainer waits for the answer to one generation batch (TRL sends the whole "
                "batch as one request) or one weight update (it stays open while every parameter streams). Set it "
                "above your longest generation; 0 or None: wait without limit. Every other request to the server "
                "waits vllm_server_timeout (TRL's start-up wait)."})

    _RC_TRL_CONFIG = GRPOConfig
    _RC_PLAN_INPUTS = _PLAN_INPUTS
    # TRL 1.16's own default correction (docs/trainer.md, "The default correction"; VESPO: _default_correction)
    _RC_DEFAULT_PRESET = "trl_default"

    def __post_init__(self) -> None:
        self._rc_trl_base = self._translate_trl_fields()
        for name in TRL_IS_FIELDS:  # TRL's own code must never apply its correction: this package computes it
            object.__setattr__(self, name, False if name == "vllm_importance_sampling_correction" else None)
        self._rc_begin_post_init()
        super().__post_init__()
        self._rc_end_post_init()

    def _translate_trl_fields(self) -> dict[str, Any] | None:
        """TRL's ``vllm_importance_sampling_*`` spelling as this package's fields (None: not used)."""
        values = {name: getattr(self, name) for name in TRL_IS_FIELDS}
        if all(v is None for v in values.values()):
            return None
        named = self.rollout_correction_preset or self.rollout_correction_config
        if values["vllm_importance_sampling_correction"] is False:
            return None if named else translate_trl_correction(False)  # TRL's "off": no correction unless one is named
        if named:
            set_here = ", ".join(f"{k}={v!r}" for k, v in values.items() if v is not None)
            raise ValueError(f"{set_here} (TRL's correction) together with rollout_correction_preset / "
                             "rollout_correction_config: name one correction. TRL's modes are the preset trl_default "
                             "and the fields rollout_is / rollout_is_bound / rollout_is_threshold(_lower).")
        return translate_trl_correction(
            values["vllm_importance_sampling_correction"], values["vllm_importance_sampling_mode"],
            values["vllm_importance_sampling_clip_max"], values["vllm_importance_sampling_clip_min"],
            values["vllm_importance_sampling_cap"])

    def _default_correction(self) -> dict[str, Any]:
        """TRL's correction as spelled in TRL's fields; else ``_RC_DEFAULT_PRESET`` (TRL 1.16's own default), so
        that swapping in this class with no preset gives exactly TRL's correction. VESPO is the exception: TRL
        refuses its sequence modes with ``loss_type="vespo"`` (phi takes per-token ratios), so there the preset's
        level and bound are TRL's ``token_truncate`` mode (``DEFAULT_TOKEN_MODE``), C unchanged.

        Why TRL's default: the evidence cannot decide yet. The old mismatch benchmark's case for ``token_truncate``
        (T <= 9 tokens, per-token KL 0.14-0.30) does not survive a paired, Holm-corrected analysis and had no
        held-out seeds (docs/trainer.md, "TRL's own correction and the default"; docs/evidence.md).
        """
        if self.__dict__.get("_rc_trl_base") is not None:
            return RolloutCorrectionConfig(**self._rc_trl_base).to_dict()
        token_mode = {}
        if self.loss_type == "vespo":
            level, bound = TRL_MODES[DEFAULT_TOKEN_MODE]
            token_mode = dict(rollout_is=level, rollout_is_bound=bound)
        return RolloutCorrectionConfig.from_preset(self._RC_DEFAULT_PRESET, **token_mode).to_dict()

    def _check_own_fields(self) -> None:
        if self.vllm_dtype not in (None, "auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"vllm_dtype={self.vllm_dtype!r} is not supported; use float32, bfloat16, float16, auto "
                             "or leave it unset (TRL's behaviour).")
        if self.vllm_enforce_eager is not None and not isinstance(self.vllm_enforce_eager, bool):
            raise ValueError(f"vllm_enforce_eager={self.vllm_enforce_eager!r}: use true, false, or leave it unset "
                             "(eager on a CPU, TRL's compiled engine on a GPU).")
        if self.vllm_enforce_eager is not None and self.use_vllm and self.vllm_mode != "colocate":
            raise ValueError(f"vllm_enforce_eager={self.vllm_enforce_eager} applies to the colocated engine only "
                             f"(vllm_mode={self.vllm_mode!r}): start the server with or without --enforce-eager "
                             "instead, and leave vllm_enforce_eager unset.")
        if not isinstance(self.vllm_sync_interval, int) or self.vllm_sync_interval < 1:
            raise ValueError(f"vllm_sync_interval={self.vllm_sync_interval!r} must be an integer >= 1 (1 = sync the "
                             "vLLM engine every optimizer step).")
        if self.vllm_sync_interval > 1 and self.vllm_enable_sleep_mode:
            raise ValueError("vllm_sync_interval > 1 with vllm_enable_sleep_mode=True: sleep mode discards the "
                             "engine's weights and TRL re-pushes the current ones on wake-up, so the engine cannot "
                             "stay stale. Use one of the two.")
        if self.vllm_server_request_timeout is not None and not self.vllm_server_request_timeout >= 0:
            raise ValueError(f"vllm_server_request_timeout={self.vllm_server_request_timeout!r} must be >= 0 seconds "
                             "(0 or None: no limit on a generation batch or a weight update).")
        if self.pi_old_source not in PI_OLD_SOURCES:
            raise ValueError(f"pi_old_source={self.pi_old_source!r}: use one of {', '.join(PI_OLD_SOURCES)}.")

    def _check_resolved(self, resolved: RolloutCorrectionConfig) -> None:
        check_composition(resolved, self.loss_type, self.importance_sampling_level)
        plan = plan_correction(resolved, pi_old_source=self.pi_old_source, loss_type=self.loss_type,
                               gradient_accumulation_steps=self.gradient_accumulation_steps,
                               steps_per_generation=self.steps_per_generation, num_iterations=self.num_iterations,
                               kept_token_normalizer_losses=KEPT_TOKEN_NORMALIZER_LOSSES)
        # (plan_correction raises where the correction is not exact); kept for correction_plan(): the plan of the
        # last resolution, which ran again wherever one of its inputs changed
        object.__setattr__(self, "_rc_plan", plan)

    def _refuse_change(self, name: str, value: Any) -> None:
        if name in TRL_IS_FIELDS and value not in (None, False):
            raise ValueError(f"{name}={value!r} after construction: TRL's correction fields are translated when the "
                             "config is built. Pass them to RolloutCorrGRPOConfig(...), or change the correction with "
                             "args.update_rollout_correction(rollout_is=..., rollout_is_bound=..., "
                             "rollout_is_threshold=...).")

    def correction_plan(self) -> CorrectionPlan:
        """Where pi_old comes from and where the correction is computed, for the current field values: the plan
        ``_check_resolved`` made when the correction was last resolved (``self.rollout_correction`` resolves it
        again first where a field or a plan input changed).

        Returns:
            The :class:`~trl_rollout_corr.config.plan.CorrectionPlan`.
        """
        self.rollout_correction  # noqa: B018 (resolves, and so plans, again where an input changed)
        return self.__dict__["_rc_plan"]
