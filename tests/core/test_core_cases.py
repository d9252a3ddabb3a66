"""Hand-computed cases, the math document's worked examples, extremes, empty / invalid inputs."""

import math

import pytest
import torch

from trl_rollout_corr import compute_rollout_correction_and_rejection_mask as correct
from trl_rollout_corr.core import compute_rollout_correction_stats, finalize_stats
from trl_rollout_corr.core.metrics import OFFPOLICY_METRICS, WEIGHT_FAMILY_METRICS

P = "rollout_corr/"


def test_token_tis_by_hand():
    # rho = [e^1, e^-1, e^2 | pad]; C = 2: w = [2, e^-1, 2, 0]
    old = torch.tensor([[0.0, -2.0, 1.0, 5.0]])
    rollout = torch.tensor([[-1.0, -1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    w, m, met = correct(old, rollout, mask, rollout_is="token", rollout_is_threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, math.exp(-1), 2.0, 0.0]]))
    assert m.tolist() == [[1, 1, 1, 0]]
    assert met[P + "rollout_is_mean"] == pytest.approx((math.e + math.exp(-1) + math.e**2) / 3)
    assert met[P + "rollout_is_max"] == pytest.approx(math.e**2)
    assert met[P + "rollout_is_ratio_fraction_high"] == pytest.approx(2 / 3)
    assert met[P + "rollout_is_ratio_fraction_low"] == pytest.approx(1 / 3)
    assert met[P + "kl"] == pytest.approx((-1 + 1 - 2) / 3)


def test_sequence_tis_by_hand():
    # sum log rho = 0.1 + 0.2 = 0.3 -> w = e^0.3 for both tokens; second row sum = 3 -> clamp to C=4? e^3 > 4 -> 4
    old = torch.tensor([[0.1, 0.2], [1.5, 1.5]])
    rollout = torch.zeros(2, 2)
    w, _, met = correct(old - 2, rollout - 2, torch.ones(2, 2), rollout_is="sequence", rollout_is_threshold=4.0)
    torch.testing.assert_close(w, torch.tensor([[math.exp(0.3)] * 2, [4.0, 4.0]]))
    assert met[P + "rollout_is_max"] == pytest.approx(math.exp(3.0), rel=1e-5)
    assert met[P + "rollout_is_ratio_fraction_high"] == pytest.approx(0.5)


def test_geometric_worked_example_100_tokens_at_1_01():
    # seeds: 100 tokens with rho = 1.01 -> product 2.7, geometric mean 1.01 -> rejected at 1.001, kept at 1.02
    log_rho = math.log(1.01)
    old = torch.full((1, 100), -1.0 + log_rho)
    rollout = torch.full((1, 100), -1.0)
    mask = torch.ones(1, 100)
    _, m, met = correct(old, rollout, mask, rollout_rs="geometric", rollout_rs_threshold=1.001)
    assert m.sum() == 0
    assert met[P + "rollout_rs_mean"] == pytest.approx(1.01, rel=1e-5)
    _, m, met = correct(old, rollout, mask, rollout_rs="geometric", rollout_rs_threshold=1.02)
    assert m.sum() == 100
    _, _, met = correct(old, rollout, mask, rollout_rs="sequence", rollout_rs_threshold=3.0)
    assert met[P + "rollout_rs_max"] == pytest.approx(1.01**100, rel=1e-4)  # ~2.7


