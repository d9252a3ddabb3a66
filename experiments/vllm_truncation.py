"""S3 of issue 36 on the REAL vLLM engine: truncated sampling (top-p) in training, every arm sampled by vLLM's CPU
engine colocated in the trainer's process, TRL's default run by TRL's unmodified ``GRPOTrainer`` on its own vLLM
path (pre-registration 20: preregistrations/20-s3v-real-engine-top-p.md).

Experiment P (``mismatch_train.py --experiment P``) ran S3 on a stand-in engine (the policy sampled at top_p 0.8 by
the benchmark's own sampler, log-probs renormalized as vLLM's processed log-probs are). This runs the same task,
model, schedule, seeds' recipe and arms with vLLM itself generating:

* **Engine**: TRL's colocated vLLM engine (``use_vllm=True, vllm_mode="colocate"``), built by TRL's
  ``VLLMGeneration`` for TRL's trainer and this package's alike, in vLLM's "auto" dtype (TRL passes none: on this CPU
  vLLM runs the float32 checkpoint in bfloat16, as a user's engine is bf16), eager, in-process, its KV cache sized
  by this package's CPU setup (``trl_rollout_corr.vllm.engine.vllm_engine_setup`` around each trainer's
  construction, the same for every arm: vLLM's CPU fix that lets a weight sync reach the engine, eager mode, the
  KV-cache size; nothing of TRL's trainer or loss is changed). The engine samples at top_p ``TOP_P`` and returns
  its processed (renormalized) log-probs, which TRL 1.16 asks for. Weights are synced at every optimizer step (TRL's
  own colocated sync for TRL's trainer, this package's default schedule for its own).
* **Task and schedule**: experiment P's (``mismatch_train.py``): running prefix sums of 48 digits (T = 49), the
  465k-parameter Qwen2-style model from the shared base checkpoint after each seed's warm-up, served as an
  equivalent Llama whose attention heads are zero-padded to vLLM's CPU head size 32 (``demo.task.served_model``:
  the same function, the same trained parameters), 8 prompts x 8 completions per generation, two optimizer steps per
  generation (the PPO clip against pi_old is live), lr ``mismatch_train.LR``, 30 steps; score = the policy's own
  held-out reward (64 fixed prompts, full distribution, no engine) averaged over the evaluations in the last 30%.
* **Regime, measured for every arm the same way**: at each evaluation the exact per-token KL(top-p(pi) || pi) of the
  current policy on the held-out prompts (the stand-in's computation: per position -log M, M the kept mass), so the
  run's per-token KL and T*KL are comparable with P's (8.6e-3, 0.42). TRL's own ``sampling/sampling_logp_difference``
  (TRL's arms) and this package's ``rollout_corr/kept_mass_mean`` (its arms) are kept beside it.

    python experiments/vllm_truncation.py --arms on_policy,M0 --seeds 220-229 --out DIR --jobs 2   # the cost check
    python experiments/vllm_truncation.py --arms M1,M1p,M3,M2 --seeds 220-229 --out DIR --jobs 2   # the family
    python experiments/vllm_truncation.py --experiment 23 --arms topk_M0,topk_M1 --seeds 220-234 --out DIR  # top-k
    python experiments/vllm_truncation.py --experiment 24 --arms minp_M0,minp_M1 --seeds 220-234 --out DIR  # min-p
    python experiments/vllm_truncation.py --report_only --out DIR                                 # the analysis
    python experiments/vllm_truncation.py --smoke --out /tmp/s3v_smoke                             # the suite's

Each run is its own process (``--jobs`` at a time); a finished run is one JSON that a re-run skips. The base model
and the warm-ups are ``mismatch_train.py``'s (built in ``OUT/base`` on the first run: 200 supervised steps, ~1 min
on one quiet core).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if not __package__:  # run as a script: this checkout's root first, for experiments.*
    sys.path.insert(0, os.path.dirname(HERE))

from experiments import mismatch_train as mt  # noqa: E402
from experiments.preregistrations import preregistered_rules  # noqa: E402

# -------------------- pre-registration 20: experiments/preregistrations/20-s3v-real-engine-top-p.md
SCENARIO = "S3V"
TOP_P = mt.S3_TOP_P  # 0.8: experiment P's level, so this replicates P on the real engine
STEPS = mt.S3_STEPS  # 30
TOP_K = 2  # pre-registration 23 (its pilot: see there)
MIN_P = 0.2  # pre-registration 24 (its pilot: see there)
ARMS = {  # arm -> (trainer, its correction fields, the engine's top_p, dtype (None: TRL's "auto"), top_k, min_p)
    "on_policy": ("ours", dict(rollout_correction_preset="disabled"), 1.0, "float32", 0, None),  # the ceiling
    "M0": ("ours", dict(rollout_correction_preset="disabled"), TOP_P, None, 0, None),  # no correction
    "M1": ("trl", mt.METHODS["M1"][1], TOP_P, None, 0, None),  # TRL's default (sequence_mask, C=3), TRL's GRPOTrainer
    "M1p": ("ours", dict(rollout_correction_preset="trl_default"), TOP_P, None, 0, None),  # + truncated-support fix
    "M2": ("trl", mt.METHODS["M2"][1], TOP_P, None, 0, None),  # TRL's token_truncate (C=3) by TRL's GRPOTrainer
    "M3": ("ours", dict(rollout_correction_preset="ppo_is_bypass"), TOP_P, None, 0, None),
    "full_bf16": ("ours", dict(rollout_correction_preset="disabled"), 1.0, None, 0, None),  # pre-registration 21
    "topk_M0": ("ours", dict(rollout_correction_preset="disabled"), 1.0, None, TOP_K, None),  # pre-registration 23
    "topk_M1": ("trl", mt.METHODS["M1"][1], 1.0, None, TOP_K, None),  # pre-registration 23: TRL's default at top_k
    "minp_M0": ("ours", dict(rollout_correction_preset="disabled"), 1.0, None, 0, MIN_P),  # pre-registration 24
    "minp_M1": ("trl", mt.METHODS["M1"][1], 1.0, None, 0, MIN_P),  # pre-registration 24: TRL's default at min_p
}
SEEDS = tuple(range(220, 230))  # fresh: never run in any experiment (mismatch_train's last were 200-214)
HELD_OUT = tuple(range(230, 235))
COST_ARMS = ("on_policy", "M0")
FAMILY_ARMS = ("M1", "M1p", "M3", "M2")
FAMILY = ((SCENARIO, "M1p"), (SCENARIO, "M3"), (SCENARIO, "M2"), (SCENARIO, "M0"))  # each - M1, Holm over 4
DEADLINE_UTC = "16:40"
PILOT = {"M1": (9.10e-3, 0.45, 8.72e-3, None, 0.654), "M0": (1.03e-2, 0.50, None, 0.991, 0.638)}
RULES_20 = preregistered_rules(20)  # the rules as the document states them


# -------------------- pre-registration 21: experiments/preregistrations/21-s3v-which-part.md
RULES_21 = preregistered_rules(21)  # the rules as the document states them
SEEDS_21 = tuple(range(220, 235))
HELD_OUT_21 = tuple(range(235, 240))
ARMS_21 = ("on_policy", "M0", "full_bf16")
FAMILY_21 = (("H1", "full_bf16", "M0", "score"), ("H2", "on_policy", "M0", "score_top_p"))  # (name, arm, ref, score)


# -------------------- pre-registration 23: experiments/preregistrations/23-s3v-top-k.md
RULES_23 = preregistered_rules(23)  # the rules as the document states them
SEEDS_23 = tuple(range(220, 235))
HELD_OUT_23 = tuple(range(235, 240))
ARMS_23 = ("topk_M0", "topk_M1")
REPRO_SEEDS_23 = (220, 221)
FAMILY_23 = (("K1", "full_bf16", "topk_M0"), ("K2", "topk_M1", "topk_M0"))  # (name, arm, ref): arm - ref on score
RESULTS_23 = os.path.join(HERE, "results", "vllm_truncation_23_results.csv")  # pre-registration 23's runs


# -------------------- pre-registration 24: experiments/preregistrations/24-s3v-min-p.md
RULES_24 = preregistered_rules(24)  # the rules as the document states them
SEEDS_24 = tuple(range(220, 235))
HELD_OUT_24 = tuple(range(235, 240))
ARMS_24 = ("minp_M0", "minp_M1")
REPRO_SEEDS_24 = (222,)
FAMILY_24 = (("P1", "full_bf16", "minp_M0"), ("P2", "minp_M1", "minp_M0"))  # (name, arm, ref): arm - ref on score
RESULTS_24 = os.path.join(HERE, "results", "vllm_truncation_24_results.csv")  # pre-registration 24's runs


def size() -> dict:
    """Experiment P's CPU size (``mismatch_train.full_size``: T = 49)."""
    return mt.full_size()


