"""Experiment G (pre-registration 25, experiments/dppo_stale.py): its analysis, recomputed from the committed runs
(experiments/results/dppo_stale_results.csv), gives the numbers the monitor (advice.DPPO_STALE_FOUND, the stale
remedy's evidence), the verdict's stale-engine row and the evidence page state; the rules it applies are the
document's."""

from __future__ import annotations

import math

import pytest

from experiments import dppo_stale as g
from trl_rollout_corr.monitor import advice
from trl_rollout_corr.monitor.verdict import verdict


def _ci(lo: float, hi: float) -> str:
    return f"[{lo:+.3f}, {hi:+.3f}]".replace("+-", "-")


@pytest.fixture(scope="module")
def s2():
    return g.analyse("S2", None)[1]


def _row(result, method):
    return next(r for r in result["family"] if r["method"] == method)


def _held(result, method):
    return next(e for e in result["held_out"] if e["method"] == method)


def test_the_family_and_held_out_numbers_are_the_monitor_s(s2):
    found = advice.DPPO_STALE_FOUND
    for method, name in (("M6", "dppo_kl_bypass"), ("M3", "ppo_is_bypass"), ("M5", "dppo_tv_bypass")):
        row, held = _row(s2, method), _held(s2, method)
        assert row["n"] == 20 and held["n"] == 10
        stated = f"{name} {row['diff']:+.3f} {_ci(row['diff_lo'], row['diff_hi'])}"
        assert stated in found, stated
        assert f"held out {held['diff']:+.3f} {_ci(held['lo'], held['hi'])}" in found, (name, held)
        assert f"one-sided p {held['p_t']:.3f}" in found, (name, held["p_t"])
        assert row["candidate"], name  # every row went to the held-out seeds
    assert _held(s2, "M6")["confirmed"] and _held(s2, "M3")["confirmed"] and not _held(s2, "M5")["confirmed"]
    assert f"Holm p {_row(s2, 'M6')['p_holm']:.2g}" in found and f"{_row(s2, 'M6')['p_sign_flip_holm']:.2g}" in found


def test_the_verdict_row_and_the_remedy_quote_it(s2):
    row = verdict("stale-engine")
    m6, m3 = _held(s2, "M6"), _held(s2, "M3")
    assert f"dppo_kl_bypass ({_row(s2, 'M6')['diff']:+.3f})" in row.confirmation
    assert f"(+{m3['diff']:.3f}, +{m6['diff']:.3f}; one-sided p {m3['p_t']:.3f}, {m6['p_t']:.3f})" in row.confirmation
    assert row.setting == "rollout_correction_preset=dppo_kl_bypass"  # the larger held-out difference first
    assert m6["diff"] > m3["diff"]
    stale = advice.REMEDIES["stale"]
    assert stale.setting == row.setting and "rollout_correction_preset=ppo_is_bypass" in stale.alternatives


def test_the_reference_arms_were_re_run_because_the_committed_ones_did_not_reproduce(s2):
    assert s2["source"] == "re-run"
    for method, (committed, rerun, equal) in s2["reproduced"].items():
        assert not equal and rerun is not None and abs(committed - rerun) > g.G_REPRODUCE_TOL, method


def test_the_one_sided_tests_are_the_document_s():
    # one-sided in the family's direction: a negative family row is tested below 0
    assert g.one_sided([0.1] * 10, +1)[1] == pytest.approx(1 / 1024)
    assert g.one_sided([0.1] * 10, -1)[1] == pytest.approx(1.0)
    p_t, _ = g.one_sided([0.1, 0.2, -0.05, 0.15], +1)
    # hand: mean 0.1, sd 0.1080, se 0.0540, t 1.852 on 3 df -> one-sided p 0.0806
    assert p_t == pytest.approx(0.0806, abs=5e-4)
    assert not math.isnan(p_t)
    text = (g.HERE + "/preregistrations/25-g-dppo-stale.md")
    doc = open(text, encoding="utf-8").read()
    assert "one-sided paired t p < 0.05 AND one-sided exact sign-flip p < 0.05" in " ".join(doc.split())
    assert g.G_SEEDS == {"S2": tuple(range(10, 30)), "S2X": tuple(range(90, 110))}
    assert g.G_HELD_OUT == {"S2": tuple(range(300, 310)), "S2X": tuple(range(310, 320))}


def test_the_257_token_family_passed_holm_and_the_held_out_seeds_did_not_confirm_it():
    s2x = g.analyse("S2X", None)[1]
    found = advice.DPPO_STALE_257_FOUND
    for method, name in (("M5", "dppo_tv_bypass"), ("M6", "dppo_kl_bypass"), ("M3", "ppo_is_bypass")):
        row = _row(s2x, method)
        assert row["n"] == 20 and row["candidate"], name
        assert f"{name} {row['diff']:+.3f} {_ci(row['diff_lo'], row['diff_hi'])}" in found, name
        assert f"Holm p {row['p_holm']:.2g}" in found
        assert not _held(s2x, method).get("confirmed", False), name
    assert f"collapsing on {_row(s2x, 'M5')['ref_collapsed']} of 20" in found
    assert all(_row(s2x, m)["collapsed"] == 0 for m in ("M3", "M5", "M6"))
    assert "neither was confirmed" in verdict("stale-engine").advice
