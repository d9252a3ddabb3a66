"""benchmarks/gpu_check.py at toy size on CPU: every phase runs (every preset, top-p/top-k, the TRL baseline, the probe
against TRL's fused head, the mismatch measure) with finite numbers and no error, in its own process as on the GPU."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _numbers(node, path=""):
    """Every (path, number) in a JSON tree."""
    if isinstance(node, bool):
        return
    if isinstance(node, (int, float)):
        yield path, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _numbers(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _numbers(value, f"{path}[{i}]")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--toy", "--out", str(out), "--budget_s", "100000"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "gpu_check.md").read_text().startswith("# GPU check (toy)")
    return json.loads((out / "gpu_check.json").read_text())


def test_every_phase_ran_without_error(report):
    from benchmarks.gpu_check import PHASES

    phases = report["phases"]
    assert list(phases) == list(PHASES)
    for name, phase in phases.items():
        assert phase["status"] == "ok", (name, phase.get("traceback"))
        assert "traceback" not in json.dumps(phase), name


def test_every_number_is_finite(report):
    numbers = list(_numbers(report["phases"]))
    assert len(numbers) > 200
    assert [p for p, x in numbers if not math.isfinite(x)] == []


def test_every_preset_and_truncated_sampling_trained_with_finite_values(report):
    from trl_rollout_corr.config.correction import RolloutCorrectionConfig

    runs = report["phases"]["presets"]["result"]["runs"]
    assert list(runs) == [*RolloutCorrectionConfig.preset_names(), "top_p_0.9", "top_k_50"]
    for name, run in runs.items():
        assert run["status"] == "ok" and run["finite"], (name, run)
        assert run["losses"] == run["steps"] >= 1 and run["rollout_corr_values"] > 0, name
        # the capture's one transfer per generation and the one per log: nothing per micro-batch
        assert 0 < run["our_syncs_per_step"] <= 2, (name, run["our_sync_sites"])
        assert run["truncation_probe"] == name.startswith("top_"), name
    top_p = runs["top_p_0.9"]["kept_mass_mean"]
    assert top_p and all(0.9 - 1e-6 <= m <= 1.0 for m in top_p)  # top-p keeps at least p of the mass


def test_step_time_compares_with_trls_trainer(report):
    lengths = report["phases"]["step_time"]["result"]["by_length"]
    assert list(lengths) == ["16", "32"]
    for block in lengths.values():
        variants = block["variants"]
        assert list(variants) == ["trl_pi_old", "trl_no_old", "decoupled_token_is", "ppo_is_bypass"]
        for row in variants.values():
            assert row["finite"] and row["step_ms"] > 0 and "time_vs_trl_pi_old" in row
        assert variants["trl_pi_old"]["time_vs_trl_pi_old"] == 1.0
        assert variants["decoupled_token_is"]["extra_forward"] is False


def test_probe_against_trls_fused_head(report):
    for rows in report["phases"]["probe_cost"]["result"]["by_hidden"].values():
        assert set(rows) == {"trl_fused_logprob_forward", "trl_fused_logprob_forward_backward", "probe_top_p_0.9",
                             "probe_top_k_50"}
        assert rows["trl_fused_logprob_forward"]["finite"]
        assert 0.9 - 1e-6 <= rows["probe_top_p_0.9"]["kept_mass_mean"] <= 1.0
        assert 0.0 < rows["probe_top_k_50"]["kept_mass_mean"] < 1.0  # 50 of 512 tokens


def test_mismatch_in_float32_is_the_capture_agreeing_with_the_trainers_forward(report):
    result = report["phases"]["mismatch"]["result"]
    assert result["finite_fraction"] == 1.0
    assert list(result["by_length"]) == ["8", "16", "32"]
    for length, row in result["by_length"].items():
        assert row["tokens"] == 4 * int(length)
        # float32 on CPU: the sampler's captured log-probs are the trainer's up to rounding (no EOS renormalization)
        assert row["max_abs_log_ratio"] < 1e-4, row
        assert abs(row["t_times_k1"] - int(length) * row["k1"]) < 1e-12


def test_the_preflight_probe_ran_on_the_model(report):
    """The probe's work on the check's model: float32 on CPU with top-p 0.95, so after renormalizing over the kept
    set the sampler and the trainer agree to rounding, and the truncation is what the raw mismatch was."""
    result = report["phases"]["preflight"]["result"]
    assert result["tokens"] == 4 * 16 and result["seconds"] > 0
    assert abs(result["k3"]) < 1e-6 < result["k3_before_renormalization"]
    assert 0 < result["kept_mass_mean"] <= 1
    assert set(result["methods"]) == {"this_run", "trl_default", "trl_token_truncate", "decoupled_token_is", "icepop"}


def _sci(x: float) -> str:
    """5.9e-5 as the docs write it (Python writes 5.9e-05)."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _h200_section() -> str:
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    return doc[doc.index("**A third run, on one NVIDIA H200"):doc.index("Read it as (the H100 runs)")]


