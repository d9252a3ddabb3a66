"""RolloutCorrGRPOConfig: TRL's ``GRPOConfig`` plus the rollout-correction fields, flat and CLI/YAML-parsable."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trl import GRPOConfig

from ._trl import kept_token_normalizer_losses
from .config import RolloutCorrectionConfig, none_if_unset
from .plan import PI_OLD_SOURCES, CorrectionPlan, check_composition, plan_correction

_CORRECTION_FIELDS = tuple(f.name for f in dataclasses.fields(RolloutCorrectionConfig))


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
        if self.vllm_importance_sampling_correction:
            raise ValueError(
                "vllm_importance_sampling_correction=True would correct the same mismatch twice (TRL's own IS and this "
                "package's). Leave it False and pick a rollout correction preset or the rollout_* fields instead.")
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
        super().__post_init__()
        self.rollout_correction = self.resolve_rollout_correction()
        check_composition(self.rollout_correction, self.loss_type, self.importance_sampling_level)
        self.correction_plan()  # raises for a shape the correction cannot compute exactly

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
        explicit = {name: getattr(self, name) for name in _CORRECTION_FIELDS if getattr(self, name) is not None}
        for level in ("rollout_is", "rollout_rs"):
            if level in explicit:
                explicit[level] = none_if_unset(explicit[level])
        if "rollout_rs" in explicit and explicit["rollout_rs"] is None:
            # switching RS off also drops the preset's RS thresholds unless they were set here
            base["rollout_rs_threshold"] = explicit.get("rollout_rs_threshold")
            base["rollout_rs_threshold_lower"] = explicit.get("rollout_rs_threshold_lower")
        return RolloutCorrectionConfig(**{**base, **explicit})
