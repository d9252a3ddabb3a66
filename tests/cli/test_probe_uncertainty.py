"""The probe's standard errors against an engine whose exact KL is known.

The known engine: a Markov chain over V tokens, pi_rollout(a_t | a_{t-1}) = softmax(L[a_{t-1}]) and pi_train the same
with a perturbed table L + D. Its exact per-token KL(pi_rollout || pi_train) follows from the state distribution at
each step (propagated exactly, full vocabulary, float64), independently of the probe's estimators. The chain has two
closed blocks of states and only one carries the perturbation, so a sequence's tokens are correlated (all perturbed or
none): a standard error that treats tokens as independent is too small, one that treats sequences as units is right.

Repeated draws of S completions (lengths uniform on [T/2, T], independent of the tokens) -> the estimates' empirical
SD must match the SE the summary reports (within sampling error), and the 95% interval must cover the exact value at
about the nominal rate.
"""

from __future__ import annotations

import math

import pytest
import torch

from trl_rollout_corr.core.mismatch import mismatch_summary, ratio_se

V = 16


def _tables(kl_scale: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(V, V) log pi_rollout(. | prev) and log pi_train(. | prev): two closed blocks of V/2 states (a chain started in
    one never leaves it, like a prompt that sets a completion's kind); only the second block is perturbed."""
    g = torch.Generator().manual_seed(seed)
    half = V // 2
    block = torch.zeros(V, V, dtype=torch.bool)  # (V, V) the transitions that stay in the block
    block[:half, :half] = block[half:, half:] = True
    logits = torch.randn(V, V, generator=g, dtype=torch.float64).masked_fill(~block, -60.0)  # (V, V)
    noise = torch.randn(V, V, generator=g, dtype=torch.float64) * block  # (V, V)
    noise[:half] = 0.0  # the first block is not perturbed
    rollout = torch.log_softmax(logits, -1)  # (V, V)
    train = torch.log_softmax(logits + kl_scale * noise, -1)  # (V, V)
    return rollout, train


def _exact(rollout: torch.Tensor, train: torch.Tensor, t_max: int) -> tuple[float, float]:
    """Exact (per-token KL, T*KL) of completions with lengths uniform on [t_max // 2, t_max], the first state
    uniform."""
    kl_state = (rollout.exp() * (rollout - train)).sum(-1)  # (V,) KL(pi_rollout(.|s) || pi_train(.|s))
    state = torch.full((V,), 1.0 / V, dtype=torch.float64)  # (V,) the first state is uniform
    lengths = torch.arange(t_max // 2, t_max + 1, dtype=torch.float64)  # (L,) equally likely
    per_step = []
    for _ in range(t_max):
        per_step.append(float(state @ kl_state))
        state = state @ rollout.exp()  # (V,)
    alive = [float((lengths > t).double().mean()) for t in range(t_max)]  # P(T > t)
    t_kl = sum(a * k for a, k in zip(alive, per_step))  # E[sum_t KL_t]
    return t_kl / float(lengths.mean()), t_kl


def _draw(rollout, train, n_seq: int, t_max: int, g: torch.Generator):
    """n_seq completions from pi_rollout: (B, T) log pi_train, log pi_rollout of the sampled tokens, and the mask."""
    prev = torch.randint(0, V, (n_seq,), generator=g)  # (B,) the first state is uniform
    train_lp, rollout_lp = [], []
    for _ in range(t_max):
        token = torch.multinomial(rollout[prev].exp(), 1, generator=g).squeeze(1)  # (B,)
        rollout_lp.append(rollout[prev, token])
        train_lp.append(train[prev, token])
        prev = token
    lengths = torch.randint(t_max // 2, t_max + 1, (n_seq,), generator=g)  # (B,)
    mask = (torch.arange(t_max)[None, :] < lengths[:, None]).long()  # (B, T)
    return torch.stack(train_lp, 1), torch.stack(rollout_lp, 1), mask


@pytest.mark.parametrize("kl_scale, t_max", [(0.065, 64), (0.2, 128)], ids=["kl~1e-3", "kl~1e-2"])
def test_standard_errors_match_repeated_draws_and_cover_the_exact_kl(kl_scale, t_max):
    rollout, train = _tables(kl_scale)
    exact_kl, exact_t_kl = _exact(rollout, train, t_max)
    g = torch.Generator().manual_seed(1)
    reps, n_seq = 300, 256
    est = {"k1": [], "k3": [], "t_kl": []}
    se = {"k1": [], "k3": [], "t_kl": []}
    token_se = []  # what an SE with tokens as the units would say for k3 (too small here)
    for _ in range(reps):
        t_lp, r_lp, mask = _draw(rollout, train, n_seq, t_max, g)
        r = mismatch_summary(t_lp, r_lp, mask)
        tok, seq = r["tokens"], r["sequences"]
        for key, value, err in (("k1", tok["k1"], tok["k1_se"]), ("k3", tok["k3"], tok["k3_se"]),
                                ("t_kl", seq["t_kl_mean"], seq["t_kl_se"])):
            est[key].append(value)
            se[key].append(err)
        d = (t_lp - r_lp)[mask.bool()]  # (N,)
        token_se.append(float((torch.expm1(d) - d).std() / math.sqrt(d.numel())))
    exact = {"k1": exact_kl, "k3": exact_kl, "t_kl": exact_t_kl}
    for key in est:
        values, errors = torch.tensor(est[key], dtype=torch.float64), torch.tensor(se[key], dtype=torch.float64)
        sd = float(values.std())
        # unbiased: the mean of 300 estimates within 4 of its standard errors of the exact KL
        assert abs(float(values.mean()) - exact[key]) < 4 * sd / math.sqrt(reps), (key, float(values.mean()), exact)
        # the reported SE is the estimate's SD (the SD of 300 draws is known to ~4%)
        assert float(errors.mean()) == pytest.approx(sd, rel=0.15), (key, float(errors.mean()), sd)
        covered = float(((values - exact[key]).abs() <= 1.96 * errors).double().mean())
        assert 0.90 <= covered <= 0.99, (key, covered)
    # the chain's runs correlate a sequence's tokens: tokens as units would understate the k3 SE by far
    assert sum(token_se) / reps < 0.8 * float(torch.tensor(est["k3"]).std())
    if kl_scale == 0.065:  # the regime: per-token KL ~1e-3
        assert 5e-4 < exact_kl < 2e-3


def test_ratio_se_by_hand():
    # x = (1, 2, 6), y = (1, 1, 2): R = 9/4; residuals (1 - 9/4, 2 - 9/4, 6 - 9/2) = (-5/4, -1/4, 3/2)
    x = torch.tensor([1.0, 2.0, 6.0])
    y = torch.tensor([1.0, 1.0, 2.0])
    ss = (25 / 16 + 1 / 16 + 9 / 4)
    assert ratio_se(x, y) == pytest.approx(math.sqrt(ss / (3 * 2)) / (4 / 3))
    assert math.isnan(ratio_se(x[:1], y[:1]))  # one unit: no spread to measure


def test_the_summary_reports_the_standard_errors_by_hand():
    # two sequences with token log rho (0.1, -0.2) and (0.3): k1 per sequence 0.1 and -0.3, T (2, 1)
    train = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    rollout = torch.tensor([[-1.1, -1.8], [-0.8, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    r = mismatch_summary(train, rollout, mask)
    k3 = [math.expm1(x) - x for x in (0.1, -0.2, 0.3)]
    seq_k3, seq_k1, lengths = [k3[0] + k3[1], k3[2]], [0.1, -0.3], [2, 1]

    def by_hand(x, y):
        ratio = sum(x) / sum(y)
        return math.sqrt(sum((a - ratio * b) ** 2 for a, b in zip(x, y)) / (2 * 1)) / (sum(y) / 2)

    assert r["tokens"]["k1_se"] == pytest.approx(by_hand(seq_k1, lengths), rel=1e-6)
    assert r["tokens"]["k3_se"] == pytest.approx(by_hand(seq_k3, lengths), rel=1e-6)
    mean = sum(seq_k3) / 2
    sd = math.sqrt(sum((v - mean) ** 2 for v in seq_k3) / 1)
    assert r["sequences"]["t_kl_se"] == pytest.approx(sd / math.sqrt(2), rel=1e-6)