def smoke_size() -> dict:
    """The suite's size: a model vLLM's CPU attention can serve (hidden 64, 2 heads of 32: the padding is a no-op),
    T = 7, 2 steps."""
    return {**mt.SMOKE, "hidden": 64, "heads": 2, "n_digits": 6, "base_steps": 2, "warmup_steps": 1, "n_eval": 4,
            "eval_every": 1}


SMOKE_STEPS = 2


def run_path(out: str, arm: str, seed: int) -> str:
    return os.path.join(out, "runs", f"{SCENARIO}__{arm}__seed{seed}.json")


def truncation_kl(model, tok, prompts, n_digits: int, top_p: float, seed: int = 4321,
                  top_k: int = 0, min_p: float | None = None) -> tuple[float, float, float]:
    """The exact per-token KL(top-p(pi) || pi) (= -log M per position, M the kept mass) of ``model`` on ``prompts``
    sampled at ``top_p`` (at top-k ``top_k`` instead when it is > 0, at min-p ``min_p`` when it is set: KL(top-k(pi)
    || pi), KL(min-p(pi) || pi)), the mean T*KL per sequence and the mean length (mismatch_train's stand-in
    computation, on its own generator: the training run is untouched)."""
    import torch

    was_training = model.training
    model.eval()
    ids = torch.tensor([tok.convert_tokens_to_ids(p.split()) for p in prompts], device=model.device)  # (B, P)
    truncation = (mt.top_k_truncation(top_k) if top_k > 0 else mt.min_p_truncation(min_p) if min_p
                  else mt.top_p_truncation(top_p))
    completions, _, _, kl = mt.sample(model, ids, n_digits + 1, torch.Generator(device=model.device).manual_seed(seed),
                                      truncation)
    model.train(was_training)
    mask = torch.zeros_like(kl)  # (B, T)
    for row, c in enumerate(completions):
        mask[row, : len(c)] = 1
    return float((kl * mask).sum() / mask.sum()), float((kl * mask).sum(-1).mean()), float(mask.sum(-1).mean())