def test_veto_1e_4_worked_example():
    # one token with rho = 5e-5 < 1e-4 vetoes its whole sequence; 2e-4 does not
    old = torch.log(torch.tensor([[5e-5 * 0.5, 0.5, 0.5], [2e-4 * 0.5, 0.5, 0.5]]))
    rollout = torch.log(torch.full((2, 3), 0.5))
    _, m, met = correct(old, rollout, torch.ones(2, 3), rollout_is="token", rollout_token_veto_threshold=1e-4)
    assert m.tolist() == [[0, 0, 0], [1, 1, 1]]
    assert met[P + "rollout_is_veto_fraction"] == 0.5
    assert met[P + "rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 6)


def test_veto_uses_unclamped_ratio():
    # log rho = -30 is below the safety bound; the veto must still see it (exp(-20) > 1e-10 would not veto)
    old = torch.tensor([[-31.0, -1.0]])
    rollout = torch.tensor([[-1.0, -1.0]])
    _, m, _ = correct(old, rollout, torch.ones(1, 2), rollout_token_veto_threshold=1e-10)
    assert m.sum() == 0


def test_batch_normalization_token_and_sequence_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.5], [0.25, 0.25]]))
    rollout = torch.log(torch.tensor([[0.25, 0.25], [0.25, 0.25]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # token: weights [2, 2, 1] -> mean 5/3
    w, _, met = correct(old, rollout, mask, rollout_is="token", rollout_is_threshold=3.0,
                        rollout_is_batch_normalize=True)
    torch.testing.assert_close(w, torch.tensor([[1.2, 1.2], [0.6, 0.0]]))
    assert met[P + "rollout_is_batch_norm_factor"] == pytest.approx(5 / 3)
    # sequence: weights row0 = 4 -> C=3 -> 3, row1 = 1 -> mean over sequences = 2
    w, _, met = correct(old, rollout, mask, rollout_is="sequence", rollout_is_threshold=3.0,
                        rollout_is_batch_normalize=True)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5], [0.5, 0.0]]))
    assert met[P + "rollout_is_batch_norm_factor"] == pytest.approx(2.0)


def test_extreme_log_ratios_stay_finite():
    old = torch.tensor([[50.0 - 60, -50.0 - 60, -60.0], [-1.0, -1.0, -1.0]])
    rollout = torch.full((2, 3), -60.0)
    rollout[1] = -1.0 - 1e4 / 3  # sequence sum of log rho = +1e4
    for level in ("token", "sequence"):
        for rs in ("token", "sequence", "geometric"):
            w, m, met = correct(old, rollout, torch.ones(2, 3), rollout_is=level, rollout_rs=rs,
                                rollout_rs_threshold=2.0, rollout_token_veto_threshold=1e-4,
                                rollout_is_batch_normalize=True)
            assert torch.isfinite(w).all()
            assert all(math.isfinite(v) for v in met.values()), {k: v for k, v in met.items() if not math.isfinite(v)}
    _, _, met = correct(rollout, rollout * 0 - 1, torch.ones(2, 3), rollout_is="sequence")  # sums of -1e4 too
    assert all(math.isfinite(v) for v in met.values())
    assert met[P + "rollout_is_max"] <= math.exp(20) * 1.0001


def test_empty_batch_and_all_padding_rows():
    old, rollout = torch.zeros(3, 4), torch.zeros(3, 4)
    w, m, met = correct(old, rollout, torch.zeros(3, 4), rollout_is="token", rollout_rs="token",
                        rollout_rs_threshold=2.0, rollout_token_veto_threshold=1e-4, rollout_is_batch_normalize=True)
    assert w.sum() == 0 and m.sum() == 0
    assert all(v == 0.0 for v in met.values())
    empty = torch.zeros(0, 0)
    w, m, met = correct(empty, empty, empty, rollout_is="sequence", rollout_rs="geometric", rollout_rs_threshold=1.01)
    assert w.shape == (0, 0) and all(v == 0.0 for v in met.values())


def test_all_rejected_batch():
    old = torch.zeros(2, 3)
    rollout = torch.full((2, 3), -1.0)  # rho = e for every token
    _, m, met = correct(old, rollout, torch.ones(2, 3), rollout_rs="token", rollout_rs_threshold=2.0)
    assert m.sum() == 0
    assert met[P + "rollout_rs_masked_fraction"] == 1.0
    assert met[P + "rollout_rs_seq_masked_fraction"] == 1.0
    assert met[P + "rejected_token_fraction"] == 1.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_logprobs_reject_their_sequence_and_are_counted(bad):
    old = torch.full((2, 3), -1.0)
    rollout = torch.full((2, 3), -1.2)
    rollout[0, 1] = bad
    old[1, 2] = bad  # on padding: ignored
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w, m, met = correct(old, rollout, mask, rollout_is="token", rollout_is_batch_normalize=True)
    assert m.tolist() == [[0, 0, 0], [1, 1, 0]]
    assert w[0].sum() == 0 and torch.isfinite(w).all()
    assert met[P + "invalid_logprob_fraction"] == pytest.approx(1 / 5)
    assert all(math.isfinite(v) for v in met.values())
    assert met[P + "kl"] == pytest.approx(-0.2, rel=1e-5)


