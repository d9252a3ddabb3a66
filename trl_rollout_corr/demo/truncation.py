"""The main job (``trl-rollout-corr`` with no arguments): a GPU user's workflow on 2 CPU cores, on the scenario of a
verdict row that the evidence confirmed -- a training sampler that truncates (``top_p`` 0.8).

1. **Measure**: the probe (:func:`trl_rollout_corr.cli.probe.probe`) on the user's setting -- TRL's default correction,
   the real vLLM engine colocated as TRL launches it (bf16 on this CPU), rollouts at ``top_p`` 0.8 -- gives the kept
   mass M, the per-token KL(pi_rollout || pi_train) and T·KL; a kept mass below 1 places the run on the
   ``truncating-sampler`` row of :data:`trl_rollout_corr.monitor.verdict.VERDICTS` (:func:`place`).
2. **Train** (:data:`ARMS`): TRL's default at ``top_p`` 0.8 (the user's setting), TRL's default at ``top_p`` 1 (what
   the row says to do), a correction at ``top_p`` 0.8 (this package's truncated-support correction: the row says no
   correction recovers the cost) and on-policy (a float32 engine at ``top_p`` 1, the ceiling), each scored by the
   policy's OWN held-out reward (:mod:`.task`).
3. **Watch**: the trainer's start-up advice for a truncating sampler and the monitor's alerts, per run.
4. **Picture**: ``demo_curves.png`` beside ``demo_results.csv`` and ``demo_summary.json``.

The task, model, schedule and engine are S3V's (``experiments/vllm_truncation.py``, pre-registrations 20-21): T = 49,
a 465k-parameter model, 30 GRPO steps. Seeds 230-234 by default: S3V's held-out seeds of pre-registration 20 (their
runs of on-policy and of no correction at ``top_p`` 0.8 are committed; pre-registration 21's family, which confirmed
the row, also ran on them): a demonstration of the row, not new evidence. Five seeds cannot establish a difference on
their own (the smallest two-sided sign-flip p of 5 pairs is 0.0625) and the printout says so.

Without vLLM (``--engine emulated``, what ``auto`` falls back to on macOS/Windows) the same arms sample through
TRL's transformers generation with an :class:`~trl_rollout_corr.rollout.emulated.EmulatedRolloutEngine` (kind
``none``: the policy itself, its processed log-probs captured) at the same ``top_p``: float32, so ``top_p`` 1 with
TRL's default and on-policy coincide there.
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ..core.metric_names import metric
from ..monitor.verdict import Verdict, verdict
from ..runtime.pool import Job, run_processes
from . import task

TOP_P = 0.8  # the user's setting: S3V's
SEEDS = (230, 231, 232, 233, 234)
PROBE_BATCHES = 8  # 8 generation batches of 32 completions: 256, the sample the probe needs to place a run
USER_ARM = "trl_default_top_p_0.8"
ADVICE_ARM = "trl_default_top_p_1"
ARMS = {
    # arm: (what it is, RolloutCorrGRPOConfig correction fields, the engine's top_p, vLLM dtype (None: TRL's auto))
    USER_ARM: ("TRL's default at top_p 0.8 (your setting)",
               dict(rollout_correction_preset="trl_default", truncated_support_correction=False), TOP_P, None),
    "truncated_support_top_p_0.8": ("TRL's default + the truncated-support correction, top_p 0.8",
                                    dict(rollout_correction_preset="trl_default"), TOP_P, None),
    ADVICE_ARM: ("TRL's default at top_p 1 (the verdict's advice)",
                 dict(rollout_correction_preset="trl_default"), 1.0, None),
    "on_policy": ("on-policy: float32 engine, top_p 1, no correction (the ceiling)",
                  dict(rollout_correction_preset="disabled"), 1.0, "float32"),
}
#: the arms the main job trains by default: your setting, a correction at it, the verdict's advice (on_policy, the
#: ceiling, is one more arm by --arms; left out of the default to keep the main job within 12 minutes with the
#: install on 2 cores: it added ~1.8 minutes)
DEFAULT_ARMS = (USER_ARM, "truncated_support_top_p_0.8", ADVICE_ARM)
ENGINES = ("vllm", "emulated")
RUN_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "TRL_EXPERIMENTAL_SILENCE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def place(top_p: float, min_p: float | None, kept_mass: float | None) -> Verdict:
    """The verdict row a run falls on, from its sampler settings and the probe's measured kept mass (None: not
    measured): the ``truncating-sampler`` row when the sampler truncates (``top_p`` < 1 or ``min_p`` > 0) unless the
    probe found it keeping the whole distribution (kept mass 1), else the ``default`` row (the demo runs no stale or
    asynchronous engine, the other rows' cases)."""
    truncates = top_p < 1 or bool(min_p)
    if truncates and (kept_mass is None or kept_mass < 1):
        return verdict("truncating-sampler")
    return verdict("default")


def build_trainer(arm: str, engine: str, model_dir: str, tok, dataset, fields: dict, callbacks):
    """This package's trainer for ``arm`` on ``engine`` (the colocated vLLM engine, or the emulated one)."""
    from ..grpo.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    _, settings, top_p, dtype = ARMS[arm]
    sampler = None
    if engine == "vllm":
        engine_fields = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.02, top_p=top_p,
                             top_k=0, min_p=None, vllm_dtype=dtype)
    elif engine == "emulated":
        from ..rollout.emulated import EmulatedRolloutEngine

        engine_fields = dict(top_p=top_p, top_k=0, min_p=None)
        sampler = EmulatedRolloutEngine("none")
    else:
        raise ValueError(f"engine={engine!r}: use one of {ENGINES}.")
    args = RolloutCorrGRPOConfig(**{**fields, **engine_fields}, **settings)
    return RolloutCorrGRPOTrainer(model=model_dir, reward_funcs=task.psum_reward_from_ids, args=args,
                                  train_dataset=dataset, processing_class=tok, callbacks=callbacks,
                                  rollout_sampler=sampler)


