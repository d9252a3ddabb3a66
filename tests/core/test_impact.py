"""The "does it hurt?" metrics (core/impact.py): gradient share pinned / masked, k3 per completion length, T*KL.

Each number is checked against a hand computation written out below (float64 ``math``, no code of the package), on
split batches against the whole batch, and in both trainers against the same formulas.
"""

from __future__ import annotations

import trl_rollout_corr  # noqa: F401  (first: its CPU-torch guard)

import math
import os

import pytest
import torch

from trl_rollout_corr.core import compute_rollout_correction_stats, finalize_stats
from trl_rollout_corr.core.impact import GRAD_SHARE_METRICS, LENGTH_METRICS, T_KL_METRICS
from trl_rollout_corr.core.stats import RolloutStats

P = "rollout_corr/"
IMPACT = (*GRAD_SHARE_METRICS, *LENGTH_METRICS, *T_KL_METRICS)
ln = math.log


def k3(log_rho: float) -> float:
    return math.exp(log_rho) - 1.0 - log_rho


def batch(rows: list[list[float]], width: int | None = None):
    """log pi_train = the row's log rho, log pi_rollout = 0; padding beyond each row."""
    width = width or max(len(r) for r in rows)
    train = torch.zeros(len(rows), width)  # (B, T)
    mask = torch.zeros(len(rows), width)  # (B, T)
    for i, r in enumerate(rows):
        train[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return train, torch.zeros_like(train), mask


def metrics_of(rows, **kw):
    train, rollout, mask = batch(rows)
    return finalize_stats(compute_rollout_correction_stats(train, rollout, mask, **kw).stats)


# ------------------------------------------------------------------------------------------------ gradient share
def test_grad_share_by_hand_token_is_with_token_rs():
    # C = 2 (truncate), token RS keeps 0.4 <= rho <= 2.5
    rows = [[ln(2.2), 0.0, 0.0],  # A = 1:    token 0 pinned at C (2.2 > 2, kept by RS)
            [0.0, ln(0.2)],  # A = -2:        token 1 rejected by RS (0.2 < 0.4)
            [ln(3.0), 0.0]]  # A = 0.5:       token 0 rejected (3 > 2.5): dropped, not pinned
    adv = torch.tensor([1.0, -2.0, 0.5])
    m = metrics_of(rows, rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token", rollout_rs_threshold=2.5,
                   rollout_rs_threshold_lower=0.4, advantages=adv)
    total = 3 * 1.0 + 2 * 2.0 + 2 * 0.5  # sum |A_t| over the 7 trained tokens = 8
    assert m[P + "grad_share_pinned"] == pytest.approx(1.0 / total)  # 0.125
    assert m[P + "grad_share_masked"] == pytest.approx((2.0 + 0.5) / total)  # 0.3125
    assert m[P + "rejected_token_fraction"] == pytest.approx(2 / 7)  # the token count weighs the rows alike


def test_grad_share_by_hand_sequence_is_and_a_zero_advantage_group():
    # sequence IS, C = 2: rho_seq = exp(sum log rho); row 0: 3.0 (pinned: all its 2 tokens), row 1: 1.2, row 2: 4.0
    # but A = 0 (a group of equal rewards: no gradient, no weight in the share)
    rows = [[ln(1.5), ln(2.0)], [ln(1.2), 0.0, 0.0], [ln(4.0)]]
    adv = torch.tensor([-0.5, 1.5, 0.0])
    m = metrics_of(rows, rollout_is="sequence", rollout_is_threshold=2.0, advantages=adv)
    total = 2 * 0.5 + 3 * 1.5 + 1 * 0.0  # 5.5
    assert m[P + "grad_share_pinned"] == pytest.approx(2 * 0.5 / total)
    assert m[P + "grad_share_masked"] == 0.0
    assert m[P + "rollout_is_ratio_fraction_high"] == pytest.approx(2 / 3)  # the sequence count says 2 of 3


def test_grad_share_masked_bound_lower_clip_invalid_and_unseen_rows():
    # token IS with rollout_is_bound="mask", C = 2, C_lower = 0.5: rho outside [0.5, 2] gets weight 0 (dropped)
    rows = [[ln(2.5), 0.0], [ln(0.25), 0.0], [0.0, 0.0], [0.0]]
    train, rollout, mask = batch(rows)
    rollout[2, 1] = float("nan")  # row 2: a non-finite log-prob rejects the sequence (dropped)
    seen = torch.tensor([True, True, True, False])  # row 3: no pi_rollout, trained uncorrected (in the total only)
    adv = torch.tensor([1.0, 2.0, 3.0, 4.0])
    m = finalize_stats(compute_rollout_correction_stats(
        train, rollout, mask, rollout_is="token", rollout_is_threshold=2.0, rollout_is_threshold_lower=0.5,
        rollout_is_bound="mask", rollout_seen=seen, advantages=adv).stats)
    total = 2 * 1 + 2 * 2 + 2 * 3 + 1 * 4  # 16
    assert m[P + "grad_share_masked"] == pytest.approx((1 + 2 + 2 * 3) / total)
    assert m[P + "grad_share_pinned"] == 0.0  # a masked bound pins nothing
    # truncate with the same lower clip: rho = 2.5 pinned at C, rho = 0.25 pinned at C_lower
    m = finalize_stats(compute_rollout_correction_stats(
        train, rollout, mask, rollout_is="token", rollout_is_threshold=2.0, rollout_is_threshold_lower=0.5,
        rollout_seen=seen, advantages=adv).stats)
    assert m[P + "grad_share_pinned"] == pytest.approx((1 + 2) / total)
    assert m[P + "grad_share_masked"] == pytest.approx(2 * 3 / total)


def test_grad_share_counts_m2po_s_zeroed_advantages():
    # M2PO trust region, tau = 0.01: row 0 (A > 0) has rho_0 = e^0.5 > 1 on the active side, (0.5)^2 > tau: zeroed
    rows = [[0.5, 0.0], [0.0, 0.0]]
    adv = torch.tensor([2.0, -1.0])
    m = metrics_of(rows, rollout_m2_threshold=0.01, rollout_m2_scope="trust_region", advantages=adv)
    assert m[P + "rollout_m2_masked_fraction"] == pytest.approx(0.25)
    assert m[P + "grad_share_masked"] == pytest.approx(2.0 / (2 * 2 + 2 * 1))


def test_no_advantages_no_grad_share():
    m = metrics_of([[0.1, 0.2]], rollout_is="token")
    assert not any(P + name in m for name in GRAD_SHARE_METRICS) and P + "t_kl_mean" in m


# ------------------------------------------------------------------------------------------------ length and T*KL
def test_k3_by_length_bucket_and_t_kl_by_hand():
    a, b, c, d = 0.1, -0.2, 0.05, 0.3  # one log rho per row, constant along the row
    rows = [[a] * 3, [b] * 70, [c] * 300, [d] * 5]  # lengths 3 and 5: bucket 0-63; 70: 64-255; 300: 256-1023
    m = metrics_of(rows)
    assert m[P + "k3_kl_len_0_63"] == pytest.approx((3 * k3(a) + 5 * k3(d)) / 8, rel=1e-5)
    assert m[P + "k3_kl_len_64_255"] == pytest.approx(k3(b), rel=1e-5)
    assert m[P + "k3_kl_len_256_1023"] == pytest.approx(k3(c), rel=1e-5)
    assert P + "k3_kl_len_1024_4095" not in m and P + "k3_kl_len_ge_4096" not in m  # empty buckets: not reported
    t_kl = [3 * k3(a), 70 * k3(b), 300 * k3(c), 5 * k3(d)]  # 0.0155, 1.311, 0.381, 0.0499
    assert m[P + "t_kl_mean"] == pytest.approx(sum(t_kl) / 4, rel=1e-5)
    assert m[P + "t_kl_max"] == pytest.approx(70 * k3(b), rel=1e-5)
    assert m[P + "t_kl_above_1_fraction"] == pytest.approx(1 / 4)  # only the 70-token row: 70 * 0.01873 > 1
    # the token-weighted k3 over every bucket is the existing k3_kl
    assert m[P + "k3_kl"] == pytest.approx(sum(t_kl) / (3 + 70 + 300 + 5), rel=1e-5)


def test_length_buckets_edges_and_the_top_bucket():
    rows = [[0.1] * 63, [0.2] * 64, [0.2] * 4096, [0.4] * 1024]
    m = metrics_of(rows)
    assert m[P + "k3_kl_len_0_63"] == pytest.approx(k3(0.1), rel=1e-5)
    assert m[P + "k3_kl_len_64_255"] == pytest.approx(k3(0.2), rel=1e-5)
    assert m[P + "k3_kl_len_1024_4095"] == pytest.approx(k3(0.4), rel=1e-5)
    assert m[P + "k3_kl_len_ge_4096"] == pytest.approx(k3(0.2), rel=1e-5)
    assert P + "k3_kl_len_256_1023" not in m
    assert m[P + "t_kl_above_1_fraction"] == pytest.approx(3 / 4)  # 63 k3(0.1) = 0.326; 64 k3(0.2) = 1.37


def test_rejected_and_unseen_rows_leave_the_length_and_t_kl_statistics():
    rows = [[0.3] * 4, [2.0] * 4, [1.0] * 2]
    train, rollout, mask = batch(rows)
    rollout[1, 0] = float("inf")  # row 1: invalid (its T*KL would be 4 k3(2) = 17.6)
    seen = torch.tensor([True, True, False])  # row 2: no pi_rollout
    m = finalize_stats(compute_rollout_correction_stats(train, rollout, mask, rollout_seen=seen).stats)
    assert m[P + "t_kl_mean"] == pytest.approx(4 * k3(0.3), rel=1e-5) and m[P + "t_kl_above_1_fraction"] == 0.0
    assert m[P + "k3_kl_len_0_63"] == pytest.approx(k3(0.3), rel=1e-5)


def test_empty_batch_reports_zero_and_no_bucket():
    m = finalize_stats(compute_rollout_correction_stats(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3),
                                                        rollout_is="token", advantages=torch.ones(2)).stats)
    assert all(m[P + name] == 0.0 for name in (*GRAD_SHARE_METRICS, *T_KL_METRICS))
    assert not any(P + name in m for name in LENGTH_METRICS)


