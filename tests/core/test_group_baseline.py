"""Rejected samples out of the GRPO group baseline (``rollout_rs_exclude_from_baseline``): hand-computed cases, the
plan's refusals, and the trainer's advantages against an independent float64 re-derivation."""

from __future__ import annotations

import math

import pytest
import torch

from trl_rollout_corr import RolloutCorrectionConfig as Cfg
from trl_rollout_corr.core.group_baseline import fully_rejected, group_advantages
from trl_rollout_corr.config.plan import plan_correction

ONE = torch.ones(1)


def std(xs):  # unbiased, by hand
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def test_group_scaling_by_hand():
    """Two groups of 4: [1, 0, 1, 0] with sample 0 rejected, and [2, 0, 0, 0] untouched."""
    rewards = torch.tensor([[1.0], [0.0], [1.0], [0.0], [2.0], [0.0], [0.0], [0.0]], dtype=torch.float64)
    excluded = torch.tensor([True, False, False, False, False, False, False, False])
    got = group_advantages(rewards, ONE, 4, "group", "sum_then_normalize", excluded).tolist()
    rest = [0.0, 1.0, 0.0]  # mean 1/3, std sqrt(1/3)
    s0 = std(rest)
    g1 = [2.0, 0.0, 0.0, 0.0]  # mean 0.5, std 1
    want = [0.0, (0 - 1 / 3) / (s0 + 1e-4), (1 - 1 / 3) / (s0 + 1e-4), (0 - 1 / 3) / (s0 + 1e-4),
            *[(r - 0.5) / (std(g1) + 1e-4) for r in g1]]
    assert got == pytest.approx(want, rel=1e-12)
    # with nothing left out: TRL's own numbers (rejected r = 1 counts: mean 0.5, std 2/sqrt(12) ...)
    full = group_advantages(rewards, ONE, 4, "group", "sum_then_normalize").tolist()
    s = std([1.0, 0.0, 1.0, 0.0])
    assert full[:4] == pytest.approx([(r - 0.5) / (s + 1e-4) for r in (1, 0, 1, 0)], rel=1e-12)
    none = group_advantages(rewards, ONE, 4, "none", "sum_then_normalize", excluded).tolist()
    assert none == pytest.approx([0.0, -1 / 3, 2 / 3, -1 / 3, 1.5, -0.5, -0.5, -0.5], rel=1e-12)
    batch = group_advantages(rewards, ONE, 4, "batch", "sum_then_normalize", excluded).tolist()
    sb = std([0.0, 1.0, 0.0, 2.0, 0.0, 0.0, 0.0])  # the batch std over the 7 samples left
    assert batch == pytest.approx([0.0, (0 - 1 / 3) / (sb + 1e-4), (1 - 1 / 3) / (sb + 1e-4),
                                   (0 - 1 / 3) / (sb + 1e-4), 1.5 / (sb + 1e-4), *[-0.5 / (sb + 1e-4)] * 3], rel=1e-12)


def test_normalize_then_sum_and_small_groups_by_hand():
    """Two reward functions (weights 1 and 2), one group of 3, sample 2 left out: each function is normalized over
    samples 0 and 1, then the weighted sums are normalized over the batch left (2 samples)."""
    r = torch.tensor([[1.0, 0.0], [0.0, 3.0], [5.0, 5.0]], dtype=torch.float64)
    got = group_advantages(r, torch.tensor([1.0, 2.0]), 3, "group", "normalize_then_sum",
                           torch.tensor([False, False, True])).tolist()
    z = [[(1 - 0.5) / (std([1, 0]) + 1e-4), (0 - 1.5) / (std([0, 3]) + 1e-4)],
         [(0 - 0.5) / (std([1, 0]) + 1e-4), (3 - 1.5) / (std([0, 3]) + 1e-4)]]
    s = [z[0][0] + 2 * z[0][1], z[1][0] + 2 * z[1][1]]
    m = sum(s) / 2
    assert got == pytest.approx([(s[0] - m) / (std(s) + 1e-4), (s[1] - m) / (std(s) + 1e-4), 0.0], rel=1e-9)
    # a group with one sample left has no std: its advantage is 0 (as TRL gives a lone scorable completion); all
    # left out: 0 everywhere
    lone = group_advantages(torch.tensor([[1.0], [0.0]]), ONE, 2, "group", "sum_then_normalize",
                            torch.tensor([True, False]))
    assert lone.tolist() == [0.0, 0.0]
    assert group_advantages(torch.tensor([[1.0], [0.0]]), ONE, 2, "none", "sum_then_normalize",
                            torch.tensor([True, True])).tolist() == [0.0, 0.0]


