"""Which correction trains best for which sampler/trainer mismatch, against TRL's own default correction.

One command, resumable (each finished run is a JSON file that a re-run skips), two runs at a time:

    python benchmarks/mismatch_bench.py                                   # every scenario, every method, 5 seeds
    python benchmarks/mismatch_bench.py --scenarios vllm_sync8,wq3 --seeds 0,1,2 --methods uncorrected,trl_default
    python benchmarks/mismatch_bench.py --map --out DIR                   # the estimator map (estimator_map.py)

Task and model: the demo's (reverse 6 digits, a tiny Qwen2-style model built locally and warmed up with 90
supervised steps, ``--steps`` GRPO steps of 8 prompts x 8 completions, dapo, lr 3e-4, T=1). Score: the **policy's
own** mean reward on 256 fixed held-out prompts (T=1), averaged over the evaluations in the last 20% of the steps.

Scenarios (the sampler every method but ``on_policy`` trains on):

* ``vllm_sync8``: the real vLLM engine (CPU build, colocated, float32) synced every 8 optimizer steps (0..7 behind);
* ``stale4``: the emulated engine, a copy of the policy exactly 4 optimizer steps behind;
* ``wq3`` / ``wq4``: a persistent precision gap, every Linear weight fake-quantized to 3 / 4 bits (per channel);
* ``int8``: torch's dynamic INT8 quantization of every Linear;
* ``vllm_bf16``: vLLM in bfloat16 (weights and compute), synced every step, the trainer in float32;
* ``vllm_top_p``: vLLM synced every step, sampling with top_p=0.8 (a truncated support: pi_rollout is renormalized
  over the kept tokens, the trainer's pi_theta is not).

``on_policy`` (the same model sampling for itself: vLLM synced every step in float32 for the vLLM scenarios, the
policy's own ``generate`` otherwise) is the ceiling, ``uncorrected`` (preset ``disabled``) the floor:
gap = on_policy - uncorrected, and "gap closed" = (method - uncorrected) / gap, with a 95% bootstrap interval
(seeds resampled within each row). Every row also shows its difference to ``trl_default`` (TRL 1.16's default,
``vllm_importance_sampling_mode="sequence_mask"``, C=3: what a TRL user has) with a 95% Welch interval.

Methods: TRL's four modes (``trl_<mode>``, spelled with TRL's own fields and run as TRL runs them: no truncated-support
fix), this package's presets, and ``METHODS``' other rows. Output: ``OUTPUT_DIR/runs/*.json``,
``OUTPUT_DIR/mismatch_results.csv``, ``OUTPUT_DIR/mismatch_results.md`` (docs/benchmarks.md's table),
``OUTPUT_DIR/mismatch_gap_closed.png`` and the table on stdout.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time

from trl_rollout_corr.core.metric_names import metric

# scenario -> (engine, lag, extra RolloutCorrGRPOConfig fields, on-policy reference)
SCENARIOS = {
    "vllm_sync8": ("vllm", 8, {}, "vllm"),
    "stale4": ("stale", 4, {}, "policy"),
    "wq3": ("wq3", 1, {}, "policy"),
    "vllm_top_p": ("vllm", 1, dict(top_p=0.8), "vllm"),
    "int8": ("int8", 1, {}, "policy"),
    "vllm_bf16": ("vllm", 1, dict(vllm_dtype="bfloat16"), "vllm"),
    "wq4": ("wq4", 1, {}, "policy"),
}
# on-policy references: (engine, lag) of a run whose sampler is the policy itself
REFERENCES = {"vllm": ("vllm", 1), "policy": ("stale", 4)}
_AS_TRL = dict(truncated_support_correction=False)  # TRL computes its ratio against the full softmax
# method -> (preset, extra fields); the fields are RolloutCorrGRPOConfig's, TRL's own spelling included
METHODS = {
    "uncorrected": ("disabled", {}),
    "trl_default": ("trl_default", {**_AS_TRL}),  # TRL's default: vllm_importance_sampling_mode "sequence_mask",
                                                   # clip_max 3 (the preset of that name)
    "trl_sequence_truncate": (None, dict(vllm_importance_sampling_mode="sequence_truncate", **_AS_TRL)),
    "trl_token_mask": (None, dict(vllm_importance_sampling_mode="token_mask", **_AS_TRL)),
    "trl_token_truncate": (None, dict(vllm_importance_sampling_mode="token_truncate", **_AS_TRL)),
    "decoupled_token_is": ("decoupled_token_is", {}),
    "ppo_is_bypass": ("ppo_is_bypass", {}),
    "icepop": ("icepop", {}),
    "decoupled_geo_rs": ("decoupled_geo_rs", {}),
    "decoupled_seq_is_rs": ("decoupled_seq_is_rs", {}),
    # candidates for where nothing closes the gap: the masks of TRL's modes made two-sided
    "seq_mask_two_sided": ("trl_default", dict(rollout_is_threshold_lower=1 / 3)),  # sequence rho in [1/3, 3], else 0
    "token_mask_in_divisor": ("trl_default", dict(rollout_is="token", rollout_is_threshold=2.0,
                                                  rollout_is_threshold_lower=0.5)),  # icepop's band, kept in the count
    # M2PO-style second-moment mask (tau 0.04, the paper's), on TRL's default and on bypass PPO
    "trl_default_m2": ("trl_default", dict(rollout_m2_threshold=0.04)),
    "bypass_m2": ("ppo_is_bypass", dict(rollout_m2_threshold=0.04)),
}
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def run_path(output_dir: str, scenario: str, method: str, seed: int) -> str:
    """On-policy runs are shared by the scenarios of one reference."""
    if method == "on_policy":
        scenario = f"ref-{SCENARIOS[scenario][3]}"
    return os.path.join(output_dir, "runs", f"{scenario}__{method}__seed{seed}.json")


def _engine(scenario: str, method: str) -> str:
    """The engine a run samples with (the on-policy reference's for ``on_policy``)."""
    engine, _, _, reference = SCENARIOS[scenario]
    return REFERENCES[reference][0] if method == "on_policy" else engine


def worker(scenario: str, method: str, seed: int, steps: int, eval_every: int, out: str) -> None:
    from trl_rollout_corr.demo.run import run_worker

    engine, lag, fields, reference = SCENARIOS[scenario]
    if method == "on_policy":
        engine, lag = REFERENCES[reference]
        run_worker("on_policy", seed, steps, lag, engine, eval_every, out, preset="disabled", stale=False)
        return
    preset, extra = METHODS[method]
    run_worker(method, seed, steps, lag, engine, eval_every, out, preset=preset, stale=True,
               config_overrides={**fields, **extra})


def run_all(cells: list[tuple[str, str, int]], steps: int, eval_every: int, output_dir: str, jobs: int) -> None:
    """Run every missing cell, ``jobs`` processes at a time (each process is one run: a trainer that ran before
    slows later generation)."""
    os.makedirs(os.path.join(output_dir, "runs"), exist_ok=True)
    todo = [c for c in cells if not os.path.exists(run_path(output_dir, *c))]
    todo = list(dict.fromkeys(todo))
    print(f"{len(cells)} runs, {len(cells) - len(todo)} already done, {len(todo)} to go", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    running: list[tuple[subprocess.Popen, str, float]] = []
    done = 0
    while todo or running:
        while todo and len(running) < jobs:
            scenario, method, seed = todo.pop(0)
            out = run_path(output_dir, scenario, method, seed)
            if any(o == out for _, o, _ in running):
                continue
            # a worker that never samples with vLLM skips its import (as the demo's do)
            no_vllm = {"TRL_ROLLOUT_CORR_NO_VLLM": "1"} if _engine(scenario, method) != "vllm" else {}
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", scenario, "--method", method,
                   "--seed", str(seed), "--steps", str(steps), "--eval_every", str(eval_every), "--out", out]
            worker = subprocess.Popen(cmd, env={**env, **no_vllm}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            running.append((worker, out, time.time()))
        time.sleep(0.5)
        for proc, out, t0 in list(running):
            if proc.poll() is None:
                continue
            running.remove((proc, out, t0))
            done += 1
            if proc.returncode != 0:
                print(f"FAILED {out}:\n{proc.stderr.read().decode()[-3000:]}", flush=True)
            else:
                print(f"[{done}] {os.path.basename(out)} {time.time() - t0:.0f} s", flush=True)


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval."""
    m = statistics.fmean(xs)
    return m, (T_975.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan)


def welch_ci(a: list[float], b: list[float]) -> tuple[float, float]:
    """mean(a) - mean(b) and the half-width of its 95% Welch interval."""
    d = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return d, math.nan
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return d, 0.0
    dof = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return d, T_975.get(max(1, round(dof)), 1.96) * se


def gap_closed_ci(method: list[float], floor: list[float], ceiling: list[float], n_boot: int = 4000,
                  seed: int = 0) -> tuple[float, float, float]:
    """(m - u) / (o - u) and its 95% bootstrap interval (each row's seeds resampled independently)."""
    def closed(x, u, o):
        gap = statistics.fmean(o) - statistics.fmean(u)
        return (statistics.fmean(x) - statistics.fmean(u)) / gap if gap != 0 else math.nan

    point = closed(method, floor, ceiling)
    rng = random.Random(seed)
    draws = sorted(closed(rng.choices(method, k=len(method)), rng.choices(floor, k=len(floor)),
                          rng.choices(ceiling, k=len(ceiling))) for _ in range(n_boot))
    draws = [d for d in draws if math.isfinite(d)]
    if not draws:
        return point, math.nan, math.nan
    return point, draws[int(0.025 * len(draws))], draws[int(0.975 * len(draws)) - 1]


def load(output_dir: str, scenario: str, method: str, seeds: list[int]) -> list[dict]:
    runs = []
    for seed in seeds:
        path = run_path(output_dir, scenario, method, seed)
        if os.path.exists(path):
            with open(path) as f:
                runs.append(json.load(f))
    return runs


def summarize(scenarios: list[str], methods: list[str], seeds: list[int], output_dir: str) -> str:
    rows, lines = [], []
    for scenario in scenarios:
        by = {m: load(output_dir, scenario, m, seeds) for m in ["on_policy", *methods]}
        done = {m: [r["eval_reward"] for r in runs] for m, runs in by.items()}
        # a row is all of its seeds or none (a partial row would compare unlike things)
        reward = {m: xs for m, xs in done.items() if len(xs) == len(seeds)}
        if not reward:
            continue
        lines.append(f"\n{scenario}: held-out reward, mean ± 95% CI (seeds: n per row)")
        lines.append(f"{'method':24s} {'n':>2s} {'reward':>15s} {'vs trl_default':>17s} {'gap closed [95% CI]':>24s} "
                     f"{'kl':>7s} {'rejected':>8s} {'s/run':>6s}")
        for m in ["on_policy", *methods]:
            xs = reward.get(m, [])
            if not xs:
                if done[m]:
                    lines.append(f"{m:24s} {len(done[m])} of {len(seeds)} seeds done: left out")
                continue
            mean, half = mean_ci(xs)
            diff, diff_half = (welch_ci(xs, reward["trl_default"]) if reward.get("trl_default") and m != "trl_default"
                               else (math.nan, math.nan))
            closed = lo = hi = math.nan
            if m not in ("on_policy", "uncorrected") and reward.get("uncorrected") and reward.get("on_policy"):
                closed, lo, hi = gap_closed_ci(xs, reward["uncorrected"], reward["on_policy"])
            kl = statistics.fmean(r["metrics"][metric("kl")] for r in by[m])
            rej = statistics.fmean(r["metrics"][metric("rejected_token_fraction")] for r in by[m])
            secs = statistics.fmean(r["seconds"] for r in by[m])
            fmt_diff = f"{diff:+.3f} ± {diff_half:.3f}" if math.isfinite(diff) else ""
            fmt_closed = f"{closed * 100:4.0f}% [{lo * 100:4.0f}, {hi * 100:4.0f}]" if math.isfinite(closed) else ""
            lines.append(f"{m:24s} {len(xs):2d} {mean:7.3f} ± {half:5.3f} {fmt_diff:>17s} {fmt_closed:>24s} "
                         f"{kl:7.4f} {rej:8.3f} {secs:6.0f}")
            rows.append(dict(scenario=scenario, method=m, n_seeds=len(xs), reward_mean=mean, reward_ci95=half,
                             per_seed=" ".join(f"{x:.6f}" for x in xs), vs_trl_default=diff,
                             vs_trl_default_ci95=diff_half, gap_closed=closed, gap_closed_lo=lo, gap_closed_hi=hi,
                             kl=kl, rejected_token_fraction=rej, seconds_per_run=secs,
                             alerts=" | ".join(",".join(f"{a}@{s}" for s, a in r.get("alerts", [])) or "-"
                                               for r in by[m])))
    if rows:
        with open(os.path.join(output_dir, "mismatch_results.md"), "w") as f:
            f.write(markdown(rows) + "\n\n" + recommendations(rows) + "\n")
        with open(os.path.join(output_dir, "mismatch_results.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        lines.append(f"\nwrote {output_dir}/mismatch_results.csv and {output_dir}/mismatch_results.md "
                     "(docs/benchmarks.md's table)")
        try:
            plot(rows, os.path.join(output_dir, "mismatch_gap_closed.png"))
            lines.append(f"wrote {output_dir}/mismatch_gap_closed.png")
        except ImportError:
            lines.append("(install matplotlib for the plot)")
    return "\n".join(lines)


SCENARIO_TEXT = {
    "vllm_sync8": "a stale engine: vLLM synced every 8 steps",
    "stale4": "a stale engine: the emulated copy 4 steps behind",
    "wq3": "a persistent precision gap: a 3-bit weight-quantized engine",
    "wq4": "a persistent precision gap: a 4-bit weight-quantized engine",
    "int8": "a persistent precision gap: an INT8 engine",
    "vllm_bf16": "a persistent precision gap: vLLM in bfloat16, the trainer in float32",
    "vllm_top_p": "truncated sampling: vLLM at top_p 0.8",
}


REFERENCE_ROWS = ("on_policy", "uncorrected")  # the ceiling and the floor of every scenario


def _significant(r: dict, sign: int) -> bool:
    """Whether ``r`` differs from TRL's default in direction ``sign`` (its 95% Welch interval excludes 0)."""
    diff, half = r["vs_trl_default"], r["vs_trl_default_ci95"]
    return math.isfinite(diff) and math.isfinite(half) and sign * diff - half > 0


def _better_corrections(rows: list[dict], scenario: str) -> list[dict]:
    """The corrections (not the floor or the ceiling) significantly above TRL's default in ``scenario``, best first."""
    return sorted((r for r in rows if r["scenario"] == scenario and r["method"] not in REFERENCE_ROWS
                   and r["method"] != "trl_default" and _significant(r, +1)), key=lambda r: -r["reward_mean"])


def recommended(rows: list[dict], scenario: str) -> str:
    """The correction to use in ``scenario``: the best of those significantly above TRL's default, else TRL's
    default. (No correction is the floor, not a remedy; where it beats TRL's default the advice says so.)"""
    better = _better_corrections(rows, scenario)
    return better[0]["method"] if better else "trl_default"


def recommendations(rows: list[dict]) -> str:
    """docs/benchmarks.md's "which preset for which mismatch", generated from the table's rows, each line citing
    its rows.

    Per scenario: the methods significantly above TRL's default (best first), or "keep TRL's default" when there is
    none; the methods significantly below it (to avoid); and whether any method closed half the gap."""
    out = []
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        block = {r["method"]: r for r in rows if r["scenario"] == scenario}
        trl = block.get("trl_default")
        if trl is None:
            continue
        methods = [r for m, r in block.items() if m not in ("on_policy", "trl_default")]
        better = _better_corrections(rows, scenario)
        worse = sorted((r for r in methods if _significant(r, -1)), key=lambda r: r["reward_mean"])
        cite = lambda r: (f"`{r['method']}` {r['reward_mean']:.3f} ({r['vs_trl_default']:+.3f} ± "  # noqa: E731
                          f"{r['vs_trl_default_ci95']:.3f})")
        line = f"- **{SCENARIO_TEXT.get(scenario, scenario)}** (`{scenario}`; TRL's default {trl['reward_mean']:.3f}): "
        if better:
            line += "use " + ", then ".join(cite(r) for r in better[:3]) + "."
        else:
            best = max(methods, key=lambda r: r["reward_mean"], default=None)
            line += "no method is significantly above TRL's default"
            line += f" (best: {cite(best)})." if best is not None else "."
        floor_row = block.get("uncorrected")
        if floor_row is not None and _significant(floor_row, +1):
            line += f" No correction is significantly above TRL's default too: {cite(floor_row)}."
        if worse:
            line += " Significantly below TRL's default: " + ", ".join(f"`{r['method']}`" for r in worse) + "."
        closing = [r for r in methods if math.isfinite(r["gap_closed"])]
        ref, floor = block.get("on_policy"), block.get("uncorrected")
        if ref and floor:
            gap, gap_half = welch_ci([float(x) for x in ref["per_seed"].split()],
                                     [float(x) for x in floor["per_seed"].split()])
            if not gap - gap_half > 0:
                line += (" The mismatch costs nothing measurable here "
                         f"(on-policy − uncorrected {gap:+.3f} ± {gap_half:.3f}).")
            elif closing:
                top = max(closing, key=lambda r: r["gap_closed"])
                share = (f"`{top['method']}`, {top['gap_closed'] * 100:.0f}% [{top['gap_closed_lo'] * 100:.0f}, "
                         f"{top['gap_closed_hi'] * 100:.0f}]")
                gap_text = f"on-policy − uncorrected {gap:+.3f} ± {gap_half:.3f}"
                line += (f" Best at closing the gap ({gap_text}): {share}." if top["gap_closed"] >= 0.5 else
                         f" No method closes half the gap ({gap_text}; best: {share}).")
        out.append(line)
    return "\n".join(out)


def read_rows(csv_path: str) -> list[dict]:
    """The rows of a ``mismatch_results.csv`` as :func:`summarize` wrote them (numbers as floats)."""
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    text = ("scenario", "method", "per_seed", "alerts")
    return [{k: (v if k in text else int(v) if k == "n_seeds" else float(v)) for k, v in r.items()} for r in rows]


def markdown(rows: list[dict]) -> str:
    """docs/benchmarks.md's table: one block of rows per scenario, best first; **bold** where a method is significantly
    above TRL's default (its 95% Welch interval excludes 0), ↓ where significantly below; ``on_policy`` is the
    ceiling (no mismatch), ``uncorrected`` the floor."""
    out = ["| scenario | method | n | held-out reward (95% CI) | vs `trl_default` (95% CI) | gap closed (95% CI) "
           "| kl | rejected |",
           "|---|---|---|---|---|---|---|---|"]
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        block = sorted((r for r in rows if r["scenario"] == scenario), key=lambda r: -r["reward_mean"])
        for r in block:
            diff, half = r["vs_trl_default"], r["vs_trl_default_ci95"]
            better = math.isfinite(diff) and math.isfinite(half) and diff - half > 0
            worse = math.isfinite(diff) and math.isfinite(half) and diff + half < 0
            name = f"**{r['method']}**" if better and r["method"] != "on_policy" else r["method"]
            vs = f"{diff:+.3f} ± {half:.3f}" + (" ↓" if worse else "") if math.isfinite(diff) else "—"
            closed = (f"{r['gap_closed'] * 100:.0f}% [{r['gap_closed_lo'] * 100:.0f}, {r['gap_closed_hi'] * 100:.0f}]"
                      if math.isfinite(r["gap_closed"]) else "")
            out.append(f"| {scenario} | {name} | {r['n_seeds']} | {r['reward_mean']:.3f} ± {r['reward_ci95']:.3f} | "
                       f"{vs} | {closed} | {r['kl']:.3f} | {r['rejected_token_fraction']:.2f} |")
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> None:
    """One panel per scenario: each method's held-out reward with its 95% CI, on-policy and uncorrected as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.2 * len(scenarios), 4.8), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        mine = [r for r in rows if r["scenario"] == scenario and r["method"] not in ("on_policy", "uncorrected")]
        for r in rows:
            if r["scenario"] == scenario and r["method"] in ("on_policy", "uncorrected"):
                ax.axvline(r["reward_mean"], ls="--" if r["method"] == "uncorrected" else "-", color="grey")
        ax.errorbar([r["reward_mean"] for r in mine], range(len(mine)),
                    xerr=[0 if math.isnan(r["reward_ci95"]) else r["reward_ci95"] for r in mine], fmt="o")
        ax.set_yticks(range(len(mine)), [r["method"] for r in mine], fontsize=7)
        ax.set(title=scenario, xlabel="held-out reward (95% CI)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


TRACE_COLUMNS = ("reward", "entropy", *(metric(name) for name in (
    "kl", "k3_kl", "chi2_token", "rollout_is_eff_sample_size", "rollout_is_ratio_fraction_high",
    "rejected_token_fraction")))


def export_trace(output_dir: str, scenario: str, method: str, seed: int, path: str) -> None:
    """One run's logged rows in the monitor tests' trace format (``tests/data``): what the monitor saw, the run's
    resolved correction and the engine's lag as the run's monitor knew them, and the held-out reward curve."""
    from trl_rollout_corr import RolloutCorrGRPOConfig

    with open(run_path(output_dir, scenario, method, seed)) as f:
        run = json.load(f)
    engine, lag, fields, _ = SCENARIOS[scenario]
    preset, extra = METHODS[method]
    correction = {k: v for k, v in {**fields, **extra}.items() if k.startswith(("rollout_", "vllm_imp"))}
    args = RolloutCorrGRPOConfig(output_dir=output_dir, use_cpu=True, rollout_correction_preset=preset, **correction)
    rows = [[log["step"], *(log.get(c) for c in TRACE_COLUMNS)] for log in run["logs"]]
    trace = dict(scenario=scenario, method=method, seed=seed, lag=lag if engine in ("stale", "vllm") else 0,
                 correction=args.rollout_correction.to_dict(), eval_curve=run["curve"], alerts=run["alerts"],
                 columns=["step", *TRACE_COLUMNS], rows=rows)
    with open(path, "w") as f:
        json.dump(trace, f)


def main(argv: list[str]) -> None:
    if "--map" in argv:  # issue 36 part 1, no training: benchmarks/estimator_map.py takes the other arguments
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from estimator_map import main as estimator_map

        estimator_map([x for x in argv if x != "--map"])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset of " + ", ".join(SCENARIOS))
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval_every", type=int, default=50)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--output_dir", default="outputs/mismatch_bench")
    p.add_argument("--summary_only", action="store_true", help="print the table of the runs already done")
    p.add_argument("--export_trace", metavar="SCENARIO:METHOD:SEED:PATH",
                   help="write one finished run's logged rows as a monitor test trace (tests/data) and exit")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.worker, a.method, a.seed, a.steps, a.eval_every, a.out)
        return
    if a.export_trace:
        scenario, method, seed, path = a.export_trace.split(":")
        export_trace(a.output_dir, scenario, method, int(seed), path)
        return
    scenarios = [s for s in a.scenarios.split(",") if s]
    methods = [m for m in a.methods.split(",") if m]
    unknown = [s for s in scenarios if s not in SCENARIOS] + [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown scenario(s)/method(s) {unknown}")
    seeds = [int(s) for s in a.seeds.split(",")]
    t0 = time.time()
    if not a.summary_only:
        # scenario by scenario, seed by seed: a partial run compares like with like
        cells = [(s, m, seed) for s in scenarios for seed in seeds for m in ["on_policy", *methods]]
        run_all(cells, a.steps, a.eval_every, a.output_dir, a.jobs)
    print(summarize(scenarios, methods, seeds, a.output_dir))
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
