"""Rollout correction for TRL's asynchronous GRPO trainer (``trl.experimental.async_grpo``), and what it needs to run
on a CPU: a PyTorch tree-attention stand-in (:mod:`.tree_attention`, :mod:`.cpu`) and a CPU weight transfer into a
vLLM server (:mod:`.transfer`)."""

from .cpu import install_cpu_support
from .transfer import CPUFileWeightTransfer

__all__ = ["CPUFileWeightTransfer", "install_cpu_support"]
