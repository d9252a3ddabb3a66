"""Which correction trains best for which sampler/trainer mismatch, against TRL's own default correction.

One command, resumable (each finished run is a JSON file that a re-run skips), two runs at a time:

    python experiments/mismatch_bench.py                                   # every scenario, every method, 5 seeds
    python experiments/mismatch_bench.py --scenarios vllm_sync8,wq3 --seeds 0,1,2 --methods uncorrected,trl_default
    python experiments/mismatch_bench.py --map --out DIR                   # the estimator map (estimator_map.py)

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
gap = on_policy - uncorrected, and "gap closed" = (method - uncorrected) / gap with Fieller's 95% interval, given only
where the gap itself is significant (paired t, p < 0.05). Every row also shows its paired difference to
``trl_default`` (TRL 1.16's default, ``vllm_importance_sampling_mode="sequence_mask"``, C=3: what a TRL user has):
the seeds are shared by every method (same initialisation, warm-up, prompt order and evaluation prompts), so the
analysis is paired (``experiments/stats.py``): the mean per-seed difference with its paired-t 95% interval, the paired-t
p, the exact sign-flip p, and both Holm-adjusted over the family of every comparison against ``trl_default`` in the
table (every method but ``on_policy``, every scenario). None of it is confirmed on held-out seeds.

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
import statistics
import sys
import time

if not __package__:  # run as a script (python experiments/x.py): this checkout's root first, for experiments.*
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import stats  # noqa: E402
from trl_rollout_corr.core.metric_names import metric  # noqa: E402

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
    # candidates for where nothing closes the gap (POST_HOC: designed after the first results, scored on the same
    # seeds): the masks of TRL's modes made two-sided
    "seq_mask_two_sided": ("trl_default", dict(rollout_is_threshold_lower=1 / 3)),  # sequence rho in [1/3, 3], else 0
    "token_mask_in_divisor": ("trl_default", dict(rollout_is="token", rollout_is_threshold=2.0,
                                                  rollout_is_threshold_lower=0.5)),  # icepop's band, kept in the count
    # M2PO-style second-moment mask (tau 0.04, the paper's), on TRL's default and on bypass PPO
    "trl_default_m2": ("trl_default", dict(rollout_m2_threshold=0.04)),
    "bypass_m2": ("ppo_is_bypass", dict(rollout_m2_threshold=0.04)),
}
# the methods designed after the first results were seen and scored on the same seeds: exploratory, never recommended
POST_HOC = ("seq_mask_two_sided", "token_mask_in_divisor", "trl_default_m2", "bypass_m2")
ALPHA = 0.05  # family-wise, Holm over every comparison against trl_default in the table
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
    from experiments.harness import run_worker

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
    from trl_rollout_corr.runtime.pool import Job, run_processes

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    workers = []
    for scenario, method, seed in todo:
        out = run_path(output_dir, scenario, method, seed)
        # a worker that never samples with vLLM skips its import (as the demo's do)
        no_vllm = {"TRL_ROLLOUT_CORR_NO_VLLM": "1"} if _engine(scenario, method) != "vllm" else {}
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", scenario, "--method", method,
               "--seed", str(seed), "--steps", str(steps), "--eval_every", str(eval_every), "--out", out]
        workers.append(Job(cmd, os.path.basename(out), {**env, **no_vllm}))
    run_processes(workers, jobs)


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval."""
    m = statistics.fmean(xs)
    return m, (T_975.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan)


def load(output_dir: str, scenario: str, method: str, seeds: list[int]) -> list[dict]:
    runs = []
    for seed in seeds:
        path = run_path(output_dir, scenario, method, seed)
        if os.path.exists(path):
            with open(path) as f:
                runs.append(json.load(f))
    return runs


