"""The entry point against the independent float64 reference (tests/support/reference.py), every combination."""

import itertools
import math

import pytest
import torch

from tests.support.reference import reference
from trl_rollout_corr import compute_rollout_correction_and_rejection_mask

IS_LEVELS = [None, "token", "sequence"]
RS_CASES = [(None, None, None), ("token", 1.5, None), ("sequence", 3.0, 0.4), ("geometric", 1.05, None)]
VETO = [None, 0.3]
BN = [False, True]


def make_batch(seed, n=6, t=7, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g) * 3 - 0.05  # (B, T) log-probs in [-3.05, -0.05]
    rollout = (old + torch.randn(n, t, generator=g) * spread).clamp(max=-1e-3)  # (B, T) valid log-probs
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    lengths[0] = 1  # a single-token sequence
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()  # (B, T) right padding
    old = torch.where(mask.bool(), old, torch.full_like(old, 123.0))  # garbage on padding must not matter
    return old, rollout, mask


def assert_metrics_close(got, want):
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    for k in want:
        assert math.isfinite(got[k]), k
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k


COMBINATIONS = [c for c in itertools.product(IS_LEVELS, RS_CASES, VETO, BN) if not (c[3] and c[0] is None)]


@pytest.mark.parametrize("rollout_is,rs,veto,bn", COMBINATIONS)  # batch normalization needs IS weights
def test_every_combination_matches_reference(rollout_is, rs, veto, bn):
    for seed in range(3):
        old, rollout, mask = make_batch(seed)
        w, m, metrics = compute_rollout_correction_and_rejection_mask(
            old, rollout, mask, rollout_is=rollout_is, rollout_is_threshold=1.6, rollout_rs=rs[0],
            rollout_rs_threshold=rs[1], rollout_rs_threshold_lower=rs[2], rollout_token_veto_threshold=veto,
            rollout_is_batch_normalize=bn,
        )
        rw, rm, rmetrics = reference(old.double().tolist(), rollout.double().tolist(), mask.tolist(), rollout_is, 1.6,
                                     rs[0], rs[1], rs[2], veto, bn)
        assert m.tolist() == rm
        assert m.dtype == mask.dtype
        if rollout_is is None:
            assert w is None
        else:
            assert not w.requires_grad
            torch.testing.assert_close(w.double(), torch.tensor(rw, dtype=torch.float64), rtol=1e-5, atol=1e-6)
        assert_metrics_close(metrics, rmetrics)


def test_random_larger_shapes_match_reference():
    for seed in range(5):
        old, rollout, mask = make_batch(100 + seed, n=16, t=33, spread=1.5)
        for rollout_is, rs in [("token", ("token", 2.0, None)), ("sequence", ("geometric", 1.2, 0.9))]:
            w, m, metrics = compute_rollout_correction_and_rejection_mask(
                old, rollout, mask, rollout_is=rollout_is, rollout_is_threshold=2.0, rollout_rs=rs[0],
                rollout_rs_threshold=rs[1], rollout_rs_threshold_lower=rs[2], rollout_token_veto_threshold=1e-3,
                rollout_is_batch_normalize=True)
            rw, rm, rmetrics = reference(old.double().tolist(), rollout.double().tolist(), mask.tolist(), rollout_is,
                                         2.0, rs[0], rs[1], rs[2], 1e-3, True)
            assert m.tolist() == rm
            torch.testing.assert_close(w.double(), torch.tensor(rw, dtype=torch.float64), rtol=1e-5, atol=1e-6)
            assert_metrics_close(metrics, rmetrics)


@pytest.mark.parametrize("rollout_is,rs,veto,bn", [("token", RS_CASES[1], 0.3, True),
                                                  ("sequence", RS_CASES[2], None, True),
                                                  (None, RS_CASES[3], 0.3, False)])