NOT_RUN_ON_A_GPU = {"dppo_tv_bypass", "dppo_kl_bypass", "dppo_tv_prime_rl", "decoupled_dppo_tv",
                    "decoupled_dppo_kl"}  # added 2026-12-06, no GPU since


def test_the_h200_runs_cover_every_preset_with_finite_values_and_two_syncs_per_step():
    """benchmarks/results/gpu_check_h200_2026-11-27_presets.json (the H200's presets call): every preset the package
    had then (26), and top-p/top-k, trained with finite values and the package's 2 host syncs per step, none per
    micro-batch (the sync sites are the generation's capture and the log's reduce). A preset added since is named in
    NOT_RUN_ON_A_GPU (so a new preset cannot pass for one the GPU ran)."""
    from trl_rollout_corr.config.correction import RolloutCorrectionConfig

    report = json.loads((ROOT / "benchmarks/results/gpu_check_h200_2026-11-27_presets.json").read_text())
    assert report["meta"]["device_name"] == "NVIDIA H200"
    runs = report["phases"]["presets"]["result"]["runs"]
    presets = set(RolloutCorrectionConfig.preset_names())
    ran = set(runs) - {"top_p_0.9", "top_k_50"}
    assert len(ran) == 26 and ran <= presets and presets - ran == NOT_RUN_ON_A_GPU
    for name, run in runs.items():
        assert run["status"] == "ok" and run["finite"] and run["steps"] == 2, name
        assert run["our_syncs_per_step"] == 2, name
        assert sum(run["our_sync_sites"].values()) == 4, name  # 2 steps x (capture + log)
    section = _h200_section()
    assert "every preset (26) and top-p 0.9 / top-k 50" in section
    assert f"all callers (transformers' `generate` included): {runs['decoupled_token_is']['all_syncs_per_step']:.0f}" \
        in section


def test_the_h200_step_probe_and_mismatch_rows_are_the_runs():
    """The H200 rows of docs/benchmarks.md, recomputed from the committed JSON (ratios from the medians)."""
    phases = json.loads((ROOT / "benchmarks/results/gpu_check_h200_2026-11-27.json").read_text())["phases"]
    section = _h200_section()
    order = ("trl_pi_old", "trl_no_old", "decoupled_token_is", "ppo_is_bypass")
    for length in ("512", "2048"):
        variants = phases["step_time"]["result"]["by_length"][length]["variants"]
        ms = [variants[name]["step_ms"] for name in order]
        ratios = " / ".join(f"{m / ms[0]:.2f}" for m in ms[1:])
        row = " / ".join(f"{m:.0f}" for m in ms) + f" ms ({ratios}"
        assert row in section, row
        assert f"peak {variants['trl_pi_old']['peak_gib']:.1f} GiB for all four" in section
        assert len({round(v["peak_gib"], 1) for v in variants.values()}) == 1
    probe = phases["probe_cost"]["result"]["by_hidden"]["896"]
    trl_forward, trl_backward = probe["trl_fused_logprob_forward"], probe["trl_fused_logprob_forward_backward"]
    row = (f"{probe['probe_top_p_0.9']['ms']:.0f} / {probe['probe_top_k_50']['ms']:.0f} ms vs "
           f"{trl_forward['ms']:.1f} / {trl_backward['ms']:.1f} ms")
    assert row in section, row
    by_length = phases["mismatch"]["result"]["by_length"]
    k3 = " / ".join(_sci(by_length[t]["k3"]) for t in ("128", "512", "2048"))
    t_k3 = " / ".join(f"{by_length[t]['t_times_k3']:.2g}" for t in ("128", "512", "2048"))
    assert f"k3 KL {k3}" in section and f"T·k3 {t_k3}" in section, (k3, t_k3)
    preflight = phases["preflight"]["result"]
    assert f"{preflight['seconds']:.1f} s; k3 {_sci(preflight['k3'])}" in section