def reward(prompts, completions, completion_ids=None, **_) -> list[float]:
    """``psum_reward`` read from the completion's token ids (TRL decodes with ``skip_special_tokens``: no EOS)."""
    from trl_rollout_corr.testing.psum_task import VOCAB, psum_reward

    texts = [" ".join(VOCAB[i] for i in ids) for ids in completion_ids]
    return psum_reward(prompts, texts)


def build_trainer(arm: str, model_dir: str, tok, dataset, fields: dict, callbacks):
    """TRL's unmodified ``GRPOTrainer`` (M1, M2) or this package's trainer, each on TRL's colocated vLLM engine."""
    kind, settings, top_p, dtype, top_k, min_p = ARMS[arm]
    engine = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.02, top_p=top_p, top_k=top_k,
                  min_p=min_p)
    if kind == "trl":
        from trl import GRPOConfig, GRPOTrainer

        from trl_rollout_corr.vllm.engine import vllm_engine_setup

        args = GRPOConfig(**{**fields, **engine}, vllm_importance_sampling_correction=True, **settings)
        with vllm_engine_setup(args):  # the same CPU engine build as this package's trainer (see the docstring)
            return GRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset,
                               processing_class=tok, callbacks=callbacks)
    from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    args = RolloutCorrGRPOConfig(**{**fields, **engine}, vllm_dtype=dtype, **settings)
    return RolloutCorrGRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset,
                                  processing_class=tok, callbacks=callbacks)


