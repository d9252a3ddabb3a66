"""vLLM general plugin (entry point ``vllm.general_plugins``): the CPU-torch guard in every vLLM process.

vLLM loads general plugins in each process it starts (engine core, workers, the model-inspection subprocess),
before any model code imports transformers. ``register`` only hides CUDA builds of torchvision / torchaudio /
torchcodec when torch is a CPU build (``trl_rollout_corr._cpu_guard``); on a GPU machine it does nothing.
"""

from __future__ import annotations


def register() -> None:
    from .._cpu_guard import hide_cuda_only_extensions

    hide_cuda_only_extensions()
