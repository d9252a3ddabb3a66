"""What a GPU run hits in the vLLM server paths, reached on CPU through stand-ins (issue 38; no vLLM engine is started):

- TRL's asynchronous client against a server with the control-token middleware (``vllm-serve-async``): the token
  rides on every request, a missing or wrong one is named (F1, F13);
- sleep mode: TRL's own re-push of discarded weights goes through the sync schedule (F2);
- generation batches and weight updates wait ``vllm_server_request_timeout``, not TRL's start-up wait (F3);
- a server returning raw log-probs is refused, by both trainers (F8);
- one token file per host and port (F13).

The server is :mod:`server_standin` (uvicorn on 127.0.0.1, vLLM's routes answering fixed JSON).
"""

from __future__ import annotations

import trl_rollout_corr  # noqa: F401  (first: its CPU-torch guard)

import os
import sys
import time
from types import SimpleNamespace

import pytest
import requests

from trl_rollout_corr.vllm.security import TOKEN_ENV, TOKEN_HEADER


from tests.support.server_standin import standin_server, vllm_routes  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    return tmp_path / "cache"


@pytest.fixture
def async_client_module(monkeypatch):
    """TRL's asynchronous client module, its ``requests`` name restored after the test."""
    import trl.experimental.async_grpo.vllm_client as module

    monkeypatch.setattr(module, "requests", module.requests)
    return module


class Built(Exception):
    """Raised by the stand-in of TRL's ``AsyncGRPOTrainer.__init__`` with what its client got from the server."""


def construct_async_trainer(monkeypatch, tmp_path, url, model="my/model"):
    """``RolloutCorrAsyncGRPOTrainer`` as on a GPU (no CPU support: TRL's own NCCL transfer), with TRL's ``__init__``
    replaced by what TRL's client does with the server at construction (PEFT) and at ``train()``: every control
    request of TRL's weight transfer. Raises ``Built`` with the answers."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    from tests.support.async_stub import async_args
    from trl_rollout_corr import RolloutCorrAsyncGRPOTrainer

    def trl_init(self, model, reward_funcs, args, *rest, weight_transfer=None, **kwargs):
        assert weight_transfer is None  # TRL's NCCL transfer, as on a GPU
        client = VLLMClient(args.vllm_server_base_url, args.vllm_server_timeout)
        client.wait_for_server_ready()
        answers = {"server_info": client.get_server_info(), "dtype": client.get_dtype(),
                   "world_size": client.get_world_size(), "max_model_len": client.get_max_model_len()}
        client.pause()
        client.init_weight_transfer_engine({"master_port": 1})
        client.start_weight_update()
        client.update_weights({"names": []})
        client.finish_weight_update()
        client.resume()
        raise Built(answers)

    monkeypatch.setattr(AsyncGRPOTrainer, "__init__", trl_init)
    monkeypatch.setattr("trl_rollout_corr.trl_hooks.async_grpo_cpu.install_cpu_support", lambda: False)  # CUDA
    monkeypatch.setattr("trl_rollout_corr.trl_hooks.async_grpo_cpu.require_kernels", lambda: None)  # installed
    return RolloutCorrAsyncGRPOTrainer(model=model, reward_funcs=[],
                                       args=async_args(str(tmp_path), vllm_server_base_url=url))


# ---------------------------------------------------------------- F1, F13: the token and TRL's asynchronous client
def test_trl_s_async_client_reaches_a_vllm_serve_async_server_with_its_token(cache, tmp_path, monkeypatch,
                                                                              async_client_module):
    """vllm-serve-async guards every control endpoint; TRL's async client sends bare requests.get/post. The trainer
    puts the token on them: TRL's whole NCCL-transfer conversation is answered (before: HTTP 401 on /server_info)."""
    monkeypatch.setenv(TOKEN_ENV, "the-server-token")  # the server's, and the trainer finds it there too
    with standin_server(vllm_routes(), token_middleware=True) as (url, seen):
        with pytest.raises(Built) as built:
            construct_async_trainer(monkeypatch, tmp_path, url)
    assert built.value.args[0]["dtype"] == "torch.float32" and built.value.args[0]["world_size"] == 1
    control = [(method, path, headers) for method, path, headers in seen if path != "/health"]
    assert {path for _, path, _ in control} >= {"/server_info", "/get_world_size", "/pause", "/resume",
                                                "/init_weight_transfer_engine", "/start_weight_update",
                                                "/update_weights", "/finish_weight_update"}
    assert all(headers.get(TOKEN_HEADER.lower()) == "the-server-token" for _, _, headers in control)
    routed = async_client_module.requests
    assert routed.codes is requests.codes and routed.RequestException is requests.RequestException


