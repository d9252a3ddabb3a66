"""Rollout correction in TRL's asynchronous GRPO trainer: reverse-digits, a real vLLM server on CPU.

Each run: the demo's tiny model (2 heads of 32, warmed up with 90 supervised steps), STEPS optimizer steps of 64
samples (8 prompts x 8), TRL 1.16's asynchronous trainer generating continuously against one
``trl-rollout-corr vllm-serve-async`` server (float32; TRL's cold sync at train begin loads each run's weights, so
one server serves every run, one run at a time). Held-out reward: the policy's own mean reward on 256 fixed prompts
(temperature 1), averaged over the evaluations in the last 20% of the steps.

Variants: ``trl_as_is`` (TRL's AsyncGRPOTrainer itself) and this package's RolloutCorrAsyncGRPOTrainer with the
corrections of ``ASYNC_VARIANTS``, at ``max_staleness`` 4 (TRL's default) and a larger one; plus ``sync`` (this
package's synchronous trainer with colocated vLLM synced every step: no staleness) on the same steps.

    python experiments/async_staleness.py --seeds 0,1,2 --steps 200 --staleness 4,16

Each run is a separate process (a trainer that ran before slows later generation); results go to
``OUTPUT_DIR/<variant>-s<staleness>-<seed>.json`` and the table to stdout.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

if not __package__:  # run as a script (python experiments/x.py): this checkout's root first, for experiments.*
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import mismatch_bench  # noqa: E402
from experiments import stats as paired  # noqa: E402
from trl_rollout_corr.core.metric_names import metric  # noqa: E402

# variant -> this package's correction fields (None: TRL's own AsyncGRPOTrainer)
ASYNC_VARIANTS = {
    "trl_as_is": None,
    "ppo_is_bypass": dict(rollout_correction_preset="ppo_is_bypass"),  # TRL's loss (same gradient, tested) + metrics
    "decoupled_token_is": dict(rollout_correction_preset="decoupled_token_is"),
    "trl_default": dict(rollout_correction_preset="trl_default"),  # pre-registration 18's rule 5 (async_mismatch.py)
    "pg_is": dict(rollout_correction_preset="pg_is"),
    "icepop": dict(rollout_correction_preset="icepop"),  # decoupled, token IS, token RS [0.5, 2]
    "bypass_ppo_token_rs": dict(rollout_correction_preset="ppo_is_bypass", rollout_rs="token",
                                rollout_rs_threshold=2.0),  # TRL's PPO + a two-sided token mask [0.5, 2]
    "bypass_ppo_token_rs_tight": dict(rollout_correction_preset="ppo_is_bypass", rollout_rs="token",
                                      rollout_rs_threshold=1.25),  # the mask at [0.8, 1.25]: PPO's clip band
    "bypass_ppo_geo_rs": dict(rollout_correction_preset="ppo_is_bypass", rollout_rs="geometric",
                              rollout_rs_threshold=1.25),  # whole sequences whose geometric-mean ratio left [0.8, 1.25]
}


def run_async(variant: str, seed: int, steps: int, staleness: int, url: str, eval_every: int, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import trl_rollout_corr  # noqa: F401
    from datasets import Dataset
    from transformers.utils import logging as hf_logging

    from experiments.async_trainers import build_async_trainer
    from experiments.harness import HIDDEN_SIZE, NUM_LAYERS, TOY_GRPO_ARGS, HeldOutRewardRecorder, warmed_up_policy
    from experiments.harness import reverse_chat_reward
    from trl_rollout_corr.testing.toy_task import build_model, reverse_prompts

    hf_logging.set_verbosity_error()
    t0 = time.time()
    tok, model = warmed_up_policy(seed, num_heads=2, chat=True)
    evaluator = build_model(HIDDEN_SIZE, NUM_LAYERS, seed=seed, num_heads=2)  # plain attention, for generate
    recorder = HeldOutRewardRecorder(model, tok, eval_every, evaluator=evaluator)
    prompts = [[{"role": "user", "content": p}] for p in reverse_prompts(steps * 16 + 256, 6, seed=seed)]
    common = dict(**TOY_GRPO_ARGS, max_steps=steps, logging_steps=10, dtype="float32", seed=seed,
                  max_staleness=staleness, token_budget=-1, vllm_server_base_url=url, weight_sync_steps=1)
    model_dir = os.environ["ASYNC_BENCH_MODEL_DIR"]  # the path the server serves: TRL's worker asks for it by name
    with tempfile.TemporaryDirectory() as out_dir:
        model.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
        kwargs = dict(model=model_dir, reward_funcs=reverse_chat_reward, processing_class=tok,
                      train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[recorder])
        trainer = build_async_trainer(ASYNC_VARIANTS[variant], url=url, output_dir=out_dir, config=common, **kwargs)
        trainer.train()
    mean = recorder.log_mean
    result = {"variant": variant, "seed": seed, "staleness": staleness, "curve": recorder.curve,
              "eval_reward": recorder.tail_reward(steps), "seconds": time.time() - t0,
              "dropped": sum(log.get("sample/dropped_stale_total", 0.0) for log in recorder.logs),
              "staleness_mean": mean("sample/staleness_mean"), "lag_mean": mean(metric("lag_mean")),
              "kl": mean(metric("kl")), "k3_kl": mean(metric("k3_kl")),
              "ppo_kl": mean("kl"), "metric_ranges": metric_ranges(recorder.logs)}
    with open(out, "w") as f:
        json.dump(result, f)


RANGED_PREFIXES = ("rollout_corr/lag_", "rollout_corr/grad_share_", "rollout_corr/t_kl_", "rollout_corr/k3_kl_len_")


def metric_ranges(logs: list[dict]) -> dict[str, list[float]]:
    """Per logged key of the per-lag and "does it hurt?" metrics (``RANGED_PREFIXES``): [min, mean, max] over the
    run's logged rows (each row a mean over ``logging_steps`` optimizer steps); non-finite values are skipped."""
    values: dict[str, list[float]] = {}
    for row in logs:
        for key, value in row.items():
            if key.startswith(RANGED_PREFIXES) and math.isfinite(value):
                values.setdefault(key, []).append(float(value))
    return {key: [min(v), statistics.fmean(v), max(v)] for key, v in sorted(values.items())}


