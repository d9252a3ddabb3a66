"""``place(...)``: a probed run's regime -> the verdict rows that apply, at, below and above each boundary, and
whether the sample decides (the 95% interval on one side of every boundary that changes the advice)."""

from __future__ import annotations

import math

import pytest

from trl_rollout_corr.monitor.advice import LAG0_CAUTION_KL, REMEDIES
from trl_rollout_corr.monitor.verdict import STALE_T_KL_BOUND, VERDICTS, Z, place

GAP = LAG0_CAUTION_KL  # 2.05e-3


def keys(placement):
    return [row.key for row in placement.rows]


def test_the_bounds_are_the_monitors_and_the_rows():
    assert GAP == 2.05e-3 and STALE_T_KL_BOUND == 0.52 and Z == pytest.approx(1.96, abs=5e-4)
    stale = next(row for row in VERDICTS if row.key == "stale-engine")
    assert "T·KL ≤ 0.52" in stale.situation and stale.t_kl.endswith("0.52")  # the bound the row states
    async_gap = next(row for row in VERDICTS if row.key == "async-precision-gap")
    assert "2.05e-3" in async_gap.situation


@pytest.mark.parametrize("kl, expected", [(GAP * 0.5, "default"), (GAP, "precision-gap"), (GAP * 2, "precision-gap")],
                         ids=["below", "at", "above"])
def test_a_synchronous_engine_by_its_gap(kl, expected):
    p = place(T=100, per_token_kl=kl, per_token_kl_se=0.0, t_kl=100 * kl, t_kl_se=0.0)
    assert keys(p) == [expected] and p.decided and p.sample_factor is None
    assert p.boundaries[0].quantity == "per_token_kl" and p.boundaries[0].bound == GAP


def test_a_synchronous_engine_straddling_the_gap_still_decides_the_advice():
    # both rows say "keep TRL's default": the advice does not depend on the side
    p = place(T=100, per_token_kl=GAP, per_token_kl_se=GAP * 0.1, t_kl=0.2, t_kl_se=0.01)
    assert keys(p) == ["precision-gap", "default"] and p.decided and p.boundaries[0].side is None
    assert all(row.setting == "" for row in p.rows)


@pytest.mark.parametrize("t_kl, expected", [(0.3, "stale-engine"), (0.52, "default"), (1.0, "default")],
                         ids=["below", "at", "above"])
def test_a_stale_engine_by_t_kl(t_kl, expected):
    p = place(T=50, per_token_kl=1e-3, per_token_kl_se=0.0, t_kl=t_kl, t_kl_se=0.0, stale=True)
    assert keys(p) == [expected] and p.decided
    assert [b.quantity for b in p.boundaries] == ["per_token_kl", "t_kl"]
    assert p.boundaries[1].side == ("below" if t_kl < 0.52 else "above")


@pytest.mark.parametrize("kl, expected", [(GAP * 0.99, "stale-engine"), (GAP, "precision-gap"),
                                          (GAP * 3, "precision-gap")], ids=["below", "at", "above"])
def test_a_stale_engine_by_its_lag0_gap(kl, expected):
    p = place(T=50, per_token_kl=kl, per_token_kl_se=0.0, t_kl=0.4, t_kl_se=0.0, stale=True)
    assert keys(p) == [expected] and p.decided
    if expected == "stale-engine":
        # the monitor's stale remedy, either of its equally confirmed settings (dppo_kl_bypass first, experiment G)
        assert p.rows[0].setting in REMEDIES["stale"].settings
        assert REMEDIES["stale"].settings == ("rollout_correction_preset=dppo_kl_bypass",
                                              "rollout_correction_preset=ppo_is_bypass")


