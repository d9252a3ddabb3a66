"""Weight sync for TRL's asynchronous GRPO trainer into a vLLM server on CPU (TRL's ``WeightTransferProtocol``).

TRL 1.16's ``AsyncGRPOTrainer`` pushes weights with NCCL (``WeightTransferClient``), which needs a CUDA device at
both ends. Against a CPU server this class does, at each of TRL's syncs: ``POST /pause?mode=keep`` (in-flight
requests wait), the policy's parameters -> a safetensors file in the weight-sync directory (0600, named with the
control token's fingerprint) -> ``POST /collective_rpc`` ``trl_rollout_corr_load_weights`` (every worker loads it with
the model's own ``load_weights``) -> ``POST /reset_prefix_cache`` (no prompt KV computed with the old weights is
reused) -> ``POST /resume``. The server must see the file: same machine or a shared filesystem, as for the
synchronous trainer's CPU server mode. Start the server with ``trl-rollout-corr vllm-serve-async``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import torch


class CPUFileWeightTransfer:
    """``init_weight_transfer`` / ``pause`` / ``send_weights`` / ``resume`` / ``destroy`` against ``base_url``.

    Every control request carries the server's control token (``token``; see :mod:`trl_rollout_corr.vllm.security`)
    and a timeout; a failure raises naming the server, the step and its answer.
    """

    def __init__(self, base_url: str, token: str | None = None, sync_dir: str | None = None,
                 timeout: float = 1800.0) -> None:
        from ..vllm.security import default_sync_dir

        self.base_url = base_url.rstrip("/")
        self.token = token
        self.sync_dir = sync_dir or default_sync_dir()
        self.timeout = timeout
        self.syncs = 0  # weight loads completed

    def _request(self, method: str, path: str, what: str, **kwargs):
        import requests

        from ..vllm.security import TOKEN_HEADER

        headers = {TOKEN_HEADER: self.token} if self.token else {}
        try:
            response = requests.request(method, f"{self.base_url}{path}", headers=headers, timeout=self.timeout,
                                        **kwargs)
        except requests.RequestException as error:
            raise RuntimeError(f"The vLLM server at {self.base_url} did not answer {what} ({type(error).__name__}: "
                               f"{error}).") from error
        if response.status_code != 200:
            hint = (" The server wants its control token: run the trainer on the server's machine, or set "
                    "TRL_ROLLOUT_CORR_CONTROL_TOKEN / vllm_server_control_token_file."
                    if response.status_code == 401 else "")
            raise RuntimeError(f"The vLLM server at {self.base_url} refused {what} ({response.status_code}: "
                               f"{response.text[:300]}).{hint}")
        return response

    def init_weight_transfer(self) -> None:
        self._request("GET", "/health", "the health check")

    def pause(self) -> None:
        self._request("POST", "/pause", "to pause before a weight sync", params={"mode": "keep"})

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save_file

        from ..vllm.security import weight_file_prefix
        from ..vllm.worker import RPC_METHOD

        tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in iterator}
        fd, path = tempfile.mkstemp(prefix=weight_file_prefix(self.token), suffix=".safetensors", dir=self.sync_dir)
        os.close(fd)  # mkstemp: 0600
        try:
            save_file(tensors, path)
            response = self._request("POST", "/collective_rpc", "to load the weights",
                                     json={"method": RPC_METHOD, "args": [path]})
            loaded = response.json().get("results") or []
            if not loaded or any(int(n) != len(tensors) for n in loaded):
                raise RuntimeError(f"The vLLM server at {self.base_url} loaded {loaded} tensors of {len(tensors)}: "
                                   "start it with `trl-rollout-corr vllm-serve-async` (the CPU weight-sync worker).")
            self._request("POST", "/reset_prefix_cache", "to reset its prefix cache after a weight sync")
        finally:
            os.unlink(path)
        self.syncs += 1

    def resume(self) -> None:
        self._request("POST", "/resume", "to resume after a weight sync")

    def destroy(self) -> None:
        pass