class _Captured(logging.Handler):
    """The trainer's start-up warnings (its advice for a truncating sampler), kept for the printout."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _prepared(arm: str, seed: int, out_dir: str, size: dict, tmp: str, engine: str, callbacks):
    """(trainer, tok, its start-up warnings) for ``arm`` and ``seed``: the seed's warm model, served and saved."""
    from datasets import Dataset

    from ..testing.psum_task import psum_prompts

    tok = task.task_tokenizer()
    model = task.served_model(task.warm_model(task.task_model(size), tok, task.base_path(out_dir), size, seed))
    model_dir = os.path.join(tmp, "model")
    model.save_pretrained(model_dir)  # the colocated engine loads this; the trainer loads the same weights
    tok.save_pretrained(model_dir)
    dataset = Dataset.from_dict({"prompt": psum_prompts(size["steps"] * task.GEN_PROMPTS + 64, size["n_digits"],
                                                        seed=seed)})
    fields = task.grpo_fields(os.path.join(tmp, "out"), size, seed)
    captured = _Captured()
    trainer_logger = logging.getLogger("trl_rollout_corr.grpo.trainer")
    trainer_logger.addHandler(captured)
    try:
        trainer = build_trainer(arm, engine, model_dir, tok, dataset, fields, callbacks)
    finally:
        trainer_logger.removeHandler(captured)
    task.freeze_added_bias(trainer.model)
    return trainer, tok, model, captured.messages


def _quiet() -> None:
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    logging.getLogger("trl_rollout_corr.monitor").setLevel(logging.ERROR)  # alerts go to the table, not stderr