def run_one(arm: str, seed: int, out_path: str, base: str, sz: dict, steps: int) -> dict:
    """Train one (arm, seed) on the colocated vLLM engine and write its JSON."""
    import torch
    from datasets import Dataset
    from transformers.utils import logging as hf_logging

    from trl_rollout_corr.demo.task import eval_recorder, freeze_added_bias, served_model
    from trl_rollout_corr.core.metric_names import metric
    from trl_rollout_corr.testing.psum_task import psum_prompts
    from trl_rollout_corr.trl_hooks.vllm import colocated_llm, vllm_generation

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    t0 = time.time()
    n_digits = sz["n_digits"]
    tok = mt.task_tokenizer(sz)
    model = served_model(mt.warm_model(mt.task_model(sz, n_digits), tok, base, sz, seed))
    held_out = psum_prompts(sz["n_eval"], n_digits, seed=777_777)  # mismatch_train's held-out prompts
    evaluator = served_model(mt.task_model(sz, n_digits)).eval()
    curve = [(0, mt.policy_reward(model, tok, held_out, n_digits))]
    regime: list[tuple[int, float, float, float]] = []
    curve_top_p = [(0, mt.policy_reward(model, tok, held_out, n_digits, perturb=mt.top_p_truncation(TOP_P)))]
    logs: list[dict] = []

    top_k, min_p = ARMS[arm][4:]

    def on_eval(step: int, evaluator) -> None:
        curve.append((step, mt.policy_reward(evaluator, tok, held_out, n_digits)))
        regime.append((step, *truncation_kl(evaluator, tok, held_out, n_digits, TOP_P, top_k=top_k, min_p=min_p)))
        curve_top_p.append((step, mt.policy_reward(evaluator, tok, held_out, n_digits,
                                                   perturb=mt.top_p_truncation(TOP_P))))

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        model.save_pretrained(model_dir)  # TRL's colocated engine loads this; the trainer loads the same weights
        tok.save_pretrained(model_dir)
        dataset = Dataset.from_dict({"prompt": psum_prompts(steps * mt.GEN_PROMPTS + 64, n_digits, seed=seed)})
        fields = mt.grpo_fields(os.path.join(tmp, "out"), steps, n_digits, mt.LR, seed)
        trainer = build_trainer(arm, model_dir, tok, dataset, fields,
                                [eval_recorder(evaluator, steps, sz["eval_every"], on_eval, logs)])
        freeze_added_bias(trainer.model)
        trainer.train()
        engine = colocated_llm(vllm_generation(trainer)).llm_engine  # read through the package's checked accessors
        engine_dtype = str(engine.vllm_config.model_config.dtype)

    def mean(key):
        values = [row[key] for row in logs if key in row and math.isfinite(row[key])]
        return statistics.fmean(values) if values else math.nan

    tail = [r for s, r in curve if s >= (1 - mt.TAIL) * steps and s > 0]
    tail_top_p = [r for s, r in curve_top_p if s >= (1 - mt.TAIL) * steps and s > 0]
    kl_token = statistics.fmean(k for _, k, _, _ in regime)
    length = statistics.fmean(n for _, _, _, n in regime)
    result = dict(scenario=SCENARIO, method=arm, seed=seed, pool=SCENARIO, trainer=ARMS[arm][0], top_p=ARMS[arm][2],
                  top_k=top_k, min_p=min_p,
                  engine_dtype=engine_dtype, steps=steps, lr=mt.LR, n_digits=n_digits, score=statistics.fmean(tail),
                  curve=curve, initial=curve[0][1], final=curve[-1][1], score_top_p=statistics.fmean(tail_top_p),
                  curve_top_p=curve_top_p,
                  collapsed=curve[-1][1] < mt.COLLAPSE_FRACTION * curve[0][1],
                  kl_token=kl_token, t_kl=statistics.fmean(t for _, _, t, _ in regime), length=length,
                  generations=[dict(step=s, kl_token=k, t_kl=t, length=n) for s, k, t, n in regime],
                  trl_logp_diff=mean("sampling/sampling_logp_difference/mean"),
                  trl_is_ratio_mean=mean("sampling/importance_sampling_ratio/mean"),
                  kept_mass_mean=mean(metric("kept_mass_mean")), rollout_kl=mean(metric("kl")),
                  k3_kl=mean(metric("k3_kl")), completion_length=mean("completions/mean_length"),
                  logs=logs, seconds=time.time() - t0)
    return mt.save_run(result, out_path)


# ------------------------------------------------------------------------------------------------ the analysis
load_runs = mt.load_runs  # OUT/runs/*.json


CSV_COLUMNS = ("scenario", "method", "seed", "trainer", "top_p", "top_k", "min_p", "engine_dtype", "steps", "lr",
               "n_digits", "score", "score_top_p", "initial", "final", "collapsed", "kl_token", "t_kl", "length",
               "trl_logp_diff", "trl_is_ratio_mean", "kept_mass_mean", "rollout_kl", "k3_kl", "seconds")
RESULTS = os.path.join(HERE, "results", "vllm_truncation_results.csv")  # the committed runs of pre-registration 20
RESULTS_21 = os.path.join(HERE, "results", "vllm_truncation_21_results.csv")  # pre-registration 21's runs
EXPERIMENT_23 = dict(rules=RULES_23, arms=ARMS_23, family=FAMILY_23, repro=REPRO_SEEDS_23, seeds=SEEDS_23,
                     held_out=HELD_OUT_23, title="### Top-k truncation on the real engine (pre-registration 23)\n",
                     file="analysis_23.md")
EXPERIMENT_24 = dict(rules=RULES_24, arms=ARMS_24, family=FAMILY_24, repro=REPRO_SEEDS_24, seeds=SEEDS_24,
                     held_out=HELD_OUT_24, title="### Min-p truncation on the real engine (pre-registration 24)\n",
                     file="analysis_24.md")


def write_csv(runs: list[dict], path: str) -> None:
    """One row per run (the analysis reads it back with :func:`runs_from_csv`)."""
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in sorted(runs, key=lambda r: (r["method"], r["seed"])):
            w.writerow({c: r.get(c, "") for c in CSV_COLUMNS})


