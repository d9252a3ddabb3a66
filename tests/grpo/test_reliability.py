"""Bad inputs, numerical extremes and checkpoint/resume: a clear error, or a handled path counted in a metric."""

import math

import pytest
import torch

from tests.grpo.test_rollout_func import TOK, build, make_rollout_func
from tests.support.trainer_utils import make_trainer
from trl_rollout_corr.cli.main import parse_train_args


def first_log(logs):
    return [entry for entry in logs.logs if "loss" in entry][0]


def assert_finite(log):
    bad = {k: v for k, v in log.items() if isinstance(v, float) and not math.isfinite(v)}
    assert not bad, bad


@pytest.mark.parametrize("body,match", [
    ("rollout_rs: token\n", "needs rollout_rs_threshold"),
    ("rollout_correction_preset: no_such_preset\n", "Unknown rollout correction preset"),
    ("rollout_rs: sequence\nrollout_rs_threshold: 2.0\nrollout_rs_threshold_lower: 3.0\n", "must be <="),
    ("rollout_token_veto_threshold: 0\n", "rollout_token_veto_threshold must be a finite number > 0"),
    ("vllm_importance_sampling_correction: true\nrollout_correction_preset: pg_is\n", "name one correction"),
    ("vllm_importance_sampling_mode: token_clip\n", "TRL's modes are token_truncate"),
    ("rollout_rs_criteria: token_k9\nrollout_rs_criteria_threshold: '1.0'\n", "unknown criteria"),
])
def test_invalid_yaml_recipe_fails_at_parse_naming_the_field(tmp_path, body, match):
    path = tmp_path / "recipe.yaml"
    path.write_text("model_name_or_path: some/model\noutput_dir: out\nuse_cpu: true\n" + body)
    with pytest.raises(ValueError, match=match):
        parse_train_args(["--config", str(path)])


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["+inf", "-inf", "nan"])
def test_non_finite_engine_logprobs_reject_the_sequence_and_are_counted(tmp_path, bad):
    def lps(ids):  # one sequence in three carries a bad value (an engine's -inf for a token it sampled, ...)
        return [bad if ids[0] == 5 else -0.5] + [-0.5] * (len(ids) - 1)

    trainer, logs = build(tmp_path, make_rollout_func(logprobs_of=lps), "decoupled_seq_is_rs")
    trainer.train()
    log = first_log(logs)
    assert_finite(log)
    assert 0 < log["rollout_corr/invalid_logprob_fraction"] < 1
    assert log["rollout_corr/rejected_token_fraction"] >= log["rollout_corr/invalid_logprob_fraction"]


def test_tool_tokens_masked_by_env_mask_leave_the_correction(tmp_path):
    """The last token of each completion is an environment/tool token (env_mask 0) with an absurd log-prob."""
    def rollout_func(prompts, trainer):
        completion_ids = [[5 + (i % 3), 6, 7, 1] for i in range(len(prompts))]
        return {"prompt_ids": [TOK(p)["input_ids"] for p in prompts], "completion_ids": completion_ids,
                "logprobs": [[-0.5, -0.5, float("nan"), -0.5] for _ in completion_ids],
                "env_mask": [[1, 1, 0, 1] for _ in completion_ids]}

    trainer, logs = build(tmp_path, rollout_func, "decoupled_geo_rs")
    assert trainer.rollout_correction.rollout_token_veto_threshold == 1e-4  # the preset's veto
    trainer.train()
    log = first_log(logs)
    assert_finite(log)
    assert log["rollout_corr/invalid_logprob_fraction"] == 0.0  # the NaN sits on a masked tool token
    assert log["rollout_corr/rollout_is_veto_fraction"] == 0.0


def test_an_empty_completion_is_a_clear_error_naming_the_sample(tmp_path):
    def rollout_func(prompts, trainer):
        completion_ids = [[] if i == 1 else [5, 6, 1] for i in range(len(prompts))]
        return {"prompt_ids": [TOK(p)["input_ids"] for p in prompts], "completion_ids": completion_ids,
                "logprobs": [[-0.5] * len(c) for c in completion_ids]}

    trainer, _ = build(tmp_path, rollout_func, "pg_rs")
    with pytest.raises(ValueError, match="Sample 1: the rollout_func returned an empty completion"):
        trainer.train()


def test_completions_of_very_different_lengths_pad_to_all_padding_tails(tmp_path):
    def rollout_func(prompts, trainer):  # a single EOS next to long completions: rows that are mostly padding
        completion_ids = [[1] if i % 2 else [5, 6, 7, 8, 9, 1] for i in range(len(prompts))]
        return {"prompt_ids": [TOK(p)["input_ids"] for p in prompts], "completion_ids": completion_ids,
                "logprobs": [[-0.5] * len(c) for c in completion_ids]}

    trainer, logs = build(tmp_path, rollout_func, "pg_rs")
    trainer.train()
    assert_finite(first_log(logs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("preset", ["decoupled_token_is", "ppo_is_bypass"])
def test_low_precision_training_gives_finite_loss_and_metrics(tmp_path, dtype, preset):
    from trl_rollout_corr.testing.toy_task import build_model

    model = build_model(hidden_size=32).to(dtype)  # low-precision weights: the policy and pi_rollout both in dtype
    trainer, logs = make_trainer(tmp_path, model=model, preset=preset, max_steps=2, bf16=dtype == torch.bfloat16)
    trainer.train()
    for log in [entry for entry in logs.logs if "loss" in entry]:
        assert_finite(log)
        assert abs(log["rollout_corr/kl"]) < 0.05  # on-policy: only rounding separates the two sides


def test_resume_continues_identically_to_an_uninterrupted_run(tmp_path):
    """Same seed, an engine whose output is a function of the prompt: steps 3-4 after resume == uninterrupted."""
    from tests.support.dist_worker import fixed_rollout_func
    from trl_rollout_corr import RolloutCorrGRPOTrainer

    def run(out, max_steps, resume=None, save_steps=None):
        base, logs = make_trainer(out, preset="decoupled_seq_is_rs", max_steps=max_steps,
                                  save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500)
        trainer = RolloutCorrGRPOTrainer(model=base.model, reward_funcs=base.reward_funcs, args=base.args,
                                         train_dataset=base.train_dataset, processing_class=TOK,
                                         rollout_func=fixed_rollout_func(TOK), callbacks=[logs])
        trainer.train(resume_from_checkpoint=resume)
        return {int(round(entry["epoch"] * 32)): entry for entry in logs.logs if "loss" in entry}

    full = run(tmp_path / "full", 4)
    run(tmp_path / "part", 2, save_steps=2)
    resumed = run(tmp_path / "resumed", 4, resume=str(tmp_path / "part" / "checkpoint-2"))
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        diffs = {key: (value, resumed[step][key]) for key, value in full[step].items()
                 if (key.startswith("rollout_corr/") or key in ("loss", "reward"))
                 and resumed[step][key] != pytest.approx(value, rel=1e-5, abs=1e-7)}
        assert not diffs, (step, diffs)
    saved = (tmp_path / "part" / "checkpoint-2" / "rollout_correction_config.json").read_text()
    assert '"rollout_rs": "sequence"' in saved
