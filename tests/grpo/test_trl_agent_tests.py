"""TRL's own agent tests (issue 38), with TRL's fixed Qwen3 token ids, for TRL's classes and this package's.

``TestGRPOTrainer::test_train_with_malformed_tool_calls`` and ``::test_train_with_multiple_environments`` of TRL's
``tests/test_grpo_trainer.py`` (read, not vendored: the bodies below follow them line by line) mock ``model.generate``
to return fixed Qwen3 token ids. They run here on the stand-ins of :mod:`qwen3_standin`: a tokenizer in which every id
the tests use decodes to the text it decodes to with Qwen3's tokenizer (checked below against the tests' own
comments), with the Hub tokenizer's chat template, and TRL's tiny Qwen3-MoE and Qwen2 reward model shapes, loaded
from a path string as TRL loads them from a Hub id. Each test runs with ``GRPOTrainer``/``GRPOConfig`` and with
``RolloutCorrGRPOTrainer``/``RolloutCorrGRPOConfig``.

Bodies followed: TRL 1.10.0.dev (huggingface/trl, 2026-07-24). No TRL 1.16.0 tree could be had; the newest found,
the fork ingambe/trl at 02f6a1a2 and c43d0079 (between TRL 1.14.0 and 1.15.0 by its ``grpo_trainer.py`` imports
against the PyPI wheels), has both bodies unchanged line for line; only TRL's skip mark changed, ``@require_jmespath``
to ``@require_response_parsing``, which skips neither with transformers 5.17 (docs/testing.md).

Changes from TRL's bodies, all for a CPU (on a CUDA machine there are none: the bodies run as TRL wrote them, TRL's
defaults and its Triton log-prob kernels included): ``use_cpu=True`` (TRL's default ``bf16=True`` needs a GPU
otherwise; bf16 autocast stays on), ``max_steps=3`` where TRL trains 3 epochs (51 and 24 steps), and TRL's fused
log-prob scores only the completion positions, as it does on a GPU (on a CPU it scores every prompt position too:
5x slower here, same values). Each test takes ~10-20 s on the 2-core machine (two 150k-vocabulary models built once
per module, then trainer construction and 3 steps with a 151,936-row LM head): the reason they are over the usual few
seconds.
On one NVIDIA H200 (2026-11-27, TRL's bodies as written) all five passed in 45 s (docs/testing.md).
"""

from __future__ import annotations

import os
from unittest.mock import patch

import pytest
import torch
from datasets import Dataset

from tests.support.qwen3_standin import build_qwen_tokenizer, saved_standins, zen_conversational_prompts
from trl import GRPOConfig, GRPOTrainer
from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

CLASSES = {"trl": (GRPOConfig, GRPOTrainer), "rollout_corr": (RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer)}
# On a CUDA machine TRL's bodies run as TRL wrote them (TRL's defaults: bf16 on the GPU, 3 epochs, TRL's Triton
# fused log-prob); on a CPU with the changes of the module docstring.
ON_GPU = torch.cuda.is_available()
ON_CPU = {} if ON_GPU else dict(use_cpu=True, max_steps=3)

# TRL's mocked completions, with TRL's comments (the text Qwen3's tokenizer decodes them to)
PAD = 151643
MALFORMED = [
    ('<tool_call>\n{"arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',
     [151657, 198, 4913, 16370, 788, 5212, 64, 788, 220, 18, 11, 330, 65, 788, 220, 19, 11248, 151658, 151645]
     + [PAD] * 5),
    ('<toolcall>\n{"arguments": {"a": 3, "b": 4}}\n</toolcall><|im_end|>',
     [27, 14172, 6659, 397, 4913, 16370, 788, 5212, 64, 788, 220, 18, 11, 330, 65, 788, 220, 19, 11248, 522, 14172,
      6659, 29, 151645]),
    ('<tool_call>\n{"arguments": {a: 3, b: 4}}\n</tool_call><|im_end|>',
     [151657, 198, 4913, 16370, 788, 314, 64, 25, 220, 18, 11, 293, 25, 220, 19, 11248, 151658, 151645] + [PAD] * 6)]
