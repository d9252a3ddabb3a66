"""RolloutCorrGRPOConfig: TRL's ``GRPOConfig`` plus the rollout-correction fields, flat and CLI/YAML-parsable."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from ._trl import kept_token_normalizer_losses
from .config import RolloutCorrectionConfig, none_if_unset
from .plan import PI_OLD_SOURCES, CorrectionPlan, check_composition, plan_correction

_CORRECTION_FIELDS = tuple(f.name for f in dataclasses.fields(RolloutCorrectionConfig))
_SOURCES = ("rollout_correction_preset", "rollout_correction_config")
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
class RolloutCorrGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the rollout-correction fields (flat, CLI/YAML-parsable).

    Resolution order: ``rollout_correction_config`` (a saved config: directory, file or Hub repo id), else
    ``rollout_correction_preset``, else the ``RolloutCorrectionConfig`` defaults; then every correction field
    set here (not ``None``) overrides it. Use the string ``"none"`` to switch ``rollout_is``/``rollout_rs`` off
    explicitly. The resolved config is ``args.rollout_correction``; where pi_old comes from and where the correction
    is computed is ``args.correction_plan()`` (see :mod:`trl_rollout_corr.plan`). Every combination that the
    correction cannot compute exactly fails here, naming the field.
    """

    rollout_correction_preset: str | None = field(default=None, metadata={"help": "Preset name, e.g. decoupled_token_is."})
    rollout_correction_config: str | None = field(default=None, metadata={"help": "Directory, file or Hub repo id of a saved RolloutCorrectionConfig."})
    rollout_is: str | None = field(default=None, metadata={"help": "IS level: token | sequence | none."})
    rollout_is_threshold: float | None = field(default=None, metadata={"help": "IS truncation C (default 2.0)."})
    rollout_is_batch_normalize: bool | None = field(default=None, metadata={"help": "Normalize IS weights to mean 1 over each generation batch."})
    rollout_rs: str | None = field(default=None, metadata={"help": "RS level: token | sequence | geometric | none."})
    rollout_rs_threshold: float | None = field(default=None, metadata={"help": "RS upper bound."})
    rollout_rs_threshold_lower: float | None = field(default=None, metadata={"help": "RS lower bound (default 1/upper)."})
    rollout_token_veto_threshold: float | None = field(default=None, metadata={"help": "Veto a sequence if any rho < this."})
    bypass_mode: bool | None = field(default=None, metadata={"help": "pi_old := pi_rollout (no extra forward pass)."})
    use_policy_gradient: bool | None = field(default=None, metadata={"help": "REINFORCE loss (bypass only)."})
    rollout_rs_criteria: str | None = field(default=None, metadata={
        "help": "Divergence RS criteria, comma-separated: token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2/k3."})
    rollout_rs_criteria_threshold: str | None = field(default=None, metadata={
        "help": "One threshold per criterion, comma-separated: k1 'lower_upper' ratio bounds (or upper); k2/k3 upper."})
    pi_old_source: str = field(default="auto", metadata={
        "help": "Where decoupled mode's pi_old comes from: auto (a no-grad forward per generation batch only when "
                "pi_theta moves within it or a generation-batch statistic needs one), forward (always that forward) "
                "or free (never: pi_theta detached; an error where that would change the result)."})
    require_rollout_logprobs: bool = field(default=False, metadata={
        "help": "Raise instead of training a sample uncorrected when its sampler's per-token log-probs are missing "
                "(a mocked, wrapped or remote generate; a rollout_func that returns none)."})
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "_rc_constructed", False)
        if self.vllm_importance_sampling_correction:
            raise ValueError(
                "vllm_importance_sampling_correction=True would correct the same mismatch twice (TRL's own IS and this "
                "package's). Leave it False and pick a rollout correction preset or the rollout_* fields instead.")
        for name, equivalent in _TRL_IS_FIELDS.items():
            if getattr(self, name) is not None:
                raise ValueError(f"{name}={getattr(self, name)!r} is TRL's own vLLM correction, which this trainer "
                                 f"replaces (it would be ignored). Unset it and use {equivalent}.")
        self._check_own_fields()
        # the correction fields the user set (the flat fields are overwritten with the resolved values below)
        self._rc_explicit = {name: getattr(self, name) for name in _CORRECTION_FIELDS if getattr(self, name) is not None}
        super().__post_init__()
        self._rc_frozen_by: str | None = None
        self._apply_correction()
        object.__setattr__(self, "_rc_constructed", True)

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

    def _apply_correction(self) -> None:
        """Resolve the correction, check it against the TRL fields, and write the resolved values into the flat
        fields (so ``to_dict()``, the hyper-parameters ``report_to`` records and a saved ``training_args`` show what
        runs; ``"none"`` marks a level switched off)."""
        resolved = self.resolve_rollout_correction()
        check_composition(resolved, self.loss_type, self.importance_sampling_level)
        plan_correction(resolved, pi_old_source=self.pi_old_source, loss_type=self.loss_type,
                        gradient_accumulation_steps=self.gradient_accumulation_steps,
                        steps_per_generation=self.steps_per_generation, num_iterations=self.num_iterations,
                        kept_token_normalizer_losses=kept_token_normalizer_losses())  # raises where it is not exact
        object.__setattr__(self, "rollout_correction", resolved)
        for name, value in resolved.to_dict().items():
            if name in ("rollout_is", "rollout_rs") and value is None:
                value = "none"
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        """After construction, a correction field, the preset, the saved-config path or a TRL field the plan depends
        on re-resolves the correction (an invalid change raises and leaves the config as it was); once a trainer
        was built on this config, a change to this package's fields raises (the trainer would not see it)."""
        if not self.__dict__.get("_rc_constructed", False):
            object.__setattr__(self, name, value)
            return
        if (name in _TRL_IS_FIELDS and value is not None) or (name == "vllm_importance_sampling_correction" and value):
            raise ValueError(f"{name}={value!r}: TRL's own vLLM correction is replaced by this package's (it would be "
                             f"ignored or correct twice). Use {_TRL_IS_FIELDS.get(name, 'a rollout correction preset')}.")
        if name not in _OWN_FIELDS and name not in _PLAN_INPUTS:
            object.__setattr__(self, name, value)
            return
        self.update_rollout_correction(**{name: value})

    def update_rollout_correction(self, **changes: Any) -> None:
        """Change several fields at once (they are checked together), e.g.
        ``args.update_rollout_correction(rollout_rs="token", rollout_rs_threshold=2.0)``: the correction fields,
        the preset, the saved-config path, ``pi_old_source`` and the TRL fields the plan depends on. An invalid
        combination raises and leaves the config as it was."""
        allowed = _OWN_FIELDS | set(_PLAN_INPUTS)
        unknown = sorted(set(changes) - allowed)
        if unknown:
            raise ValueError(f"update_rollout_correction() takes this package's fields and {', '.join(_PLAN_INPUTS)}; "
                             f"got {unknown}.")
        for name, value in changes.items():
            if (name in _OWN_FIELDS and name != "require_rollout_logprobs"  # read live by the trainer
                    and self._rc_frozen_by is not None and getattr(self, name) != value):
                raise AttributeError(
                    f"{name} changed after {self._rc_frozen_by} was built on these args: the trainer resolved the "
                    "correction at construction and would not see the change. Set it before building the trainer (or "
                    "build a new trainer with the changed args).")
        saved = dict(self.__dict__)
        explicit = dict(self.__dict__.get("_rc_explicit", {}))
        for name, value in changes.items():
            object.__setattr__(self, name, value)
            if name in _CORRECTION_FIELDS:
                if value is None:
                    explicit.pop(name, None)
                else:
                    explicit[name] = value
        object.__setattr__(self, "_rc_explicit", explicit)
        try:
            self._check_own_fields()
            self._apply_correction()
        except ValueError as error:
            self.__dict__.clear()
            self.__dict__.update(saved)
            if len(changes) == 1:
                raise ValueError(f"{error} (To change several correction fields together, use "
                                 "args.update_rollout_correction(field=value, ...).)") from None
            raise
        except Exception:
            self.__dict__.clear()
            self.__dict__.update(saved)
            raise

    def correction_plan(self) -> CorrectionPlan:
        """Where pi_old comes from and where the correction is computed, for the current field values."""
        return plan_correction(
            self.rollout_correction, pi_old_source=self.pi_old_source, loss_type=self.loss_type,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            steps_per_generation=self.steps_per_generation, num_iterations=self.num_iterations,
            kept_token_normalizer_losses=kept_token_normalizer_losses())

    def resolve_rollout_correction(self) -> RolloutCorrectionConfig:
        if self.rollout_correction_config:
            base = RolloutCorrectionConfig.from_pretrained(self.rollout_correction_config).to_dict()
        elif self.rollout_correction_preset:
            base = RolloutCorrectionConfig.from_preset(self.rollout_correction_preset).to_dict()
        else:
            base = RolloutCorrectionConfig().to_dict()
        explicit = dict(self.__dict__.get("_rc_explicit", {}))
        for level in ("rollout_is", "rollout_rs"):
            if level in explicit:
                explicit[level] = none_if_unset(explicit[level])
        if "rollout_rs" in explicit and explicit["rollout_rs"] is None:
            # switching RS off also drops the preset's RS thresholds unless they were set here
            base["rollout_rs_threshold"] = explicit.get("rollout_rs_threshold")
            base["rollout_rs_threshold_lower"] = explicit.get("rollout_rs_threshold_lower")
        return RolloutCorrectionConfig(**{**base, **explicit})


_OWN_FIELDS = frozenset(f.name for f in dataclasses.fields(RolloutCorrGRPOConfig)
                        if f.name not in {g.name for g in dataclasses.fields(GRPOConfig)})
