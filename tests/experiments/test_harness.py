"""The run harness the demo and the experiments share (``experiments/harness.py``): the recorder's
evaluation schedule, the rows it keeps, its score and means (against hand-computed values), its evaluator stand-in,
and that the held-out reward is evaluated in that one place."""

from __future__ import annotations

import ast
import pathlib
from types import SimpleNamespace

import pytest
import torch

from experiments.harness import HELD_OUT_N, HELD_OUT_SEED, HeldOutRewardRecorder, held_out_prompts, held_out_reward
from trl_rollout_corr.testing.toy_task import build_model, build_tokenizer, reverse_prompts

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    """A 1-layer hidden-32 policy (untrained) and 8 prompts: evaluating it samples 8 x 9 tokens."""
    return build_tokenizer(), build_model(hidden_size=32, num_layers=1, seed=3, num_heads=2), reverse_prompts(8, 6, 5)


def step(n: int):
    return SimpleNamespace(global_step=n)


def test_the_curve_starts_at_step_0_and_takes_every_eval_every_th_step(tiny):
    tok, model, prompts = tiny
    recorder = HeldOutRewardRecorder(model, tok, eval_every=5, prompts=prompts)
    for n in range(1, 13):
        recorder.on_step_end(None, step(n), None, model=model)
    assert [s for s, _ in recorder.curve] == [0, 5, 10]
    # the weights do not change here and the evaluation reseeds itself: every point is the same number
    assert len({r for _, r in recorder.curve}) == 1 and 0.0 <= recorder.curve[0][1] <= 1.0


def test_a_logged_row_is_kept_with_its_numbers_and_step_and_only_a_training_row(tiny):
    tok, model, prompts = tiny
    recorder = HeldOutRewardRecorder(model, tok, eval_every=5, prompts=prompts)
    recorder.on_log(None, step(3), None, logs={"loss": 0.5, "kl": 2, "flag": True, "name": "x", "grad_norm": 1.25})
    recorder.on_log(None, step(4), None, logs={"train_runtime": 9.0})  # the end-of-training summary: no loss
    recorder.on_log(None, step(5), None, logs=None)
    assert recorder.logs == [{"loss": 0.5, "kl": 2, "grad_norm": 1.25, "step": 3}]


def test_the_score_is_the_mean_of_the_last_20_percent_and_log_means_skip_missing_keys(tiny):
    tok, model, prompts = tiny
    recorder = HeldOutRewardRecorder(model, tok, eval_every=5, prompts=prompts)
    recorder.curve = [(0, 0.1), (5, 0.2), (7, 0.3), (8, 0.4), (10, 0.6)]
    assert recorder.tail_reward(10) == pytest.approx((0.4 + 0.6) / 2)  # steps >= 0.8 * 10
    recorder.logs = [{"kl": 1.0, "step": 10}, {"kl": 3.0, "step": 20}, {"loss": 0.0, "step": 30}]
    assert recorder.log_mean("kl") == 2.0
    assert recorder.log_mean("chi2_token") is None and recorder.log_mean("chi2_token", 0.0) == 0.0


def test_an_evaluator_samples_with_the_policy_s_weights(tiny):
    tok, model, prompts = tiny
    evaluator = build_model(hidden_size=32, num_layers=1, seed=4, num_heads=2)  # other initial weights
    recorder = HeldOutRewardRecorder(model, tok, eval_every=5, prompts=prompts, evaluator=evaluator)
    for (name, p), q in zip(model.named_parameters(), evaluator.parameters()):
        assert torch.equal(p, q), name
    assert recorder.curve[0][1] == held_out_reward(model, tok, prompts)


def test_the_held_out_prompts_are_the_fixed_set():
    assert held_out_prompts() == reverse_prompts(256, 6, seed=10_007)
    assert (HELD_OUT_N, HELD_OUT_SEED) == (256, 10_007)


def calls_of(path: pathlib.Path, name: str) -> int:
    tree = ast.parse(path.read_text(), filename=str(path))
    return sum(isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name
               for node in ast.walk(tree))


def test_the_held_out_reward_is_evaluated_in_the_harness_only():
    """The demo's worker and the experiments that train on the toy task record through the harness' recorder: no
    other module of the package or of experiments/ calls ``held_out_reward`` (issue 39: it was written three
    times)."""
    files = [*sorted((ROOT / "trl_rollout_corr").rglob("*.py")), *sorted((ROOT / "experiments").glob("*.py"))]
    callers = [str(p.relative_to(ROOT)) for p in files if calls_of(p, "held_out_reward")]
    assert callers == ["experiments/harness.py"]
