"""Config fields both trainers share to reach a vLLM server: its control token and, on a CPU, the weight file."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class VllmServerFields:
    """Mixed into ``RolloutCorrGRPOConfig`` (server mode) and ``RolloutCorrAsyncGRPOConfig``."""

    vllm_server_control_token_file: str | None = field(default=None, metadata={
        "help": "A file holding the vLLM server's control token (`trl-rollout-corr vllm-serve` and `vllm-serve-async` "
                "write one per port under ~/.cache/trl_rollout_corr, which a trainer on the same machine finds by "
                "itself; TRL_ROLLOUT_CORR_CONTROL_TOKEN also works). The token itself never goes into the config."})
    vllm_weight_sync_dir: str | None = field(default=None, metadata={
        "help": "vLLM server on a CPU: directory for the weight file handed to the server at each sync (default "
                "/dev/shm); the server must see the same path."})