def test_a_trainer_without_the_server_s_token_is_told_which_token_and_where(cache, tmp_path, monkeypatch,
                                                                             async_client_module):
    """No token on this machine (the server runs elsewhere): an error naming the token, the variable and the config
    field, from both trainers' paths, instead of TRL's bare 401."""
    from trl_rollout_corr.vllm.security import ControlTokenRefused

    monkeypatch.setenv(TOKEN_ENV, "the-server-token")
    with standin_server(vllm_routes(), token_middleware=True) as (url, _):
        monkeypatch.delenv(TOKEN_ENV)  # the trainer's machine has no token
        with pytest.raises(ControlTokenRefused, match=rf"{url} refused /server_info \(401\).*found no control token"
                                                      rf".*{TOKEN_ENV}.*vllm_server_control_token_file"):
            construct_async_trainer(monkeypatch, tmp_path, url)
        # TRL's async client itself (a server that was not up yet at construction): the same message
        from trl.experimental.async_grpo.vllm_client import VLLMClient

        from trl_rollout_corr.async_grpo.server_probe import send_token_from_trl_client

        send_token_from_trl_client(url, "a-stale-token")
        with pytest.raises(ControlTokenRefused, match=r"refused /get_world_size \(401\).*sent is not the server's"):
            VLLMClient(url).get_world_size()
        # the synchronous trainer's client (TRL's VLLMClient builds its session while the package's class is in place)
        from trl.generation.vllm_client import VLLMClient as SyncClient

        from trl_rollout_corr.trl_hooks.vllm import constructing_vllm_generation
        from trl_rollout_corr.vllm.security import token_session_class

        with constructing_vllm_generation(session_class=token_session_class(requests.Session, None, url)):
            client = SyncClient(base_url=url)
        with pytest.raises(ControlTokenRefused, match=rf"refused /get_world_size \(401\).*{TOKEN_ENV}"):
            client.get_world_size()
        assert client.model == "my/model"  # /v1/models: public, no token needed


def test_one_token_file_per_host_and_port(cache):
    """Two servers on port 8000 of two nodes sharing $HOME keep their own token files; a trainer finds the one of the
    host it names (a shared $HOME), or this machine's for a loopback URL."""
    from trl_rollout_corr.vllm.security import find_token, this_host, token_path, write_token

    here = write_token(8000, "this-machine")
    assert here == cache / "trl_rollout_corr" / f"vllm-serve-{this_host()}-8000.token"
    there = token_path(8000, "node12")
    there.write_text("node12-s")
    assert here != there and here.read_text() == "this-machine"
    assert find_token(8000, host="127.0.0.1") == find_token(8000) == "this-machine"
    assert find_token(8000, host="node12") == "node12-s"
    assert find_token(8000, host="node13") is None  # another machine's server: not this machine's token
    assert find_token(8001) is None


# ---------------------------------------------------------------- F2: sleep mode
class SleepingGeneration:
    """TRL 1.16's colocated ``VLLMGeneration`` with ``vllm_enable_sleep_mode=True``, as far as the weights go
    (trl/generation/vllm_generation.py): level-2 sleep after each generation discards them; ``generate`` re-pushes
    them through ``self.sync_weights()`` when they sleep; ``sync_weights`` wakes and loads the trainer's weights."""

    mode = "colocate"
    enable_sleep_mode = True

    def __init__(self, trainer):
        self.trainer = trainer
        self._llm_weights_sleeping = True  # TRL sleeps the engine right after building it
        self.loads: list[int] = []

    def sync_weights(self):
        self._llm_weights_sleeping = False
        self.loads.append(self.trainer.state.global_step)

    def generate(self):
        if self._llm_weights_sleeping:
            self.sync_weights()  # resolves to the instance attribute: the package's schedule
        if self._llm_weights_sleeping:
            raise RuntimeError("generated with discarded weights (on a GPU: an illegal memory access)")
        self._llm_weights_sleeping = True  # sleep(level=2)