def run_arm(arm: str, seed: int, out_path: str, out_dir: str, size: dict, engine: str) -> dict:
    """Train one (arm, seed) and write its JSON: the held-out reward curve and score, the regime (the exact
    per-token KL of top-p 0.8 on the held-out prompts, as S3V measured it for every arm), the logged diagnostics, the
    trainer's start-up advice and the monitor's alerts."""
    from ..monitor import RolloutCorrectionMonitor
    from ..testing.psum_task import psum_prompts

    _quiet()
    t0 = time.time()
    n, steps = size["n_digits"], size["steps"]
    held_out = psum_prompts(size["n_eval"], n, seed=task.EVAL_PROMPT_SEED)
    evaluator = task.served_model(task.task_model(size)).eval()
    regime: list[tuple[int, float, float]] = []
    logs: list[dict] = []
    curve: list[tuple[int, float]] = []

    def on_eval(step: int, model) -> None:
        curve.append((step, task.policy_reward(model, tok, held_out, n)))
        regime.append((step, *task.truncation_kl(model, tok, held_out, n, TOP_P)))

    monitor = RolloutCorrectionMonitor(rollout_lag=0, write_csv=False, write_plot=False)  # synchronous engine
    recorder = task.eval_recorder(evaluator, steps, size["eval_every"], on_eval, logs)
    with tempfile.TemporaryDirectory() as tmp:
        trainer, tok, model, advice = _prepared(arm, seed, out_dir, size, tmp, engine, [recorder, monitor])
        curve.append((0, task.policy_reward(model, tok, held_out, n)))
        trainer.train()
        engine_dtype = _engine_dtype(trainer, engine)

    def mean(key: str) -> float:
        values = [row[key] for row in logs if key in row and math.isfinite(row[key])]
        return statistics.fmean(values) if values else math.nan

    result = dict(arm=arm, seed=seed, engine=engine, engine_dtype=engine_dtype, top_p=ARMS[arm][2], steps=steps,
                  curve=sorted(curve), score=task.tail_score(curve, steps),
                  kl_token=statistics.fmean(k for _, k, _ in regime), t_kl=statistics.fmean(t for _, _, t in regime),
                  rollout_kl=mean(metric("kl")), k3_kl=mean(metric("k3_kl")),
                  kept_mass_mean=mean(metric("kept_mass_mean")),
                  startup_advice=advice, alerts=[(a["step"], a["alert"]) for a in monitor.alerts],
                  seconds=time.time() - t0)
    _save(result, out_path)
    return result


def _engine_dtype(trainer, engine: str) -> str:
    if engine != "vllm":
        return "float32 (emulated)"
    from ..trl_hooks.vllm import colocated_llm, vllm_generation

    llm = colocated_llm(vllm_generation(trainer)).llm_engine  # through the package's checked accessors
    return str(llm.vllm_config.model_config.dtype).removeprefix("torch.")


def run_probe(seed: int, out_path: str, out_dir: str, size: dict, engine: str, batches: int, probe_tools) -> dict:
    """Step 1: the probe on the user's setting (:data:`USER_ARM`, seed ``seed``'s warm model), ``batches``
    generation batches; writes ``probe/probe.json`` and ``probe/probe.png`` and the demo's summary of it.

    ``probe_tools``: ``(probe, write_report)`` of :mod:`trl_rollout_corr.cli.probe`, passed in by the command
    (``trl-rollout-corr demo-probe``, the probe worker): the CLI imports the demo, not the other way round."""
    probe, write_report = probe_tools
    _quiet()
    with tempfile.TemporaryDirectory() as tmp:
        trainer, _, _, _ = _prepared(USER_ARM, seed, out_dir, size, tmp, engine, [])
        report = probe(trainer, batches)
        engine_dtype = _engine_dtype(trainer, engine)
    written = write_report(report, os.path.join(out_dir, "probe"))
    result = {"seed": seed, "batches": batches, "engine": engine, "engine_dtype": engine_dtype, "top_p": TOP_P,
              **probe_summary(report), "written": written}
    _save(result, out_path)
    return result


