"""Trainer-side wiring of the vLLM engine: precision, CPU defaults, a stale engine, CPU weight sync for a server.

Used by ``RolloutCorrGRPOTrainer`` only when ``use_vllm=True``:

- ``vllm_engine_setup(args)`` wraps ``GRPOTrainer.__init__``. It passes ``vllm_dtype`` to the colocated engine
  (TRL passes none: vLLM's "auto" silently runs a float32 checkpoint in bfloat16). When vLLM runs on its CPU
  platform it also applies ``cpu.apply_cpu_fixes``, runs a colocated engine in-process and eager, sizes its KV
  cache from ``vllm_gpu_memory_utilization`` (a fraction of host memory), talks to a server on loopback by default,
  and skips TRL's NCCL communicator (CUDA only), which ``install_cpu_server_sync`` replaces.
- ``finish_vllm_setup(trainer)`` installs the sync schedule (``vllm_sync_interval``: the engine lags up to k-1
  optimizer steps behind, as an asynchronous engine does), bounded, clearly-worded server errors, and logs the
  engine's dtype next to the trainer's once.

What it swaps in TRL while TRL builds its engine, the methods it replaces on TRL's ``vllm_generation`` object and the
use of its client's requests session all go through :mod:`trl_rollout_corr.trl_hooks.vllm`, which checks each.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import tempfile
from typing import Any
from urllib.parse import urlparse

logger = logging.getLogger(__name__)

SERVER_RETRIES = 2  # connection retries before a request to the server fails (TRL's default: 5, ~60 s of backoff)


@contextlib.contextmanager
def vllm_engine_setup(args: Any):
    """Context for ``GRPOTrainer.__init__``: engine kwargs, CPU defaults and the server's control token (nothing when
    ``use_vllm`` is off). Yields a dict for :func:`finish_vllm_setup` (``control_token``: kept off ``args``, which
    are saved with checkpoints)."""
    setup: dict[str, Any] = {"control_token": None}
    if args is None or not getattr(args, "use_vllm", False):
        yield setup
        return
    from ..trl_hooks.vllm import constructing_vllm_generation, import_trl_vllm
    from . import vllm_on_cpu
    from .cpu import (apply_cpu_fixes, guard_subprocesses, kv_cache_bytes, release_engine_rendezvous,
                      set_cpu_env_defaults)

    import_trl_vllm()  # before the CPU fixes below, as before

    on_cpu = vllm_on_cpu()
    colocate = args.vllm_mode == "colocate"
    engine_kwargs: dict[str, Any] = {}
    dtype = getattr(args, "vllm_dtype", None)
    if dtype is not None:
        engine_kwargs["dtype"] = dtype
    enforce_eager = getattr(args, "vllm_enforce_eager", None)
    if colocate and enforce_eager is not None:  # the user's choice wins (None: eager on a CPU, TRL's on a GPU)
        engine_kwargs["enforce_eager"] = enforce_eager
    skip_communicator = False
    env_applied: dict[str, str] = {}
    if on_cpu:
        apply_cpu_fixes()
        guard_subprocesses()
        env_applied = set_cpu_env_defaults(in_process=colocate)
        if colocate:
            # torch.compile costs ~30 s more per engine start on CPU; its decoding is faster (7-13% of a step at the
            # toy size, bench_step --engine vllm): eager by default for short runs, vllm_enforce_eager=False to compile
            engine_kwargs.setdefault("enforce_eager", True)
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                engine_kwargs["kv_cache_memory_bytes"] = kv_cache_bytes(args.vllm_gpu_memory_utilization)
        else:
            if args.vllm_server_base_url is None and args.vllm_server_host == "0.0.0.0":
                args.vllm_server_host = "127.0.0.1"  # TRL's default "0.0.0.0"; loopback unless the user chose
            # TRL's communicator is vLLM's NCCL engine (CUDA only); install_cpu_server_sync replaces its use
            skip_communicator = True
    session_class = None
    if not colocate:  # the control token rides on every request TRL's client sends to the server
        import requests

        from .security import find_token, token_session_class

        base_url = server_base_url(args)
        url = urlparse(base_url)
        token = find_token(url.port, getattr(args, "vllm_server_control_token_file", None), url.hostname)
        setup["control_token"] = token
        # with no token too: a 401 then names the token and where to put it instead of TRL's bare "Request failed"
        session_class = token_session_class(requests.Session, token, base_url)
    try:
        with constructing_vllm_generation(skip_communicator=skip_communicator, session_class=session_class,
                                          engine_kwargs=engine_kwargs if colocate else None):
            yield setup
    finally:  # the engine's group is built: its rendezvous port must not leak into processes started later
        release_engine_rendezvous(env_applied)


def server_base_url(args: Any) -> str:
    """The server URL TRL's client talks to (``vllm_server_base_url``, else host and port)."""
    if args.vllm_server_base_url:
        return args.vllm_server_base_url.rstrip("/")
    return f"http://{args.vllm_server_host}:{args.vllm_server_port}"