ENVIRONMENTS = [
    ('<tool_call>\n{"name": "increment", "arguments": {"step": 1}}\n</tool_call><|im_end|>',
     [151657, 198, 4913, 606, 788, 330, 35744, 497, 330, 16370, 788, 5212, 9520, 788, 220, 16, 11248, 151658, 151645,
      PAD]),
    ("I won't<|im_end|>", [40, 2765, 944, 151645] + [PAD] * 16),
    ('<tool_call>\n{"name": "shout", "arguments": {"text": "hi"}}\n</tool_call><|im_end|>',
     [151657, 198, 4913, 606, 788, 330, 927, 411, 497, 330, 16370, 788, 5212, 1318, 788, 330, 6023, 95642, 151658,
      151645]),
    ("Done!<|im_end|>", [17453, 0, 151645] + [PAD] * 17)]
DONE = ("Done!<|im_end|>", [17453, 0, 151645])


@pytest.fixture(scope="module")
def hub_standins(tmp_path_factory):
    return saved_standins(str(tmp_path_factory.mktemp("hub")))


@pytest.fixture(autouse=True)
def _compact_fused_logprob(monkeypatch):
    """TRL's fused log-prob scores only the completion positions, as on a GPU (``_use_triton`` is its switch)."""
    if ON_GPU:  # TRL's own choice on a GPU: its Triton kernels
        return
    import trl.trainer.utils as trl_utils

    monkeypatch.setattr(trl_utils, "_use_triton", lambda device: True)


def test_the_standin_ids_decode_as_trls_comments_say():
    """Each mocked row of TRL's two tests decodes to the text TRL's comment gives for it (Qwen3's decoding)."""
    tokenizer = build_qwen_tokenizer()
    for text, ids in [*MALFORMED, *ENVIRONMENTS, DONE]:
        decoded = tokenizer.decode(ids)
        assert decoded.removesuffix("<|endoftext|>" * ids.count(PAD)) == text
    # <tool_call> is not a special token in Qwen3: TRL's fallback decode (skip_special_tokens) keeps it
    assert tokenizer.decode(MALFORMED[0][1], skip_special_tokens=True) == MALFORMED[0][0].removesuffix("<|im_end|>")
    assert len(tokenizer) == 151669 and tokenizer.convert_ids_to_tokens(151667) == "<think>"


def assert_trained_uncorrected(trainer, classes):
    """Not in TRL's tests: a mocked ``generate`` has no pi_rollout, so with this package's classes every sample is
    counted missing and trains uncorrected, nothing rejected (rejecting them all leaves every parameter unchanged:
    TRL's own last assertion then fails)."""
    if classes == "rollout_corr":
        last = trainer.state.log_history[-1]
        assert last["rollout_corr/missing_rollout_logprobs_fraction"] == 1.0
        assert last["rollout_corr/rejected_token_fraction"] == 0.0


def multiply_tool(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


@pytest.mark.parametrize("classes", list(CLASSES))
def test_train_with_malformed_tool_calls(tmp_path, hub_standins, classes):
    config_class, trainer_class = CLASSES[classes]
    model_path, reward_path = hub_standins
    dataset = zen_conversational_prompts()

    training_args = config_class(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        per_device_train_batch_size=3,  # reduce the batch size to reduce memory usage
        num_generations=3,  # reduce the number of generations to reduce memory usage
        max_completion_length=128,
        report_to="none",
        **ON_CPU,
    )
    trainer = trainer_class(model=model_path, reward_funcs=reward_path, args=training_args, train_dataset=dataset,
                            tools=[multiply_tool])

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}

    def fake_generate(input_ids, **kwargs):
        # If input_ids.shape[0] < 3, it means that it's a second call, which should not happen here
        assert input_ids.shape[0] == 3
        completion_ids = torch.tensor([ids for _, ids in MALFORMED], device=input_ids.device)
        return torch.cat([input_ids, completion_ids], dim=-1)

    with patch.object(trainer.model, "generate", side_effect=fake_generate):
        trainer.train()

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_trained_uncorrected(trainer, classes)

    # Check that the params have changed
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


