"""vLLM worker extension: weight sync from a safetensors file, for a vLLM server on CPU.

TRL 1.16 pushes weights into a server over vLLM's NCCL weight-transfer engine, which needs CUDA. On CPU the
trainer writes the policy's state dict to a file and calls ``POST /collective_rpc`` with
``method="trl_rollout_corr_load_weights"``; every worker loads it with the model's own ``load_weights`` (the same
call TRL's colocate sync uses). Start the server with this class (``trl-rollout-corr vllm-serve`` does)::

    trl vllm-serve --model DIR ... --worker-extension-cls trl_rollout_corr.vllm.worker.CPUWeightSyncExtension

Importing this module in a worker applies the CPU fixes (``trl_rollout_corr.vllm.cpu``) before the model loads.
"""

from __future__ import annotations

from ..runtime.cpu_guard import hide_cuda_only_extensions
from .cpu import apply_cpu_fixes

hide_cuda_only_extensions()
apply_cpu_fixes()

RPC_METHOD = "trl_rollout_corr_load_weights"


class CPUWeightSyncExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``."""

    def trl_rollout_corr_load_weights(self, path: str) -> int:
        """Load every tensor of the safetensors file at ``path`` into the engine's model; returns their count.

        Only a file the trainer wrote for this server: inside the weight-sync directory, named with the control
        token's fingerprint (checked by the server's middleware, and again here).
        """
        import os

        from safetensors.torch import load_file

        from .security import SYNC_DIR_ENV, TOKEN_ENV, default_sync_dir, weight_file_refusal

        token = os.environ.get(TOKEN_ENV)
        why = ("the server has no control token (start it with `trl-rollout-corr vllm-serve`)" if not token else
               weight_file_refusal(path, token, os.environ.get(SYNC_DIR_ENV) or default_sync_dir()))
        if why is not None:
            raise PermissionError(f"trl_rollout_corr_load_weights refused: {why}.")
        weights = load_file(path)
        self.model_runner.model.load_weights(weights=list(weights.items()))
        return len(weights)