def engine_dtype(trainer) -> str:
    """The dtype the engine computes in ("float32", "bfloat16", ...)."""
    from ..trl_hooks.vllm import colocated_llm, server_client, vllm_generation

    gen = vllm_generation(trainer)
    if gen.mode == "colocate":
        dtype = colocated_llm(gen).llm_engine.vllm_config.model_config.dtype  # vLLM's own API
    elif trainer.accelerator.is_main_process:
        model_config = server_model_config(server_client(gen))
        require_processed_logprobs(model_config, server_client(gen).base_url)
        dtype = model_config["dtype"]
    else:
        dtype = "unknown"
    return str(dtype).removeprefix("torch.")


def server_model_config(client) -> dict[str, Any]:
    """The ``model_config`` of the server's ``/server_info`` (TRL's own reading of it; a 401 raises
    :class:`~trl_rollout_corr.vllm.security.ControlTokenRefused` from the client's session)."""
    return client.get_server_info()["model_config"]


PROCESSED_LOGPROBS = "processed_logprobs"


def require_processed_logprobs(model_config: dict[str, Any], base_url: str) -> None:
    """Refuse a server whose log-probs are not those of the distribution it samples from.

    pi_rollout is the server's sampling log-prob. vLLM's default ``--logprobs-mode raw_logprobs`` returns them before
    temperature, penalties and top-k/top-p/min-p: every ratio pi_theta / pi_rollout would be biased at temperature != 1
    or under truncation, silently (TRL only warns, and only while its own correction is on, which this package turns
    off). A server that does not report its mode (an older vLLM) is not refused.
    """
    mode = model_config.get("logprobs_mode") if isinstance(model_config, dict) else None
    if mode is None:
        return
    mode = str(mode).rsplit(".", 1)[-1].lower()  # "LogprobsMode.RAW_LOGPROBS" -> "raw_logprobs"
    if mode != PROCESSED_LOGPROBS:
        raise ValueError(
            f"The vLLM server at {base_url} runs with --logprobs-mode {mode}: the log-probs it returns are not those "
            "of the distribution it samples from (before temperature, penalties and top-k/top-p/min-p), so every "
            "importance ratio pi_theta / pi_rollout would be biased. Restart it with --logprobs-mode "
            "processed_logprobs (`trl-rollout-corr vllm-serve` / `vllm-serve-async` and `trl vllm-serve` add it).")


def finish_vllm_setup(trainer, setup: dict[str, Any]) -> None:
    """After ``GRPOTrainer.__init__``: CPU server sync, bounded server errors, sync schedule, the dtype log."""
    from ..trl_hooks.vllm import server_client, vllm_generation
    from . import vllm_on_cpu

    gen = vllm_generation(trainer)
    args = trainer.args
    if gen.mode == "server":
        if trainer.accelerator.is_main_process:
            _bound_server_requests(server_client(gen), args.vllm_server_timeout,
                                   getattr(args, "vllm_server_request_timeout", DEFAULT_REQUEST_TIMEOUT))
        if vllm_on_cpu():
            install_cpu_server_sync(gen, getattr(args, "vllm_weight_sync_dir", None), setup["control_token"])
        _wrap_server_errors(trainer)
    _install_sync_schedule(trainer, int(getattr(args, "vllm_sync_interval", 1) or 1))
    trainer.vllm_engine_dtype = engine_dtype(trainer)
    wanted = getattr(args, "vllm_dtype", None)
    if gen.mode == "server" and wanted not in (None, "auto") and trainer.accelerator.is_main_process \
            and _canonical(wanted) != trainer.vllm_engine_dtype:
        raise ValueError(f"vllm_dtype={wanted!r}, but the vLLM server at {server_client(gen).base_url} runs in "
                         f"{trainer.vllm_engine_dtype}. Restart the server with --dtype {wanted} or drop vllm_dtype.")
    param_dtype = str(next(trainer.model.parameters()).dtype).removeprefix("torch.")
    train_dtype = "bfloat16 (autocast)" if args.bf16 else "float16 (autocast)" if args.fp16 else param_dtype
    if trainer.accelerator.is_main_process:
        differ = not train_dtype.startswith(trainer.vllm_engine_dtype)
        (logger.warning if differ else logger.info)(
            "pi_rollout from vLLM (%s) computes in %s, the trainer in %s%s", gen.mode, trainer.vllm_engine_dtype,
            train_dtype, ": a precision mismatch the rollout_corr/* metrics measure (set vllm_dtype to change the "
            "engine's)." if differ else ".")