def summarize(scenarios: list[str], methods: list[str], seeds: list[int], output_dir: str) -> str:
    """The table of the runs done (``OUTPUT_DIR/runs``): one row per (scenario, method) with every seed, analysed by
    :func:`analyse`, written by :func:`write_outputs`; returns the text table."""
    rows, left_out = [], []
    for scenario in scenarios:
        by = {m: load(output_dir, scenario, m, seeds) for m in ["on_policy", *methods]}
        for m, runs in by.items():
            # a row is all of its seeds or none (a partial row would compare unlike things)
            if len(runs) != len(seeds):
                if runs:
                    left_out.append(f"{scenario} {m}: {len(runs)} of {len(seeds)} seeds done: left out")
                continue
            xs = [r["eval_reward"] for r in runs]
            mean, half = mean_ci(xs)
            rows.append(dict(scenario=scenario, method=m, n_seeds=len(xs), reward_mean=mean, reward_ci95=half,
                             per_seed=" ".join(f"{x:.6f}" for x in xs),
                             kl=statistics.fmean(r["metrics"][metric("kl")] for r in runs),
                             rejected_token_fraction=statistics.fmean(r["metrics"][metric("rejected_token_fraction")]
                                                                      for r in runs),
                             seconds_per_run=statistics.fmean(r["seconds"] for r in runs),
                             alerts=" | ".join(",".join(f"{a}@{s}" for s, a in r.get("alerts", [])) or "-"
                                               for r in runs)))
    analyse(rows)
    lines = [*left_out, text_table(rows)]
    if rows:
        lines.append(write_outputs(rows, output_dir))
    return "\n".join(lines)


RESULT_FIELDS = ("scenario", "method", "n_seeds", "reward_mean", "reward_ci95", "per_seed", "vs_trl_default",
                 "vs_trl_default_lo", "vs_trl_default_hi", "p_paired", "p_holm", "p_sign_flip", "p_sign_flip_holm",
                 "gap_closed", "gap_closed_lo", "gap_closed_hi", "kl", "rejected_token_fraction", "seconds_per_run",
                 "alerts")


def _seeds(row: dict) -> list[float]:
    return [float(x) for x in row["per_seed"].split()]


def analyse(rows: list[dict]) -> list[dict]:
    """Add the paired statistics to ``rows`` (in place; each needs ``scenario``, ``method`` and ``per_seed``, the
    per-seed rewards in seed order, the same seeds in every row):

    * ``vs_trl_default`` (mean per-seed difference to ``trl_default`` in the same scenario), ``vs_trl_default_lo`` /
      ``_hi`` (its paired-t 95% interval), ``p_paired`` (paired t) and ``p_sign_flip`` (exact sign-flip), and
      ``p_holm`` / ``p_sign_flip_holm``: Holm-adjusted over the family of every such comparison in ``rows`` (every
      method but ``trl_default`` and ``on_policy``, every scenario); NaN for ``trl_default`` and ``on_policy``;
    * ``gap_closed`` = (m - u) / (o - u) with Fieller's 95% interval (``_lo``, ``_hi``), for every method but the
      floor and the ceiling, only where the gap o - u itself is significant (paired t, p < 0.05; exactly where
      Fieller's interval is bounded), else NaN."""
    nan = math.nan
    by = {(r["scenario"], r["method"]): _seeds(r) for r in rows}
    for r in rows:
        r.update(vs_trl_default=nan, vs_trl_default_lo=nan, vs_trl_default_hi=nan, p_paired=nan, p_sign_flip=nan,
                 gap_closed=nan, gap_closed_lo=nan, gap_closed_hi=nan)
        s, m, xs = r["scenario"], r["method"], by[(r["scenario"], r["method"])]
        trl, floor, ceiling = by.get((s, "trl_default")), by.get((s, "uncorrected")), by.get((s, "on_policy"))
        if trl is not None and m not in ("trl_default", "on_policy"):
            c = stats.compare_paired(xs, trl)
            r.update(vs_trl_default=c["diff"], vs_trl_default_lo=c["diff_lo"], vs_trl_default_hi=c["diff_hi"],
                     p_paired=c["p"], p_sign_flip=c["p_sign_flip"])
        if floor is not None and ceiling is not None and m not in REFERENCE_ROWS:
            if stats.paired_t(ceiling, floor).p < ALPHA:
                g = stats.fieller(xs, floor, ceiling)
                r.update(gap_closed=g.estimate, gap_closed_lo=g.lo, gap_closed_hi=g.hi)
    for r in rows:  # add_holm keeps a value already there
        r.pop("p_holm", None), r.pop("p_sign_flip_holm", None)
    stats.add_holm(rows, "p_paired", "p_holm")
    stats.add_holm(rows, "p_sign_flip")
    return rows


