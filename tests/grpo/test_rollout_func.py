"""The rollout_func path (SGLang / remote / async engines) and the vLLM hand-over we consume."""

import logging
import math

import pytest

from tests.support.trainer_utils import make_trainer
from trl_rollout_corr import RolloutCorrGRPOTrainer
from trl_rollout_corr.testing.toy_task import build_tokenizer, reverse_reward

TOK = build_tokenizer()


def make_rollout_func(logprobs_of=lambda ids: [-0.7] * len(ids), drop_key=False):
    def rollout_func(prompts, trainer):
        prompt_ids = [TOK(p)["input_ids"] for p in prompts]
        completion_ids = [[5 + (i % 3), 6, 1] for i in range(len(prompts))]
        out = {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
               "logprobs": [logprobs_of(c) for c in completion_ids]}
        if drop_key:
            out["logprobs"] = None
        return out
    return rollout_func


def build(tmp_path, rollout_func, preset="decoupled_token_is", **overrides):
    trainer, col = make_trainer(tmp_path, preset=preset, max_steps=overrides.pop("max_steps", 1), **overrides)
    t = RolloutCorrGRPOTrainer(model=trainer.model, reward_funcs=reverse_reward, args=trainer.args,
                               train_dataset=trainer.train_dataset, processing_class=TOK, rollout_func=rollout_func,
                               callbacks=[col])
    return t, col


@pytest.mark.parametrize("preset", ["decoupled_seq_is_rs", "pg_rs"])
def test_rollout_func_logprobs_reach_the_loss(tmp_path, preset):
    trainer, col = build(tmp_path, make_rollout_func(), preset)
    trainer.train()
    log = [entry for entry in col.logs if "loss" in entry][0]
    assert math.isfinite(log["loss"])
    # the engine claims log p = -0.7 for every token: rollout_log_ppl is exactly 0.7
    assert log["rollout_corr/rollout_log_ppl"] == pytest.approx(0.7, abs=1e-6)


def test_rollout_func_without_logprobs_trains_uncorrected_warns_once_and_counts(tmp_path, caplog):
    trainer, col = build(tmp_path, make_rollout_func(drop_key=True), "decoupled_seq_is_rs", max_steps=2)
    with caplog.at_level(logging.WARNING, logger="trl_rollout_corr.grpo.trainer"):
        trainer.train()
    logs = [entry for entry in col.logs if "loss" in entry]
    assert len(logs) == 2 and all(math.isfinite(log["loss"]) for log in logs)
    assert all(log["rollout_corr/missing_rollout_logprobs_fraction"] == 1.0 for log in logs)
    assert all(log["rollout_corr/rejected_token_fraction"] == 0.0 for log in logs)  # nothing rejected
    assert caplog.text.count("have no rollout log-probs") == 1  # warned once, not per step
    assert "require_rollout_logprobs=True" in caplog.text


def test_rollout_logprobs_present_stay_quiet(tmp_path, caplog):
    trainer, col = build(tmp_path, make_rollout_func())
    with caplog.at_level(logging.WARNING, logger="trl_rollout_corr.grpo.trainer"):
        trainer.train()
    log = [entry for entry in col.logs if "loss" in entry][0]
    assert log["rollout_corr/missing_rollout_logprobs_fraction"] == 0.0
    assert "rollout log-probs" not in caplog.text


def test_require_rollout_logprobs_makes_missing_logprobs_an_error(tmp_path):
    trainer, _ = build(tmp_path, make_rollout_func(drop_key=True), require_rollout_logprobs=True)
    with pytest.raises(ValueError,
                       match=r"Sample 0: the rollout engine \(rollout_func\) returned no per-token log-probs"):
        trainer.train()


def test_misaligned_logprobs_name_the_sample(tmp_path):
    trainer, _ = build(tmp_path, make_rollout_func(logprobs_of=lambda ids: [-0.5] * (len(ids) - 1)))
    with pytest.raises(ValueError, match="Sample 0: 2 rollout log-probs for 3 completion tokens"):
        trainer.train()


def test_nested_topk_logprobs_are_refused(tmp_path):
    trainer, _ = build(tmp_path, make_rollout_func(logprobs_of=lambda ids: [[-0.5]] * len(ids)))
    with pytest.raises(ValueError, match="not a float"):
        trainer.train()


def test_none_and_nan_entries_from_an_engine_are_rejected_and_counted(tmp_path):
    # vLLM hands NaN log-probs over as None (TRL turns them into NaN): the sequence leaves the loss
    def lps(ids):
        return [None if ids[0] == 5 else -0.5] + [-0.5] * (len(ids) - 1)

    trainer, col = build(tmp_path, make_rollout_func(logprobs_of=lps), "ppo_is_bypass")
    trainer.train()
    log = [entry for entry in col.logs if "loss" in entry][0]
    assert math.isfinite(log["loss"])
    assert 0 < log["rollout_corr/invalid_logprob_fraction"] < 1
