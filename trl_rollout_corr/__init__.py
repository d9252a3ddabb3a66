"""trl_rollout_corr: rollout correction (TIS, rejection sampling, veto, bypass, PG) for TRL's GRPOTrainer."""

from .runtime.cpu_guard import hide_cuda_only_extensions as _hide_cuda_only_extensions

_hide_cuda_only_extensions()  # before transformers/vLLM look for torchvision & co. (see _cpu_guard)

from .runtime.distributed_exit import drain_gloo_workers_at_exit as _drain_gloo_workers_at_exit

_drain_gloo_workers_at_exit()  # a finished multi-process CPU run exits 0, not SIGABRT (see distributed_exit)

from .config.correction import RolloutCorrectionConfig
from .core import (
    compute_offpolicy_metrics,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_stats,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
    compute_veto_mask,
)

__version__ = "0.1.0"

__all__ = [
    "RolloutCorrectionConfig",
    "RolloutCorrGRPOConfig",
    "RolloutCorrGRPOTrainer",
    "RolloutCorrAsyncGRPOConfig",
    "RolloutCorrAsyncGRPOTrainer",
    "RolloutCorrectionMonitor",
    "compute_offpolicy_metrics",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_stats",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "compute_veto_mask",
]


def __getattr__(name: str):
    # The trainer imports TRL (slow); load it only when asked for.
    if name in ("RolloutCorrGRPOConfig", "RolloutCorrGRPOTrainer"):
        from .grpo import trainer

        return getattr(trainer, name)
    if name in ("RolloutCorrAsyncGRPOConfig", "RolloutCorrAsyncGRPOTrainer"):
        from .async_grpo import trainer as async_trainer

        return getattr(async_trainer, name)
    if name == "RolloutCorrectionMonitor":
        from .monitor import RolloutCorrectionMonitor

        return RolloutCorrectionMonitor
    raise AttributeError(f"module 'trl_rollout_corr' has no attribute {name!r}")
