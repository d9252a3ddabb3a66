"""The regime map's data are the committed results': every experiment's per-token KL and T·KL (the compared arms'
means, lowest to highest) recomputed from its CSV, and the docs' evidence page names every experiment's anchor."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from experiments import regime_map as rm

ROOT = Path(__file__).resolve().parents[2]


def _close(stated: float, measured: float) -> bool:
    """The stated number is the measured one rounded to 2 or 3 significant figures."""
    return any(float(f"{measured:.{digits}g}") == stated for digits in (2, 3))


@pytest.mark.parametrize("experiment", rm.EXPERIMENTS, ids=lambda e: e.key)
def test_each_mark_is_its_csv_s_regime(experiment):
    lo, hi = rm.measured_kl(experiment)
    assert _close(experiment.kl[0], lo) and _close(experiment.kl[1], hi), (experiment.kl, (lo, hi))
    tlo, thi = rm.measured_t_kl(experiment)
    assert _close(experiment.t_kl[0], tlo) and _close(experiment.t_kl[1], thi), (experiment.t_kl, (tlo, thi))


def test_the_verdicts_and_anchors_are_known():
    keys = [e.key for e in rm.EXPERIMENTS]
    assert len(keys) == len(set(keys))
    assert {e.verdict for e in rm.EXPERIMENTS} <= set(rm.VERDICT_STYLE)
    page = (ROOT / "docs" / "evidence.md").read_text(encoding="utf-8")
    anchors = set(re.findall(r'<a id="([\w-]+)"', page)) | {
        re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in re.findall(r"^#+ (.+)$", page, re.M)}
    assert not set(keys) - anchors, sorted(set(keys) - anchors)


def test_the_old_benchmark_s_verdicts_are_its_holm_p_s():
    """old-*: 'worse' iff some compared method is below TRL's default at Holm p < 0.05, 'free' iff the uncorrected
    arm is not below on-policy, else 'same' (the CSV's paired, Holm-adjusted p over 33 comparisons)."""
    import csv

    rows = list(csv.DictReader(open(rm.RESULTS / "mismatch_results.csv", newline="")))
    for e in (e for e in rm.EXPERIMENTS if e.key.startswith("old-")):
        mine = [r for r in rows if r["scenario"] == e.scenario]
        worse = any(r["p_holm"] not in ("", "nan") and float(r["p_holm"]) < 0.05 and float(r["vs_trl_default"]) < 0
                    for r in mine)
        on = next(float(r["reward_mean"]) for r in mine if r["method"] == "on_policy")
        unc = next(float(r["reward_mean"]) for r in mine if r["method"] == "uncorrected")
        expected = "worse" if worse else ("free" if unc >= on - 0.01 else "same")
        assert e.verdict == expected, (e.key, e.verdict, expected)


def test_the_committed_png_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    out = rm.plot(tmp_path / "map.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (ROOT / "docs" / "img" / "regime_map.png").is_file()


def test_the_evidence_page_s_table_is_the_rendering():
    page = (ROOT / "docs" / "evidence.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- experiments-table -->\n(.*?)\n<!-- /experiments-table -->", page, re.S)
    assert block and block.group(1).strip() == rm.markdown_table(), (
        "docs/evidence.md's experiments table differs from experiments/regime_map.py's markdown_table(): paste it")
    assert len(re.findall(r'<a id="', block.group(1))) == len(rm.EXPERIMENTS)