def test_sleep_mode_re_push_goes_through_the_schedule_without_moving_it():
    """A second generation in one optimizer step (after an eval, TRL's tool loop, steps_per_generation <
    gradient_accumulation_steps): TRL re-pushes the discarded weights; the schedule lets it through (before: skipped,
    the engine generated with discarded weights) and keeps its syncs at the steps it chose."""
    from trl_rollout_corr.vllm.engine import _install_sync_schedule

    trainer = SimpleNamespace(state=SimpleNamespace(global_step=0))
    gen = trainer.vllm_generation = SleepingGeneration(trainer)
    _install_sync_schedule(trainer, 1)
    for step in range(3):
        trainer.state.global_step = step
        gen.sync_weights()  # TRL, before the step's first generation
        gen.generate()
        gen.generate()  # the second generation of the same step
    assert gen.loads == [0, 0, 1, 1, 2, 2]
    assert trainer.vllm_sync_steps == [0, 1, 2]


def test_sleep_mode_state_is_read_through_the_trl_boundary():
    from trl_rollout_corr.trl_hooks.base import TrlInternalsChanged
    from trl_rollout_corr.trl_hooks.vllm import weights_sleeping

    assert weights_sleeping(SimpleNamespace(mode="colocate", enable_sleep_mode=True, _llm_weights_sleeping=True))
    assert not weights_sleeping(SimpleNamespace(mode="colocate", enable_sleep_mode=False))
    assert not weights_sleeping(SimpleNamespace(mode="server"))
    with pytest.raises(TrlInternalsChanged, match="_llm_weights_sleeping is gone"):
        weights_sleeping(SimpleNamespace(mode="colocate", enable_sleep_mode=True))


# ---------------------------------------------------------------- F3: read timeouts
def test_a_generation_batch_longer_than_the_start_up_wait_is_answered(cache):
    """TRL sends a whole generation batch as one request and /update_weights stays open for the whole stream: they
    wait vllm_server_request_timeout; other requests vllm_server_timeout (before: every request timed out after
    vllm_server_timeout)."""
    from trl.generation.vllm_client import VLLMClient

    from trl_rollout_corr.vllm.engine import _bound_server_requests

    slow = {"/v1/completions": 1.2, "/update_weights": 1.2, "/get_world_size": 1.2}
    with standin_server(vllm_routes(), delays=slow) as (url, _):
        client = VLLMClient(base_url=url)
        _bound_server_requests(client, 1.0)  # vllm_server_timeout=1, vllm_server_request_timeout at its default
        assert client._post(f"{url}/v1/completions", json={}) == {"choices": []}
        _bound_server_requests(client, 1.0, 10.0)
        assert client._post(f"{url}/v1/completions", json={}) == {"choices": []}
        client._post(f"{url}/update_weights", json={})
        with pytest.raises(requests.RequestException, match="Read timed out"):
            client.get_world_size()  # a control request: the short wait
        _bound_server_requests(client, 1.0, 0.5)
        start = time.monotonic()
        with pytest.raises(requests.RequestException, match="Read timed out"):
            client._post(f"{url}/v1/completions", json={})
        assert time.monotonic() - start < 1.15
        _bound_server_requests(client, 1.0, None)  # no limit
        assert client._post(f"{url}/v1/completions", json={}) == {"choices": []}


