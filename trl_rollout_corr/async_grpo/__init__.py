"""Rollout correction for TRL's asynchronous GRPO trainer (``trl.experimental.async_grpo``), and what it needs to run
on a CPU: a PyTorch tree-attention stand-in (:mod:`.tree_attention`, installed by
:mod:`trl_rollout_corr.trl_hooks.async_grpo_cpu`) and a CPU weight transfer into a vLLM server (:mod:`.transfer`); the
trainer itself is :mod:`.trainer`."""

from ..trl_hooks.async_grpo_cpu import install_cpu_support
from .transfer import CPUFileWeightTransfer

__all__ = ["CPUFileWeightTransfer", "RolloutCorrAsyncGRPOConfig", "RolloutCorrAsyncGRPOTrainer", "install_cpu_support"]


def __getattr__(name: str):
    # the trainer and its config import TRL's experimental async trainer (slow): only when asked for
    if name in ("RolloutCorrAsyncGRPOConfig", "RolloutCorrAsyncGRPOTrainer"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'trl_rollout_corr.async_grpo' has no attribute {name!r}")