def test_an_interval_straddling_the_t_kl_bound_cannot_decide_and_says_how_much_more_would():
    # T*KL 0.42 +- 1.96 * 0.05: [0.322, 0.518] is below 0.52; 0.45 +- 0.098 straddles it; deciding needs
    # 1.96 * SE' < |0.45 - 0.52| = 0.07, SE' = 0.05 / sqrt(f): f = (1.96 * 0.05 / 0.07)^2 = 1.96
    assert keys(place(T=50, per_token_kl=1e-3, per_token_kl_se=1e-4, t_kl=0.42, t_kl_se=0.05, stale=True)) == [
        "stale-engine"]
    p = place(T=50, per_token_kl=1e-3, per_token_kl_se=1e-4, t_kl=0.45, t_kl_se=0.05, stale=True)
    assert not p.decided and keys(p) == ["stale-engine", "default"]
    assert p.boundaries[1].side is None
    assert p.sample_factor == pytest.approx((1.96 * 0.05 / 0.07) ** 2, rel=1e-3)  # 1.96 times the sample
    lower, upper = p.boundaries[1].interval
    assert lower == pytest.approx(0.45 - Z * 0.05) and upper == pytest.approx(0.45 + Z * 0.05)
    # just decided on either side: the interval's edge below the bound / at it
    assert keys(place(50, 1e-3, 1e-4, 0.52 - Z * 0.05 - 1e-9, 0.05, stale=True)) == ["stale-engine"]
    assert keys(place(50, 1e-3, 1e-4, 0.52 + Z * 0.05, 0.05, stale=True)) == ["default"]
    # on the bound itself: no sample decides
    assert place(50, 1e-3, 1e-4, 0.52, 0.05, stale=True).sample_factor == math.inf


def test_a_stale_engine_straddling_the_gap_cannot_decide():
    p = place(T=50, per_token_kl=GAP * 1.05, per_token_kl_se=GAP * 0.1, t_kl=0.3, t_kl_se=0.01, stale=True)
    assert not p.decided and keys(p) == ["stale-engine", "precision-gap"]
    assert p.sample_factor == pytest.approx((1.96 * 0.1 / 0.05) ** 2, rel=1e-3)


@pytest.mark.parametrize("kl, expected", [(GAP / 2, ["async-default"]), (GAP, ["async-precision-gap"]),
                                          (GAP * 2, ["async-precision-gap"])], ids=["below", "at", "above"])
def test_the_asynchronous_trainer_by_its_lag0_gap(kl, expected):
    p = place(T=257, per_token_kl=kl, per_token_kl_se=0.0, t_kl=257 * kl, t_kl_se=0.0, asynchronous=True)
    assert keys(p) == expected and p.decided
    straddle = place(T=257, per_token_kl=GAP, per_token_kl_se=GAP / 5, t_kl=0.5, t_kl_se=0.0, asynchronous=True)
    assert not straddle.decided and straddle.sample_factor == math.inf


def test_a_truncating_sampler_adds_its_row_first():
    p = place(T=50, per_token_kl=1e-3, per_token_kl_se=0.0, t_kl=0.05, t_kl_se=0.0, truncates=True)
    assert keys(p) == ["truncating-sampler", "default"] and p.decided
    undecided = place(50, 1e-3, 1e-4, 0.5, 0.05, truncates=True, stale=True)
    assert keys(undecided) == ["truncating-sampler", "stale-engine", "default"] and not undecided.decided


def test_an_unknown_se_cannot_decide_and_bad_input_is_refused():
    # one sequence: no SE, so no side of a bound that changes the advice, and no multiple of the sample to name
    p = place(T=50, per_token_kl=1e-3, per_token_kl_se=float("nan"), t_kl=0.5, t_kl_se=float("nan"), stale=True)
    assert not p.decided and math.isnan(p.sample_factor)
    assert keys(p) == ["stale-engine", "default", "precision-gap"]
    with pytest.raises(ValueError, match="T="):
        place(T=0, per_token_kl=1e-3, per_token_kl_se=0, t_kl=0.5, t_kl_se=0)
    with pytest.raises(ValueError, match="per_token_kl=nan"):
        place(T=10, per_token_kl=float("nan"), per_token_kl_se=0, t_kl=0.5, t_kl_se=0)
