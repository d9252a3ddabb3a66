"""experiments/stats.py against values computed by hand (the arithmetic is in the comments).

Student t with 2 degrees of freedom has a closed form, used throughout so that nothing here needs a t table:
P(T_2 <= t) = 1/2 + t / (2 sqrt(2 + t^2)), so the two-sided p of |t| is 1 - |t| / sqrt(2 + t^2), and the quantile
t_q solves t / sqrt(2 + t^2) = 2q - 1, i.e. t_q^2 = 2 (2q-1)^2 / (1 - (2q-1)^2):
t_{0.975}^2 = 2 * 0.9025 / 0.0975 = 18.5128205..., t_{0.975} = 4.3026527; t_{0.95}^2 = 2 * 0.81 / 0.19 = 8.5263158.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from experiments import stats

T975_2 = math.sqrt(1.805 / 0.0975)  # 4.3026527
T95_2 = math.sqrt(1.62 / 0.19)  # 2.9199856


def test_paired_t_on_three_pairs():
    # d = a - b = [1, 2, 3]: mean 2, sd 1 (squares of deviations 1 + 0 + 1 = 2, / (n-1) = 1), se = 1/sqrt(3);
    # t = 2 sqrt(3) = 3.4641, t^2 = 12; p = 1 - sqrt(12 / 14) = 1 - sqrt(6/7) = 0.0741799;
    # interval 2 ± 4.3026527 / sqrt(3) = 2 ± 2.4841377 = [-0.4841377, 4.4841377]
    r = stats.paired_t([5, 7, 9], [4, 5, 6])
    assert r.n == 3 and r.mean == pytest.approx(2) and r.sd == pytest.approx(1)
    assert r.t == pytest.approx(2 * math.sqrt(3))
    assert r.p == pytest.approx(1 - math.sqrt(6 / 7), rel=1e-9)
    assert (r.lo, r.hi) == pytest.approx((-0.4841377, 4.4841377), abs=1e-6)


def test_paired_t_on_five_pairs():
    # d = [2, 3, 2, 3, 3]: mean 2.6, squared deviations .36 .16 .36 .16 .16 = 1.2, var 0.3, se = sqrt(0.3/5)
    # = 0.2449490, t = 10.614456; with 4 df P(T <= t) = 1/2 + (3/8) u (1 - t^2 / (12 (1 + t^2/4))),
    # u = t / sqrt(1 + t^2/4); t_{0.975, 4} = 2.7764451 (table), half-width 0.6800874
    r = stats.paired_t([3, 5, 4, 6, 7], [1, 2, 2, 3, 4])
    t = 2.6 / math.sqrt(0.06)
    cdf = 0.5 + 3 / 8 * t / math.sqrt(1 + t * t / 4) * (1 - t * t / (12 * (1 + t * t / 4)))
    assert r.t == pytest.approx(t) and r.p == pytest.approx(2 * (1 - cdf), rel=1e-6)
    assert (r.lo, r.hi) == pytest.approx((2.6 - 0.6800874, 2.6 + 0.6800874), abs=1e-6)


def test_paired_t_refuses_unpaired_and_degenerate_input():
    with pytest.raises(ValueError, match="same length"):
        stats.paired_t([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="at least 2"):
        stats.paired_t([1], [0])
    with pytest.raises(ValueError, match="non-finite"):
        stats.paired_t([1, float("nan")], [0, 0])
    same = stats.paired_t([2, 3], [1, 2])  # every difference 1: no spread
    assert (same.mean, same.lo, same.hi, same.p) == (1, 1, 1, 0.0)


def test_sign_flip_p_exact_on_small_sets():
    # five positive differences: only the all-plus and all-minus patterns reach |sum| = 15 -> 2 / 2^5 = 1/16
    assert stats.sign_flip_p([1, 2, 3, 4, 5]) == 2 / 32
    assert stats.sign_flip_p([0.1, 0.5, 0.2, 0.3, 0.9]) == 2 / 32
    # d = [1, 2, 3, -1]: |sum| = 5. The magnitudes are 1, 2, 3, 1 (max signed sum 7): |sum| >= 5 needs 7 (all plus)
    # or 5 (one of the two 1s minus), and the mirror images: 6 of 16 patterns
    assert stats.sign_flip_p([1, 2, 3, -1]) == 6 / 16
    # d = [1, 2, 3]: |sum| 6 reached only by +++ and --- : 2/8
    assert stats.sign_flip_p([1, 2, 3]) == 2 / 8
    # all zeros: every pattern ties -> 1
    assert stats.sign_flip_p([0.0, 0.0, 0.0]) == 1.0


def test_sign_flip_p_monte_carlo_beyond_twenty():
    # 25 positive differences: exact p = 2 / 2^25 ~ 6e-8, so no draw but the observed one counts: p = 1 / (1 + draws)
    assert stats.sign_flip_p(np.arange(1, 26), n_mc=1000) == 1 / 1001
    # the draws are seeded: the same call gives the same p
    d = np.linspace(-1, 1.3, 24)
    assert stats.sign_flip_p(d, n_mc=5000) == stats.sign_flip_p(d, n_mc=5000)


def test_sign_flip_p_one_sided_by_hand():
    # d = (1, 2, -0.5): signed sums of the 8 patterns: 3.5, 2.5, -0.5, -1.5, 1.5, 0.5, -2.5, -3.5 (+-1, +-2, +-0.5)
    # observed sum 2.5: patterns with sum >= 2.5 are 3.5 and 2.5 -> 2/8
    assert stats.sign_flip_p_one_sided([1.0, 2.0, -0.5]) == pytest.approx(2 / 8)
    assert stats.sign_flip_p_one_sided([0.1] * 10) == pytest.approx(1 / 1024)  # all ten positive
    assert stats.sign_flip_p_one_sided([-0.1] * 10) == pytest.approx(1.0)  # the other direction: every pattern
    with pytest.raises(ValueError, match="2\\*\\*n"):
        stats.sign_flip_p_one_sided([0.1] * 21)


def test_holm_on_known_p_values():
    # sorted: 0.005 (x4 = 0.02), 0.01 (x3 = 0.03), 0.03 (x2 = 0.06), 0.04 (x1 = 0.04 -> monotone max 0.06)
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # [0.5, 0.4]: 0.4 x2 = 0.8, 0.5 x1 = 0.5 -> 0.8 (monotone)
    assert stats.holm([0.5, 0.4]) == pytest.approx([0.8, 0.8])
    # capped at 1: 0.6 x3, 0.7 x2 are > 1, 0.9 -> max(1, 0.9) = 1
    assert stats.holm([0.6, 0.7, 0.9]) == [1.0, 1.0, 1.0]
    assert stats.holm([0.2]) == [0.2]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        stats.holm([0.1, 1.5])


def test_tost_paired_hand_case():
    # d = [1, 2, 3]: mean 2, se 1/sqrt(3), 2 df. margin 5:
    # t_lower = (2 + 5) sqrt(3), t^2 = 147, p_lower = (1 - sqrt(147/149)) / 2 = 0.0033670
    # t_upper = (2 - 5) sqrt(3), t^2 = 27,  p_upper = (1 - sqrt(27/29)) / 2  = 0.0175494 -> p = 0.0175494
    # 90% interval: 2 ± t_{0.95,2} / sqrt(3) = 2 ± 1.6858545
    r = stats.tost_paired([1, 2, 3], margin=5)
    assert r.p_lower == pytest.approx(0.0033670417, rel=1e-6)
    assert r.p_upper == pytest.approx(0.0175493593, rel=1e-6)
    assert r.p == r.p_upper
    assert (r.lo, r.hi) == pytest.approx((2 - 1.6858545, 2 + 1.6858545), abs=1e-6)
    # margin 3: t_upper = -sqrt(3), p_upper = (1 - sqrt(3/5)) / 2 = 0.1127017: not equivalent, interval exceeds 3
    r3 = stats.tost_paired([1, 2, 3], margin=3)
    assert r3.p == pytest.approx(0.1127016654, rel=1e-6) and r3.hi > 3
    assert r3.p_lower == pytest.approx((1 - math.sqrt(75 / 77)) / 2, rel=1e-6)
    with pytest.raises(ValueError, match="margin"):
        stats.tost_paired([1, 2, 3], margin=0)


def test_fieller_hand_case():
    # num = m - u = [1, 2, 3] (mean x = 2, var 1), den = o - u = [10, 11, 12] (mean y = 11, var 1), cov 1;
    # v11 = v22 = v12 = 1/3, t^2 = 18.5128205:
    # a = 121 - t^2/3 = 114.8290598, b = -2 (22 - t^2/3) = -31.6581197, c = 4 - t^2/3 = -2.1709402
    # disc = b^2 - 4ac = 1999.3846154, roots (31.6581197 ∓ 44.7145910) / 229.6581197 = -0.0568513, 0.3325491
    u = np.array([0.0, 1.0, -1.0])
    r = stats.fieller(u + [1, 2, 3], u, u + [10, 11, 12])
    assert r.bounded and r.note == ""
    assert r.estimate == pytest.approx(2 / 11)
    assert (r.lo, r.hi) == pytest.approx((-0.0568512847, 0.3325490890), abs=1e-8)
    # num exactly half of den: (x - R y)^2 = y^2 (1/2 - R)^2 <= t^2 v22 (R - 1/2)^2, i.e. (R - 1/2)^2 a <= 0 with
    # a > 0: the interval is the point 1/2
    pt = stats.fieller_ratio([5, 5.5, 6], [10, 11, 12])
    assert (pt.lo, pt.hi) == pytest.approx((0.5, 0.5), abs=1e-6)


def test_fieller_unbounded_when_the_gap_is_not_significant():
    # den = [1, -1, 2]: mean 2/3, sd 1.5275, |t| = 0.756 < 4.30: a = y^2 - t^2 v22 < 0 -> unbounded, said so
    r = stats.fieller([1, 0, 1], [0, 0, 0], [1, -1, 2])
    assert not r.bounded and (r.lo, r.hi) == (-math.inf, math.inf) and "not significantly" in r.note
    assert not stats.bca_ratio([1, 0, 1], [0, 0, 0], [1, -1, 2]).bounded


def test_bca_ratio_agrees_with_scipy():
    # an independent implementation: scipy.stats.bootstrap(paired=True, method="BCa") on the same statistic
    from scipy.stats import bootstrap

    # a skewed gap (exponential), where BCa and the plain percentile interval differ by 0.04 / 0.08 at the ends
    rng = np.random.default_rng(3)
    u = rng.normal(0.6, 0.05, 8)
    o = u + rng.exponential(0.15, 8) + 0.05
    m = u + rng.normal(0.1, 0.1, 8)
    ours = stats.bca_ratio(m, u, o, n_boot=40_000, seed=1)

    def gap(mm, uu, oo, axis=-1):
        return (mm.mean(axis) - uu.mean(axis)) / (oo.mean(axis) - uu.mean(axis))

    ref = bootstrap((m, u, o), gap, paired=True, method="BCa", n_resamples=40_000, rng=np.random.default_rng(2))
    assert ours.bounded and ours.lo < ours.estimate < ours.hi
    ci = ref.confidence_interval
    assert (ours.lo, ours.hi) == pytest.approx((ci.low, ci.high), abs=0.015)


def test_fisher_exact_on_the_tea_tasting_table():
    # Fisher's lady tasting tea: [[3, 1], [1, 3]], margins 4/4/4/4 of 8. P(a = k) = C(4,k) C(4,4-k) / C(8,4):
    # k = 0..4 -> 1, 16, 36, 16, 1 (/70). Two-sided: tables no more likely than k = 3 (16/70): 1+16+16+1 = 34/70;
    # one-sided (greater): k >= 3: 17/70. Odds ratio 3*3 / (1*1) = 9
    r = stats.fisher_exact([[3, 1], [1, 3]])
    assert r.odds_ratio == 9 and r.p == pytest.approx(34 / 70)
    assert stats.fisher_exact([[3, 1], [1, 3]], alternative="greater").p == pytest.approx(17 / 70)
    # 5 collapses of 5 runs vs 0 of 5: P = C(5,5) C(5,0) / C(10,5) = 1/252, two-sided 2/252
    assert stats.fisher_exact([[5, 0], [0, 5]]).p == pytest.approx(2 / 252)
    with pytest.raises(ValueError, match="2x2"):
        stats.fisher_exact([[1, 2, 3], [4, 5, 6]])


def test_compare_paired_row():
    # x - ref = [1, 2, 3] (the paired-t hand case above); gap o - u = [10, 11, 12] (mean 11, sd 1: p =
    # 1 - 11 sqrt(3) / sqrt(2 + 363) = 0.00282, significant) and m - u = [1, 2, 3]: the Fieller case above
    ref = np.array([0.0, 1.0, -1.0])
    x = ref + [1, 2, 3]
    row = stats.compare_paired(x, ref, floor=ref, ceiling=ref + [10, 11, 12], margin=5)
    assert row["diff"] == pytest.approx(2) and row["p"] == pytest.approx(1 - math.sqrt(6 / 7))
    assert (row["diff_lo"], row["diff_hi"]) == pytest.approx((-0.4841377, 4.4841377), abs=1e-6)
    assert row["p_sign_flip"] == 2 / 8
    assert row["tost_p"] == pytest.approx(0.0175493593, rel=1e-6)
    assert row["gap"] == pytest.approx(11) and row["gap_p"] == pytest.approx(1 - 11 * math.sqrt(3 / 365), rel=1e-6)
    assert (row["gap_closed"], row["gap_closed_lo"], row["gap_closed_hi"]) == pytest.approx(
        (2 / 11, -0.0568512847, 0.3325490890), abs=1e-8)
    # the gap [1, -1, 2] is not significant: no gap closed, and the row says why
    flat = stats.compare_paired(x, ref, floor=ref, ceiling=ref + [1, -1, 2])
    assert math.isnan(flat["gap_closed"]) and "not significant" in flat["gap_closed_note"]
    assert "tost_p" not in flat


def test_add_holm_over_a_family_of_rows():
    rows = [dict(p=0.01), dict(p=math.nan), dict(p=0.04), dict(p=0.03), dict(p=0.005)]
    stats.add_holm(rows)
    # the NaN row is outside the family: the other four are the Holm case above
    assert [r["p_holm"] for r in rows[2:]] == pytest.approx([0.06, 0.06, 0.02])
    assert rows[0]["p_holm"] == pytest.approx(0.03) and math.isnan(rows[1]["p_holm"])


def test_clopper_pearson_matches_the_closed_forms_at_the_ends():
    """k = 0: [0, 1 - (a/2)^(1/n)]; k = n: [(a/2)^(1/n), 1]; 1 of 2 by the beta quantiles' closed form (uniform)."""
    assert stats.clopper_pearson(0, 10) == (0.0, pytest.approx(1 - 0.025 ** 0.1))  # 0.3085
    assert stats.clopper_pearson(10, 10) == (pytest.approx(0.025 ** 0.1), 1.0)  # 0.6915
    assert stats.clopper_pearson(2, 2)[0] == pytest.approx(0.025 ** 0.5)  # 0.158
    lo, hi = stats.clopper_pearson(1, 2)  # Beta(0.025; 1, 2) = 1 - sqrt(0.975); Beta(0.975; 2, 1) = sqrt(0.975)
    assert lo == pytest.approx(1 - 0.975 ** 0.5) and hi == pytest.approx(0.975 ** 0.5)
    with pytest.raises(ValueError, match="0 <= k <= n"):
        stats.clopper_pearson(3, 2)