def runs_from_csv(path: str = RESULTS) -> list[dict]:
    """The runs of a results CSV as the analysis reads them (numbers as numbers, ``collapsed`` as a bool)."""
    import csv

    def value(key: str, text: str):
        if key in ("scenario", "method", "trainer", "engine_dtype"):
            return text
        if key == "collapsed":
            return text == "True"
        if text in ("", "nan"):  # a column the run predates (score_top_p: 21; top_k: 23; min_p: 24), written back
            return math.nan
        return int(text) if key in ("seed", "steps", "n_digits", "top_k") else float(text)

    with open(path, newline="") as f:
        runs = [{k: value(k, v) for k, v in row.items()} for row in csv.DictReader(f)]
    return [{**r, "pool": SCENARIO, "generations": [{"length": r["length"]}]} for r in runs]  # the mean length


def report(out: str, runs: list[dict] | None = None) -> str:
    """The pre-registered analysis (rules 1-4) of ``runs`` (default: ``OUT/runs``), written to ``OUT/analysis.md``
    with ``OUT/results.csv``."""
    runs = load_runs(out) if runs is None else runs
    os.makedirs(out, exist_ok=True)
    write_csv(runs, os.path.join(out, "results.csv"))
    st = mt._stats()
    text, result = mt.analyse_family(runs, list(SEEDS), SCENARIO, FAMILY,
                                     "S3 on the real vLLM engine (pre-registration 20)")
    lines = [RULES_20, "", text]
    common, o, u = mt.paired(mt.score_table(runs), SCENARIO, "on_policy", "M0", list(SEEDS))
    if len(common) >= 2 and not result["counts"]:
        tost = st.tost_paired([a - b for a, b in zip(o, u)], mt.TOST_MARGIN)
        lines.append(f"\nRule 1: the cost does not count; TOST (+-{mt.TOST_MARGIN}) of on_policy - M0: p "
                     f"{tost.p:.3g} ({'equivalent' if tost.p < mt.ALPHA else 'not shown equivalent'}).")
    held = [s for s in HELD_OUT if any(r["seed"] == s for r in runs)]
    if held:
        common, o, u = mt.paired(mt.score_table(runs), SCENARIO, "on_policy", "M0", held)
        if len(common) >= 2:
            row = st.compare_paired(o, u)
            lines.append(f"\nHeld-out seeds {held[0]}-{held[-1]}: on_policy - M0 {row['diff']:+.4f} "
                         f"[{row['diff_lo']:+.4f}, {row['diff_hi']:+.4f}] (n {row['n']}, t p {row['p']:.3g}, "
                         f"sign-flip p {row['p_sign_flip']:.3g}): "
                         + ("same sign, CONFIRMED." if row["diff"] > 0 else "the sign flips: NOT confirmed."))
        lines.append(mt.held_out_row_text(runs, result, held, SCENARIO))
    by_arm: dict[str, list[dict]] = {}
    for r in runs:
        by_arm.setdefault(r["method"], []).append(r)
    lines += ["\n**Regime and engine** (run means; ranges over runs):\n",
              "| arm | n | engine | per-token KL(top-p(pi)‖pi) | T·KL | TRL's sampling_logp_difference | "
              "kept_mass_mean | seconds |", "|---|---|---|---|---|---|---|---|"]

    def rng(rs, key, f="{:.2e}"):
        xs = [r[key] for r in rs if r.get(key) is not None and math.isfinite(r[key])]
        return "—" if not xs else f"{f.format(min(xs))}–{f.format(max(xs))}"

    for arm in ARMS:
        rs = by_arm.get(arm, [])
        if rs:
            lines.append(f"| {arm} | {len(rs)} | {rs[0]['engine_dtype'].removeprefix('torch.')}, top_p "
                         f"{rs[0]['top_p']:g} | {rng(rs, 'kl_token')} | {rng(rs, 't_kl', '{:.2f}')} | "
                         f"{rng(rs, 'trl_logp_diff')} | {rng(rs, 'kept_mass_mean', '{:.3f}')} | "
                         f"{rng(rs, 'seconds', '{:.0f}')} |")
    text = "\n".join(lines)
    with open(os.path.join(out, "analysis.md"), "w") as f:
        f.write(text + "\n")
    return text