def test_a_read_timeout_names_the_knob_to_raise():
    from trl_rollout_corr.vllm.engine import _wrap_server_errors

    def generate(*args, **kwargs):  # what the session raises once Retry(read=0) gives up on a read timeout
        raise requests.exceptions.ConnectionError("HTTPConnectionPool(host='h', port=8000): Max retries exceeded with "
                                                  "url: /v1/completions (Caused by ReadTimeoutError(...Read timed "
                                                  "out. (read timeout=1800.0)))")

    gen = SimpleNamespace(mode="server", vllm_client=SimpleNamespace(base_url="http://h:8000"), generate=generate,
                          sync_weights=lambda: None)
    trainer = SimpleNamespace(vllm_generation=gen, state=SimpleNamespace(global_step=7),
                              args=SimpleNamespace(vllm_server_request_timeout=1800.0, vllm_server_timeout=240.0))
    _wrap_server_errors(trainer)
    with pytest.raises(RuntimeError, match=r"at http://h:8000 stopped answering during generation at step 7 "
                                           r"\(ConnectionError.*vllm_server_request_timeout=1800.0 s.*raise "
                                           r"vllm_server_request_timeout"):
        gen.generate(["p"])


def test_the_request_timeout_field_is_checked(tmp_path):
    from trl_rollout_corr import RolloutCorrGRPOConfig

    config = RolloutCorrGRPOConfig(str(tmp_path), report_to=[], use_cpu=True, bf16=False)
    assert config.vllm_server_request_timeout == 1800.0
    with pytest.raises(ValueError, match="vllm_server_request_timeout=-1.0 must be >= 0"):
        RolloutCorrGRPOConfig(str(tmp_path), report_to=[], use_cpu=True, bf16=False,
                              vllm_server_request_timeout=-1.0)


# ---------------------------------------------------------------- F8: raw log-probs
def sync_trainer_on(url):
    """What engine_dtype reads of a trainer in server mode: TRL's VLLMClient on the server."""
    from trl.generation.vllm_client import VLLMClient

    gen = SimpleNamespace(mode="server", vllm_client=VLLMClient(base_url=url))
    return SimpleNamespace(vllm_generation=gen, accelerator=SimpleNamespace(is_main_process=True))


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logits"])
def test_a_server_without_processed_log_probs_is_refused(cache, tmp_path, monkeypatch, async_client_module, mode):
    """A plain `vllm serve` returns raw log-probs (vLLM's default): every ratio would be biased at T != 1 or under
    truncation. Both trainers refuse it (before: nothing checked it once TRL's correction was off)."""
    from trl_rollout_corr.vllm.engine import engine_dtype

    with standin_server(vllm_routes(logprobs_mode=mode)) as (url, _):
        with pytest.raises(ValueError, match=f"{url} runs with --logprobs-mode {mode}.*biased.*processed_logprobs"):
            engine_dtype(sync_trainer_on(url))
        with pytest.raises(ValueError, match=f"--logprobs-mode {mode}"):
            construct_async_trainer(monkeypatch, tmp_path, url)
        from trl_rollout_corr.async_grpo.server_probe import check_server_info

        with pytest.raises(ValueError, match=f"--logprobs-mode {mode}"):
            check_server_info(url, None)  # at the first weight sync when the server was not up at construction


def test_a_server_with_processed_log_probs_or_an_older_vllm_passes(cache):
    from trl_rollout_corr.async_grpo.server_probe import check_server_info
    from trl_rollout_corr.vllm.engine import engine_dtype

    with standin_server(vllm_routes()) as (url, _):
        assert engine_dtype(sync_trainer_on(url)) == "float32"
        assert check_server_info(url, None) is True
    with standin_server(vllm_routes(logprobs_mode=None)) as (url, _):  # does not report it: not refused
        assert engine_dtype(sync_trainer_on(url)) == "float32"
    assert check_server_info("http://127.0.0.1:9", None) is False  # not up yet: checked at the first weight sync