# ------------------------------------------------------------------------------------------------ split invariance
def test_the_metrics_of_one_batch_are_those_of_its_two_halves():
    """Every quantity is a sum (or a max) over sequences: statistics of two halves, added, finalize to the numbers
    of the whole batch (as a log over two micro-batches or two processes does)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 70, 300, 12, 1100, 40, 64, 9])
    mask = (torch.arange(1200) < lengths[:, None]).float()  # (8, 1200)
    train = -torch.rand(8, 1200, generator=g)  # (8, 1200)
    rollout = train + 0.15 * torch.randn(8, 1200, generator=g)  # (8, 1200)
    adv = torch.randn(8, generator=g)  # (8,)
    kw = dict(rollout_is="token", rollout_is_threshold=1.2, rollout_rs="token", rollout_rs_threshold=1.4)
    whole = finalize_stats(compute_rollout_correction_stats(train, rollout, mask, advantages=adv, **kw).stats)
    halves = RolloutStats()
    for rows in (slice(0, 3), slice(3, 8)):
        halves.update(compute_rollout_correction_stats(train[rows], rollout[rows], mask[rows], advantages=adv[rows],
                                                       **kw).stats)
    split = finalize_stats(halves)
    names = [P + n for n in IMPACT if P + n in whole]
    assert len(names) == len(IMPACT) - 1  # every bucket but >= 4096 has a sequence
    assert 0 < whole[P + "grad_share_pinned"] < 1 and 0 < whole[P + "grad_share_masked"] < 1
    assert 0 < whole[P + "t_kl_above_1_fraction"] < 1
    for name in names:
        assert split[name] == pytest.approx(whole[name], rel=1e-12), name


# ------------------------------------------------------------------------------------------------ the trainers
def test_a_real_trainer_step_logs_them_finite(tmp_path):
    from tests.support.trainer_utils import make_trainer
    from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine

    trainer, col = make_trainer(tmp_path, preset="decoupled_token_is", max_steps=1,
                                rollout_sampler=EmulatedRolloutEngine("wq3"))
    trainer.train()
    log = [entry for entry in col.logs if "loss" in entry][0]
    for name in (*GRAD_SHARE_METRICS, *T_KL_METRICS, "k3_kl_len_0_63"):
        assert math.isfinite(log[P + name]), name
    assert 0 <= log[P + "grad_share_pinned"] <= 1 and log[P + "grad_share_masked"] == 0.0  # no rejection here
    assert log[P + "t_kl_mean"] > 0 and log[P + "t_kl_max"] >= log[P + "t_kl_mean"]
    # max_completion_length=8: every sequence is in the first bucket, whose k3 is the batch's
    # (k3_kl's per-token terms are float32, these float64: equal to float32 rounding)
    assert log[P + "k3_kl_len_0_63"] == pytest.approx(log[P + "k3_kl"], rel=1e-3)


def test_the_async_trainer_logs_them_equal_to_a_float64_computation(tmp_path_factory, tmp_path):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import numpy as np
    from tests.support.async_stub import build_model_dir, build_trainer, make_samples
    from transformers import AutoModelForCausalLM

    model_dir = build_model_dir(str(tmp_path_factory.mktemp("impact_async_model")))
    batch_ = make_samples(model_dir, n_groups=4, noise=0.4, seed=5, version=[1, 1, 0, 0] * 4)
    trainer, _ = build_trainer(model_dir, batch_, str(tmp_path), max_steps=1, per_device_train_batch_size=8,
                               rollout_correction_preset="decoupled_token_is")  # C = 2, truncate
    trainer.train()
    log = trainer.state.log_history[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    abs_adv = pinned = 0.0
    t_kl, by_lag = [], {0: [], 1: []}  # versions 1 and 0 at the first step (trainer version 1): lags 0 and 1
    for s in batch_[:8]:  # the first micro-batch: pi_theta = the initial model
        ids = torch.tensor(s.input_ids.tolist())
        with torch.no_grad():
            logp = model(input_ids=ids[None]).logits[0, :-1].log_softmax(-1).gather(-1, ids[1:, None])[:, 0]
        pos = np.nonzero(s.completion_mask[1:])[0]
        log_rho = [float(x) for x in logp[pos]] - s.old_log_probs[1:][pos]  # log pi_theta - log pi_rollout
        abs_adv += abs(s.advantage) * len(log_rho)
        pinned += abs(s.advantage) * sum(math.exp(x) > 2.0 for x in log_rho)
        t_kl.append(sum(k3(x) for x in log_rho))
        by_lag[1 - s.model_version].append(t_kl[-1])
    assert pinned > 0
    assert log[P + "grad_share_pinned"] == pytest.approx(pinned / abs_adv, rel=1e-4)
    assert log[P + "grad_share_masked"] == 0.0
    assert log[P + "t_kl_mean"] == pytest.approx(sum(t_kl) / len(t_kl), rel=1e-4)
    assert log[P + "t_kl_max"] == pytest.approx(max(t_kl), rel=1e-4)
    assert log[P + "t_kl_above_1_fraction"] == pytest.approx(sum(t > 1 for t in t_kl) / len(t_kl))
    for lag, values in by_lag.items():  # the per-lag attribution of the same numbers
        assert len(values) == 4
        assert log[f"{P}lag_{lag}/t_kl_mean"] == pytest.approx(sum(values) / 4, rel=1e-4)
        assert log[f"{P}lag_{lag}/t_kl_above_1_fraction"] == pytest.approx(sum(t > 1 for t in values) / 4)


def test_per_lag_t_kl_by_hand():
    from trl_rollout_corr.core.lag import finalize_lag, lag_stats

    train, rollout, mask = batch([[0.5] * 6, [0.1] * 2, [0.3] * 3, [2.0] * 2])
    valid = mask.bool().clone()
    valid[3] = False  # row 3: invalid (a non-finite log-prob): out of T*KL, still a sample at its lag
    lag = torch.tensor([0, 1, 1, 0])
    m = finalize_lag(lag_stats(train, rollout, mask, valid, valid, lag, max_lag=2).to_floats())
    assert m[P + "lag_0/t_kl_mean"] == pytest.approx(6 * k3(0.5), rel=1e-6)  # 0.893
    assert m[P + "lag_0/t_kl_above_1_fraction"] == 0.0
    assert m[P + "lag_1/t_kl_mean"] == pytest.approx((2 * k3(0.1) + 3 * k3(0.3)) / 2, rel=1e-6)
    valid[0, :] = True
    train[0] = 0.6  # 6 k3(0.6) = 1.33 > 1
    m = finalize_lag(lag_stats(train, rollout, mask, valid, valid, lag, max_lag=2).to_floats())
    assert m[P + "lag_0/t_kl_above_1_fraction"] == 1.0 and P + "lag_2/t_kl_mean" not in m