def test_fully_rejected_by_hand():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0]])
    keep = torch.tensor([[0, 0, 0], [0, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert fully_rejected(keep, mask).tolist() == [True, False, False, False]  # an empty sample is not "rejected"


def test_config_and_plan_refuse_what_cannot_be_exact():
    rs = dict(rollout_is=None, rollout_rs="sequence", rollout_rs_threshold=2.0, rollout_rs_exclude_from_baseline=True)
    with pytest.raises(ValueError, match="rollout_rs_exclude_from_baseline=True but nothing can reject"):
        Cfg(rollout_rs_exclude_from_baseline=True)
    with pytest.raises(ValueError, match="rollout_rs_exclude_from_baseline=True with rollout_m2_scope='trust_region'"):
        Cfg.m2po(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_exclude_from_baseline=True)
    kw = dict(kept_token_normalizer_losses=("dapo",), loss_type="dapo")
    # decoupled: the correction moves to generation time (a pi_old forward), even where nothing else needs it
    plan = plan_correction(Cfg(**rs), **kw)
    assert (plan.pi_old, plan.at_generation) == ("forward", True)
    assert "rollout_rs_exclude_from_baseline" in plan.describe()
    assert not plan_correction(Cfg(**{**rs, "rollout_rs_exclude_from_baseline": False}), **kw).at_generation
    with pytest.raises(ValueError, match="pi_old_source='free' with rollout_rs_exclude_from_baseline=True"):
        plan_correction(Cfg(**rs), pi_old_source="free", **kw)
    # bypass: exact with one optimizer step per generation batch, refused otherwise
    bypass = Cfg(**rs, bypass_mode=True)
    assert plan_correction(bypass, **kw).at_generation
    with pytest.raises(ValueError, match="rollout_rs_exclude_from_baseline=True with bypass_mode=True and "
                                         "gradient_accumulation_steps=1, steps_per_generation=2"):
        plan_correction(bypass, steps_per_generation=2, **kw)


def test_the_async_trainer_refuses_it(tmp_path):
    from trl_rollout_corr import RolloutCorrAsyncGRPOConfig

    with pytest.raises(ValueError, match="rollout_rs_exclude_from_baseline=True is not supported by "
                                         "RolloutCorrAsyncGRPOTrainer"):
        RolloutCorrAsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none",
                                   rollout_correction_preset="decoupled_seq_is_rs",
                                   rollout_rs_exclude_from_baseline=True)


def reference_advantages(rewards, rejected, g):
    """TRL's default (sum_then_normalize, scale_rewards='group', one reward function) in float64 by hand, the
    rejected samples left out of their group's mean and std."""
    out = []
    for start in range(0, len(rewards), g):
        rows = range(start, start + g)
        left = [rewards[i] for i in rows if not rejected[i]]
        for i in rows:
            if rejected[i] or len(left) < 2:
                out.append(0.0)
            else:
                out.append((rewards[i] - sum(left) / len(left)) / (std(left) + 1e-4))
    return out


def test_the_trainer_leaves_rejected_samples_out_of_the_baseline(tmp_path):
    from tests.support.trainer_utils import make_trainer
    from trl_rollout_corr.core.metric_names import metric
    from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine

    trainer, collector = make_trainer(tmp_path, preset="decoupled_seq_is_rs", rollout_rs_threshold_lower=0.98,
                                      rollout_rs_threshold=1.02, rollout_rs_exclude_from_baseline=True, max_steps=1,
                                      rollout_sampler=EmulatedRolloutEngine("wq3"))
    assert trainer.correction_plan.at_generation
    captured = {}
    calculate = trainer._calculate_rewards

    def spy(*args, **kwargs):
        captured["rewards"] = calculate(*args, **kwargs).clone()
        return captured["rewards"]

    trainer._calculate_rewards = spy
    trainer.model.train()
    batch = trainer._generate_and_score_completions(trainer.train_dataset.select(range(8)).to_list())
    mask = batch["completion_mask"]
    rejected = [bool(m.sum() > 0 and (m * k).sum() == 0) for m, k in zip(mask, batch["rc_keep_mask"])]
    assert any(rejected) and not all(rejected), rejected
    rewards = captured["rewards"][:, 0].double().tolist()
    want = reference_advantages(rewards, rejected, 4)
    assert batch["advantages"].double().tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)
    trl = reference_advantages(rewards, [False] * 8, 4)
    assert batch["advantages"].double().tolist() != pytest.approx(trl, rel=1e-5, abs=1e-6)  # really changed
    trainer._calculate_rewards = calculate
    trainer.train()
    log = next(entry for entry in collector.logs if "loss" in entry)
    assert 0 < log[metric("rollout_rs_baseline_excluded_fraction")] < 1
