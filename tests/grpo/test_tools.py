"""TRL's environment_factory / tools training with the correction on, and a generate whose distribution is hidden.

* With the model's real ``generate``: multi-turn rollouts (tool call, tool response masked out by ``tool_mask``,
  answer) carry pi_rollout for every generated token of every turn; on-policy in float32 it equals the trainer's
  pi_theta (|kl| ~ 1e-8), and with a stale engine the correction sees the mismatch.
* With a mocked ``generate`` (TRL's own environment_factory test does this): the samples train uncorrected, as TRL
  trains them, with one warning and ``missing_rollout_logprobs_fraction`` = 1; ``require_rollout_logprobs=True``
  makes it an error.
"""

from __future__ import annotations

import logging
import os
from unittest.mock import patch

import pytest
import torch
from datasets import Dataset

from tests.support.tool_task import PROMPTS, Counter, build_tool_model, build_tool_tokenizer
from tests.support.trainer_utils import LogCollector, spy_batches
from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer
from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine

P = "rollout_corr/"


@pytest.fixture(scope="module")
def tool_task():
    tokenizer = build_tool_tokenizer()
    model = build_tool_model(tokenizer)
    return tokenizer, {k: v.clone() for k, v in model.state_dict().items()}, model.config


def make(tmp_path, tool_task, per_device=4, max_steps=2, rollout_sampler=None, **overrides):
    tokenizer, state, config = tool_task
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(config)
    model.load_state_dict(state)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, config.eos_token_id
    args = dict(output_dir=str(tmp_path), per_device_train_batch_size=per_device, num_generations=per_device,
                max_completion_length=80, max_steps=max_steps, learning_rate=1e-4, logging_steps=1, save_strategy="no",
                report_to="none", use_cpu=True, bf16=False, seed=0, disable_tqdm=True,
                rollout_correction_preset="decoupled_token_is", rollout_rs="token", rollout_rs_threshold=2.0)
    args.update(overrides)
    collector = LogCollector()
    with patch.dict(os.environ, {"TRL_EXPERIMENTAL_SILENCE": "1"}):
        trainer = RolloutCorrGRPOTrainer(
            model=model, args=RolloutCorrGRPOConfig(**args), processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS * 8]}),
            environment_factory=Counter, callbacks=[collector], rollout_sampler=rollout_sampler)
    return trainer, collector


def train_logs(collector):
    return [log for log in collector.logs if "loss" in log]


def test_multi_turn_tool_rollouts_carry_pi_rollout_for_every_generated_token(tmp_path, tool_task):
    trainer, collector = make(tmp_path, tool_task)
    batches = spy_batches(trainer)
    trainer.train()
    logs = train_logs(collector)
    assert len(logs) == 2
    assert all(log["tools/call_frequency"] > 0 for log in logs)
    batch = batches[0]
    loss_mask = batch["completion_mask"] * batch["tool_mask"]  # (B, T) model tokens only
    assert (batch["completion_mask"] * (1 - batch["tool_mask"])).sum() > 0  # tool responses are in, masked out
    rows_with_tools = (batch["tool_mask"] * batch["completion_mask"] == 0).logical_and(batch["completion_mask"] > 0)
    assert rows_with_tools.any(-1).sum() >= 1  # multi-turn samples: tokens after the tool response were generated
    assert torch.isfinite(batch["sampling_per_token_logps"][loss_mask.bool()]).all()
    for log in logs:  # on-policy, float32: pi_rollout of every turn equals pi_theta
        assert abs(log[P + "kl"]) < 1e-5 and log[P + "max_prob_diff_max"] < 1e-4
        assert log[P + "missing_rollout_logprobs_fraction"] == 0.0 and log[P + "rejected_token_fraction"] == 0.0


