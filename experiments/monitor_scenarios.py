"""Scenarios for RolloutCorrectionMonitor: record per-step traces once, replay them into the monitor offline.

    python experiments/monitor_scenarios.py record  --out outputs/monitor_traces --jobs 2     # 6 scenarios x 3 seeds
    python experiments/monitor_scenarios.py replay  --traces outputs/monitor_traces          # docs/monitor.md

``record`` trains the demo's tiny reverse task (64 x 8 completions per step, lr 3e-4, 150 steps) with
``logging_steps=1`` and writes every log row (and the policy's own held-out reward every 10 steps) as JSON.
``replay`` feeds the traces into a fresh monitor (optionally with the rows of ``--logging_steps`` steps
aggregated the way the trainer logs them) and prints alerts per 100 steps and the step of the first alert.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if not __package__:  # run as a script (python experiments/x.py): this checkout's root first, for experiments.*
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trl_rollout_corr.core.metric_names import metric  # noqa: E402

# name: (preset, engine kind or None for on-policy, lag)
SCENARIOS = {
    "on_policy": ("decoupled_token_is", None, 0),
    "stale4_ppo_is_bypass": ("ppo_is_bypass", "stale", 4),
    "stale4_decoupled_token_is": ("decoupled_token_is", "stale", 4),
    "int8_decoupled_token_is": ("decoupled_token_is", "int8", 0),
    "wq3_ppo_is_bypass": ("ppo_is_bypass", "wq3", 0),
    "wq3_decoupled_token_is": ("decoupled_token_is", "wq3", 0),
}


def record_one(scenario: str, seed: int, steps: int, out: str, eval_every: int = 10, live_logging: int = 0) -> None:
    """One run; with ``live_logging`` > 0 a RolloutCorrectionMonitor(stop_on_alert=True) rides along instead."""
    import tempfile

    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from datasets import Dataset
    from transformers.utils import logging as hf_logging

    from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine
    from experiments.harness import TOY_GRPO_ARGS, HeldOutRewardRecorder, warmed_up_policy
    from trl_rollout_corr.testing.toy_task import reverse_prompts, reverse_reward
    from trl_rollout_corr.grpo.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    hf_logging.set_verbosity_error()
    t0 = time.time()
    preset, engine, lag = SCENARIOS[scenario]
    tok, model = warmed_up_policy(seed)
    recorder = HeldOutRewardRecorder(model, tok, eval_every)  # the held-out reward at step 0, then every eval_every
    callbacks = [recorder]
    if live_logging:
        from trl_rollout_corr import RolloutCorrectionMonitor

        monitor = RolloutCorrectionMonitor(rollout_lag=lag, stop_on_alert=True, write_plot=False)
        callbacks.append(monitor)
    with tempfile.TemporaryDirectory() as out_dir:
        args = RolloutCorrGRPOConfig(
            output_dir=out_dir, rollout_correction_preset=preset, max_steps=steps, loss_type="dapo", beta=0.0,
            logging_steps=live_logging or 1, seed=seed, dataloader_num_workers=0, **TOY_GRPO_ARGS,
        )
        sampler = EmulatedRolloutEngine(engine, lag=max(lag, 1)) if engine else None
        trainer = RolloutCorrGRPOTrainer(
            model=model, reward_funcs=reverse_reward, args=args, processing_class=tok,
            train_dataset=Dataset.from_dict({"prompt": reverse_prompts(steps * 8 + 64, 6, seed=seed)}),
            callbacks=callbacks, rollout_sampler=sampler)
        trainer.train()
        if live_logging:
            step = trainer.state.global_step
            live = {"scenario": scenario, "seed": seed, "logging_steps": live_logging, "stopped_at": step,
                    "alerts": monitor.alerts, "checkpoint": os.path.isdir(os.path.join(out_dir, f"checkpoint-{step}")),
                    "seconds": time.time() - t0}
            with open(out, "w") as f:
                json.dump(live, f)
            return
    with open(out, "w") as f:
        json.dump({"scenario": scenario, "seed": seed, "preset": preset, "engine": engine, "lag": lag,
                   "bypass": trainer.rollout_correction.bypass_mode, "eval_curve": recorder.curve,
                   "rows": recorder.logs, "seconds": time.time() - t0}, f)


def record(out_dir: str, scenarios: list[str], seeds: list[int], steps: int, jobs: int) -> None:
    os.makedirs(out_dir, exist_ok=True)
    todo = [(s, seed) for seed in seeds for s in scenarios
            if not os.path.exists(os.path.join(out_dir, f"{s}_seed{seed}.json"))]
    from trl_rollout_corr.runtime.pool import Job, run_processes

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    workers = []
    for s, seed in todo:
        out = os.path.join(out_dir, f"{s}_seed{seed}.json")
        cmd = [sys.executable, os.path.abspath(__file__), "worker", "--scenario", s, "--seed", str(seed),
               "--steps", str(steps), "--out", out]
        workers.append(Job(cmd, out, env))
    run_processes(workers, jobs, poll_seconds=1.0)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("record", "worker", "replay", "export"))
    p.add_argument("--out", default="outputs/monitor_traces")
    p.add_argument("--traces", default="outputs/monitor_traces")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--scenario")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--logging_steps", default="1,5")
    p.add_argument("--live_logging", type=int, default=0, help="worker: run with a stopping monitor, logging every N")
    a = p.parse_args(argv)
    if a.mode == "worker":
        record_one(a.scenario, a.seed, a.steps, a.out, live_logging=a.live_logging)
    elif a.mode == "record":
        record(a.out, a.scenarios.split(","), [int(s) for s in a.seeds.split(",")], a.steps, a.jobs)
    elif a.mode == "export":  # --scenario NAME --seed N --out tests/data/x.json [--steps N]
        with open(os.path.join(a.traces, f"{a.scenario}_seed{a.seed}.json")) as f:
            export_fixture(json.load(f), a.out, a.steps)
    else:
        replay_main(a)


def load_traces(traces: str, scenarios: list[str], seeds: list[int]) -> dict[str, list[dict]]:
    out = {}
    for s in scenarios:
        out[s] = []
        for seed in seeds:
            path = os.path.join(traces, f"{s}_seed{seed}.json")
            if os.path.exists(path):
                with open(path) as f:
                    out[s].append(json.load(f))
    return out


def replay_table(by_scenario: dict[str, list[dict]], every_list: list[int], **monitor_kwargs) -> str:
    from experiments.replay import aggregate, replay

    lines = ["| scenario | held-out reward (step 0 -> 150, mean) | logging | alerts / 100 steps (per seed) "
             "| first alert step (per seed) | alerts | stopped by (stop_on_alert=True) |",
             "|---|---|---|---|---|---|---|"]
    for s, runs in by_scenario.items():
        if not runs:
            continue
        r0 = statistics.fmean(r["eval_curve"][0][1] for r in runs)
        r1 = statistics.fmean(r["eval_curve"][-1][1] for r in runs)
        for every in every_list:
            rates, firsts, names, stops = [], [], [], []
            for r in runs:
                rows = aggregate(r["rows"], every)
                steps = rows[-1]["step"]
                kw = {"rollout_lag": r["lag"], **monitor_kwargs}
                m = replay(rows, bypass=r["bypass"], **kw)
                rates.append(100.0 * len(m.alerts) / steps)
                firsts.append(str(m.alerts[0]["step"]) if m.alerts else "-")
                names.extend(a["alert"] for a in m.alerts)
                stop = replay(rows, bypass=r["bypass"], stop_on_alert=True, **kw)
                stops.append(str(stop.alerts[0]["step"]) if stop.alerts else "-")
            kinds = ", ".join(f"{n} x{names.count(n)}" for n in sorted(set(names))) or "none"
            per_seed = " ".join(f"{x:.1f}" for x in rates)
            lines.append(f"| {s} | {r0:.2f} -> {r1:.2f} | every {every} | {statistics.fmean(rates):.2f} ({per_seed}) "
                         f"| {' '.join(firsts)} | {kinds} | {' '.join(stops)} |")
    return "\n".join(lines)


FIXTURE_KEYS = ("step", "reward", "entropy", *(metric(name) for name in (
    "kl", "k3_kl", "chi2_token", "rollout_is_eff_sample_size", "rollout_is_ratio_fraction_high",
    "rejected_token_fraction")))


def export_fixture(trace: dict, path: str, steps: int | None = None) -> None:
    """A trimmed trace for tests/data: the monitor's columns, 4 significant digits, the first ``steps`` steps."""
    rows = [r for r in trace["rows"] if steps is None or r["step"] <= steps]
    compact = {k: trace[k] for k in ("scenario", "seed", "preset", "engine", "lag", "bypass")}
    compact["eval_curve"] = [[s, round(r, 3)] for s, r in trace["eval_curve"] if steps is None or s <= steps]
    compact["columns"] = list(FIXTURE_KEYS)
    compact["rows"] = [[float(f"{r.get(k, float('nan')):.4g}") for k in FIXTURE_KEYS] for r in rows]
    with open(path, "w") as f:
        json.dump(compact, f, separators=(",", ":"))


def replay_main(a) -> None:
    import logging

    logging.getLogger("trl_rollout_corr.monitor").setLevel(logging.ERROR)
    seeds = [int(s) for s in a.seeds.split(",")]
    by = load_traces(a.traces, a.scenarios.split(","), seeds)
    print(replay_table(by, [int(x) for x in a.logging_steps.split(",")]))


if __name__ == "__main__":
    main(sys.argv[1:])