def test_samples_without_rollout_logprobs_stay_uncorrected(rollout_is, rs, veto, bn):
    """Rows whose pi_rollout is unknown: weight 1, nothing rejected, out of every statistic, counted as missing."""
    old, rollout, mask = make_batch(7, spread=1.0)
    seen = torch.tensor([True, False, True, True, False, True])
    rollout = torch.where(seen[:, None], rollout, torch.full_like(rollout, float("nan")))  # what the capture writes
    w, m, metrics = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is=rollout_is, rollout_is_threshold=1.6, rollout_rs=rs[0],
        rollout_rs_threshold=rs[1], rollout_rs_threshold_lower=rs[2], rollout_token_veto_threshold=veto,
        rollout_is_batch_normalize=bn, rollout_seen=seen)
    rw, rm, rmetrics = reference(old.double().tolist(), rollout.double().tolist(), mask.tolist(), rollout_is, 1.6,
                                 rs[0], rs[1], rs[2], veto, bn, seen=seen.tolist())
    assert m.tolist() == rm
    assert torch.equal(m[~seen], mask[~seen])  # nothing rejected where pi_rollout is unknown
    if rollout_is is not None:
        torch.testing.assert_close(w.double(), torch.tensor(rw, dtype=torch.float64), rtol=1e-5, atol=1e-6)
        assert torch.equal(w[~seen], mask[~seen])  # weight exactly 1
    assert_metrics_close(metrics, rmetrics)
    assert metrics["rollout_corr/missing_rollout_logprobs_fraction"] == pytest.approx(2 / 6)
    assert metrics["rollout_corr/invalid_logprob_fraction"] == 0.0  # missing is not invalid


def test_compute_offpolicy_metrics_matches_the_reference_diagnostics():
    from trl_rollout_corr import compute_offpolicy_metrics
    from trl_rollout_corr.core.metrics import OFFPOLICY_METRICS

    old, rollout, mask = make_batch(3, spread=0.8)
    got = compute_offpolicy_metrics(old, rollout, mask)
    _, _, want = reference(old.double().tolist(), rollout.double().tolist(), mask.tolist())
    assert set(got) == {f"rollout_corr/{k}" for k in OFFPOLICY_METRICS}
    assert_metrics_close(got, {k: want[k] for k in got})


# TRL's bounds (rollout_is_bound / rollout_is_threshold_lower): every level x bound x lower, with RS and batch norm
IS_BOUND_CASES = list(itertools.product(("token", "sequence"), ("truncate", "mask"), (None, 0.7), (False, True)))


@pytest.mark.parametrize("rollout_is,bound,lower,bn", IS_BOUND_CASES)
def test_is_bounds_match_reference(rollout_is, bound, lower, bn):
    zeroed = 0
    for seed in range(3):
        old, rollout, mask = make_batch(seed)
        w, m, metrics = compute_rollout_correction_and_rejection_mask(
            old, rollout, mask, rollout_is=rollout_is, rollout_is_threshold=1.6, rollout_is_batch_normalize=bn,
            rollout_is_threshold_lower=lower, rollout_is_bound=bound, rollout_rs="token", rollout_rs_threshold=4.0)
        rw, rm, rmetrics = reference(old.double().tolist(), rollout.double().tolist(), mask.tolist(), rollout_is, 1.6,
                                     "token", 4.0, None, None, bn, is_lower=lower, is_bound=bound)
        assert m.tolist() == rm
        torch.testing.assert_close(w.double(), torch.tensor(rw, dtype=torch.float64), rtol=1e-5, atol=1e-6)
        assert_metrics_close(metrics, rmetrics)
        zeroed += int(((w == 0) & m.bool()).sum())
        if bound == "truncate" and lower is not None and not bn:
            assert (w[m.bool()] >= lower - 1e-7).all()
    assert (zeroed > 0) == (bound == "mask")  # the mask zeroes weights on these batches, truncation never does


def test_trl_default_by_hand():
    """Sequence mask, C=3: rho = prod_t pi_old/pi_rollout; 2.0 keeps its weight, 4.0 gets 0 (and stays in the mask)."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rollout = torch.zeros(2, 3)
    old = torch.tensor([[math.log(2.0), 0.0, 5.0], [math.log(2.0), math.log(2.0), 0.0]])  # rho_seq = 2, 4
    w, m, metrics = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is="sequence", rollout_is_threshold=3.0, rollout_is_bound="mask")
    torch.testing.assert_close(w, torch.tensor([[2.0, 2.0, 0.0], [0.0, 0.0, 0.0]]))
    assert m.tolist() == mask.tolist()
    assert metrics["rollout_corr/rollout_is_masked_fraction"] == pytest.approx(3 / 5)
    assert metrics["rollout_corr/rollout_is_seq_masked_fraction"] == pytest.approx(1 / 2)
    assert metrics["rollout_corr/rejected_token_fraction"] == 0.0
    # truncation with a lower bound: clamp(rho, 0.5, 3) per token
    old = torch.tensor([[math.log(0.25), math.log(5.0), 0.0]])
    w, _, _ = compute_rollout_correction_and_rejection_mask(
        old, torch.zeros(1, 3), torch.ones(1, 3), rollout_is="token", rollout_is_threshold=3.0,
        rollout_is_threshold_lower=0.5)
    torch.testing.assert_close(w, torch.tensor([[0.5, 3.0, 1.0]]))
