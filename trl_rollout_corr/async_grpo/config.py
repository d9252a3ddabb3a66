"""RolloutCorrAsyncGRPOConfig: TRL's ``AsyncGRPOConfig`` plus the rollout-correction fields (the same as
``RolloutCorrGRPOConfig``'s), flat and CLI/YAML-parsable."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl.experimental.async_grpo import AsyncGRPOConfig

from ..config.correction import RolloutCorrectionConfig
from ..config.fields import RolloutCorrectionFields
from ..config.server_fields import VllmServerFields


@dataclass
class RolloutCorrAsyncGRPOConfig(RolloutCorrectionFields, VllmServerFields, AsyncGRPOConfig):
    """``AsyncGRPOConfig`` plus the rollout-correction fields.

    Default correction (no preset, no saved config): ``ppo_is_bypass`` (``_RC_DEFAULT_PRESET``), what TRL's
    ``AsyncGRPOTrainer`` computes: PPO clipped against pi_rollout, no IS weight. Resolution as
    ``RolloutCorrGRPOConfig``'s; the resolved config is ``args.rollout_correction``.

    In the asynchronous trainer every sample is trained on exactly once, in one micro-batch, and the parameters do not
    move between the micro-batches of one optimizer step: the decoupled anchor pi_prox (the policy before this step)
    is therefore pi_theta detached, with no extra forward. A "batch" statistic (``rollout_is_batch_normalize``, the
    kept-token count the loss divides by) has the scope of one micro-batch, all processes together: TRL's loss
    normalizes each micro-batch by its own token count.

    Fields (keyword arguments; each field's ``help`` metadata says what it does): ``AsyncGRPOConfig``'s, the
    correction's flat fields and the server's (as ``RolloutCorrGRPOConfig``'s), and ``server_unreachable_timeout_s``.

    Raises:
        ValueError: naming the field and the fix.
    """

    server_unreachable_timeout_s: float = field(default=60.0, metadata={
        "help": "While the trainer waits for samples, the vLLM server is probed every few seconds; training stops with "
                "an error naming the server once it has not answered for this long."})

    _RC_TRL_CONFIG = AsyncGRPOConfig
    # TRL's AsyncGRPOTrainer clips pi_theta / pi_rollout with no IS weight: bypass PPO (its gradient, tested;
    # docs/trainer.md, "The default correction")
    _RC_DEFAULT_PRESET = "ppo_is_bypass"

    def __post_init__(self) -> None:
        self._rc_begin_post_init()
        super().__post_init__()
        self._rc_end_post_init()

    def _check_own_fields(self) -> None:
        if not self.server_unreachable_timeout_s > 0:
            raise ValueError(f"server_unreachable_timeout_s={self.server_unreachable_timeout_s!r} must be > 0 "
                             "(seconds without an answer from the vLLM server before training stops).")

    def _check_resolved(self, resolved: RolloutCorrectionConfig) -> None:
        """Every correction the synchronous trainer computes is exact here (one micro-batch per sample), so only the
        RolloutCorrectionConfig's own checks apply, but for the one that needs the rejection before the advantages
        exist (``rollout_rs_exclude_from_baseline``)."""
        if resolved.rollout_rs_exclude_from_baseline:
            raise ValueError(
                "rollout_rs_exclude_from_baseline=True is not supported by RolloutCorrAsyncGRPOTrainer: TRL's "
                "AsyncGRPOTrainer forms the advantages on its rollout worker, before the trainer sees a sample, and "
                "the rejection is decided in the loss (on pi_theta), so a rejected sample's group baseline is already "
                "fixed. Set rollout_rs_exclude_from_baseline=False, or use RolloutCorrGRPOTrainer (decoupled mode).")