# ---------------------------------------------------------------- F4: vllm serve's own dispatch
def run_server_with(monkeypatch, flags, env=None):
    """``serve.run_server`` with a stand-in build returning ``flags``, this machine's vLLM platform check answered
    "not CPU" (as on a GPU), up to vLLM's real ``vllm serve`` subcommand (parser, validation, dispatch)."""
    from trl_rollout_corr.vllm import serve

    monkeypatch.setitem(sys.modules, "__main__", SimpleNamespace(__spec__=None))  # not a package's __main__: no exec
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv(TOKEN_ENV, "the-token")  # run_server puts it into os.environ; restored after the test
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "spawn"))
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("trl_rollout_corr.vllm.vllm_on_cpu", lambda: False)

    def build(argv):
        return ["--model", "my/model", "--port", "8123", *flags, "--middleware", serve.MIDDLEWARE], \
            {TOKEN_ENV: "the-token"}, 8123

    serve.run_server([], build, "trl_rollout_corr.vllm.serve", "trl-rollout-corr vllm-serve")


@pytest.fixture
def dispatched(monkeypatch):
    """vLLM's ``vllm serve`` dispatch with its four destinations replaced by recorders: (destination, args)."""
    import vllm.entrypoints.cli.serve as cli_serve

    calls = []

    async def one_server(args):
        calls.append(("one API server in this process", args))

    monkeypatch.setattr(cli_serve, "run_server", one_server)
    monkeypatch.setattr(cli_serve, "run_headless", lambda args: calls.append(("headless engines", args)))
    monkeypatch.setattr(cli_serve, "run_multi_api_server", lambda args: calls.append(("API servers", args)))
    monkeypatch.setattr(cli_serve, "run_dp_supervisor", lambda args: calls.append(("DP supervisor", args)))
    return calls


@pytest.mark.parametrize("flags, where, count", [
    ([], "one API server in this process", None),
    (["--api-server-count", "3"], "API servers", 3),
    (["--data-parallel-size", "2"], "API servers", 2),  # vllm serve: one front end per data-parallel rank
    (["--headless", "--data-parallel-size", "2"], "headless engines", 0),
    (["--data-parallel-size", "2", "--data-parallel-size-local", "2", "--data-parallel-multi-port-external-lb"],
     "DP supervisor", 1),
])
def test_vllm_serve_goes_through_vllm_serves_own_dispatch(cache, monkeypatch, dispatched, flags, where, count):
    """The server is `vllm serve`'s: --api-server-count, data-parallel front ends and --headless reach vLLM 0.31's own
    dispatch (before: its single API server ran whatever was asked, ignoring them). The model goes positionally,
    the middleware and the other options as given."""
    run_server_with(monkeypatch, flags)
    assert [call[0] for call in dispatched] == [where]
    args = dispatched[0][1]
    assert args.model == "my/model" and args.port == 8123 and args.api_server_count == count
    assert args.middleware == ["trl_rollout_corr.vllm.security.ControlTokenMiddleware"]
    assert sys.argv[:3] == ["trl-rollout-corr vllm-serve", "serve", "my/model"]


@pytest.mark.parametrize("flags, env, named", [
    (["--grpc"], {}, "--grpc serves vLLM over gRPC, where the control token .* does not apply.*leave --grpc out"),
    ([], {"VLLM_USE_RUST_FRONTEND": "1"}, "VLLM_USE_RUST_FRONTEND is set.*does not run the control-token "
                                          "middleware: unset it"),
])
def test_front_ends_the_token_does_not_cover_are_refused(cache, monkeypatch, dispatched, flags, env, named):
    with pytest.raises(SystemExit, match=f"trl-rollout-corr vllm-serve: {named}"):
        run_server_with(monkeypatch, flags, env)
    assert dispatched == []


