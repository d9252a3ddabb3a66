"""The former target of the ``vllm.general_plugins`` entry point, kept for environments installed before it moved to
the top-level :mod:`trl_rollout_corr_vllm_plugin` (which, on a GPU machine, returns without importing this package;
reinstall the package to get it): the CPU-torch guard in every vLLM process. ``register`` only hides CUDA builds of
torchvision / torchaudio / torchcodec when torch is a CPU build (``trl_rollout_corr.runtime.cpu_guard``); on a GPU
machine
it does nothing (but the package was imported to get here).
"""

from __future__ import annotations


def register() -> None:
    from ..runtime.cpu_guard import hide_cuda_only_extensions

    hide_cuda_only_extensions()