def test_a_stale_tool_rollout_engine_is_corrected(tmp_path, tool_task):
    trainer, collector = make(tmp_path, tool_task, max_steps=3, learning_rate=1e-3,
                              rollout_sampler=EmulatedRolloutEngine("stale", lag=1))
    trainer.train()
    logs = train_logs(collector)
    assert abs(logs[0][P + "kl"]) < 1e-5  # step 0: the engine has the policy's weights
    # afterwards it lags one step: the mismatch is seen on multi-turn tool rollouts
    lagging = [log for log in logs[1:] if log["tools/call_frequency"] > 0]
    assert lagging and all(abs(log[P + "kl"]) > 1e-4 and log[P + "rollout_is_std"] > 1e-3 for log in lagging)


def fake_generate_factory(tokenizer):
    """TRL's own test pattern: token ids returned without sampling (one call, one bad tool name, no call)."""
    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    first = [encode('<tool_call>{"name": "increment", "arguments": {"step": 1}}</tool_call><|im_end|>'),
             encode('<tool_call>{"name": "decrement", "arguments": {"step": 2}}</tool_call><|im_end|>'),
             encode("I won't increment<|im_end|>")]
    then = encode("Done!<|im_end|>")

    def fake_generate(input_ids, **kwargs):
        rows = first if input_ids.shape[0] == 3 else [then] * input_ids.shape[0]
        width = max(len(r) for r in rows)
        completions = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=input_ids.device)
        assert all(r[-1] == eos for r in rows)
        return torch.cat([input_ids, completions], dim=-1)

    return fake_generate


def test_a_mocked_generate_trains_uncorrected_like_trl_warns_once_and_counts(tmp_path, tool_task, caplog):
    trainer, collector = make(tmp_path, tool_task, per_device=3, max_steps=3, learning_rate=0.1)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with patch.object(trainer.model, "generate", side_effect=fake_generate_factory(tool_task[0])), \
            caplog.at_level(logging.WARNING, logger="trl_rollout_corr.grpo.trainer"):
        trainer.train()
    logs = train_logs(collector)
    assert len(logs) == 3
    for log in logs:
        assert log["tools/call_frequency"] == pytest.approx(2 / 3) and log["tools/failure_frequency"] == 0.5
        assert log[P + "missing_rollout_logprobs_fraction"] == 1.0 and log[P + "rejected_token_fraction"] == 0.0
    assert caplog.text.count("have no rollout log-probs") == 1
    assert "transformers generate" in caplog.text
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())  # it trained
    assert trainer.environments[0]._counter == 1 and trainer.environments[1]._counter == 0


def test_a_mocked_generate_is_an_error_when_log_probs_are_required(tmp_path, tool_task):
    trainer, _ = make(tmp_path, tool_task, per_device=3, max_steps=1, require_rollout_logprobs=True)
    with patch.object(trainer.model, "generate", side_effect=fake_generate_factory(tool_task[0])), \
            pytest.raises(ValueError, match="Sample 0: the model's generate returned tokens without running its "
                                            "sampling distribution"):
        trainer.train()


# ---------------------------------------------------------------------------------------------- TRL's agent scenarios
# The two scenarios of TRL's own tests that failed with this package's classes swapped in (issue 38 item 4), rebuilt
# on the local tool task. Neither fails here at fb6f0b7 (see docs/testing.md): they pin the behaviour.
def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def length_reward(completions, **_):
    return [float(len(str(c)) % 3) for c in completions]


def fake_rows(tokenizer, texts, calls):
    """A fake generate that returns ``texts`` (then "Done!") as token ids, counting its calls by batch size."""
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    done = tokenizer("Done!<|im_end|>", add_special_tokens=False)["input_ids"]

    def fake_generate(input_ids, **kwargs):
        calls.append(input_ids.shape[0])
        chosen = rows if input_ids.shape[0] == len(rows) else [done] * input_ids.shape[0]
        width = max(len(r) for r in chosen)
        completions = torch.tensor([r + [0] * (width - len(r)) for r in chosen], device=input_ids.device)
        return torch.cat([input_ids, completions], dim=-1)

    return fake_generate


