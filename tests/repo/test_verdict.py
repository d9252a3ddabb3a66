"""The verdict table is one record, rendered everywhere and held to the evidence.

- The README's and docs/evidence.md's tables (between ``<!-- verdict-table -->`` markers) are exactly
  ``verdict.markdown_table()``; at most 6 rows; every row's anchor exists on the evidence page.
- Every row's regime (T, per-token KL, T·KL of the compared arms) is the range over the experiments it rests on
  (``ROW_EXPERIMENTS``), whose numbers ``tests/experiments/test_regime_map.py`` recomputes from the committed CSVs.
- Every row's confirmation quotes the numbers the monitor's and trainer's messages quote (``monitor/advice.py``), and
  the defaults it names are the trainer configs' defaults.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from experiments import regime_map
from trl_rollout_corr.monitor import advice
from trl_rollout_corr.monitor.verdict import ROW_EXPERIMENTS, VERDICTS, markdown_table, verdict

ROOT = Path(__file__).resolve().parents[2]
PAGES = {"README.md": "docs/", "docs/evidence.md": ""}


def _block(text: str, marker: str) -> str:
    match = re.search(rf"<!-- {marker} -->\n(.*?)\n<!-- /{marker} -->", text, re.S)
    assert match, f"no <!-- {marker} --> ... <!-- /{marker} --> block"
    return match.group(1).strip()


@pytest.mark.parametrize("page", sorted(PAGES))
def test_the_page_s_table_is_the_rendering(page):
    text = (ROOT / page).read_text(encoding="utf-8")
    assert _block(text, "verdict-table") == markdown_table(PAGES[page]), (
        f"{page}'s verdict table differs from trl_rollout_corr.monitor.verdict.markdown_table({PAGES[page]!r}): "
        "paste the rendering between the markers")


def test_at_most_six_rows_each_with_an_anchor_on_the_evidence_page():
    assert 1 <= len(VERDICTS) <= 6
    assert len({row.key for row in VERDICTS}) == len(VERDICTS)
    evidence = (ROOT / "docs" / "evidence.md").read_text(encoding="utf-8")
    for row in VERDICTS:
        assert f'<a id="{row.key}"></a>' in evidence, row.key
        assert verdict(row.key) is row
    with pytest.raises(KeyError, match="the rows are"):
        verdict("nope")


def _numbers(cell: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+(?:\.\d+)?(?:e-\d+)?", cell)]


def _same(stated: float, exact: float) -> bool:
    return any(float(f"{exact:.{d}g}") == stated for d in (2, 3))


@pytest.mark.parametrize("row", VERDICTS, ids=lambda r: r.key)
def test_each_row_s_regime_is_its_experiments_range(row):
    by_key = {e.key: e for e in regime_map.EXPERIMENTS}
    experiments = [by_key[k] for k in ROW_EXPERIMENTS[row.key]]
    t = sorted({e.T for e in experiments})
    assert _numbers(row.T) == ([t[0]] if len(t) == 1 else [t[0], t[-1]]), (row.key, row.T, t)
    for cell, lo, hi in ((row.per_token_kl, min(e.kl[0] for e in experiments), max(e.kl[1] for e in experiments)),
                         (row.t_kl, min(e.t_kl[0] for e in experiments), max(e.t_kl[1] for e in experiments))):
        stated = _numbers(cell)
        assert len(stated) == 2 and _same(stated[0], lo) and _same(stated[1], hi), (row.key, cell, (lo, hi))
    assert "465k" in row.model


def _ascii(text: str) -> str:
    return text.replace("−", "-").replace("±", "+-")


def test_the_rows_quote_what_the_monitor_and_trainer_say():
    stale = advice.REMEDIES["stale"]
    row = verdict("stale-engine")
    assert row.setting == stale.setting and "ppo_is_bypass" in row.advice
    for quoted in ("+0.065 [+0.032, +0.097]", "Holm p 0.00017", "20 fresh paired seeds"):
        assert quoted in row.confirmation and quoted in stale.evidence, quoted
    assert "T = 49" in stale.regime and "not confirmed at long completions" in stale.regime

    row = verdict("truncating-sampler")
    for quoted in ("+0.055 [+0.017, +0.092]", "Holm p 0.0093", "+0.039"):
        assert quoted in row.confirmation and quoted in advice.TRUNCATION_FOUND, quoted
    assert "min_p" in row.situation and "min_p" in advice.MIN_P_FOUND

    row = verdict("precision-gap")
    bound = f"{advice.LAG0_CAUTION_KL:.2e}".replace("e-0", "e-")
    assert bound in row.situation and bound in verdict("async-default").situation
    caution = _ascii(stale.caution + advice.FOUND["persistent"])
    for quoted in ("−0.046", "−0.166", "−0.044"):
        assert quoted in row.confirmation and _ascii(quoted) in caution, quoted

    row = verdict("async-precision-gap")
    for quoted in ("+0.110 [+0.046, +0.174]", "p 0.002", "+0.067", "all 10"):
        assert quoted in row.confirmation and quoted in advice.ASYNC_S4_FOUND, quoted
    row = verdict("async-default")
    assert _ascii("−0.038 [−0.093, +0.016]") in _ascii(row.confirmation)
    assert "-0.038 [-0.093, +0.016]" in advice.ASYNC_S4_FOUND


def _default_preset(path: Path, cls: str) -> str:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(ast.literal_eval(a.value) for a in node.body if isinstance(a, ast.Assign)
                and any(getattr(t, "id", "") == "_RC_DEFAULT_PRESET" for t in a.targets))


def test_the_defaults_the_rows_name_are_the_configs():
    from trl_rollout_corr.config.correction import RolloutCorrectionConfig

    pkg = ROOT / "trl_rollout_corr"
    sync = _default_preset(pkg / "grpo" / "config.py", "RolloutCorrGRPOConfig")
    async_ = _default_preset(pkg / "async_grpo" / "config.py", "RolloutCorrAsyncGRPOConfig")
    assert (sync, async_) == ("trl_default", "ppo_is_bypass")
    trl_default = RolloutCorrectionConfig.from_preset("trl_default")
    assert "sequence_mask, C = 3" in verdict("default").advice
    assert (trl_default.rollout_is, trl_default.rollout_is_bound, trl_default.rollout_is_threshold) == (
        "sequence", "mask", 3.0)
    assert "ppo_is_bypass" in verdict("async-default").advice
    for row in VERDICTS:  # a row's setting is a preset that exists, or a sampler field
        if row.setting.startswith("rollout_correction_preset="):
            assert row.setting.split("=")[1] in RolloutCorrectionConfig.preset_names()