def ranges_table(output_dir: str) -> str:
    """Markdown: per variant and metric, the smallest, the mean of the run means and the largest logged value over
    the runs in ``output_dir`` that recorded ``metric_ranges`` (the docs' measured ranges)."""
    per: dict[tuple[str, int], dict[str, list[list[float]]]] = {}
    for name in sorted(os.listdir(output_dir)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(output_dir, name)) as f:
            r = json.load(f)
        for key, lo_mean_hi in r.get("metric_ranges", {}).items():
            per.setdefault((r["variant"], r["staleness"]), {}).setdefault(key, []).append(lo_mean_hi)
    lines = ["| variant | max_staleness | metric | runs | min | mean of run means | max |",
             "|---|---|---|---|---|---|---|"]
    for (variant, staleness), metrics in sorted(per.items()):
        for key, runs in sorted(metrics.items()):
            lines.append(f"| {variant} | {staleness} | `{key}` | {len(runs)} | {min(r[0] for r in runs):.3g} | "
                         f"{statistics.fmean(r[1] for r in runs):.3g} | {max(r[2] for r in runs):.3g} |")
    return "\n".join(lines)


def run_sync(seed: int, steps: int, eval_every: int, out: str) -> None:
    from experiments.harness import run_worker

    run_worker("on_policy", seed, steps, 1, "vllm", eval_every, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--staleness", default="4,16")
    p.add_argument("--variants", default="sync,trl_as_is,decoupled_token_is,pg_is")
    p.add_argument("--eval_every", type=int, default=20)
    p.add_argument("--output_dir", default="outputs/async_staleness")
    p.add_argument("--reanalyse", metavar="CSV", help="recompute the statistics of an async_staleness_results.csv "
                   "from its per-seed column, rewrite it in place and print the table; runs nothing")
    p.add_argument("--ranges", action="store_true",
                   help="print the per-lag and 'does it hurt?' metrics' measured ranges of the runs in --output_dir "
                        "(docs/metrics.md); runs nothing")
    p.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)  # variant seed staleness url out
    p.add_argument("--results", default=None,
                   help="write the rows with all --seeds to this CSV (docs/async.md's table: experiments/results/"
                        "async_staleness_results.csv) and print the table; runs nothing")
    a = p.parse_args()
    if a.reanalyse:
        rows = analyse(read_results(a.reanalyse))
        write_results(rows, a.reanalyse)
        print(markdown(rows))
        return
    if a.ranges:
        print(ranges_table(a.output_dir))
        return
    if a.results:
        rows = result_rows(a.output_dir, [int(s) for s in a.seeds.split(",")])
        write_results(rows, a.results)
        print(markdown(rows))
        return
    if a.worker:
        variant, seed, staleness, url, out = a.worker
        if variant == "sync":
            run_sync(int(seed), a.steps, a.eval_every, out)
        else:
            run_async(variant, int(seed), a.steps, int(staleness), url, a.eval_every, out)
        return
    os.makedirs(a.output_dir, exist_ok=True)
    seeds = [int(s) for s in a.seeds.split(",")]
    variants = a.variants.split(",")
    runs = [(v, s, st) for st in [int(x) for x in a.staleness.split(",")] for v in variants if v != "sync"
            for s in seeds]
    runs = [("sync", s, 0) for s in seeds if "sync" in variants] + runs
    from experiments.server import free_port, running_server
    from experiments.harness import build_chat_tokenizer
    from trl_rollout_corr.testing.toy_task import build_model

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    with tempfile.TemporaryDirectory() as model_dir:
        env["ASYNC_BENCH_MODEL_DIR"] = model_dir
        build_model(hidden_size=64, num_layers=2, seed=0, num_heads=2).save_pretrained(model_dir)
        build_chat_tokenizer().save_pretrained(model_dir)
        cmd = [sys.executable, "-m", "trl_rollout_corr", "vllm-serve-async", model_dir, "--port", str(port),
               "--dtype", "float32", "--gpu-memory-utilization", "0.02"]
        from pathlib import Path

        with running_server(cmd, port, Path(a.output_dir) / "server.log", env):
            for variant, seed, staleness in runs:
                out = os.path.join(a.output_dir, f"{variant}-s{staleness}-{seed}.json")
                if os.path.exists(out):
                    continue
                worker = [sys.executable, __file__, "--steps", str(a.steps), "--eval_every", str(a.eval_every),
                          "--worker", variant, str(seed), str(staleness), url, out]
                proc = subprocess.run(worker, env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"{variant} seed {seed} staleness {staleness} failed:\n{proc.stderr[-3000:]}",
                          file=sys.stderr)
                    continue
                r = json.load(open(out))
                print(f"{variant:20s} s={staleness:<3d} seed={seed} reward={r['eval_reward']:.3f} "
                      f"{r['seconds']:.0f}s", flush=True)
    print(summarize(a.output_dir))


