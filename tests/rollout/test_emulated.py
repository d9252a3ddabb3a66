"""The emulated engines on a non-CPU policy (rollout/emulated.py), with the meta device standing in for a GPU: the
ZeRO-3 copy is built on the policy's device, INT8 (CPU kernels only) is refused there, and a stale engine keeps its
snapshots (what a checkpoint carries) on the CPU."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from trl_rollout_corr.rollout import emulated
from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine


def tiny_policy(device: str = "cpu") -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=20, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    with torch.device(device):
        return Qwen2ForCausalLM(config)


def test_the_zero3_copy_is_built_on_the_policy_s_device(monkeypatch):
    policy = tiny_policy("meta")
    for i, p in enumerate(policy.parameters()):
        p.ds_id = i  # what DeepSpeed ZeRO-3 marks its partitions with
    monkeypatch.setattr(emulated, "gathered_parameters", lambda module, sharded: contextlib.nullcontext())
    engine = EmulatedRolloutEngine("fp16")
    engine.sync(policy, step=0)  # was: built on the CPU, then "Cannot copy out of meta tensor"
    devices = {p.device.type for p in engine._engine.parameters()}
    assert devices == {"meta"} and next(engine._engine.parameters()).dtype == torch.float16
    assert not any(hasattr(p, "ds_id") for p in engine._engine.parameters())  # a plain, full copy


def test_int8_is_refused_off_the_cpu_naming_an_alternative():
    with pytest.raises(ValueError, match=r"CPU only.*meta.*'wq8'"):
        EmulatedRolloutEngine("int8").sync(tiny_policy("meta"), step=0)


def test_a_stale_engine_keeps_its_snapshots_on_the_cpu(monkeypatch):
    """Each snapshot is requested as a CPU copy (``.to("cpu", copy=True)``: from a GPU policy, a device-to-host
    copy); what state_dict() hands to a checkpoint is CPU tensors only."""
    policy = tiny_policy()
    real = policy.state_dict()
    requested = []

    class OnDevice:  # stands in for a parameter tensor on a GPU: records where it is copied to
        def __init__(self, tensor):
            self.tensor = tensor

        def detach(self):
            return self

        def to(self, device, copy=False):
            requested.append((str(device), copy))
            return self.tensor.clone()

    monkeypatch.setattr(policy, "state_dict", lambda: {k: OnDevice(v) for k, v in real.items()})
    engine = EmulatedRolloutEngine("stale", lag=2)
    for step in range(4):
        engine.sync(policy, step)
    assert requested and set(requested) == {("cpu", True)}
    assert len(requested) == 4 * len(real)
    saved = engine.state_dict()["snapshots"]
    assert 1 <= len(saved) <= 3  # at most lag + 1
    assert all(t.device.type == "cpu" for _, state in saved for t in state.values())


def test_a_bf16_engine_samples_a_tied_model_under_cast_lm_head_to_fp32(tmp_path):
    """TRL's cast_lm_head_to_fp32 on a tied model hooks the input embedding to cast its output back to the policy's
    dtype (fp32); the engine's bf16 copy inherited that hook and failed with a dtype error in its first layer. The
    copy now runs in bf16 end to end: training steps run, and the engine's log-probs are a bf16 model's (not equal
    to the fp32 trainer's, a small positive KL)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.support.trainer_utils import make_trainer
    from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine
    from trl_rollout_corr.testing.toy_task import VOCAB

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1,
        bos_token_id=3))
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    engine = EmulatedRolloutEngine("bf16")
    trainer, logs = make_trainer(tmp_path, model=model, preset="decoupled_token_is", max_steps=2,
                                 rollout_sampler=engine, cast_lm_head_to_fp32=True)
    trainer.train()
    steps = [log for log in logs.logs if "loss" in log]
    assert len(steps) == 2
    assert engine._engine.get_input_embeddings().weight.dtype == torch.bfloat16
    assert all(0 < log["rollout_corr/kl"] < 1e-2 for log in steps)  # a bf16 engine's mismatch, finite and small
