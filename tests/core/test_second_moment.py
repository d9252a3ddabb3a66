"""The second-moment mask (``rollout_m2_threshold``) against an independent float64 re-derivation: sort the squared
log-ratios and keep the longest prefix whose mean is <= tau (ties at the cut masked together)."""

from __future__ import annotations

import math

import pytest
import torch

from trl_rollout_corr import compute_rollout_correction_and_rejection_mask as correct
from trl_rollout_corr.core.second_moment import second_moment_mask


def greedy_keep(log_ratio, valid, tau):
    """The M2PO rule by hand: drop the largest v = (log rho)^2 while the mean of the rest exceeds tau."""
    v = {(i, t): min(max(float(log_ratio[i][t]), -20.0), 20.0) ** 2
         for i in range(len(valid)) for t in range(len(valid[0])) if valid[i][t]}
    ordered = sorted(v.values())
    k = len(ordered)
    while k > 0 and sum(ordered[:k]) / k > tau:
        k -= 1
    cut = ordered[k] if k < len(ordered) else math.inf  # the smallest value dropped; its ties go with it
    return [[bool(valid[i][t]) and v[(i, t)] < cut for t in range(len(valid[0]))] for i in range(len(valid))]


def batch(seed, n=6, t=7, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(n, t, generator=g, dtype=torch.float64) * spread  # (B, T)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    valid = torch.arange(t)[None, :] < lengths[:, None]  # (B, T)
    return log_ratio, valid


@pytest.mark.parametrize("tau", [1e-4, 0.01, 0.04, 0.2, 10.0])
def test_keeps_the_longest_sorted_prefix_with_mean_at_most_tau(tau):
    masked = 0
    for seed in range(5):
        log_ratio, valid = batch(seed)
        keep, _ = second_moment_mask(log_ratio, valid, tau)
        want = greedy_keep(log_ratio.tolist(), valid.tolist(), tau)
        assert keep.tolist() == want
        kept_v = log_ratio[keep] ** 2
        assert kept_v.numel() == 0 or kept_v.mean() <= tau + 1e-12
        masked += int((valid & ~keep).sum())
    assert (masked == 0) == (tau == 10.0)


def test_ties_padding_empty_and_all_masked():
    log_ratio = torch.tensor([[0.1, -0.1, 0.1, 9.0], [0.3, 0.3, 0.0, 0.0]], dtype=torch.float64)
    valid = torch.tensor([[True, True, True, False], [True, True, False, False]])
    keep, _ = second_moment_mask(log_ratio, valid, 0.02)  # v: 0.01 x3, 0.09 x2 -> the two 0.09 go together
    assert keep.tolist() == [[True, True, True, False], [False, False, False, False]]
    keep, _ = second_moment_mask(log_ratio, torch.zeros_like(valid), 0.02)  # nothing valid
    assert not keep.any()
    keep, _ = second_moment_mask(torch.full((1, 3), 2.0), torch.ones(1, 3, dtype=torch.bool), 0.01)  # all equal
    assert not keep.any()


def test_global_across_processes_equals_one_batch():
    """Two halves with a summing reduce give the threshold of the whole batch (what two processes compute)."""
    log_ratio, valid = batch(7, n=8)
    halves = [(log_ratio[:4], valid[:4]), (log_ratio[4:], valid[4:])]

    whole, _ = second_moment_mask(log_ratio, valid, 0.03)
    # simulate two ranks in lock-step: each call's statistic is the sum (max) over both halves
    import threading

    results, barrier, box = {}, threading.Barrier(2), {}

    def rank(r):
        def reduce_fn(stat, op):
            box[(r, "in")] = stat
            barrier.wait()
            other = box[(1 - r, "in")]
            out = stat + other if op == "sum" else torch.maximum(stat, other)
            barrier.wait()
            return out
        results[r] = second_moment_mask(*halves[r], 0.03, reduce_fn)[0]

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert torch.cat([results[0], results[1]]).tolist() == whole.tolist()
    assert (valid & ~whole).any()


def test_in_the_pipeline_it_rejects_and_reports():
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(5, 6, generator=g) * 2 - 0.1
    rollout = old + torch.randn(5, 6, generator=g) * 0.5
    mask = torch.ones(5, 6)
    mask[0, 3:] = 0
    _, keep, met = correct(old, rollout, mask, rollout_is="token", rollout_m2_threshold=0.05)
    want = greedy_keep((old - rollout).tolist(), mask.bool().tolist(), 0.05)
    assert keep.bool().tolist() == want
    v = (old - rollout).double() ** 2
    n_valid = mask.sum().item()
    assert met["rollout_corr/rollout_m2"] == pytest.approx(v[mask.bool()].mean().item(), rel=1e-6)
    assert met["rollout_corr/rollout_m2_kept"] == pytest.approx(v[keep.bool()].mean().item(), rel=1e-6)
    assert met["rollout_corr/rollout_m2_kept"] <= 0.05 + 1e-9
    assert met["rollout_corr/rollout_m2_masked_fraction"] == pytest.approx(1 - keep.sum().item() / n_valid)
    assert met["rollout_corr/rejected_token_fraction"] == pytest.approx(1 - keep.sum().item() / n_valid)


def test_config_validates_tau():
    from trl_rollout_corr import RolloutCorrectionConfig

    with pytest.raises(ValueError, match="rollout_m2_threshold must be a finite number > 0"):
        RolloutCorrectionConfig(rollout_m2_threshold=0.0)
    assert RolloutCorrectionConfig(rollout_m2_threshold=0.04).masks_tokens
