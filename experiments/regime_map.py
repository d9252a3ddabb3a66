"""The regime map: where every training experiment of this package sits, and what it found.

One mark per experiment at (completion length T, per-token KL(pi_rollout || pi_theta)) on log axes, coloured by its
verdict against the trainer's default correction:

- ``better``: a correction trained better than the trainer's default (paired seeds, confirmed);
- ``same``: no correction differed significantly from the default;
- ``worse``: a correction trained significantly worse than the default;
- ``free``: the mismatch itself cost nothing measurable (on-policy vs uncorrected not significant).

A mark's vertical bar spans the per-token KL of the COMPARED arms (the mean over each arm's runs, lowest to highest
arm), so the same experiment is not placed by its uncorrected arm alone. The lines are T·KL = 0.1, 1, 10 (T·KL = T x
per-token KL: sequence-level weights degenerate roughly as exp(-2·T·KL), a log-normal approximation). The shaded boxes
are where bf16 vLLM runs at 1k-8k tokens sit (published, ``TYPICAL_KL`` darker, ``QUOTED_KL`` lighter): nothing here
ran there.

Every number of ``EXPERIMENTS`` is recomputed from the committed CSVs by ``tests/experiments/test_regime_map.py``.

    python experiments/regime_map.py            # writes docs/img/regime_map.png
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
OUT = ROOT / "docs" / "img" / "regime_map.png"

# where bf16 vLLM runs at 1k-8k tokens sit (published, not measured here): per-token KL ~1e-4-1e-3 (NeMo-RL's docs:
# its vllm-kl is ~1e-3 in practice, below 1e-3 acceptable; this package's bf16 vLLM engine vs a float32 trainer: 4e-4),
# the darker box; 4e-4-1e-2 as quoted for bf16 vLLM against an FSDP trainer (docs/probe.md), the lighter one
TYPICAL_KL = (1e-4, 1e-3)
QUOTED_KL = (4e-4, 1e-2)

VERDICT_STYLE = {  # verdict -> (label, colour, marker)
    "better": ("a correction trained better than the default", "#1a9850", "^"),
    "same": ("no correction differed from the default", "#636363", "o"),
    "worse": ("a correction trained worse than the default", "#d73027", "v"),
    "free": ("the mismatch cost nothing measurable", "#4575b4", "s"),
}


@dataclass(frozen=True)
class Experiment:
    """One experiment's regime and verdict, as the evidence page states them.

    Args:
        key: its anchor on docs/evidence.md.
        label: the short name printed beside its mark.
        csv: the committed results file (under experiments/results/).
        scenario: the value of the CSV's ``scenario`` column (or ``sigma`` for the asynchronous S4 file).
        arms: the compared arms (``method`` or ``arm`` column).
        seeds: the analysed seeds (inclusive range; ``None``: every row, the old benchmark's aggregated file).
        T: the completion length in tokens (with EOS).
        kl: (lowest, highest) per-token KL over the compared arms' means.
        t_kl: (lowest, highest) T·KL over the compared arms' means (the runs' own T·KL where the CSV logs it, with the
            completions' real lengths; T x KL otherwise).
        verdict: one of ``VERDICT_STYLE``.
    """

    key: str
    label: str
    csv: str
    scenario: str
    arms: tuple[str, ...]
    seeds: tuple[int, int] | None
    T: int
    kl: tuple[float, float]
    t_kl: tuple[float, float]
    verdict: str


MT = "mismatch_train"
EXPERIMENTS: tuple[Experiment, ...] = (
    # the old benchmark: a 0.13M model, T <= 9, 5 seeds, one row per method (mismatch_bench.py)
    Experiment("old-stale4", "old: stale 4", "mismatch_results.csv", "stale4",
               ("uncorrected", "trl_default", "ppo_is_bypass", "decoupled_geo_rs"), None, 9, (0.07, 0.3), (0.63, 2.7),
               "worse"),
    Experiment("old-wq3", "old: 3-bit", "mismatch_results.csv", "wq3",
               ("uncorrected", "trl_default", "ppo_is_bypass", "trl_token_truncate"), None, 9, (0.027, 0.171),
               (0.24, 1.5), "worse"),
    Experiment("old-int8", "old: INT8", "mismatch_results.csv", "int8",
               ("uncorrected", "trl_default", "trl_token_truncate"), None, 9, (0.0016, 0.0019), (0.014, 0.017), "free"),
    Experiment("old-vllm-bf16", "old: vLLM bf16", "mismatch_results.csv", "vllm_bf16",
               ("uncorrected", "trl_default", "trl_token_truncate"), None, 9, (0.00036, 0.0004), (0.0033, 0.0036),
               "free"),
    Experiment("old-vllm-sync8", "old: vLLM sync 8", "mismatch_results.csv", "vllm_sync8",
               ("uncorrected", "trl_default", "ppo_is_bypass"), None, 9, (0.054, 0.23), (0.48, 2), "same"),
    # the training benchmark: a 465k model, mismatch_train.py / vllm_truncation.py / async_mismatch.py
    Experiment("s1", "S1", f"{MT}_results.csv", "S1", ("M0", "M1", "M2", "M3", "M4"), (0, 9), 49,
               (0.077, 0.099), (3.7, 4.8), "free"),
    Experiment("s2", "S2", f"{MT}_results.csv", "S2", ("M0", "M1", "M2", "M3", "M4"), (0, 9), 49,
               (0.006, 0.013), (0.29, 0.64), "same"),
    Experiment("experiment-c", "C", f"{MT}_confirm_results.csv", "S2", ("M1", "M2", "M3"), (10, 29), 49,
               (0.0062, 0.0106), (0.3, 0.52), "better"),
    Experiment("experiment-g", "G (DPPO)", "dppo_stale_results.csv", "S2", ("M1", "M3", "M5", "M6"), (10, 29), 49,
               (0.0051, 0.0083), (0.25, 0.41), "better"),
    Experiment("experiment-g-257", "G at 257 (DPPO)", "dppo_stale_results.csv", "S2X", ("M1", "M3", "M5", "M6"),
               (90, 109), 257, (0.0019, 0.0057), (0.49, 1.46), "same"),
    Experiment("experiment-l", "L", f"{MT}_confirm_results.csv", "S2L", ("M0",), (30, 39), 129,
               (0.0103, 0.0103), (0.98, 0.98), "free"),
    Experiment("experiment-p", "P", f"{MT}_truncation_results.csv", "S3", ("M0", "M1", "M1p", "M2", "M3"), (40, 49),
               49, (0.00845, 0.00864), (0.41, 0.42), "same"),
    Experiment("s3v", "S3V", "vllm_truncation_results.csv", "S3V", ("M0", "M1", "M1p", "M2", "M3"), (220, 229), 49,
               (0.0081, 0.0083), (0.4, 0.41), "same"),
    Experiment("experiment-x", "X", f"{MT}_target_results.csv", "S2X", ("M1", "M3"), (60, 69), 257,
               (0.00179, 0.00195), (0.45, 0.49), "same"),
    Experiment("experiment-y", "Y", f"{MT}_target_lag16_results.csv", "S2X", ("M1", "M2", "M3"), (75, 84), 257,
               (0.003, 0.009), (0.76, 2.2), "same"),
    Experiment("experiment-z", "Z", f"{MT}_target_z_results.csv", "S2X", ("M1", "M2", "M3"), (90, 119), 257,
               (0.0029, 0.0042), (0.72, 1.06), "worse"),
    Experiment("experiment-q", "Q", f"{MT}_target_q_results.csv", "S1X", ("M0", "M1", "M2", "M3"), (125, 134), 257,
               (0.0083, 0.0085), (2.1, 2.15), "free"),
    Experiment("experiment-d", "D", f"{MT}_target_d_results.csv", "S1D", ("M1", "M2", "M3"), (140, 149), 257,
               (0.0043, 0.0075), (1.08, 1.83), "worse"),
    Experiment("experiment-a", "A", f"{MT}_target_a_results.csv", "S2D", ("M1", "M2", "M3"), (155, 164), 257,
               (0.006, 0.0088), (1.5, 2.17), "worse"),
    Experiment("experiment-b", "B", f"{MT}_target_b_results.csv", "S2B", ("M1", "M3"), (170, 179), 257,
               (0.0031, 0.0045), (0.79, 1.13), "worse"),
    Experiment("experiment-e", "E", f"{MT}_target_e_results.csv", "S2E", ("M1", "M3"), (185, 194), 257,
               (0.0016, 0.0025), (0.4, 0.63), "worse"),
    Experiment("experiment-f", "F", f"{MT}_target_f_results.csv", "S2F", ("M1", "M3"), (200, 209), 257,
               (0.00145, 0.0016), (0.37, 0.4), "same"),
    Experiment("s4", "S4 (async)", "async_mismatch_s4_results.csv", "1.0", ("trl_as_is", "trl_default"), (185, 194),
               257, (0.0031, 0.0046), (0.8, 1.18), "better"),
    Experiment("pre-registration-19", "19 (async)", "async_mismatch_s4_results.csv", "0.8",
               ("trl_as_is", "trl_default"), (185, 194), 257, (0.0022, 0.003), (0.57, 0.78), "same"),
    Experiment("pre-registration-18", "18 (async)", "async_mismatch_s4_results.csv", "0.0",
               ("trl_as_is", "trl_default"), (185, 194), 257, (0.0003, 0.00048), (0.077, 0.12), "same"),
)


def _kl_column(row: dict[str, str]) -> float:
    """The run's mean per-token KL(pi_rollout || pi_theta): ``kl_token`` (training benchmark), ``kl`` (old benchmark,
    async arms of this package), ``trl_kl`` (TRL's AsyncGRPOTrainer as is, logged by TRL's own metric)."""
    for column in ("kl_token", "trl_kl" if row.get("arm") == "trl_as_is" else "kl", "kl"):
        if column in row and row[column] not in ("", "nan"):
            return float(row[column])
    raise ValueError(f"no per-token KL column in row {row}")


def _arm_means(experiment: Experiment, value, results: Path) -> list[float]:
    """Each compared arm's mean of ``value(row)`` over its analysed runs in the experiment's CSV."""
    with open(results / experiment.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    means = []
    for arm in experiment.arms:
        values = []
        for row in rows:
            scenario = row.get("scenario", row.get("sigma"))
            method = row.get("method", row.get("arm"))
            if scenario != experiment.scenario or method != arm:
                continue
            if experiment.seeds is not None and not experiment.seeds[0] <= int(row["seed"]) <= experiment.seeds[1]:
                continue
            values.append(value(row))
        if not values:
            raise ValueError(f"{experiment.key}: no rows for arm {arm!r} in {experiment.csv}")
        means.append(statistics.fmean(values))
    return means


def measured_kl(experiment: Experiment, results: Path = RESULTS) -> tuple[float, float]:
    """(lowest, highest) over the compared arms of each arm's mean per-token KL, recomputed from the CSV."""
    means = _arm_means(experiment, _kl_column, results)
    return min(means), max(means)


