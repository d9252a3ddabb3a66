"""vLLM general plugin of trl_rollout_corr (entry point ``vllm.general_plugins``), kept outside the package.

vLLM loads every installed general plugin in each process it starts (engine core, workers, the model-inspection
subprocess), for every ``vllm serve`` of the environment, not only this package's. The plugin is needed only where
torch is a CPU build: there it hides CUDA builds of torchvision / torchaudio / torchcodec before model code imports
transformers (``trl_rollout_corr.runtime.cpu_guard``). With a CUDA or ROCm torch ``register`` returns at once and
``trl_rollout_corr`` is not imported (its config, core and the exit hook stay out of vLLM's processes).
"""

from __future__ import annotations

import os


def register() -> None:
    if os.environ.get("TRL_ROLLOUT_CORR_KEEP_CUDA_EXTENSIONS") == "1":
        return
    import torch  # vLLM has imported it already

    if torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None:
        return
    from trl_rollout_corr.runtime.cpu_guard import hide_cuda_only_extensions

    hide_cuda_only_extensions()