def scenario_gap(rows: list[dict], scenario: str) -> stats.PairedT | None:
    """The paired on-policy - uncorrected gap of ``scenario`` (None without both rows)."""
    block = {r["method"]: r for r in rows if r["scenario"] == scenario}
    if "on_policy" not in block or "uncorrected" not in block:
        return None
    return stats.paired_t(_seeds(block["on_policy"]), _seeds(block["uncorrected"]))


def text_table(rows: list[dict]) -> str:
    lines = []
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        lines.append(f"\n{scenario}: held-out reward, mean ± 95% CI; paired difference to trl_default [95% CI], "
                     "Holm p over the whole table")
        lines.append(f"{'method':24s} {'n':>2s} {'reward':>15s} {'vs trl_default [95% CI]':>26s} {'Holm p':>7s} "
                     f"{'gap closed [Fieller]':>22s} {'kl':>7s} {'rejected':>8s} {'s/run':>6s}")
        for r in (r for r in rows if r["scenario"] == scenario):
            diff = (f"{r['vs_trl_default']:+.3f} [{r['vs_trl_default_lo']:+.3f}, {r['vs_trl_default_hi']:+.3f}]"
                    if math.isfinite(r["vs_trl_default"]) else "")
            holm_p = f"{r['p_holm']:.2g}" if math.isfinite(r["p_holm"]) else ""
            lines.append(f"{r['method']:24s} {r['n_seeds']:2d} {r['reward_mean']:7.3f} ± {r['reward_ci95']:5.3f} "
                         f"{diff:>26s} {holm_p:>7s} {_fmt_closed(r):>22s} {r['kl']:7.4f} "
                         f"{r['rejected_token_fraction']:8.3f} {r['seconds_per_run']:6.0f}")
    return "\n".join(lines)