@pytest.mark.parametrize("classes", list(CLASSES))
@patch.dict(os.environ, {"TRL_EXPERIMENTAL_SILENCE": "1"})
def test_train_with_multiple_environments(tmp_path, hub_standins, classes):
    config_class, trainer_class = CLASSES[classes]
    model_path, reward_path = hub_standins
    dataset = Dataset.from_dict({"environment": ["counter", "echo"] * 8})

    reset_kwargs_seen = {"counter": [], "echo": []}
    tool_calls_made = {"increment": [], "shout": []}

    class CounterEnvironment:
        def reset(self, **kwargs):
            reset_kwargs_seen["counter"].append(kwargs)
            return "Count."

        def increment(self, step: int) -> int:
            """
            Increment the internal counter.

            Args:
                step: Value to add to the counter.

            Returns:
                The updated counter value.
            """
            tool_calls_made["increment"].append(step)
            return step

    class EchoEnvironment:
        def reset(self, **kwargs):
            reset_kwargs_seen["echo"].append(kwargs)
            return "Echo."

        def shout(self, text: str) -> str:
            """
            Shout the given text.

            Args:
                text: Text to shout.

            Returns:
                The text in upper case.
            """
            tool_calls_made["shout"].append(text)
            return text.upper()

    training_args = config_class(
        output_dir=str(tmp_path),
        learning_rate=0.1,  # use higher lr because gradients are tiny and default lr can stall updates
        per_device_train_batch_size=4,  # 2 prompts x 2 generations, so a batch mixes both environments
        num_generations=2,
        shuffle_dataset=False,  # keep the [counter, counter, echo, echo] batch layout deterministic
        report_to="none",
        **ON_CPU,
    )

    trainer = trainer_class(model=model_path, reward_funcs=reward_path, args=training_args, train_dataset=dataset,
                            environment_factory={"counter": CounterEnvironment, "echo": EchoEnvironment})

    # Each environment exposes only its own tool.
    assert [tool.__name__ for tool in trainer._env_tools["counter"]] == ["increment"]
    assert [tool.__name__ for tool in trainer._env_tools["echo"]] == ["shout"]
    # The probe instances seed the reuse pool, so they are not wasted.
    assert len(trainer._environment_pool["counter"]) == 1
    assert len(trainer._environment_pool["echo"]) == 1

    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}
    calls = []

    def fake_generate(input_ids, **kwargs):
        calls.append(input_ids.shape[0])
        if input_ids.shape[0] == 4:  # first generation: batch is [counter, counter, echo, echo]
            completion_ids = torch.tensor([ids for _, ids in ENVIRONMENTS], device=input_ids.device)
        else:  # regeneration after tool execution: only the two examples that issued a (valid) tool call
            completion_ids = torch.tensor([DONE[1], DONE[1]], device=input_ids.device)
        return torch.cat([input_ids, completion_ids], dim=-1)

    with patch.object(trainer.model, "generate", side_effect=fake_generate):
        trainer.train()

    # not in TRL's test: one regeneration per step, for the two rows that called a tool
    assert calls == [4, 2] * trainer.state.global_step
    assert trainer.state.log_history[-1]["train_loss"] is not None
    # The tool call from the counter example ran `increment` (defined only on CounterEnvironment) and the one from
    # the echo example ran `shout` (defined only on EchoEnvironment): each rollout dispatched to its own tools.
    assert tool_calls_made["increment"]
    assert tool_calls_made["shout"]
    # 2 of the 4 rollouts issued a tool call, and both calls succeeded.
    assert trainer.state.log_history[-1]["tools/call_frequency"] == pytest.approx(2 / 4)
    assert trainer.state.log_history[-1]["tools/failure_frequency"] == pytest.approx(0.0)
    # Both environments were selected and reset, and `environment` is a control field not forwarded to `reset`.
    assert reset_kwargs_seen["counter"] and reset_kwargs_seen["echo"]
    assert all("environment" not in kwargs for kwargs in reset_kwargs_seen["counter"] + reset_kwargs_seen["echo"])
    assert_trained_uncorrected(trainer, classes)

    # Check that the params have changed
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."