def family_table(rows: list[dict], with_score: bool) -> list[str]:
    """Holm over ``rows`` (exact sign-flip and paired t, each adjusted), each marked confirmed iff positive with both
    Holm p < ALPHA (pre-registrations 21, 23, 24), and the family's markdown table."""
    st = mt._stats()
    st.add_holm(rows, "p_sign_flip")
    st.add_holm(rows, "p")
    fmt = "{:+.4f} [{:+.4f}, {:+.4f}]".format
    lines = [f"\nFamily (Holm over {len(rows)}; confirmed iff positive with both Holm p < {mt.ALPHA:g}):\n",
             "| | comparison |" + (" score |" if with_score else "") + " n | difference, 95% CI | p sign-flip (Holm) "
             "| p t (Holm) | TOST ±0.02 p | confirmed |", "|---|---|" + ("---|" if with_score else "") + "---|" * 6]
    for r in rows:
        r["confirmed"] = bool(r["diff"] > 0 and r["p_sign_flip_holm"] < mt.ALPHA and r["p_holm"] < mt.ALPHA)
        lines.append(f"| {r['name']} | {r['arm']} − {r['ref']} |" + (f" {r['key']} |" if with_score else "")
                     + f" {r['n']} | {fmt(r['diff'], r['diff_lo'], r['diff_hi'])} | {r['p_sign_flip']:.3g} "
                     f"({r['p_sign_flip_holm']:.3g}) | {r['p']:.3g} ({r['p_holm']:.3g}) | {r['tost_p']:.3g} | "
                     f"{'yes' if r['confirmed'] else 'no'} |")
    return lines


def report_21(out: str, runs: list[dict] | None = None, committed: str = RESULTS) -> tuple[str, dict]:
    """Pre-registration 21's analysis of ``runs`` (default: ``OUT/runs``; pre-registration 20's committed runs in
    ``committed`` for the reproduction check), written to ``OUT/analysis_21.md`` with ``OUT/results.csv``."""
    st = mt._stats()
    runs = load_runs(out) if runs is None else runs
    os.makedirs(out, exist_ok=True)
    write_csv(runs, os.path.join(out, "results.csv"))
    by = {(r["method"], r["seed"]): r for r in runs}
    old = {(r["method"], r["seed"]): r for r in runs_from_csv(committed)}
    repro = [(m, s, by[m, s]["score"], old[m, s]["score"]) for m, s in sorted(by) if (m, s) in old]
    differ = [(m, s) for m, s, new, was in repro if new != was]

    def value(arm: str, seed: int, key: str) -> float:
        if key == "score" and (arm, seed) in differ:
            return old[arm, seed]["score"]  # rule 2: pre-registration 20's value is kept
        return by[arm, seed][key]

    def compare(arm: str, ref: str, key: str, seeds) -> dict | None:
        common = [s for s in seeds if (arm, s) in by and (ref, s) in by]
        if len(common) < 2:
            return None
        x, y = [value(arm, s, key) for s in common], [value(ref, s, key) for s in common]
        return st.compare_paired(x, y, margin=mt.TOST_MARGIN)

    fmt = "{:+.4f} [{:+.4f}, {:+.4f}]".format
    lines = [RULES_21, "", "### Which part of S3V's cost is the truncation (pre-registration 21)\n",
             f"Reproduction (rule 2): {len(repro)} re-runs of pre-registration 20's runs; "
             + (f"{len(differ)} differ in the score: {differ} (their pre-registration 20 value is kept)."
                if differ else "every score equal to the committed one, bit for bit."), "",
             "| arm | n | score (full distribution) | score_top_p (served at top_p 0.8) |", "|---|---|---|---|"]
    for arm in ARMS_21:
        seeds = [s for s in SEEDS_21 if (arm, s) in by]
        if seeds:
            lines.append(f"| {arm} | {len(seeds)} | {statistics.fmean(value(arm, s, 'score') for s in seeds):.4f} | "
                         f"{statistics.fmean(by[arm, s]['score_top_p'] for s in seeds):.4f} |")
    rows = []
    for name, arm, ref, key in FAMILY_21:
        row = compare(arm, ref, key, SEEDS_21)
        if row is not None:
            rows.append({**row, "name": name, "arm": arm, "ref": ref, "key": key})
    lines += family_table(rows, with_score=True)
    result = {"rows": rows, "differ": differ, "reproduced": len(repro)}
    h1 = next((r for r in rows if r["name"] == "H1"), None)
    if h1 is not None and h1["confirmed"]:
        held = compare("full_bf16", "M0", "score", HELD_OUT_21)
        if held is None:
            lines.append(f"\nHeld out (rule 4): full_bf16 and M0 on seeds {HELD_OUT_21[0]}-{HELD_OUT_21[-1]} not run "
                         "yet.")
        else:
            held["survives"] = held["diff"] > 0
            result["held_out"] = held
            lines.append(f"\nHeld out (rule 4), seeds {HELD_OUT_21[0]}-{HELD_OUT_21[-1]}: full_bf16 − M0 "
                         f"{fmt(held['diff'], held['diff_lo'], held['diff_hi'])} (n {held['n']}, t p {held['p']:.3g}, "
                         f"sign-flip p {held['p_sign_flip']:.3g}): "
                         + ("the same sign: H1 SURVIVES." if held["survives"] else "the sign flips: H1 does NOT "
                                                                                  "survive."))
    bf16 = compare("full_bf16", "on_policy", "score", SEEDS_21)
    if bf16 is not None:
        result["bf16_alone"] = bf16
        lines.append(f"\nReported (rule 5): full_bf16 − on_policy (the bf16 engine alone) "
                     f"{fmt(bf16['diff'], bf16['diff_lo'], bf16['diff_hi'])} (n {bf16['n']}, t p {bf16['p']:.3g}, "
                     f"TOST ±{mt.TOST_MARGIN} p {bf16['tost_p']:.3g}).")
    text = "\n".join(lines)
    with open(os.path.join(out, "analysis_21.md"), "w") as f:
        f.write(text + "\n")
    return text, result