def measured_t_kl(experiment: Experiment, results: Path = RESULTS) -> tuple[float, float]:
    """(lowest, highest) over the compared arms of each arm's mean T·KL: the CSV's ``t_kl`` (each run's own
    sum over its completions' real lengths) where it has one, else T x the arm's mean per-token KL."""
    with open(results / experiment.csv, newline="") as f:
        has_t_kl = "t_kl" in (csv.DictReader(f).fieldnames or [])
    if has_t_kl:
        means = _arm_means(experiment, lambda row: float(row["t_kl"]), results)
    else:
        means = [experiment.T * m for m in _arm_means(experiment, _kl_column, results)]  # (arms,)
    return min(means), max(means)


def plot(out: Path = OUT) -> Path:
    """Draw the map into ``out`` (PNG) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5.6), dpi=110)
    ax.set_xscale("log")
    ax.set_yscale("log")
    t_lo, t_hi, kl_lo, kl_hi = 5, 2e4, 3e-5, 1.0
    ts = [t_lo, t_hi]
    for c in (0.1, 1.0, 10.0):
        ax.plot(ts, [c / t for t in ts], color="#999999", lw=0.8, ls="--", zorder=1)
        x = min(t_hi / 1.6, c / kl_lo / 1.5) if c / t_hi < kl_lo else t_hi / 1.6
        ax.text(x, c / x * 1.25, f"T·KL = {c:g}", color="#777777", fontsize=8, rotation=-33, ha="center")
    ax.fill_between([1000, 8000], *QUOTED_KL, color="#fdae61", alpha=0.18, lw=0, zorder=0)
    ax.fill_between([1000, 8000], *TYPICAL_KL, color="#fdae61", alpha=0.45, lw=0, zorder=0)
    ax.text(2800, 3.2e-4, "bf16 vLLM, 1k-8k tokens\n(published KL)\nnot measured", ha="center", va="center",
            fontsize=8, color="#8c510a")
    seen = set()
    by_t: dict[int, list[Experiment]] = {}
    for e in EXPERIMENTS:
        by_t.setdefault(e.T, []).append(e)
    for group in by_t.values():  # spread the marks of one T sideways (x only: their T is the same), sorted by KL
        group.sort(key=lambda e: e.kl[0] * e.kl[1])
        for i, e in enumerate(group):
            x = e.T * 1.07 ** (i - (len(group) - 1) / 2)
            label, colour, marker = VERDICT_STYLE[e.verdict]
            mid = math.sqrt(e.kl[0] * e.kl[1])
            ax.plot([x, x], list(e.kl), color=colour, lw=2.2, alpha=0.6, zorder=2)
            ax.scatter([x], [mid], color=colour, marker=marker, s=46, zorder=3, edgecolor="black", linewidth=0.4,
                       label=None if e.verdict in seen else label)
            seen.add(e.verdict)
            left = i % 2 == 0 and len(group) > 2
            ax.annotate(e.label, (x, mid), xytext=(-5 if left else 5, 0), textcoords="offset points", fontsize=7,
                        va="center", ha="right" if left else "left")
    ax.set_xlim(t_lo, t_hi)
    ax.set_ylim(kl_lo, kl_hi)
    ax.set_xlabel("completion length T (tokens; marks of one T spread sideways to be legible)")
    ax.set_ylabel("per-token KL(pi_rollout || pi_theta), compared arms")
    ax.set_title("Where each experiment ran (465k / 0.13M-parameter models, CPU) and what it found", fontsize=10)
    ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
    ax.grid(True, which="major", alpha=0.25)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="the PNG to write (default: docs/img/regime_map.png)")
    print(plot(parser.parse_args(argv).out))


if __name__ == "__main__":
    main()


_A = "staleness-and-a-dense-gap-together-experiment-a-bypass-the-asynchronous-trainers-loss-trains-worse"
SECTION = {  # evidence.md section of each experiment (heading anchors)
    "old": "which-preset-for-which-mismatch-measured",
    "s1": "training-in-the-regime-of-real-runs",
    "s2": "training-in-the-regime-of-real-runs",
    "experiment-c": "confirmation-of-the-s2-lead-on-fresh-seeds-experiment-c",
    "experiment-g": "dppo-on-a-stale-engine-experiment-g-pre-registration-25",
    "experiment-g-257": "dppo-on-a-stale-engine-experiment-g-pre-registration-25",
    "experiment-l": "the-long-completion-s2l-experiment-l-at-the-edge-of-the-target-regime-no-significant-cost",
    "experiment-p": "truncated-sampling-s3-experiment-p-no-correction-helps-the-cost-itself-not-confirmed",
    "s3v": "truncated-sampling-on-the-real-vllm-engine-s3v-pre-registrations-20-21-23-and-24",
    "experiment-x": "the-target-regime-s2x-experiment-x-the-stale-engine-costs-trls-default-recovers-most-of-it",
    "experiment-y": "twice-the-lag-s2x-at-lag-16-experiment-y-trls-default-collapses-in-2-of-10-runs-not-confirmed-"
                    "below-bypass",
    "experiment-z": "thirty-more-seeds-at-lag-16-experiment-z-the-collapses-do-not-recur-token_truncate-trains-worse",
    "experiment-q": "a-precision-like-gap-at-257-tokens-experiment-q-no-measurable-cost-no-method-differs",
    "experiment-d": "a-dense-precision-gap-at-257-tokens-experiment-d-bypass-and-token_truncate-train-worse-than-trls-"
                    "default",
    "experiment-a": _A,
    "experiment-b": _A,
    "experiment-e": _A,
    "experiment-f": _A,
    "s4": "trls-asynchronous-trainer-with-a-gap-inside-vllm-s4-pre-registration-17",
    "pre-registration-19": "at-the-monitors-bound-pre-registration-19-sigma-08-not-significant",
    "pre-registration-18": "without-the-gap-pre-registration-18-trl_default-not-shown-to-cost-nothing-so-the-default-"
                           "stays-trls-loss",
}

FINDING = {  # what each experiment found, with the numbers its section (and its test) states
    "old-stale4": "emulated engine 4 steps stale: nothing above TRL's default after Holm (`ppo_is_bypass` 0.896 vs "
                  "0.559, Holm p 0.054); `decoupled_geo_rs` below it (Holm p 0.0013)",
    "old-wq3": "3-bit engine: nothing above TRL's default; `ppo_is_bypass` below it (0.184 vs 0.624, Holm p 0.0085)",
    "old-int8": "INT8 engine: no cost, no method differs (Holm p 1)",
    "old-vllm-bf16": "vLLM bf16 against a float32 trainer: no cost, no method differs (Holm p 1)",
    "old-vllm-sync8": "vLLM synced every 8 steps: nothing above TRL's default (`ppo_is_bypass` 0.857 vs 0.701, "
                      "Holm p 0.38)",
    "s1": "heavy-tailed precision-like gap: no cost (+0.003 [−0.026, +0.032]), nothing to compare",
    "s2": "engine 8 steps stale: costs +0.122; nothing significant after Holm (`ppo_is_bypass` +0.099, Holm p 0.47)",
    "experiment-c": "S2 on 20 fresh seeds: `ppo_is_bypass` +0.065 [+0.032, +0.097] above TRL's default "
                    "(Holm p 0.00017)",
    "experiment-g": "S2 re-run with DPPO (20 paired seeds, then 10 held out): `dppo_kl_bypass` +0.076 "
                    "[+0.040, +0.112], held out +0.035 (one-sided p 0.030); `ppo_is_bypass` +0.079, held out +0.030 "
                    "(p 0.027); `dppo_tv_bypass` not confirmed held out (p 0.073)",
    "experiment-g-257": "engine 16 steps stale at T = 257: `dppo_tv_bypass` +0.125, `dppo_kl_bypass` +0.108, "
                        "`ppo_is_bypass` +0.116 above TRL's default (Holm p 0.048; TRL's default collapsed on 4 of "
                        "20); held out cut by the deadline at 4 of 10 seeds (+0.013, +0.013, −0.003): not confirmed",
    "experiment-l": "engine 16 steps stale at T = 129: cost not significant (+0.027, p 0.095), no method run",
    "experiment-p": "top_p 0.8 on a stand-in engine: nothing above TRL's default (every Holm p 1); the cost not "
                    "confirmed on held-out seeds",
    "s3v": "top_p 0.8 on the real vLLM CPU engine (bf16): nothing above TRL's default (every Holm p 1); the cost, "
           "held out, is the truncation's (top_p 1: +0.055, Holm p 0.0093)",
    "experiment-x": "engine 8 steps stale: costs +0.209; `ppo_is_bypass` +0.025 [−0.024, +0.073] (p 0.28)",
    "experiment-y": "engine 16 steps stale: `ppo_is_bypass` +0.132, `token_truncate` +0.088 (Holm p 0.80); TRL's "
                    "default collapsed on 2 of 10 seeds",
    "experiment-z": "Y on 30 fresh seeds: `ppo_is_bypass` −0.004 [−0.024, +0.016]; `token_truncate` −0.060 "
                    "[−0.090, −0.029] below TRL's default (Holm p 0.00015)",
    "experiment-q": "heavy-tailed precision-like gap: no cost (+0.012); nothing differs (every Holm p 0.73)",
    "experiment-d": "dense precision-like gap: no cost; `ppo_is_bypass` −0.166 and `token_truncate` −0.044 below "
                    "TRL's default (Holm p 0.0059); held out −0.099 and −0.065",
    "experiment-a": "dense gap on an engine 4 steps stale: `ppo_is_bypass` −0.100 [−0.145, −0.054] (Holm p 0.0059); "
                    "held out −0.087",
    "experiment-b": "A with σ 1.0: `ppo_is_bypass` −0.081 [−0.119, −0.043]; held out −0.043 [−0.067, −0.018]",
    "experiment-e": "A with σ 0.8: `ppo_is_bypass` −0.046 [−0.085, −0.006]; held out −0.025 [−0.037, −0.013]",
    "experiment-f": "A with σ 0.6: `ppo_is_bypass` −0.012 [−0.049, +0.025] (p 0.48), not shown equal either",
    "s4": "TRL's AsyncGRPOTrainer, N(0, 1) logit noise in a vLLM CPU server: `trl_default` +0.110 [+0.046, +0.174] "
          "above TRL's trainer as is; held out +0.067 [−0.016, +0.149]",
    "pre-registration-19": "S4 at σ 0.8: `trl_default` +0.038 [−0.007, +0.084], not significant",
    "pre-registration-18": "S4 without noise: `trl_default` −0.038 [−0.093, +0.016], not shown equal (TOST ±0.02 "
                           "p 0.77)",
}


def _g(x: float) -> str:
    return f"{x:.2g}" if x < 1e-2 else f"{x:.3g}"


def markdown_table() -> str:
    """The evidence page's table of every experiment: an anchor per row, the model size, T, and the per-token KL
    and T·KL of the compared arms (their means, lowest to highest), the verdict and what it found."""
    lines = ["| experiment | model | T | per-token KL | T·KL | verdict | what it found |",
             "|---|---|---|---|---|---|---|"]
    for e in EXPERIMENTS:
        old = e.key.startswith("old-")
        model = "0.13M" if old else "465k"
        section = SECTION["old" if old else e.key]
        kl = _g(e.kl[0]) if e.kl[0] == e.kl[1] else f"{_g(e.kl[0])}–{_g(e.kl[1])}"
        t_kl = _g(e.t_kl[0]) if e.t_kl[0] == e.t_kl[1] else f"{_g(e.t_kl[0])}–{_g(e.t_kl[1])}"
        T = f"≤ {e.T}" if old else str(e.T)
        lines.append(f'| <a id="{e.key}"></a>[{e.label}](#{section}) | {model} | {T} | {kl} | {t_kl} | '
                     f"{e.verdict} | {FINDING[e.key]} |")
    return "\n".join(lines)