def probe_summary(report: dict) -> dict:
    """The probe's numbers the demo prints: the sample, the kept mass, the per-token KL(pi_rollout || pi_train) k1
    and k3 of the trainer's ratio (TRL's default keeps the truncation in it: no renormalization), T and T·KL.

    Under truncation k1 (mean of -log rho) is the KL: on a kept token log rho = log M, so k1 = -log M, while k3
    (rho - 1 - log rho) assumes E[rho] = 1, which a truncated sampler breaks (E[rho] = M): k3 reads ~(1 - M)^2 / 2.
    T·KL is therefore mean T x k1 here (the probe's own ``t_kl_mean`` sums k3)."""
    tokens, seqs = report["tokens"], report["sequences"]
    truncation = report.get("truncation") or {}
    before = truncation.get("before_renormalization", tokens)
    k1 = before["k1"]
    return {"samples": report["samples"], "tokens": tokens["count"], "T": seqs["mean_length"],
            "kept_mass_mean": truncation.get("kept_mass_mean"), "k1": k1, "k3": before["k3"],
            "minus_log_kept_mass": (-math.log(truncation["kept_mass_mean"]) if truncation else None),
            "t_kl": seqs["mean_length"] * k1, "seconds": report["seconds"]}


def _save(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


# ------------------------------------------------------------------------------------------------ the driver
def run_all(arms: list[str], seeds: list[int], size_name: str, engine: str, out_dir: str, jobs: int,
            probe_batches: int) -> tuple[dict | None, list[dict]]:
    """The base model, then the probe and the runs, ``jobs`` processes at a time (``runtime/pool.py``'s
    ``run_processes``; a finished run's JSON is kept: a re-run with the same output directory skips it; a failed run
    stops the others and raises with its log's tail). Returns (the probe's summary or None, the runs)."""
    from tqdm.auto import tqdm

    size = task.FULL if size_name == "full" else task.TINY
    os.makedirs(out_dir, exist_ok=True)
    env = {**os.environ, **RUN_ENV}
    if engine != "vllm":
        env["TRL_ROLLOUT_CORR_NO_VLLM"] = "1"
    base = [sys.executable, "-m", "trl_rollout_corr.demo.truncation", "--size", size_name, "--engine", engine,
            "--out_dir", out_dir]
    if not os.path.exists(task.base_path(out_dir)):
        t0 = time.time()
        print(f"building the base model ({size['base_steps']} supervised steps; ~1 min on a quiet core) ...",
              file=sys.stderr, flush=True)
        subprocess.run([*base, "--worker", "base"], env=env, check=True)
        print(f"base model: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    # the probe's worker runs through the command (it needs cli.probe, which the demo does not import)
    probe_cmd = [sys.executable, "-m", "trl_rollout_corr", "demo-probe", *base[3:]]
    todo = []
    if probe_batches > 0:
        todo.append(("probe", seeds[0], os.path.join(out_dir, "runs", "probe.json")))
    todo += [(arm, seed, os.path.join(out_dir, "runs", f"{arm}__seed{seed}.json")) for seed in seeds for arm in arms]
    todo = [item for item in todo if not os.path.exists(item[2])]
    jobs_list = [Job([*(probe_cmd if arm == "probe" else base), "--worker", arm, "--seed", str(seed), "--out", path,
                      "--probe_batches", str(probe_batches)], os.path.basename(path), env,
                     log=path + ".log")  # vLLM's and the trainer's output, one file per run
                 for arm, seed, path in todo]
    with tqdm(total=len(todo), desc=f"probe + GRPO runs ({size['steps']} steps each)", unit="run") as bar:

        def on_done(job: Job, returncode: int, seconds: float, done: int, log_tail: str) -> None:
            if returncode != 0:  # run_processes stops the other workers before this propagates
                raise RuntimeError(f"demo worker failed ({job.log}):\n{log_tail}")
            bar.update(1)

        run_processes(jobs_list, jobs, on_done=on_done)
    probe_result = None
    probe_path = os.path.join(out_dir, "runs", "probe.json")
    if probe_batches > 0 and os.path.exists(probe_path):
        with open(probe_path) as f:
            probe_result = json.load(f)
    runs = []
    for seed in seeds:
        for arm in arms:
            with open(os.path.join(out_dir, "runs", f"{arm}__seed{seed}.json")) as f:
                runs.append(json.load(f))
    return probe_result, runs


# ------------------------------------------------------------------------------------------------ the printout
def sign_flip_p(diffs: list[float]) -> float:
    """The exact two-sided sign-flip p of the mean of paired differences (2^n sign patterns)."""
    observed = abs(statistics.fmean(diffs))
    patterns = list(itertools.product((1, -1), repeat=len(diffs)))
    return sum(abs(statistics.fmean(s * d for s, d in zip(signs, diffs))) >= observed - 1e-12
               for signs in patterns) / len(patterns)


def paired(runs: list[dict], arm: str, ref: str) -> list[float]:
    """Per seed (ascending), ``arm``'s score minus ``ref``'s, over the seeds both ran."""
    by = {(r["arm"], r["seed"]): r["score"] for r in runs}
    return [by[arm, s] - by[ref, s] for s in sorted({r["seed"] for r in runs}) if (arm, s) in by and (ref, s) in by]


def _alerts(runs: list[dict]) -> str:
    return " · ".join(",".join(f"{name}@{step}" for step, name in r["alerts"]) or "–" for r in runs)


def summarize(probe_result: dict | None, runs: list[dict], arms: list[str], out_dir: str, engine: str) -> str:
    """The printout (the four steps and the verdict), ``demo_results.csv``, ``demo_summary.json`` and
    ``demo_curves.png`` in ``out_dir``."""
    seeds = sorted({r["seed"] for r in runs})
    by_arm = {arm: sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"]) for arm in arms}
    row = place(TOP_P, None, probe_result["kept_mass_mean"] if probe_result else None)
    engine_text = ("the real vLLM CPU engine, colocated as TRL launches it" if engine == "vllm" else
                   "an EMULATED engine (--engine emulated, what auto picks without vLLM: TRL's transformers "
                   "generation, float32)")
    steps = runs[0]["steps"]
    lines = [f"Scenario: GRPO on the running-prefix-sum task (T = 49 tokens at full size), a 465k-parameter model, "
             f"{engine_text}; rollouts sampled at top_p {TOP_P:g}: your setting. A demonstration on 2 CPU cores; "
             "the evidence is docs/evidence.md.", ""]
    lines.append("1. Measure -- the probe on your setting (TRL's default correction, top_p "
                 f"{TOP_P:g}; trl-rollout-corr probe does this on your own config):")
    if probe_result:
        p = probe_result
        lines += [f"   {p['samples']} completions ({p['tokens']} tokens) of seed {p['seed']}'s model, engine "
                  f"{p['engine_dtype']}: kept mass M {p['kept_mass_mean']:.4f} per token, per-token KL(pi_rollout || "
                  f"pi_train) k1 {p['k1']:.2e} (-log M {p['minus_log_kept_mass']:.2e}), T {p['T']:.0f}, "
                  f"T·KL {p['t_kl']:.2f}",
                  f"   (k3 reads {p['k3']:.1e}: it assumes E[rho] = 1, which truncation breaks; k1 is the KL here)"]
    else:
        lines.append("   (not run: --probe_batches 0)")
    lines.append(f"   -> falls on the verdict row \"{row.key}\": {row.situation}")
    seed_text = f"seeds {seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) and len(seeds) > 1 \
        else "seed" + ("s " if len(seeds) > 1 else " ") + ", ".join(map(str, seeds))
    lines += ["", f"2. Train -- {seed_text}, {steps} GRPO steps each; score = the policy's own "
              "held-out reward (64 prompts, full distribution), mean of the last 30% of the steps:"]
    head = (f"   {'arm':29s} {'top_p':>5s} {'score mean ± sd':>16s}  {'per seed':<36s} {'vs your setting':>15s} "
            f"{'kept mass':>9s} {'kl (k1)':>8s}")
    lines += [head, "   " + "-" * (len(head) - 3)]
    csv_rows = []
    for arm in arms:
        rs = by_arm[arm]
        if not rs:
            continue
        scores = [r["score"] for r in rs]
        m, sd = statistics.fmean(scores), (statistics.stdev(scores) if len(scores) > 1 else 0.0)
        d = paired(runs, arm, USER_ARM)
        vs = "—" if arm == USER_ARM or not d else f"{statistics.fmean(d):+.3f} ({sum(x > 0 for x in d)}/{len(d)})"
        kept = statistics.fmean(r["kept_mass_mean"] for r in rs)
        kl = statistics.fmean(r["rollout_kl"] for r in rs)
        per_seed = " ".join(f"{s:.3f}" for s in scores)
        kept_text = f"{kept:9.4f}" if math.isfinite(kept) else f"{'—':>9s}"
        lines.append(f"   {arm:29s} {ARMS[arm][2]:5g} {m:8.3f} ± {sd:.3f}  {per_seed:<36s} {vs:>15s} "
                     f"{kept_text} {kl:8.1e}")
        csv_rows.append({"arm": arm, "what": ARMS[arm][0], "top_p": ARMS[arm][2], "n_seeds": len(rs),
                         "score_mean": m, "score_sd": sd, "per_seed": per_seed,
                         "seeds": " ".join(str(r["seed"]) for r in rs),
                         "vs_your_setting_mean": statistics.fmean(d) if d and arm != USER_ARM else "",
                         "kept_mass_mean": kept, "rollout_kl": kl, "truncation_kl_token": statistics.fmean(
                             r["kl_token"] for r in rs), "monitor_alerts": _alerts(rs),
                         "seconds_per_run": statistics.fmean(r["seconds"] for r in rs)})
    lines.append("   (vs your setting: the mean paired difference, and on how many seeds it is positive; kept mass and "
                 f"kl: {metric('kept_mass_mean')} and {metric('kl')}, the trainer's logs)")
    lines += ["", "3. Watch -- the trainer's start-up advice and the monitor (rollout_corr/* alerts), per run:"]
    advice = next((a for r in runs for a in r["startup_advice"] if "truncates" in a), None)
    if advice:
        truncating = ", ".join(a for a in arms if ARMS[a][2] < 1)
        lines.append(f"   the trainer, at the start of every top_p {TOP_P:g} run ({truncating}):")
        lines.append(f"     \"{_first_and_last_sentence(advice)}\"")
    for arm in arms:
        if by_arm[arm]:
            lines.append(f"   monitor alerts, {arm}: {_alerts(by_arm[arm])} (per seed; – = quiet)")
    picture = plot(by_arm, os.path.join(out_dir, "demo_curves.png"))
    lines += ["", "4. Picture and numbers: " + ", ".join(
        os.path.join(out_dir, f) for f in (["demo_curves.png"] if picture else [])
        + ["demo_results.csv", "demo_table.md", "demo_summary.json"])
              + (f", {os.path.join(out_dir, 'probe')}/probe.json, probe.png" if probe_result else "")]
    verdict_lines, agrees = verdict_text(row, runs, arms, engine)
    lines += ["", *verdict_lines]
    with open(os.path.join(out_dir, "demo_table.md"), "w") as f:
        f.write(markdown_table(runs, arms) + "\n")
    with open(os.path.join(out_dir, "demo_results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(csv_rows[0]))
        writer.writeheader()
        writer.writerows(csv_rows)
    with open(os.path.join(out_dir, "demo_summary.json"), "w") as f:
        json.dump({"engine": engine, "seeds": seeds, "probe": probe_result, "verdict_row": row.key,
                   "agrees_with_verdict": agrees, "arms": csv_rows,
                   "runs": [{k: r[k] for k in ("arm", "seed", "score", "curve", "engine_dtype", "alerts",
                                               "kl_token", "t_kl", "seconds")} for r in runs]}, f, indent=1)
    return "\n".join(lines)


def markdown_table(runs: list[dict], arms: list[str]) -> str:
    """The runs as the README's and docs/demo.md's table (``demo_table.md``): per arm the mean ± sd and each seed's
    score, the paired difference from the user's setting (and on how many seeds it is positive), the logged kept mass
    and rollout_corr/kl, and the monitor's alerts per seed."""
    seeds = sorted({r["seed"] for r in runs})
    lines = [f"| arm | top_p | held-out reward (mean ± sd) | per seed ({' '.join(map(str, seeds))}) | vs your setting "
             "(seeds higher) | kept mass | kl (k1) | monitor alerts (per seed) |", "|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        rs = sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"])
        if not rs:
            continue
        scores = [r["score"] for r in rs]
        m, sd = statistics.fmean(scores), (statistics.stdev(scores) if len(scores) > 1 else 0.0)
        d = paired(runs, arm, USER_ARM)
        vs = "—" if arm == USER_ARM or not d else \
            f"{statistics.fmean(d):+.3f} ({sum(x > 0 for x in d)} of {len(d)})".replace("-", "−")
        kept = statistics.fmean(r["kept_mass_mean"] for r in rs)
        kl = statistics.fmean(r["rollout_kl"] for r in rs)
        name = {USER_ARM: f"{arm} (your setting)", ADVICE_ARM: f"**{arm}** (the verdict's advice)"}.get(arm, arm)
        lines.append(f"| {name} | {ARMS[arm][2]:g} | {m:.3f} ± {sd:.3f} | {' '.join(f'{x:.3f}' for x in scores)} | "
                     f"{vs} | {f'{kept:.4f}' if math.isfinite(kept) else '—'} | {kl:.1e} | {_alerts(rs)} |")
    return "\n".join(lines)


def _first_and_last_sentence(text: str) -> str:
    """The advice's lead (up to its first colon) and its last sentence, the action: the printout's short form."""
    lead, last = text.split(":", 1)[0], text.rsplit(". ", 1)[-1]
    return text if last == text else f"{lead}: [...] {last}"


def verdict_text(row: Verdict, runs: list[dict], arms: list[str], engine: str) -> tuple[list[str], bool | None]:
    """The verdict row, quoted from :data:`~trl_rollout_corr.monitor.verdict.VERDICTS`, and what this run says
    about it: the sign of the advice's paired difference, and that 5 seeds cannot decide on their own."""
    lines = [f"Verdict -- trl_rollout_corr.monitor.verdict, row \"{row.key}\" ({row.evidence}):",
             f"   situation: {row.situation}",
             f"   advice:    {row.advice}" + (f" ({row.setting})" if row.setting else ""),
             f"   measured:  T {row.T}; per-token KL {row.per_token_kl}; T·KL {row.t_kl}; {row.model}; "
             f"{row.trainer}",
             f"   evidence:  {row.confirmation}"]
    note = ["(Emulated engine: the row was measured on the real vLLM engine, not on this one.)"] if engine != "vllm" \
        else []
    if row.key != "truncating-sampler" or USER_ARM not in arms or ADVICE_ARM not in arms:
        return lines + note, None
    d = paired(runs, ADVICE_ARM, USER_ARM)
    if len(d) < 2:
        return lines + ["This run has too few seeds to compare the advice with your setting.", *note], None
    mean, up, p = statistics.fmean(d), sum(x > 0 for x in d), sign_flip_p(d)
    agrees = mean > 0
    lines.append(f"This run: top_p 1 - top_p {TOP_P:g} (TRL's default both) {mean:+.3f} held-out reward, higher on "
                 f"{up} of {len(d)} seeds (exact sign-flip p {p:.3g}).")
    other = [a for a in arms if a not in (USER_ARM, ADVICE_ARM, "on_policy") and ARMS[a][2] < 1]
    for arm in other:
        c = paired(runs, arm, USER_ARM)
        if c:
            lines.append(f"          {arm} - TRL's default at top_p {TOP_P:g}: {statistics.fmean(c):+.3f} "
                         f"(higher on {sum(x > 0 for x in c)} of {len(c)}), beside the {mean:+.3f} that top_p 1 gave.")
    floor = 2 / 2 ** len(d)
    if agrees:
        lines.append(f"The demo agrees with the verdict: sampling at top_p 1 trained better here. {len(d)} seeds "
                     f"cannot establish it on their own (the smallest two-sided sign-flip p of {len(d)} pairs is "
                     f"{floor:.3g}); the evidence is the row's.")
    else:
        lines.append(f"The demo does NOT agree with the verdict on these seeds: top_p 1 did not train better here. "
                     f"{len(d)} seeds cannot overturn the row either (the smallest two-sided sign-flip p of "
                     f"{len(d)} pairs is {floor:.3g}); see {row.evidence}.")
    return lines + note, agrees


def plot(by_arm: dict, path: str) -> bool:
    """``demo_curves.png``: each arm's held-out reward curve (mean over seeds; each seed thin), and each seed's score
    per arm. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    arms = [a for a, rs in by_arm.items() if rs]
    for i, arm in enumerate(arms):
        rs, color = by_arm[arm], f"C{i}"
        steps = [s for s, _ in rs[0]["curve"]]
        for r in rs:
            ax1.plot(steps, [v for _, v in r["curve"]], color=color, alpha=0.25, linewidth=0.8)
        ax1.plot(steps, [statistics.fmean(r["curve"][j][1] for r in rs) for j in range(len(steps))], color=color,
                 marker="o", label=f"{arm} (top_p {ARMS[arm][2]:g})")
        scores = [r["score"] for r in rs]
        ax2.scatter([i] * len(scores), scores, color=color, alpha=0.6)
        ax2.hlines(statistics.fmean(scores), i - 0.3, i + 0.3, color=color)
    ax1.set(title="the policy's own held-out reward (mean over seeds; thin: each seed)", xlabel="GRPO step",
            ylabel="held-out reward")
    ax1.legend(fontsize=8)
    ax2.set_xticks(range(len(arms)), [a.replace("_top_p", "\ntop_p") for a in arms], fontsize=7)
    ax2.set(title="score per seed (bar: mean)", ylabel="mean of the last 30% of the steps")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str], probe_tools=None) -> None:
    """A worker (``--worker base|probe|ARM``): one process per run, as the driver starts them (``probe`` through
    ``trl-rollout-corr demo-probe``, which passes ``probe_tools``: :func:`run_probe`)."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--worker", required=True)
    p.add_argument("--size", choices=("full", "tiny"), default="full")
    p.add_argument("--engine", choices=ENGINES, default="vllm")
    p.add_argument("--out_dir", required=True)
    p.add_argument("--seed", type=int, default=SEEDS[0])
    p.add_argument("--out")
    p.add_argument("--probe_batches", type=int, default=PROBE_BATCHES)
    a = p.parse_args(argv)
    size = task.FULL if a.size == "full" else task.TINY
    if a.worker == "base":
        task.build_base(a.out_dir, size)
    elif a.worker == "probe":
        if probe_tools is None:
            raise SystemExit("the probe's worker runs as `trl-rollout-corr demo-probe --worker probe ...`")
        run_probe(a.seed, a.out, a.out_dir, size, a.engine, a.probe_batches, probe_tools)
    else:
        run_arm(a.worker, a.seed, a.out, a.out_dir, size, a.engine)


if __name__ == "__main__":
    main(sys.argv[1:])
