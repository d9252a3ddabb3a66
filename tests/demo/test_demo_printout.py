"""The main job's printout and picture (trl_rollout_corr/demo/truncation.py), fast.

- The statistics and the placement, against hand-computed values.
- The printout of synthetic runs (no training): the verdict row quoted from VERDICTS, the demo's agreement said by the
  sign of its own paired difference, the 5-seed floor of the sign-flip p, the CSV, JSON and PNG written.
- One tiny run of the command itself on the emulated engine (T = 7, 2 steps, one seed, vLLM hidden): the fallback
  says so, the four steps print, the probe places the run on the truncating-sampler row, the files are written.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

from trl_rollout_corr.demo import truncation as t
from trl_rollout_corr.monitor.verdict import VERDICTS, verdict


def test_sign_flip_p_against_hand_counts():
    assert t.sign_flip_p([0.1] * 5) == pytest.approx(2 / 32)  # only all-plus and all-minus reach the mean
    assert t.sign_flip_p([0.1, -0.1]) == pytest.approx(1.0)
    # (3, 1, -1): |sum| of the 8 sign patterns: 3 5 1 3 3 1 5 3 -> 6 of 8 reach 3
    assert t.sign_flip_p([3.0, 1.0, -1.0]) == pytest.approx(6 / 8)


def test_place_reads_the_sampler_and_the_probe():
    assert t.place(0.8, None, 0.992).key == "truncating-sampler"
    assert t.place(1.0, 0.2, 0.99).key == "truncating-sampler"
    assert t.place(0.8, None, None).key == "truncating-sampler"  # not probed: the setting decides
    assert t.place(0.8, None, 1.0).key == "default"  # the probe saw nothing truncated
    assert t.place(1.0, None, None).key == "default"


def test_the_scenario_is_a_row_of_the_verdict_table():
    row = verdict("truncating-sampler")
    assert row in VERDICTS and row.setting == "top_p=1.0"
    assert t.ARMS[t.ADVICE_ARM][2] == 1.0 and t.ARMS[t.USER_ARM][2] == t.TOP_P < 1
    assert t.ARMS[t.USER_ARM][1] == t.ARMS[t.ADVICE_ARM][1] | {"truncated_support_correction": False}  # TRL's both


def synthetic_runs(advice_minus_user: list[float]) -> list[dict]:
    runs = []
    for i, seed in enumerate(t.SEEDS[: len(advice_minus_user)]):
        user = 0.70 + 0.01 * i
        scores = {t.USER_ARM: user, "truncated_support_top_p_0.8": user + 0.001, t.ADVICE_ARM:
                  user + advice_minus_user[i], "on_policy": user + 0.08}
        for arm, score in scores.items():
            runs.append(dict(arm=arm, seed=seed, score=score, steps=30, engine_dtype="bfloat16",
                             curve=[(0, 0.7), (10, score - 0.01), (30, score)], kl_token=8e-3, t_kl=0.4,
                             rollout_kl=8e-3 if t.ARMS[arm][2] < 1 else 1e-5,
                             kept_mass_mean=0.992 if t.ARMS[arm][2] < 1 else float("nan"),
                             startup_advice=["The sampler truncates (top_p=0.8): importance sampling cannot. Do X. "
                                             "Sample training rollouts at top_p=1."] if t.ARMS[arm][2] < 1 else [],
                             alerts=[(12, "policy_collapse")] if (arm, seed) == ("on_policy", 231) else [],
                             seconds=20.0))
    return runs


PROBE = dict(seed=230, batches=8, engine="vllm", engine_dtype="bfloat16", top_p=0.8, samples=256, tokens=12544,
             T=49.0, kept_mass_mean=0.9922, k1=8.09e-3, k3=1.8e-4, minus_log_kept_mass=7.84e-3, t_kl=0.396,
             seconds=25.0)


def test_the_printout_quotes_the_row_and_agrees_by_its_own_numbers(tmp_path):
    text = t.summarize(PROBE, synthetic_runs([0.05, 0.04, 0.06, 0.02, 0.03]), list(t.ARMS), str(tmp_path), "vllm")
    row = verdict("truncating-sampler")
    for said in (row.situation, row.advice, row.confirmation, f"({row.setting})", row.evidence):
        assert said in text  # quoted from VERDICTS, not retyped
    assert 'falls on the verdict row "truncating-sampler"' in text
    assert "+0.040 held-out reward, higher on 5 of 5 seeds (exact sign-flip p 0.0625)" in text
    assert "The demo agrees with the verdict" in text and "smallest two-sided sign-flip p of 5 pairs is 0.0625" in text
    assert "kept mass M 0.9922" in text and "T·KL 0.40" in text
    assert "Sample training rollouts at top_p=1." in text  # the trainer's advice, its action
    assert "policy_collapse@12" in text  # the monitor's alert, on its seed
    summary = json.loads((tmp_path / "demo_summary.json").read_text())
    assert summary["agrees_with_verdict"] is True and summary["verdict_row"] == "truncating-sampler"
    with open(tmp_path / "demo_results.csv") as f:
        rows = {r["arm"]: r for r in csv.DictReader(f)}
    assert set(rows) == set(t.ARMS)
    assert float(rows[t.ADVICE_ARM]["vs_your_setting_mean"]) == pytest.approx(0.04)
    table = (tmp_path / "demo_table.md").read_text().splitlines()  # the README's and docs/demo.md's table
    assert table[0].startswith("| arm | top_p |") and len(table) == 2 + len(t.ARMS)
    assert "| +0.040 (5 of 5) |" in next(line for line in table if t.ADVICE_ARM in line)
    pytest.importorskip("matplotlib")
    assert (tmp_path / "demo_curves.png").stat().st_size > 10_000


def test_the_printout_says_when_the_demo_disagrees(tmp_path):
    text = t.summarize(PROBE, synthetic_runs([-0.05, 0.01, -0.02, -0.03, -0.01]), list(t.ARMS), str(tmp_path),
                       "vllm")
    assert "The demo does NOT agree with the verdict" in text and "agrees with the verdict:" not in text
    assert "higher on 1 of 5 seeds" in text
    assert json.loads((tmp_path / "demo_summary.json").read_text())["agrees_with_verdict"] is False


def test_the_command_on_the_emulated_engine_prints_the_workflow_and_draws(tmp_path):
    """`trl-rollout-corr demo` where vLLM cannot be imported (engine auto): tiny size, one seed, two arms."""
    env = {**os.environ, "TRL_ROLLOUT_CORR_NO_VLLM": "1"}
    res = subprocess.run([sys.executable, "-m", "trl_rollout_corr", "demo", "--size", "tiny", "--seeds", "230",
                          "--probe_batches", "1", "--arms", f"{t.USER_ARM},{t.ADVICE_ARM}", "--output_dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "vLLM is not installed, so the engine is EMULATED" in res.stderr
    out = res.stdout
    for step in ("1. Measure", "2. Train", "3. Watch", "4. Picture", "Verdict -- "):
        assert step in out
    assert "an EMULATED engine" in out and "(Emulated engine: the row was measured on the real vLLM engine" in out
    assert 'falls on the verdict row "truncating-sampler"' in out
    assert "This run has too few seeds" in out  # one seed: nothing to compare, and it says so
    assert "Sample training rollouts at top_p=1" in out  # the trainer's start-up advice reached the printout
    probe = json.loads((tmp_path / "runs" / "probe.json").read_text())
    assert probe["engine"] == "emulated" and 0 < probe["kept_mass_mean"] < 1 and probe["samples"] == 32
    for name in ("demo_results.csv", "demo_summary.json", "probe/probe.json"):
        assert (tmp_path / name).exists(), name
    if "matplotlib" in sys.modules or __import__("importlib").util.find_spec("matplotlib"):
        assert (tmp_path / "demo_curves.png").exists() and (tmp_path / "probe" / "probe.png").exists()