def test_malformed_tool_calls_train_without_a_second_generation(tmp_path, tool_task):
    tokenizer, state, config = tool_task
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(config)
    model.load_state_dict(state)
    args = RolloutCorrGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=3, num_generations=3,
                                 max_completion_length=128, max_steps=2, learning_rate=0.1, logging_steps=1,
                                 save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=0,
                                 disable_tqdm=True)
    collector = LogCollector()
    trainer = RolloutCorrGRPOTrainer(
        model=model, reward_funcs=length_reward, args=args, processing_class=tokenizer, tools=[multiply],
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS * 2]}),
        callbacks=[collector])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    calls = []
    malformed = ['<tool_call>{"arguments": {"a": 3, "b": 4}}</tool_call><|im_end|>',  # no name
                 '<toolcall>{"arguments": {"a": 3, "b": 4}}</toolcall><|im_end|>',  # not the call markers
                 '<tool_call>{"arguments": {a: 3, b: 4}}</tool_call><|im_end|>']  # not JSON
    with patch.object(trainer.model, "generate", side_effect=fake_rows(tokenizer, malformed, calls)):
        trainer.train()
    assert calls == [3, 3]  # no tool ran, so no second generation
    logs = train_logs(collector)
    assert len(logs) == 2 and all(log["tools/call_frequency"] == 0.0 for log in logs)
    assert all(log[P + "missing_rollout_logprobs_fraction"] == 1.0 for log in logs)
    assert all(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())  # every parameter moved


def test_each_environment_of_several_gets_its_own_tool_calls(tmp_path, tool_task):
    tokenizer, state, config = tool_task
    from transformers import Qwen2ForCausalLM

    seen = {"increment": [], "shout": []}

    class CounterEnv:
        def reset(self, **kwargs):
            assert "environment" not in kwargs
            return "Count."

        def increment(self, step: int) -> int:
            """
            Increment the counter.

            Args:
                step: Value to add.

            Returns:
                The value.
            """
            seen["increment"].append(step)
            return step

    class EchoEnv:
        def reset(self, **kwargs):
            return "Echo."

        def shout(self, text: str) -> str:
            """
            Shout the text.

            Args:
                text: Text to shout.

            Returns:
                The text in upper case.
            """
            seen["shout"].append(text)
            return text.upper()

    model = Qwen2ForCausalLM(config)
    model.load_state_dict(state)
    args = RolloutCorrGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                                 shuffle_dataset=False, max_completion_length=80, max_steps=2, learning_rate=0.1,
                                 logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
                                 seed=0, disable_tqdm=True)
    collector = LogCollector()
    with patch.dict(os.environ, {"TRL_EXPERIMENTAL_SILENCE": "1"}):
        trainer = RolloutCorrGRPOTrainer(
            model=model, reward_funcs=length_reward, args=args, processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"environment": ["counter", "echo"] * 4}),
            environment_factory={"counter": CounterEnv, "echo": EchoEnv}, callbacks=[collector])
    calls = []
    first = ['<tool_call>{"name": "increment", "arguments": {"step": 1}}</tool_call><|im_end|>', "I won't<|im_end|>",
             '<tool_call>{"name": "shout", "arguments": {"text": "hi"}}</tool_call><|im_end|>', "Done!<|im_end|>"]
    with patch.object(trainer.model, "generate", side_effect=fake_rows(tokenizer, first, calls)):
        trainer.train()
    assert calls == [4, 2, 4, 2]  # per step: the batch, then the two rows that called a tool
    assert seen == {"increment": [1, 1], "shout": ["hi", "hi"]}
    logs = train_logs(collector)
    assert all(log["tools/call_frequency"] == 0.5 and log["tools/failure_frequency"] == 0.0 for log in logs)
    assert all(log[P + "missing_rollout_logprobs_fraction"] == 1.0 for log in logs)