def test_metric_names_are_exact():
    old, rollout, mask = torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(2, 2)
    _, _, met = correct(old, rollout, mask, rollout_is="token", rollout_rs="sequence", rollout_rs_threshold=2.0,
                        rollout_is_batch_normalize=True)
    expected = {P + f"rollout_{family}_{k}" for family in ("is", "rs") for k in WEIGHT_FAMILY_METRICS}
    expected |= {P + k for k in OFFPOLICY_METRICS}
    expected |= {P + k for k in ("rollout_is_batch_norm_factor", "rollout_is_veto_fraction",
                                 "rollout_is_catastrophic_token_fraction", "rollout_rs_masked_fraction",
                                 "rollout_rs_seq_masked_fraction", "invalid_logprob_fraction",
                                 "rejected_token_fraction", "missing_rollout_logprobs_fraction")}
    expected |= {P + k for k in ("t_kl_mean", "t_kl_max", "t_kl_above_1_fraction", "k3_kl_len_0_63")}  # 2 tokens
    assert set(met) == expected
    _, _, met = correct(old, rollout, mask, rollout_is="sequence", rollout_is_bound="mask", rollout_m2_threshold=0.04)
    assert {P + "rollout_is_masked_fraction", P + "rollout_is_seq_masked_fraction", P + "rollout_m2",
            P + "rollout_m2_kept", P + "rollout_m2_masked_fraction"} <= set(met)
    assert not any("rollout_rs_" in k for k in met)
    # the documented names, spelled out so that a rename fails here
    for name in ("rollout_is_mean", "rollout_is_std", "rollout_is_min", "rollout_is_max", "rollout_is_eff_sample_size",
                 "rollout_is_ratio_fraction_high", "rollout_is_ratio_fraction_low", "rollout_is_seq_mean",
                 "rollout_is_seq_std", "rollout_is_seq_min", "rollout_is_seq_max", "rollout_is_seq_max_deviation",
                 "rollout_is_seq_fraction_high", "rollout_is_seq_fraction_low", "training_ppl", "rollout_ppl",
                 "training_log_ppl", "rollout_log_ppl", "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max",
                 "log_ppl_diff_min", "ppl_ratio", "kl", "k3_kl", "chi2_token", "chi2_seq", "max_prob_diff",
                 "max_prob_diff_max", "mean_prob_diff"):
        assert P + name in met
    _, _, met = correct(old, rollout, mask)
    assert not any(k.startswith(P + "rollout_is_") and "veto" not in k and "catastrophic" not in k for k in met)


def test_stats_reduce_like_concatenation():
    """Splitting a batch in two and merging the stats gives the metrics of the whole batch."""
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(8, 5, generator=g) - 0.1
    rollout = old + 0.3 * torch.randn(8, 5, generator=g)
    mask = (torch.rand(8, 5, generator=g) > 0.2).float()
    kw = dict(rollout_is="sequence", rollout_rs="token", rollout_rs_threshold=1.5, rollout_token_veto_threshold=0.5)
    whole = finalize_stats(compute_rollout_correction_stats(old, rollout, mask, **kw).stats)
    a = compute_rollout_correction_stats(old[:3], rollout[:3], mask[:3], **kw).stats
    b = compute_rollout_correction_stats(old[3:], rollout[3:], mask[3:], **kw).stats
    merged = finalize_stats(a.update(b))
    for k in whole:
        assert merged[k] == pytest.approx(whole[k], rel=1e-6, abs=1e-9), k


def test_gradients_never_flow_through_weights():
    old = torch.zeros(1, 3, requires_grad=True)
    w, m, _ = correct(old, torch.zeros(1, 3), torch.ones(1, 3), rollout_is="token")
    assert not w.requires_grad and not m.requires_grad


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="same \\(B, T\\) shape"):
        correct(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="rollout_rs_threshold is required"):
        correct(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), rollout_rs="token")