def test_vllm_serve_without_vllms_serve_subcommand_says_so(cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm.entrypoints.cli.serve", None)  # import of it: not found
    with pytest.raises(RuntimeError, match=r"has no vllm.entrypoints.cli.serve .*vllm>=0.22.0,<=0.31.0"):
        run_server_with(monkeypatch, [])


# ---------------------------------------------------------------- F15: samplers that change pi_rollout
def test_penalties_biases_and_constrained_decoding_are_named():
    from trl_rollout_corr.grpo.trainer import pi_rollout_modifiers

    def args(**kwargs):
        return SimpleNamespace(generation_kwargs=kwargs.pop("generation_kwargs", None), **kwargs)

    assert pi_rollout_modifiers(args(), 1.0) == []
    assert pi_rollout_modifiers(args(generation_kwargs={"presence_penalty": 0.0, "logit_bias": {}, "top_k": 5,
                                                        "frequency_penalty": None}), None) == []
    assert pi_rollout_modifiers(args(generation_kwargs={"presence_penalty": 0.5, "frequency_penalty": 0.2,
                                                        "logit_bias": {"7": 5.0}, "bad_words": ["no"]}), 1.0) == [
        "presence_penalty=0.5", "frequency_penalty=0.2", "logit_bias={'7': 5.0}", "bad_words=['no']"]
    assert pi_rollout_modifiers(args(vllm_structured_outputs_regex=r"\d+"), 1.0) == [
        "vllm_structured_outputs_regex='\\\\d+'"]
    assert pi_rollout_modifiers(args(), 1.3) == ["repetition_penalty=1.3"]
    # generation_kwargs win over the field, as in TRL
    assert pi_rollout_modifiers(args(generation_kwargs={"repetition_penalty": 1.0}), 1.3) == []
    assert pi_rollout_modifiers(args(generation_kwargs={"repetition_penalty": 1.2}), 1.0) == ["repetition_penalty=1.2"]


def test_the_trainer_warns_for_a_sampler_setting_it_does_not_reproduce(tmp_path, caplog):
    """Before: only repetition_penalty was named; a no-repeat n-gram ban (or a presence penalty, a logit bias,
    constrained decoding on vLLM) biased pi_rollout silently."""
    import logging

    from tests.support.trainer_utils import make_trainer

    with caplog.at_level(logging.WARNING, logger="trl_rollout_corr.grpo.trainer"):
        make_trainer(tmp_path, generation_kwargs={"no_repeat_ngram_size": 2})
    assert "no_repeat_ngram_size=2 change pi_rollout in a way the trainer does not reproduce" in caplog.text


# ---------------------------------------------------------------- F16: the GPU async trainer's kernels, the plugin
def test_the_async_trainer_on_a_gpu_without_kernels_says_which_extra(tmp_path, monkeypatch):
    """TRL's packed attention on a GPU imports `kernels` at the first forward: without it, an error at construction
    naming the extra (before: an ImportError deep in the first step)."""
    import importlib.util

    from tests.support.async_stub import async_args
    from trl_rollout_corr import RolloutCorrAsyncGRPOTrainer

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "kernels" else
                        real_find_spec(name, *a))
    monkeypatch.setattr("trl_rollout_corr.trl_hooks.async_grpo_cpu.install_cpu_support", lambda: False)  # CUDA
    with pytest.raises(ImportError, match=r"`kernels` package.*pip install \"trl-rollout-corr\[kernels\]\""):
        RolloutCorrAsyncGRPOTrainer(model="unused", reward_funcs=[], args=async_args(str(tmp_path)))


def test_the_vllm_plugin_does_not_load_the_package_into_a_gpu_machine_s_vllm(tmp_path):
    """vLLM runs every installed general plugin in each of its processes, for any `vllm serve`: with a CUDA torch the
    plugin returns without importing trl_rollout_corr (before: the entry point was inside the package, whose
    __init__ ran in every vLLM process); with a CPU torch it runs the guard."""
    import subprocess
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    plugins = tomllib.loads((root / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins == {"trl_rollout_corr_cpu_guard": "trl_rollout_corr_vllm_plugin:register"}
    code = ("import sys, torch; torch.version.cuda = sys.argv[1] or None; import trl_rollout_corr_vllm_plugin as p; "
            "p.register(); print('trl_rollout_corr' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("TRL_ROLLOUT_CORR_KEEP_CUDA_EXTENSIONS", None)
    for cuda, loaded in (("12.8", "False"), ("", "True")):
        out = subprocess.run([sys.executable, "-c", code, cuda], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == loaded
