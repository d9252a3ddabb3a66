"""``trl-rollout-corr vllm-serve-async MODEL [vllm serve options]``: the server TRL's asynchronous GRPO trainer
talks to, with ``vllm serve``'s own argument spelling.

TRL 1.16 documents ``VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "nccl"}'
--logprobs-mode processed_logprobs --max-logprobs -1`` for ``AsyncGRPOTrainer``. This command runs that server
(every option given is passed to vLLM as is), adding only what is missing:

- everywhere: dev mode, ``--logprobs-mode processed_logprobs`` (the log-probs of the distribution the engine samples
  from: the trainer uses them as pi_rollout), ``--max-logprobs -1``, and the control token of
  :mod:`trl_rollout_corr.vllm.security` (``--control_token_file``, ``--weight_sync_dir`` as for ``vllm-serve``);
- on a GPU: ``--weight-transfer-config '{"backend": "nccl"}'`` (TRL's transfer);
- on vLLM's CPU platform: the CPU weight-sync worker extension (the trainer then sends weights through a file,
  :class:`trl_rollout_corr.async_grpo.CPUFileWeightTransfer`), ``--enforce-eager``, ``--no-enable-chunked-prefill``
  (:data:`CPU_CHUNKED_PREFILL`), a KV cache sized from
  ``--gpu-memory-utilization`` (a fraction of host memory, default 0.05, at most half of what is free;
  ``VLLM_CPU_KVCACHE_SPACE`` wins), host 127.0.0.1 unless ``--host`` is given.

The served model name is MODEL as given: TRL's rollout worker asks for the trainer's model path, so start the server
with the same string the trainer loads.
"""

from __future__ import annotations

import json
import os
import sys

from .serve import _LOOPBACK, MIDDLEWARE, WORKER_EXTENSION, run_server, split_own_args


CPU_CHUNKED_PREFILL = (
    "TRL's asynchronous rollout worker seeds every request; vLLM 0.31's CPU engine dies (EngineDeadError, 'CPU "
    "Generator does not use offset', vllm/v1/worker/gpu_model_runner.py _bookkeeping_sync) when a seeded request's "
    "prefill is split across steps, which chunked prefill does as soon as several long prompts arrive together "
    "(measured: 258-token prompts, 64 requests in flight, the first minute). Without chunked prefill a prompt is "
    "never split; --enable-chunked-prefill given on the command line wins.")


def _value(flags: list[str], *names: str) -> str | None:
    """The value of the last ``--name value`` / ``--name=value`` among ``flags`` (None when absent)."""
    found = None
    for i, flag in enumerate(flags):
        for name in names:
            if flag == name and i + 1 < len(flags):
                found = flags[i + 1]
            elif flag.startswith(name + "="):
                found = flag.split("=", 1)[1]
    return found


def _has(flags: list[str], *names: str) -> bool:
    return any(flag == name or flag.startswith(name + "=") for flag in flags for name in names)


def build_server_argv(argv: list[str]) -> tuple[list[str], dict[str, str], int]:
    """The vLLM OpenAI-server arguments and environment for ``trl-rollout-corr vllm-serve-async ARGV``."""
    from . import vllm_on_cpu
    from .cpu import kv_cache_bytes
    from .security import SYNC_DIR_ENV, TOKEN_ENV, default_sync_dir, new_token, read_token_file

    own, rest = split_own_args(argv)
    if not rest or rest[0].startswith("-"):
        raise SystemExit("trl-rollout-corr vllm-serve-async: give the model first, as for `vllm serve MODEL "
                         "[options]` (the path or name the trainer loads).")
    flags = ["--model", rest[0], *rest[1:]]
    on_cpu = vllm_on_cpu()
    if not _has(flags, "--logprobs-mode"):
        flags += ["--logprobs-mode", "processed_logprobs"]
    if not _has(flags, "--max-logprobs"):
        flags += ["--max-logprobs", "-1"]
    host = _value(flags, "--host")
    if on_cpu:
        if host is None:
            flags += ["--host", "127.0.0.1"]
            host = "127.0.0.1"
        if not _has(flags, "--enforce-eager"):
            flags += ["--enforce-eager"]
        if not _has(flags, "--enable-chunked-prefill", "--no-enable-chunked-prefill"):
            flags += ["--no-enable-chunked-prefill"]  # see CPU_CHUNKED_PREFILL
        if not _has(flags, "--worker-extension-cls"):
            flags += ["--worker-extension-cls", WORKER_EXTENSION]
        fraction = float(_value(flags, "--gpu-memory-utilization") or 0.05)
        if not _has(flags, "--kv-cache-memory-bytes") and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            flags += ["--kv-cache-memory-bytes", str(kv_cache_bytes(fraction))]
    elif not _has(flags, "--weight-transfer-config"):
        flags += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    flags += ["--middleware", MIDDLEWARE]
    token = read_token_file(own.control_token_file) if own.control_token_file else os.environ.get(TOKEN_ENV)
    env = {"VLLM_SERVER_DEV_MODE": "1", TOKEN_ENV: token or new_token(),
           SYNC_DIR_ENV: os.path.realpath(own.weight_sync_dir or default_sync_dir())}
    if on_cpu and host in _LOOPBACK and not os.environ.get("VLLM_HOST_IP"):
        env["VLLM_HOST_IP"] = "127.0.0.1"
    return flags, env, int(_value(flags, "--port") or 8000)


def main(argv: list[str]) -> None:
    run_server(argv, build_server_argv, "trl_rollout_corr.vllm.serve_async", "trl-rollout-corr vllm-serve-async")


if __name__ == "__main__":
    main(sys.argv[1:])