def _canonical(dtype: str) -> str:
    return {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(
        dtype, dtype)


def _install_sync_schedule(trainer, interval: int) -> None:
    """Sync the engine's weights when at least ``interval`` optimizer steps passed since the last sync.

    TRL calls ``sync_weights`` before the first generation of every optimizer step; with ``interval=k`` only every
    k-th call reaches the engine, so pi_rollout lags pi_theta by 0..k-1 steps. ``trainer.vllm_sync_steps`` lists
    the global steps at which the engine was synced. ``trainer.vllm_refresh_pending`` (set on a resume whose
    engine weights cannot be restored, :mod:`trl_rollout_corr.training.resume`) loads the current weights once without
    moving the schedule.

    With ``vllm_enable_sleep_mode`` TRL puts a colocated engine to sleep at level 2 after each generation (its
    weights are discarded) and re-pushes the weights itself, through ``sync_weights()``, before the next generation.
    That call always goes through (the engine has no weights otherwise) and does not move the schedule: a second
    generation in one optimizer step (after an evaluation, in TRL's multi-turn tool loop, with
    ``steps_per_generation < gradient_accumulation_steps``) reloads the current weights.
    """
    from ..trl_hooks.vllm import vllm_generation, weights_sleeping, wrap_vllm_generation_method

    trainer.vllm_sync_steps = []
    trainer.vllm_refresh_pending = False
    gen = vllm_generation(trainer)

    def schedule(sync):
        def scheduled_sync():
            step = trainer.state.global_step
            if trainer.vllm_sync_steps and step - trainer.vllm_sync_steps[-1] < interval:
                if trainer.vllm_refresh_pending or weights_sleeping(gen):
                    trainer.vllm_refresh_pending = False
                    sync()
                return
            trainer.vllm_refresh_pending = False
            sync()
            trainer.vllm_sync_steps.append(step)
        return scheduled_sync

    wrap_vllm_generation_method(gen, "sync_weights", schedule)


def install_cpu_server_sync(gen, directory: str | None = None, token: str | None = None) -> None:
    """Replace TRL's NCCL weight push by: state dict -> safetensors file -> ``POST /collective_rpc`` -> workers load it.

    Every process iterates the parameters (gathering them is collective under ZeRO-3/FSDP); the main process writes
    and calls the server. The file lives in ``directory`` (default ``/dev/shm`` when present): the server must see
    the same path, i.e. run on the same machine or share that filesystem. The file is 0600, named with the control
    token's fingerprint (the server loads nothing else) and removed once loaded.
    """
    from safetensors.torch import save_file

    from ..trl_hooks.vllm import client_session, named_parameters, replace_vllm_generation_method, server_client
    from .security import default_sync_dir, weight_file_prefix
    from .worker import RPC_METHOD

    directory = directory or default_sync_dir()

    def sync_weights():
        tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in named_parameters(gen)}
        if not gen.accelerator.is_main_process:
            return
        client = server_client(gen)
        fd, path = tempfile.mkstemp(prefix=weight_file_prefix(token), suffix=".safetensors", dir=directory)  # 0600
        os.close(fd)
        try:
            save_file(tensors, path)
            response = client_session(client).post(f"{client.base_url}/collective_rpc",
                                                   json={"method": RPC_METHOD, "args": [path]})
            if response.status_code != 200 or not response.json().get("results"):
                raise RuntimeError(
                    f"The vLLM server at {client.base_url} could not load the weights ({response.status_code}: "
                    f"{response.text[:300]}). On CPU it must run with the worker extension and VLLM_SERVER_DEV_MODE=1: "
                    "start it with `trl-rollout-corr vllm-serve --model ...`.")
            client.reset_prefix_cache()
        finally:
            os.unlink(path)

    replace_vllm_generation_method(gen, "sync_weights", sync_weights)