def summarize(output_dir: str) -> str:
    results = [json.load(open(os.path.join(output_dir, f))) for f in sorted(os.listdir(output_dir))
               if f.endswith(".json")]
    rows = {}
    for r in results:
        variant = "sync" if r["variant"] == "on_policy" else r["variant"]  # the demo's worker names it on_policy
        rows.setdefault((variant, r.get("staleness", 0)), []).append(r)
    sd = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0  # noqa: E731
    lines = ["| variant | max_staleness | held-out reward (mean ± sd) | seeds | lag at the loss (mean) | dropped "
             "samples | kl(pi_rollout‖pi_theta) | wall time (s) |", "|---|---|---|---|---|---|---|---|"]
    for (variant, staleness), rs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rewards = [r["eval_reward"] for r in rs]
        fmt = lambda k, rs=rs: f"{statistics.fmean(r[k] for r in rs if r.get(k) is not None):.3f}" if any(  # noqa: E731
            r.get(k) is not None for r in rs) else "–"
        lines.append(f"| {variant} | {staleness if variant != 'sync' else '– (synced every step)'} | "
                     f"{statistics.fmean(rewards):.3f} ± {sd(rewards):.3f} | {len(rs)} | "
                     f"{fmt('lag_mean') if variant not in ('sync', 'trl_as_is') else fmt('staleness_mean')} | "
                     f"{fmt('dropped')} | {fmt('kl')} | {statistics.fmean(r['seconds'] for r in rs):.0f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ committed results (docs/async.md's table, tests)
RESULT_FIELDS = ("variant", "max_staleness", "n_seeds", "reward_mean", "reward_ci95", "per_seed", "vs_trl_as_is",
                 "vs_trl_as_is_lo", "vs_trl_as_is_hi", "p_paired", "p_holm", "p_sign_flip", "tost_p", "lag_mean",
                 "dropped", "kl", "seconds_per_run")
EQUIVALENCE_MARGIN = 0.05  # TOST margin of "level with TRL's trainer" (chosen after the runs: descriptive)
ALPHA = 0.05  # family-wise, Holm over every comparison of the table


def result_rows(output_dir: str, seeds: list[int]) -> list[dict]:
    """One row per (variant, max_staleness) with all of ``seeds`` (a partial row is left out): reward mean and 95%
    t-interval, and the paired comparisons of :func:`analyse`."""
    runs: dict[tuple[str, int], list[dict]] = {}
    for name in sorted(os.listdir(output_dir)):
        if name.endswith(".json"):
            with open(os.path.join(output_dir, name)) as f:
                r = json.load(f)
            variant = "sync" if r["variant"] == "on_policy" else r["variant"]
            if r.get("seed") in seeds:
                runs.setdefault((variant, int(r.get("staleness", 0))), []).append(r)
    partial = sorted(f"{v}@{s} ({len(rs)} of {len(seeds)} seeds)" for (v, s), rs in runs.items()
                     if len(rs) != len(seeds))
    if partial:
        print(f"left out (a row is all of its seeds or none): {', '.join(partial)}", file=sys.stderr)
    runs = {k: sorted(v, key=lambda r: r["seed"]) for k, v in runs.items() if len(v) == len(seeds)}
    rows = []
    first = {"sync": 0, "trl_as_is": 1}  # then the corrections, by name
    for (variant, staleness), rs in sorted(runs.items(), key=lambda kv: (kv[0][1] or 4, first.get(kv[0][0], 2),
                                                                         kv[0][0])):
        xs = [r["eval_reward"] for r in rs]
        mean, half = mismatch_bench.mean_ci(xs)  # one definition of the per-row interval
        avg = lambda key, rs=rs: (statistics.fmean(r[key] for r in rs if r.get(key) is not None)  # noqa: E731
                                  if any(r.get(key) is not None for r in rs) else math.nan)
        rows.append(dict(variant=variant, max_staleness=staleness, n_seeds=len(xs), reward_mean=mean,
                         reward_ci95=half, per_seed=" ".join(f"{x:.6f}" for x in xs),
                         lag_mean=avg("staleness_mean") if variant == "trl_as_is" else avg("lag_mean"),
                         dropped=avg("dropped"), kl=avg("kl"), seconds_per_run=avg("seconds")))
    return analyse(rows)


def baseline(row: dict) -> tuple[str, int] | None:
    """What a row is compared with: TRL's trainer as is at the same ``max_staleness``; the synchronous run and TRL's
    trainer at a larger bound against TRL's trainer at its default bound 4 (the cost of asynchrony / of the bound)."""
    if row["variant"] == "trl_as_is":
        return None if row["max_staleness"] == 4 else ("trl_as_is", 4)
    return ("trl_as_is", row["max_staleness"] or 4)


def analyse(rows: list[dict]) -> list[dict]:
    """Add the paired comparisons to ``rows`` (in place; the seeds are shared, ``per_seed`` in seed order): against
    :func:`baseline`, the mean per-seed difference ``vs_trl_as_is`` with its paired-t 95% interval (``_lo``,
    ``_hi``), ``p_paired``, ``p_sign_flip`` (exact), ``tost_p`` (equivalence within ±EQUIVALENCE_MARGIN), and
    ``p_holm``: the paired-t p Holm-adjusted over every comparison of the table. NaN where there is no baseline."""
    by = {(r["variant"], r["max_staleness"]): [float(x) for x in r["per_seed"].split()] for r in rows}
    for r in rows:
        r.update(vs_trl_as_is=math.nan, vs_trl_as_is_lo=math.nan, vs_trl_as_is_hi=math.nan, p_paired=math.nan,
                 p_sign_flip=math.nan, tost_p=math.nan)
        r.pop("p_holm", None)
        base = baseline(r)
        if base is None or base not in by:
            continue
        c = paired.compare_paired(by[(r["variant"], r["max_staleness"])], by[base], margin=EQUIVALENCE_MARGIN)
        r.update(vs_trl_as_is=c["diff"], vs_trl_as_is_lo=c["diff_lo"], vs_trl_as_is_hi=c["diff_hi"], p_paired=c["p"],
                 p_sign_flip=c["p_sign_flip"], tost_p=c["tost_p"])
    return paired.add_holm(rows, "p_paired", "p_holm")


def write_results(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RESULT_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def read_results(path: str) -> list[dict]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [{k: (v if k in ("variant", "per_seed") else int(v) if k in ("max_staleness", "n_seeds") else float(v))
             for k, v in r.items()} for r in rows]


VARIANT_TEXT = {
    "sync": "sync (this package's synchronous trainer, vLLM synced every step)",
    "trl_as_is": "TRL's AsyncGRPOTrainer as is (= `ppo_is_bypass`)",
    "decoupled_token_is": "`decoupled_token_is`",
    "bypass_ppo_token_rs": "`ppo_is_bypass` + token RS [0.5, 2]",
}


def markdown(rows: list[dict]) -> str:
    """The table in docs/async.md: the paired difference to TRL's trainer as is (:func:`baseline`) with its 95%
    interval, the paired-t p Holm-adjusted over the table, the exact sign-flip p and the TOST p of equivalence within
    ±EQUIVALENCE_MARGIN; **bold** where a correction is above its baseline after Holm, ↓ where below."""
    out = ["| variant | max_staleness | n | held-out reward (95% CI) | vs TRL's trainer as is, paired (95% CI) | "
           f"Holm p | sign-flip p | TOST p (±{EQUIVALENCE_MARGIN}) | lag at the loss (mean) | samples dropped as "
           "stale | kl(pi_rollout‖pi_theta) | wall time (s) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, spec: format(x, spec) if math.isfinite(x) else "–"  # noqa: E731
    for r in rows:
        diff = r["vs_trl_as_is"]
        significant = math.isfinite(r["p_holm"]) and r["p_holm"] < ALPHA
        name = VARIANT_TEXT.get(r["variant"], r["variant"])
        vs = "—"
        if math.isfinite(diff):
            vs = (f"{diff:+.3f} [{r['vs_trl_as_is_lo']:+.3f}, {r['vs_trl_as_is_hi']:+.3f}]"
                  + (" ↓" if significant and diff < 0 else ""))
            if r["variant"] == "trl_as_is":
                vs += " (vs itself at 4)"
        bold = significant and diff > 0 and r["variant"] != "trl_as_is"
        out.append(f"| {'**' + name + '**' if bold else name} | {r['max_staleness'] or '–'} | {r['n_seeds']} | "
                   f"{r['reward_mean']:.3f} ± {r['reward_ci95']:.3f} | {vs} | {fmt(r['p_holm'], '.2g')} | "
                   f"{fmt(r['p_sign_flip'], '.2g')} | {fmt(r['tost_p'], '.2g')} | {fmt(r['lag_mean'], '.1f')} | "
                   f"{fmt(r['dropped'], '.0f')} | {fmt(r['kl'], '.3f')} | {fmt(r['seconds_per_run'], '.0f')} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