def report_23(out: str, runs: list[dict] | None = None, reference: str = RESULTS_21) -> tuple[str, dict]:
    """Pre-registration 23's analysis of ``runs`` (default: ``OUT/runs``: topk_M0, topk_M1 and the full_bf16
    re-runs), against full_bf16's committed runs in ``reference`` (rule 2), written to ``OUT/analysis_23.md`` with
    ``OUT/results.csv``."""
    return _against_full_bf16(out, runs, reference, EXPERIMENT_23)


def report_24(out: str, runs: list[dict] | None = None, reference: str = RESULTS_21) -> tuple[str, dict]:
    """Pre-registration 24's analysis (min-p; the same rules as 23's with its own arms), to ``OUT/analysis_24.md``."""
    return _against_full_bf16(out, runs, reference, EXPERIMENT_24)


def _against_full_bf16(out: str, runs: list[dict] | None, reference: str, exp: dict) -> tuple[str, dict]:
    """Pre-registrations 23 and 24: a truncating arm and TRL's default at it against full_bf16's committed runs
    (reproduced first on ``exp["repro"]``), Holm over ``exp["family"]``, held-out seeds for a confirmed row."""
    st = mt._stats()
    runs = load_runs(out) if runs is None else runs
    os.makedirs(out, exist_ok=True)
    write_csv(runs, os.path.join(out, "results.csv"))
    new = {(r["method"], r["seed"]): r for r in runs}
    committed = {(r["method"], r["seed"]): r for r in runs_from_csv(reference) if r["method"] == "full_bf16"}
    repro = [(s, new["full_bf16", s]["score"], committed["full_bf16", s]["score"]) for s in exp["repro"]
             if ("full_bf16", s) in new and ("full_bf16", s) in committed]
    reproduced = len(repro) == len(exp["repro"]) and all(a == b for _, a, b in repro)
    by = {**new, **({k: v for k, v in committed.items() if k not in new} if reproduced else {})}

    def compare(arm: str, ref: str, seeds) -> dict | None:
        common = [s for s in seeds if (arm, s) in by and (ref, s) in by]
        if len(common) < 2:
            return None
        return st.compare_paired([by[arm, s]["score"] for s in common], [by[ref, s]["score"] for s in common],
                                 margin=mt.TOST_MARGIN)

    fmt = "{:+.4f} [{:+.4f}, {:+.4f}]".format
    lines = [exp["rules"], "", exp["title"],
             "Reproduction (rule 2): "
             + ", ".join(f"full_bf16 seed {s} {a:.6f} (committed {b:.6f})" for s, a, b in repro)
             + (": equal, bit for bit; the committed runs are the reference." if reproduced else
                ": NOT all equal (or not run): only re-run full_bf16 runs are the reference."), "",
             "| arm | n | score | per-token KL of the truncation | T·KL | TRL's sampling_logp_difference | "
             "kept_mass_mean |",
             "|---|---|---|---|---|---|---|"]
    def mean_of(rs: list[dict], key: str, f: str) -> str:
        xs = [r[key] for r in rs if r.get(key) is not None and math.isfinite(r[key])]
        return f.format(statistics.fmean(xs)) if xs else "—"

    for arm in ("full_bf16", *exp["arms"]):
        rs = [by[arm, s] for s in exp["seeds"] if (arm, s) in by]
        if rs:
            def m(key, f, rs=rs):
                return mean_of(rs, key, f)

            regime = (m("kl_token", "{:.2e}"), m("t_kl", "{:.3f}")) if arm != "full_bf16" else ("—", "—")
            lines.append(f"| {arm} | {len(rs)} | {m('score', '{:.4f}')} | {regime[0]} | {regime[1]} | "
                         f"{m('trl_logp_diff', '{:.2e}')} | {m('kept_mass_mean', '{:.3f}')} |")
    rows = []
    for name, arm, ref in exp["family"]:
        row = compare(arm, ref, exp["seeds"])
        if row is not None:
            rows.append({**row, "name": name, "arm": arm, "ref": ref})
    lines += family_table(rows, with_score=False)
    result = {"rows": rows, "reproduced": reproduced, "held_out": {}}
    for r in rows:
        if not r["confirmed"]:
            continue
        held_seeds = exp["held_out"]
        held = compare(r["arm"], r["ref"], held_seeds)
        if held is None:
            lines.append(f"\nHeld out (rule 4): {r['name']} on seeds {held_seeds[0]}-{held_seeds[-1]} not run yet.")
            continue
        held["survives"] = held["diff"] > 0
        result["held_out"][r["name"]] = held
        lines.append(f"\nHeld out (rule 4), seeds {held_seeds[0]}-{held_seeds[-1]}: {r['arm']} − {r['ref']} "
                     f"{fmt(held['diff'], held['diff_lo'], held['diff_hi'])} (n {held['n']}, t p {held['p']:.3g}): "
                     + (f"the same sign: {r['name']} SURVIVES." if held["survives"] else
                        f"the sign flips: {r['name']} does NOT survive."))
    text = "\n".join(lines)
    with open(os.path.join(out, exp["file"]), "w") as f:
        f.write(text + "\n")
    return text, result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default=",".join(COST_ARMS))
    p.add_argument("--seeds", default="220-229")
    p.add_argument("--out", default="outputs/vllm_truncation")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--report_only", action="store_true", help="write OUT/analysis.md from OUT/runs; runs nothing")
    p.add_argument("--results", default=None, metavar="CSV", help="with --report_only: analyse a results CSV (the "
                   f"committed one: {os.path.relpath(RESULTS, os.path.dirname(HERE))}) instead of OUT/runs")
    p.add_argument("--experiment", choices=("20", "21", "23", "24"), default="20", help="the pre-registration "
                   "whose analysis --report_only and the end of a run write (20: OUT/analysis.md, 21: "
                   "OUT/analysis_21.md, 23: OUT/analysis_23.md, 24: OUT/analysis_24.md)")
    p.add_argument("--smoke", action="store_true", help="the suite's version: a tiny model, T = 7, 2 steps")
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)  # arm seed out_path
    a = p.parse_args(argv)
    if a.report_only:
        runs = runs_from_csv(a.results) if a.results else None
        print(REPORTS[a.experiment](a.out, runs))
        return
    sz, steps = (smoke_size(), SMOKE_STEPS) if a.smoke else (size(), STEPS)
    base = mt.base_model_path(a.out)
    if a.worker:
        arm, seed, out_path = a.worker
        run_one(arm, int(seed), out_path, base, sz, steps)
        return
    mt.in_child(mt.build_base, a.out, sz, base)
    todo = [(arm, seed) for seed in mt.parse_seeds(a.seeds) for arm in a.arms.split(",")
            if not os.path.exists(run_path(a.out, arm, seed))]  # seed by seed: whole paired seeds
    unknown = sorted({arm for arm, _ in todo} - set(ARMS))
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}: choose from {', '.join(ARMS)}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    from trl_rollout_corr.runtime.pool import Job, run_processes

    def finish(job, returncode, seconds, done, stderr_tail):
        arm, seed, path = job.label.split(":", 2)
        if returncode != 0:
            print(f"{arm} seed {seed} failed ({path}.log):\n{stderr_tail}", file=sys.stderr, flush=True)
            return
        r = json.load(open(path))
        print(f"{arm:10s} seed={seed} score={r['score']:.3f} kl={r['kl_token']:.2e} t_kl={r['t_kl']:.2f} "
              f"{r['engine_dtype']} {r['seconds']:.0f}s", flush=True)

    workers = []
    for arm, seed in todo:
        path = run_path(a.out, arm, seed)
        cmd = [sys.executable, os.path.abspath(__file__), "--out", a.out, *(["--smoke"] if a.smoke else []),
               "--worker", arm, str(seed), path]
        # vLLM's and the trainer's output, one file per run
        workers.append(Job(cmd, f"{arm}:{seed}:{path}", env, log=path + ".log"))
    run_processes(workers, a.jobs, on_done=finish, poll_seconds=1.0)
    print(REPORTS[a.experiment](a.out))


REPORTS = {"20": report, "21": lambda out, runs=None: report_21(out, runs)[0],
           "23": lambda out, runs=None: report_23(out, runs)[0], "24": lambda out, runs=None: report_24(out, runs)[0]}

if __name__ == "__main__":
    main()