# Requests to the server that may take as long as the work they ask for: a generation batch (TRL sends the whole batch
# as one non-streaming request) and a weight update (open while every parameter streams over NCCL or loads from a
# file). They wait ``vllm_server_request_timeout``; every other request ``vllm_server_timeout``.
LONG_REQUEST_PREFIXES = ("/v1/", "/v2/", "/inference/", "/update_weights", "/init_weight_transfer_engine",
                         "/collective_rpc")
DEFAULT_REQUEST_TIMEOUT = 1800.0


def is_long_request(path: str) -> bool:
    """Whether a request to ``path`` (``/v1/completions?x=1``) waits for generation or a weight update."""
    return path.split("?", 1)[0].startswith(LONG_REQUEST_PREFIXES)


class _TimeoutAdapter:
    """A requests HTTPAdapter factory with a default timeout (requests has none: a hung server would block forever)."""

    @staticmethod
    def make(timeout: float, retries: int, long_timeout: float | None = DEFAULT_REQUEST_TIMEOUT):
        from requests.adapters import HTTPAdapter
        from urllib3.util.retry import Retry

        class Adapter(HTTPAdapter):
            def send(self, request, **kwargs):
                if kwargs.get("timeout") is None:
                    read = long_timeout if is_long_request(request.path_url) else timeout
                    kwargs["timeout"] = (10.0, read)  # read None: no limit
                return super().send(request, **kwargs)

        retry = Retry(total=retries, connect=retries, read=0, status=3, status_forcelist=[500, 502, 503],
                      backoff_factor=1.0, allowed_methods=["POST", "GET"])
        return Adapter(max_retries=retry, pool_maxsize=64)


def _bound_server_requests(client, timeout: float, long_timeout: float | None = DEFAULT_REQUEST_TIMEOUT) -> None:
    """Every request to the server gets a connect/read timeout (``long_timeout`` for generation and weight updates,
    None or 0: no read limit there) and at most ``SERVER_RETRIES`` connection retries."""
    from ..trl_hooks.vllm import mount_client_adapter

    long_timeout = float(long_timeout) if long_timeout else None
    mount_client_adapter(client, _TimeoutAdapter.make(max(float(timeout), 1.0), SERVER_RETRIES, long_timeout))


def _wrap_server_errors(trainer) -> None:
    """A server that dies or hangs mid-run: a RuntimeError naming the server, the step and the cause."""
    import requests

    from ..trl_hooks.vllm import vllm_generation, wrap_vllm_generation_method

    gen = vllm_generation(trainer)

    def guarded(what, fn):
        @functools.wraps(fn)
        def call(*a, **kw):
            try:
                return fn(*a, **kw)
            except (requests.exceptions.RequestException, ConnectionError) as exc:
                url = getattr(getattr(gen, "vllm_client", None), "base_url", "(unknown)")
                advice = ("Check that the server process is alive (its log says why it stopped) and restart the run "
                          "from the last checkpoint.")
                if isinstance(exc, requests.exceptions.ReadTimeout) or "Read timed out" in str(exc):
                    waited = getattr(trainer.args, "vllm_server_request_timeout", DEFAULT_REQUEST_TIMEOUT)
                    advice = (f"It did not answer within the read timeout: vllm_server_request_timeout={waited} s "
                              "for a generation batch or a weight update, vllm_server_timeout="
                              f"{trainer.args.vllm_server_timeout} s for other requests. If the server is alive and "
                              "busy (long completions, a large batch, a large model's weight update), raise "
                              f"vllm_server_request_timeout (0: no limit); otherwise {advice[0].lower()}{advice[1:]}")
                raise RuntimeError(
                    f"The vLLM server at {url} stopped answering during {what} at step {trainer.state.global_step} "
                    f"({type(exc).__name__}: {str(exc)[:300]}). {advice}") from exc
        return call

    wrap_vllm_generation_method(gen, "generate", functools.partial(guarded, "generation"))
    wrap_vllm_generation_method(gen, "sync_weights", functools.partial(guarded, "the weight sync"))