def write_outputs(rows: list[dict], output_dir: str) -> str:
    """``mismatch_results.csv``, ``mismatch_results.md`` (docs/benchmarks.md's table and advice) and the plot."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "mismatch_results.md"), "w") as f:
        f.write(markdown(rows) + "\n\n" + recommendations(rows) + "\n")
    with open(os.path.join(output_dir, "mismatch_results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RESULT_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"\nwrote {output_dir}/mismatch_results.csv and {output_dir}/mismatch_results.md "
             "(docs/benchmarks.md's table)"]
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


def _holm_significant(r: dict, sign: int) -> bool:
    """Whether ``r`` differs from TRL's default in direction ``sign`` after Holm over the table's family
    (adjusted paired-t p < ALPHA)."""
    return math.isfinite(r["p_holm"]) and r["p_holm"] < ALPHA and sign * r["vs_trl_default"] > 0


def _better_corrections(rows: list[dict], scenario: str, post_hoc: bool = False) -> list[dict]:
    """The corrections (not the floor or the ceiling) above TRL's default in ``scenario`` after Holm, best first;
    the POST_HOC candidates only with ``post_hoc``."""
    return sorted((r for r in rows if r["scenario"] == scenario and r["method"] not in REFERENCE_ROWS
                   and r["method"] != "trl_default" and (post_hoc or r["method"] not in POST_HOC)
                   and _holm_significant(r, +1)), key=lambda r: -r["reward_mean"])


def recommended(rows: list[dict], scenario: str) -> str | None:
    """The correction the table supports for ``scenario``: the best of the (not post-hoc) corrections above TRL's
    default after Holm over the whole table, else None (the evidence does not single one out). Even then it is not
    confirmed: no held-out seeds were run."""
    better = _better_corrections(rows, scenario)
    return better[0]["method"] if better else None


def _cite(r: dict) -> str:
    return (f"`{r['method']}` {r['reward_mean']:.3f} ({r['vs_trl_default']:+.3f} [{r['vs_trl_default_lo']:+.3f}, "
            f"{r['vs_trl_default_hi']:+.3f}], Holm p {r['p_holm']:.2g})")


def recommendations(rows: list[dict]) -> str:
    """docs/benchmarks.md's per-scenario reading of the table, generated from its rows, each line citing its rows.

    Per scenario: the corrections above TRL's default after Holm (paired t, the family of every comparison against
    TRL's default in the table), the post-hoc candidates that pass apart; else the smallest Holm p; no correction
    where it passes; the methods below TRL's default after Holm; and the gap on-policy - uncorrected with the best
    gap closed (Fieller), or that the gap is not significant. Nothing here was confirmed on held-out seeds."""
    family = sum(1 for r in rows if math.isfinite(r["p_holm"]))
    out = [f"Family: {family} paired comparisons against TRL's default (every method but `on_policy`, every "
           f"scenario), Holm-adjusted, α = {ALPHA}. With 5 seeds the exact sign-flip p cannot go below 2/32 = 0.0625, "
           "so no difference here survives a test free of the t-distribution's assumption. None of it was confirmed "
           "on held-out seeds: read every line as not confirmed (old benchmark: T ≤ 9 tokens, per-token KL "
           "0.14–0.30 on the stale and 3-bit engines).", ""]
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        block = {r["method"]: r for r in rows if r["scenario"] == scenario}
        trl = block.get("trl_default")
        if trl is None:
            continue
        methods = [r for m, r in block.items() if m not in ("on_policy", "trl_default")]
        better = _better_corrections(rows, scenario)
        exploratory = [r for r in _better_corrections(rows, scenario, post_hoc=True) if r["method"] in POST_HOC]
        worse = sorted((r for r in methods if _holm_significant(r, -1)), key=lambda r: r["reward_mean"])
        line = f"- **{SCENARIO_TEXT.get(scenario, scenario)}** (`{scenario}`; TRL's default {trl['reward_mean']:.3f}): "
        if better:
            line += "above TRL's default after Holm: " + ", then ".join(_cite(r) for r in better[:3]) + "."
        else:
            closest = min((r for r in methods if r["method"] not in ("uncorrected", *POST_HOC)
                           and r["vs_trl_default"] > 0),
                          key=lambda r: r["p_holm"], default=None)
            line += "no correction is above TRL's default after Holm"
            line += f" (closest: {_cite(closest)})." if closest is not None else "."
        if exploratory:
            line += (" Post-hoc candidates above it after Holm (designed after the first results, same seeds: "
                     "exploratory): " + ", ".join(_cite(r) for r in exploratory) + ".")
        floor_row = block.get("uncorrected")
        if floor_row is not None:
            line += (f" No correction: {_cite(floor_row)}"
                     + (", above TRL's default after Holm." if _holm_significant(floor_row, +1) else "."))
        if worse:
            line += " Below TRL's default after Holm: " + ", ".join(f"`{r['method']}`" for r in worse) + "."
        gap = scenario_gap(rows, scenario)
        if gap is not None:
            gap_text = f"on-policy − uncorrected {gap.mean:+.3f} [{gap.lo:+.3f}, {gap.hi:+.3f}], paired p {gap.p:.2g}"
            closing = [r for r in methods if math.isfinite(r["gap_closed"])]
            if gap.p >= ALPHA:
                line += f" The mismatch costs nothing measurable here ({gap_text}): no gap closed is computed."
            elif closing:
                top = max(closing, key=lambda r: r["gap_closed"])
                line += (f" Gap {gap_text}; most closed: `{top['method']}` {top['gap_closed'] * 100:.0f}% "
                         f"[{top['gap_closed_lo'] * 100:.0f}, {top['gap_closed_hi'] * 100:.0f}] (Fieller).")
        out.append(line)
    return "\n".join(out)


def read_rows(csv_path: str) -> list[dict]:
    """The rows of a ``mismatch_results.csv`` as :func:`summarize` wrote them (numbers as floats)."""
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    text = ("scenario", "method", "per_seed", "alerts")
    return [{k: (v if k in text else int(v) if k == "n_seeds" else float(v)) for k, v in r.items()} for r in rows]


def reanalyse(csv_path: str, output_dir: str) -> str:
    """Recompute every statistic of a ``mismatch_results.csv`` from its per-seed column (no run needed; the runs'
    other columns, kl, rejected, time and alerts, are kept) and write the outputs to ``output_dir``."""
    rows = [{k: r[k] for k in ("scenario", "method", "n_seeds", "per_seed", "kl", "rejected_token_fraction",
                               "seconds_per_run", "alerts")} for r in read_rows(csv_path)]
    for r in rows:
        r["reward_mean"], r["reward_ci95"] = mean_ci(_seeds(r))
    analyse(rows)
    return "\n".join([text_table(rows), write_outputs(rows, output_dir)])


def _fmt_closed(r: dict) -> str:
    if not math.isfinite(r["gap_closed"]):
        return ""
    return f"{r['gap_closed'] * 100:.0f}% [{r['gap_closed_lo'] * 100:.0f}, {r['gap_closed_hi'] * 100:.0f}]"


def markdown(rows: list[dict]) -> str:
    """docs/evidence.md's table: one block of rows per scenario, best first; **bold** where a method is above TRL's
    default after Holm over the whole table (paired t), ↓ where below; ``on_policy`` is the ceiling (no mismatch),
    ``uncorrected`` the floor; gap closed only where the gap is significant (Fieller's interval)."""
    out = ["| scenario (~0.13M model, T ≤ 9) | method | n | held-out reward (95% CI) | "
           "vs `trl_default`, paired (95% CI) | p | Holm p | sign-flip p | gap closed (Fieller 95% CI) | kl | "
           "rejected |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    p_fmt = lambda p: f"{p:.2g}" if math.isfinite(p) else "—"  # noqa: E731
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        block = sorted((r for r in rows if r["scenario"] == scenario), key=lambda r: -r["reward_mean"])
        for r in block:
            diff = r["vs_trl_default"]
            name = f"**{r['method']}**" if _holm_significant(r, +1) else r["method"]
            vs = (f"{diff:+.3f} [{r['vs_trl_default_lo']:+.3f}, {r['vs_trl_default_hi']:+.3f}]"
                  + (" ↓" if _holm_significant(r, -1) else "") if math.isfinite(diff) else "—")
            out.append(f"| {scenario} | {name} | {r['n_seeds']} | {r['reward_mean']:.3f} ± {r['reward_ci95']:.3f} | "
                       f"{vs} | {p_fmt(r['p_paired'])} | {p_fmt(r['p_holm'])} | {p_fmt(r['p_sign_flip'])} | "
                       f"{_fmt_closed(r)} | {r['kl']:.3f} | {r['rejected_token_fraction']:.2f} |")
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
    if "--map" in argv:  # issue 36 part 1, no training: experiments/estimator_map.py takes the other arguments
        from experiments.estimator_map import main as estimator_map

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
    p.add_argument("--reanalyse", metavar="CSV", help="recompute the statistics of a mismatch_results.csv from its "
                   "per-seed column into --output_dir (no run) and exit")
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
    if a.reanalyse:
        print(reanalyse(a.reanalyse, a.output_dir))
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
