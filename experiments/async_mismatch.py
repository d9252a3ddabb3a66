"""S4 of issue 36: TRL's asynchronous trainer itself, in the regime of real runs (T = 257), with a precision-like gap
inside the real vLLM engine, analysed as a pre-registered paired experiment (pre-registration 17:
preregistrations/17-s4-async-trainer.md).

Experiments A, B and E of ``experiments/mismatch_train.py`` found, in the SYNCHRONOUS trainer with an emulated
4-step-stale engine that also samples with dense logit noise, that ``ppo_is_bypass`` (the asynchronous trainer's loss:
TRL's ``AsyncGRPOTrainer`` is bypass PPO by construction) trains worse than TRL's synchronous default
(``sequence_mask``, C = 3). Only a run of the asynchronous trainer itself may change its default (pre-registration
16). This runs it:

* **Engine**: one ``trl-rollout-corr vllm-serve-async`` server (vLLM's CPU build, float32) serving the psum model,
  sampling with ``GaussianLogitNoise`` (:mod:`experiments.logit_noise`): every logit + N(0, sigma^2),
  the log-probs returned are the noisy distribution's (vLLM's ``processed_logprobs``). Staleness is the asynchronous
  trainer's own (``max_staleness`` 4, TRL's default; the lag each sample reaches the loss at is logged).
* **Task, model, schedule**: experiment E's (``mismatch_train.py``'s target regime): running prefix sums of 256
  digits (T = 257), the 465k-parameter Qwen2-style model from the shared base checkpoint after each seed's warm-up,
  lr ``X_LR``, 30 optimizer steps of 16 completions (2 prompts x 8), score = the policy's own held-out reward (64
  fixed prompts, no noise, no staleness) averaged over the last 30% of the steps (``mismatch_train.policy_reward``).
* **Arms**: ``trl_as_is`` = TRL's ``AsyncGRPOTrainer`` itself, unmodified (TRL's default in S4, by TRL's code); the
  others are this package's ``RolloutCorrAsyncGRPOTrainer`` with a preset. ``ARMS`` / ``FAMILY`` below.

    python experiments/async_mismatch.py --arms trl_as_is,trl_default,decoupled_token_is --seeds 185-194 --out DIR
    python experiments/async_mismatch.py --sigma 0 --arms trl_as_is --seeds 185-194 --out DIR   # the cost check
    python experiments/async_mismatch.py --report_only --out DIR                                  # the analysis
    python experiments/async_mismatch.py --sigma 0 --arms trl_default --seeds 185-194 --out DIR \
        --import_results experiments/results/async_mismatch_s4_results.csv                       # pre-registration 18

Each run is its own process, one at a time (the server and the trainer share the 2 cores); a finished run is one
JSON that a re-run skips. The shared base model and the warm-ups are ``mismatch_train.py``'s (``--base_dir``: a
folder holding ``base_n256_s400.pt``; the warm-ups are saved beside it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
if not __package__:  # run as a script: this checkout's root first, for experiments.*
    sys.path.insert(0, os.path.dirname(HERE))

from experiments import mismatch_train as mt  # noqa: E402
from experiments.preregistrations import preregistered_rules  # noqa: E402
from trl_rollout_corr.demo.task import eval_recorder, freeze_added_bias, served_model  # noqa: E402,F401

# -------------------- pre-registration 17: experiments/preregistrations/17-s4-async-trainer.md
ARMS = {  # arm -> this package's correction fields (None: TRL's AsyncGRPOTrainer itself, unmodified)
    "trl_as_is": None,  # TRL's default in S4 (its loss is bypass PPO: ppo_is_bypass's gradient, tested)
    "trl_default": dict(rollout_correction_preset="trl_default"),  # TRL's synchronous default (sequence_mask, C=3)
    "decoupled_token_is": dict(rollout_correction_preset="decoupled_token_is"),  # runnable, not in the family
    # pre-registration 22's candidate: TRL's bypass PPO (the trust region against pi_rollout) plus TRL's synchronous
    # default's one-sided sequence mask (prod_t pi_theta / pi_rollout > 3 leaves the loss; lower bound 1e-300: none)
    "bypass_seq_mask": dict(rollout_correction_preset="ppo_is_bypass", rollout_rs="sequence", rollout_rs_threshold=3.0,
                            rollout_rs_threshold_lower=1e-300),
}
REFERENCE = "trl_as_is"
FAMILY = (("S4", "trl_default"),)  # trl_default - trl_as_is; Holm over this one
SIGMA = 1.0  # experiment B's dense gap (4.41e-3 per token at step 0), where the synchronous finding is -0.081
COST_SIGMA = 0.0  # the cost check: trl_as_is without the gap (the staleness of asynchrony only)
SEEDS = tuple(range(185, 195))  # experiment E's seeds: their warm-ups exist (mismatch_train's warm_model)
HELD_OUT = tuple(range(195, 200))  # run only if the family row is significant; the sign must hold
FAMILY_ARMS = ("trl_as_is", "trl_default")  # run seed by seed (a partial run leaves whole paired seeds)

# -------------------- pre-registration 18: experiments/preregistrations/18-s4-without-gap.md
RULES_18 = preregistered_rules(18)  # the rules as the document states them
STALENESS_CSV = "experiments/results/async_staleness_results.csv"  # rule 5's reference: trl_as_is at max_staleness 4
STALENESS_SEEDS = (0, 1, 2, 3, 4)

# -------------------- pre-registration 19: experiments/preregistrations/19-s4-smaller-gap.md
RULES_19 = preregistered_rules(19)  # the rules as the document states them
# -------------------- pre-registration 22: experiments/preregistrations/22-s4-bypass-seq-mask.md
RULES_22 = preregistered_rules(22)  # the rules as the document states them
CANDIDATE_22 = "bypass_seq_mask"
DEADLINE_22_UTC = "16:30"
LADDER_SIGMA = 0.8
LADDER_DEADLINE_UTC = "13:40"
EQUIV_ARM = "trl_default"
EQUIV_SIGMA = COST_SIGMA  # 0: the asynchronous trainer's staleness only
EQUIV_MARGIN = mt.TOST_MARGIN  # 0.02 reward units, as every "no cost" of mismatch_train
RULES = preregistered_rules(17)  # the rules as the document states them
MAX_STALENESS = 4  # TRL's default
STEPS = mt.X_STEPS  # 30
N_DIGITS = mt.X_DIGITS  # 256: T = 257
PER_STEP = mt.GEN_PROMPTS * mt.NUM_GENERATIONS // mt.STEPS_PER_GENERATION  # 16 completions per optimizer step


SMOKE_STEPS = 2


def smoke_size() -> dict:
    """mismatch_train's smoke size at S2E's length (hidden 32, 1 layer, 2 heads, T = 11): seconds per run."""
    smoke = {**mt.full_size(), **{k: v for k, v in mt.SMOKE.items() if k != "steps"}}
    return {**mt.cell_size("S2E", smoke), "device": "cpu", "bf16": False, "name": "smoke"}


def run_path(out: str, arm: str, sigma: float, seed: int) -> str:
    return os.path.join(out, "runs", f"S4__{arm}__sigma{sigma:g}__seed{seed}.json")


def size() -> dict:
    """Experiment E's sizes (mismatch_train's full size at the target regime's length)."""
    return {**mt.cell_size("S2E", mt.full_size()), "device": "cpu", "bf16": False, "name": "full"}


def run_one(arm: str, seed: int, sigma: float, url: str, model_dir: str, base: str, out_path: str,
            sz: dict | None = None, steps: int = STEPS) -> dict:
    """Train one (arm, seed) against the running server and write its JSON (``sz``, ``steps``: the pre-registered
    size and 30 steps unless given: the suite's smoke run)."""
    import torch
    from datasets import Dataset
    from transformers.utils import logging as hf_logging

    from trl_rollout_corr.core.metric_names import metric
    from experiments.async_trainers import build_async_trainer
    from trl_rollout_corr.testing.psum_task import psum_prompts

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    t0 = time.time()
    sz = size() if sz is None else sz
    n_digits = sz["n_digits"]
    tok = chat_tokenizer(sz)
    model = served_model(mt.warm_model(mt.task_model(sz, n_digits), tok, base, sz, seed))  # E's model, servable
    evaluator = served_model(mt.task_model(sz, n_digits)).eval()  # plain attention: the trainer's may be packed
    held_out = psum_prompts(sz["n_eval"], n_digits, seed=777_777)  # mismatch_train's held-out prompts
    curve = [(0, mt.policy_reward(model, tok, held_out, n_digits))]
    logs: list[dict] = []
    recorder = eval_recorder(evaluator, steps, sz["eval_every"], lambda step, ev: curve.append(
        (step, mt.policy_reward(ev, tok, held_out, n_digits))), logs)
    prompts = [[{"role": "user", "content": p}] for p in psum_prompts(steps * PER_STEP * 4 + 256, n_digits, seed=seed)]
    common = dict(per_device_train_batch_size=PER_STEP, num_generations=mt.NUM_GENERATIONS,
                  max_completion_length=n_digits + 1, learning_rate=mt.X_LR, lr_scheduler_type="constant",
                  adam_beta2=0.99, max_grad_norm=1.0, temperature=1.0, epsilon=0.2, max_steps=steps, logging_steps=1,
                  save_strategy="no", report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
                  disable_tqdm=True, dtype="float32", seed=seed, max_staleness=MAX_STALENESS, token_budget=-1,
                  vllm_server_base_url=url, weight_sync_steps=1)
    model.save_pretrained(model_dir)  # TRL's cold sync at train begin loads this run's weights into the server
    tok.save_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        kwargs = dict(model=model_dir, reward_funcs=psum_chat_reward, processing_class=tok,
                      train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[recorder])
        trainer = build_async_trainer(ARMS[arm], url=url, output_dir=tmp, config=common, **kwargs)
        freeze_added_bias(trainer.model)
        trainer.train()

    def mean(key):
        values = [row[key] for row in logs if key in row and math.isfinite(row[key])]
        return statistics.fmean(values) if values else math.nan

    tail = [r for s, r in curve if s >= (1 - mt.TAIL) * steps and s > 0]
    result = dict(scenario="S4", arm=arm, seed=seed, sigma=sigma, steps=steps, lr=mt.X_LR, n_digits=n_digits,
                  max_staleness=MAX_STALENESS, score=statistics.fmean(tail), curve=curve, initial=curve[0][1],
                  final=curve[-1][1], collapsed=curve[-1][1] < mt.COLLAPSE_FRACTION * curve[0][1],
                  staleness_mean=mean("sample/staleness_mean"), lag_mean=mean(metric("lag_mean")),
                  kl=mean(metric("kl")), k3_kl=mean(metric("k3_kl")), lag0_kl=mean(metric("lag_0/kl")),
                  trl_kl=mean("kl"), trl_kl_first=logs[0].get("kl", math.nan) if logs else math.nan,
                  dropped=sum(row.get("sample/dropped_stale_total", 0.0) for row in logs),
                  logs=logs, seconds=time.time() - t0)
    return mt.save_run(result, out_path)


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # a user turn renders as the plain prompt


def chat_tokenizer(sz: dict):
    """The psum tokenizer with a chat template rendering ``[{"role": "user", "content": p}]`` as ``p`` (the same ids
    as the plain prompt) and TRL's Qwen3 response template, as TRL's asynchronous trainer needs."""
    from trl.chat_template_utils import qwen3_template

    tok = mt.task_tokenizer(sz)
    tok.chat_template = CHAT_TEMPLATE
    tok.response_template = qwen3_template
    return tok


def psum_chat_reward(prompts, completions, completion_ids=None, **_) -> list[float]:
    """``psum_reward`` on conversational prompts; the completion read from its token ids (TRL's response parser,
    made for chat models, would leave the prompt in a plain completion's text)."""
    from trl_rollout_corr.testing.psum_task import VOCAB, psum_reward

    def text(x):
        return x[-1]["content"] if isinstance(x, list) else x

    texts = ([" ".join(VOCAB[i] for i in ids) for ids in completion_ids]
             if completion_ids is not None else [text(c) or "" for c in completions])
    return psum_reward([text(p) for p in prompts], texts)


# ------------------------------------------------------------------------------------------------ the analysis
load_runs = mt.load_runs  # OUT/runs/*.json, as mismatch_train writes them


def scores(runs: list[dict], arm: str, sigma: float, seeds) -> dict[int, float]:
    return {r["seed"]: r["score"] for r in runs if r["arm"] == arm and r["sigma"] == sigma and r["seed"] in seeds}


def held_out_diffs(x: dict[int, float], ref: dict[int, float]) -> dict | None:
    """The held-out seeds both arms ran (``x``, ``ref``: seed -> score), their differences x - ref and mean; None when
    there are none. ``complete``: every seed of ``HELD_OUT`` ran. The verdict is each pre-registration's own."""
    held = sorted(set(x) & set(ref))
    if not held:
        return None
    diffs = [x[s] - ref[s] for s in held]
    return dict(seeds=held, diffs=diffs, mean=statistics.fmean(diffs), complete=len(held) == len(HELD_OUT))


def same_sign(held: dict, row: dict) -> bool:
    """A significant ``row`` whose complete held-out mean keeps its sign (pre-registrations 17 and 19)."""
    return held["complete"] and row["significant"] and math.copysign(1, held["mean"]) == math.copysign(1, row["diff"])


def paired_text(row: dict, sigma: float) -> str:
    """"trl_default - trl_as_is at sigma S, seeds a-b (n): mean vs mean, diff [95% CI]" of a paired ``row``."""
    return (f"{EQUIV_ARM} - {REFERENCE} at sigma {sigma:g}, seeds {row['seeds'][0]}-{row['seeds'][-1]} "
            f"({len(row['seeds'])}): {row['mean']:.3f} vs {row['ref_mean']:.3f}, {row['diff']:+.3f} "
            f"[{row['diff_lo']:+.3f}, {row['diff_hi']:+.3f}]")


def section(title: str, rules: str, row: dict | None) -> list[str]:
    """A pre-registration's heading and rules in analysis.md, then "Not run." when it has no paired row."""
    return ["", f"## {title}", "", "```", rules, "```", ""] + (["Not run."] if row is None else [])


def held_out_line(held: dict, verdict: str) -> str:
    return (f"Held out (seeds {held['seeds'][0]}-{held['seeds'][-1]}): mean {held['mean']:+.3f} (per seed "
            f"{', '.join(f'{d:+.3f}' for d in held['diffs'])}): {verdict}.")


def analyse(runs: list[dict], staleness: dict[int, float] | None = None) -> dict:
    """Pre-registration 17's analysis (``RULES``) of ``runs``: the family row on the family seeds that have both
    arms, its Holm p (over ``FAMILY``), the verdict; the held-out mean difference; the cost check; per arm the regime
    (TRL's kl at the first step and over the run, this package's kl, the lag at the loss, dropped samples)."""
    from experiments import stats

    out: dict = {"family": [], "held_out": {}, "cost": None, "regime": {}}
    for scenario, arm in FAMILY:
        x, ref = scores(runs, arm, SIGMA, SEEDS), scores(runs, REFERENCE, SIGMA, SEEDS)
        paired = sorted(set(x) & set(ref))
        if len(paired) < 2:
            continue
        row = stats.compare_paired([x[s] for s in paired], [ref[s] for s in paired], margin=mt.TOST_MARGIN)
        out["family"].append(dict(scenario=scenario, arm=arm, seeds=paired, **row))
    stats.add_holm(out["family"], "p")
    stats.add_holm(out["family"], "p_sign_flip")
    for row in out["family"]:
        row["significant"] = row["p_holm"] < mt.ALPHA and row["p_sign_flip_holm"] < mt.ALPHA
        held = held_out_diffs(scores(runs, row["arm"], SIGMA, HELD_OUT), scores(runs, REFERENCE, SIGMA, HELD_OUT))
        if held:
            out["held_out"][row["arm"]] = dict(held, confirmed=same_sign(held, row))
    gap, clean = scores(runs, REFERENCE, SIGMA, SEEDS), scores(runs, REFERENCE, COST_SIGMA, SEEDS)
    paired = sorted(set(gap) & set(clean))
    if len(paired) >= 2:
        row = stats.compare_paired([gap[s] for s in paired], [clean[s] for s in paired])
        out["cost"] = dict(seeds=paired, costs=row["diff"] < 0 and row["p"] < mt.ALPHA
                           and row["p_sign_flip"] < mt.ALPHA, **row)
    out["equivalence"] = equivalence(runs, staleness)
    out["ladder"] = ladder(runs)
    out["candidate_22"] = candidate_22(runs)
    for arm in dict.fromkeys([REFERENCE, *ARMS]):
        for sigma in (SIGMA, LADDER_SIGMA, COST_SIGMA):
            rs = [r for r in runs if r["arm"] == arm and r["sigma"] == sigma]
            if not rs:
                continue

            def m(key, rs=rs):
                values = [r[key] for r in rs if r.get(key) is not None and math.isfinite(r[key])]
                return statistics.fmean(values) if values else math.nan

            out["regime"][f"{arm} sigma {sigma:g}"] = dict(
                n=len(rs), score=m("score"), score_sd=statistics.stdev([r["score"] for r in rs]) if len(rs) > 1
                else math.nan, trl_kl_first=m("trl_kl_first"), trl_kl=m("trl_kl"), kl=m("kl"), lag0_kl=m("lag0_kl"),
                staleness=m("staleness_mean"), lag=m("lag_mean"), dropped=m("dropped"), seconds=m("seconds"),
                collapsed=sum(bool(r["collapsed"]) for r in rs))
    return out


def staleness_check(trl_default_rewards: dict[int, float], csv_path: str | None = None) -> dict | None:
    """Pre-registration 18's rule 5: ``trl_default_rewards`` (seed -> held-out reward of async_staleness.py's
    ``trl_default`` runs at max_staleness 4) paired with the committed ``trl_as_is`` row's per-seed rewards; ``blocks``
    iff the mean difference is < 0 with paired t p < ``mt.ALPHA``. None until every seed has run."""
    import csv

    from experiments import stats

    if sorted(trl_default_rewards) != list(STALENESS_SEEDS):
        return None
    path = csv_path or os.path.join(os.path.dirname(HERE), STALENESS_CSV)
    with open(path) as f:
        (row,) = [r for r in csv.DictReader(f)
                  if r["variant"] == REFERENCE and r["max_staleness"] == str(MAX_STALENESS)]
    ref = [float(v) for v in row["per_seed"].split()]  # seeds 0-4 in order
    x = [trl_default_rewards[s] for s in STALENESS_SEEDS]
    out = stats.compare_paired(x, ref)
    return dict(seeds=list(STALENESS_SEEDS), **out, blocks=out["diff"] < 0 and out["p"] < mt.ALPHA)


def staleness_rewards(folder: str | None) -> dict[int, float]:
    """seed -> held-out reward of async_staleness.py's ``trl_default`` runs at ``MAX_STALENESS`` in ``folder``."""
    out = {}
    for seed in STALENESS_SEEDS:
        path = os.path.join(folder or "", f"{EQUIV_ARM}-s{MAX_STALENESS}-{seed}.json")
        if folder and os.path.exists(path):
            with open(path) as f:
                out[seed] = json.load(f)["eval_reward"]
    return out


def ladder(runs: list[dict], sigma: float = LADDER_SIGMA) -> dict | None:
    """Pre-registration 19's analysis (``RULES_19``): trl_default - trl_as_is at ``sigma`` on the family seeds both
    ran (paired t, sign-flip, TOST at ``EQUIV_MARGIN``), significant iff both p < ``mt.ALPHA``; the held-out mean and
    whether its sign holds. None before two paired seeds exist."""
    from experiments import stats

    x, ref = scores(runs, EQUIV_ARM, sigma, SEEDS), scores(runs, REFERENCE, sigma, SEEDS)
    paired = sorted(set(x) & set(ref))
    if len(paired) < 2:
        return None
    row = stats.compare_paired([x[s] for s in paired], [ref[s] for s in paired], margin=EQUIV_MARGIN)
    out = dict(sigma=sigma, seeds=paired, **row, significant=row["p"] < mt.ALPHA and row["p_sign_flip"] < mt.ALPHA)
    held = held_out_diffs(scores(runs, EQUIV_ARM, sigma, HELD_OUT), scores(runs, REFERENCE, sigma, HELD_OUT))
    out["held_out"] = held and dict(held, survives=same_sign(held, out))
    return out


def candidate_22(runs: list[dict]) -> dict | None:
    """Pre-registration 22's analysis (``RULES_22``): ``CANDIDATE_22`` - ``REFERENCE`` at ``SIGMA`` (significant iff
    positive with both p < ``mt.ALPHA``) and at ``COST_SIGMA`` (TOST at ``EQUIV_MARGIN``), the held-out mean at
    ``SIGMA`` (survives iff it keeps the sign), the seeds whose initial score differs from the reference's (rule 4)
    and the decision (rule 5). None before any pair exists."""
    from experiments import stats

    def at(arm, sigma, seeds):
        return {r["seed"]: r for r in runs if r["arm"] == arm and r["sigma"] == sigma and r["seed"] in seeds}

    out: dict = {}
    for key, sigma in (("gap", SIGMA), ("no_gap", COST_SIGMA)):
        x, ref = at(CANDIDATE_22, sigma, SEEDS), at(REFERENCE, sigma, SEEDS)
        paired = sorted(set(x) & set(ref))
        if len(paired) >= 2:
            row = stats.compare_paired([x[s]["score"] for s in paired], [ref[s]["score"] for s in paired],
                                       margin=EQUIV_MARGIN)
            out[key] = dict(sigma=sigma, seeds=paired, **row,
                            significant=row["diff"] > 0 and row["p"] < mt.ALPHA and row["p_sign_flip"] < mt.ALPHA,
                            equivalent=row["tost_p"] < mt.ALPHA and len(paired) == len(SEEDS))
    if not out:
        return None
    mismatch = []
    for sigma in (SIGMA, COST_SIGMA):
        x, ref = at(CANDIDATE_22, sigma, SEEDS + HELD_OUT), at(REFERENCE, sigma, SEEDS + HELD_OUT)
        mismatch += [(sigma, s) for s in sorted(set(x) & set(ref)) if x[s]["initial"] != ref[s]["initial"]]
    out["initial_mismatch"] = mismatch
    gap = out.get("gap")
    held = held_out_diffs(scores(runs, CANDIDATE_22, SIGMA, HELD_OUT), scores(runs, REFERENCE, SIGMA, HELD_OUT))
    out["held_out"] = held and gap and dict(held, survives=same_sign(held, gap))
    out["advise"] = bool(gap and gap["significant"] and out["held_out"] and out["held_out"]["survives"]
                         and out.get("no_gap") and out["no_gap"]["equivalent"])
    return out


def equivalence(runs: list[dict], staleness: dict[int, float] | None = None) -> dict | None:
    """Pre-registration 18's analysis (``RULES_18``): ``EQUIV_ARM`` - ``REFERENCE`` at ``EQUIV_SIGMA`` on the family
    seeds both ran (TOST at ``EQUIV_MARGIN``, paired t, sign-flip), the seeds whose initial scores differ (rule 2),
    the held-out mean difference, rule 5 on ``staleness`` (:func:`staleness_rewards`) and the decision (rule 4).
    None before any pair exists."""
    from experiments import stats

    def at(arm, seeds):
        return {r["seed"]: r for r in runs if r["arm"] == arm and r["sigma"] == EQUIV_SIGMA and r["seed"] in seeds}

    x, ref = at(EQUIV_ARM, SEEDS), at(REFERENCE, SEEDS)
    paired = sorted(set(x) & set(ref))
    if len(paired) < 2:
        return None
    row = stats.compare_paired([x[s]["score"] for s in paired], [ref[s]["score"] for s in paired], margin=EQUIV_MARGIN)
    hx, href = at(EQUIV_ARM, HELD_OUT), at(REFERENCE, HELD_OUT)
    every_x, every_ref = {**x, **hx}, {**ref, **href}
    out = dict(seeds=paired, **row, equivalent=row["tost_p"] < mt.ALPHA and len(paired) == len(SEEDS),
               different=row["p"] < mt.ALPHA and row["p_sign_flip"] < mt.ALPHA,
               initial_mismatch=[s for s in sorted(set(every_x) & set(every_ref))
                                 if every_x[s]["initial"] != every_ref[s]["initial"]])
    held = held_out_diffs({s: r["score"] for s, r in hx.items()}, {s: r["score"] for s, r in href.items()})
    out["held_out"] = held and dict(held, confirmed=held["complete"] and abs(held["mean"]) < EQUIV_MARGIN)
    out["staleness"] = staleness_check(staleness or {})
    out["change_default"] = bool(out["equivalent"] and out["held_out"] and out["held_out"]["confirmed"]
                                 and not out["initial_mismatch"] and out["staleness"] is not None
                                 and not out["staleness"]["blocks"])
    return out


RESULT_COLUMNS = ("arm", "seed", "sigma", "score", "initial", "final", "collapsed", "trl_kl_first", "trl_kl", "kl",
                  "k3_kl", "lag0_kl", "staleness_mean", "lag_mean", "dropped", "seconds")


def write_results(runs: list[dict], path: str) -> None:
    """One CSV row per run (``RESULT_COLUMNS``): the committed copy the docs' tables and the tests read."""
    import csv

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(RESULT_COLUMNS)
        for r in sorted(runs, key=lambda r: (r["sigma"], r["seed"], r["arm"])):
            w.writerow([r[c] for c in RESULT_COLUMNS])


def read_results(path: str) -> list[dict]:
    import csv

    with open(path) as f:
        rows = list(csv.DictReader(f))
    out = []
    for row in rows:
        r = {k: float(v) for k, v in row.items() if k not in ("arm", "seed", "collapsed")}
        out.append({**r, "arm": row["arm"], "seed": int(row["seed"]), "collapsed": row["collapsed"] == "True"})
    return out


def import_results(path: str, out: str) -> int:
    """Write each row of a committed results CSV (``write_results``) as a run JSON of ``out`` where that run has none
    (a later experiment pairs with committed runs; ``imported_from`` names the CSV). Returns how many it wrote."""
    written = 0
    for r in read_results(path):
        target = run_path(out, r["arm"], r["sigma"], r["seed"])
        if os.path.exists(target):
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as f:
            json.dump({**r, "imported_from": os.path.basename(path)}, f)
        written += 1
    return written


def report(out: str, staleness_dir: str | None = None) -> str:
    """analysis.md of ``out`` (and analysis.json, results.csv): pre-registration 17's and 18's rows, verdicts and the
    regime."""
    runs = load_runs(out)
    write_results(runs, os.path.join(out, "results.csv"))
    a = analyse(runs, staleness_rewards(staleness_dir))
    lines = ["# S4: TRL's asynchronous trainer, T = 257, a dense gap in vLLM (pre-registration 17)", "",
             "```", RULES, "```", "",
             "| comparison | seeds | mean (arm) | mean (ref) | arm - ref, paired 95% CI | p t (Holm) | "
             "p sign-flip (Holm) | TOST +-0.02 p | significant |", "|---|---|---|---|---|---|---|---|---|"]
    for r in a["family"]:
        lines.append(f"| {r['arm']} - {REFERENCE} (sigma {SIGMA:g}) | {len(r['seeds'])} | {r['mean']:.3f} | "
                     f"{r['ref_mean']:.3f} | {r['diff']:+.3f} [{r['diff_lo']:+.3f}, {r['diff_hi']:+.3f}] | "
                     f"{r['p']:.2g} ({r['p_holm']:.2g}) | {r['p_sign_flip']:.2g} ({r['p_sign_flip_holm']:.2g}) | "
                     f"{r['tost_p']:.2g} | {'yes' if r['significant'] else 'no'} |")
    for arm, h in a["held_out"].items():
        lines.append(f"\n({arm} - {REFERENCE}) " + held_out_line(h, "confirmed" if h["confirmed"] else "not confirmed"))
    c = a["cost"]
    lines.append("\nCost check (trl_as_is sigma 1 - sigma 0): " + (
        "not run." if c is None else f"{c['diff']:+.3f} [{c['diff_lo']:+.3f}, {c['diff_hi']:+.3f}], p t {c['p']:.2g}, "
        f"p sign-flip {c['p_sign_flip']:.2g} on {len(c['seeds'])} seeds: the gap "
        f"{'costs' if c['costs'] else 'shows no significant cost'}."))
    e = a["equivalence"]
    lines += section("Pre-registration 18: trl_default without the gap", RULES_18, e)
    if e is not None:
        lines.append(
            f"{paired_text(e, EQUIV_SIGMA)} (95%), 90% [{e['tost_lo']:+.3f}, {e['tost_hi']:+.3f}], TOST "
            f"+-{EQUIV_MARGIN:g} p {e['tost_p']:.2g}: {'equivalent' if e['equivalent'] else 'not shown equivalent'}; "
            f"p t {e['p']:.2g}, "
            f"p sign-flip {e['p_sign_flip']:.2g}{' (different by both tests)' if e['different'] else ''}.")
        if e["initial_mismatch"]:
            lines.append(f"Initial scores differ from the reference's on seeds {e['initial_mismatch']} (rule 2).")
        h = e["held_out"]
        if h:
            lines.append(held_out_line(h, "confirmed" if h["confirmed"] else "not confirmed"))
        c = e["staleness"]
        if c is not None:
            lines.append(f"Rule 5 (async_staleness.py, T <= 9, max_staleness {MAX_STALENESS}, seeds 0-4): "
                         f"{EQUIV_ARM} - {REFERENCE} {c['diff']:+.3f} [{c['diff_lo']:+.3f}, {c['diff_hi']:+.3f}], "
                         f"p t {c['p']:.2g}: {'blocks' if c['blocks'] else 'does not block'} the change.")
        lines.append(f"Decision (rule 4): the asynchronous default "
                     f"{'becomes trl_default' if e['change_default'] else 'stays ppo_is_bypass'}.")
    g = a["ladder"]
    lines += section("Pre-registration 19: the smaller gap (sigma 0.8)", RULES_19, g)
    if g is not None:
        lines.append(
            f"{paired_text(g, g['sigma'])}, p t {g['p']:.2g}, p sign-flip {g['p_sign_flip']:.2g}: "
            f"{'significant' if g['significant'] else 'not significant'}; TOST +-{EQUIV_MARGIN:g} p {g['tost_p']:.2g}.")
        h = g["held_out"]
        if h:
            lines.append(held_out_line(h, "survives" if h["survives"] else "does not survive"))
    c22 = a["candidate_22"]
    lines += section("Pre-registration 22: TRL's trust region plus TRL's sequence mask", RULES_22, c22)
    if c22 is not None:
        for key in ("gap", "no_gap"):
            r = c22.get(key)
            if r is None:
                lines.append(f"sigma {SIGMA if key == 'gap' else COST_SIGMA:g}: not run.")
                continue
            lines.append(
                f"{CANDIDATE_22} - {REFERENCE} at sigma {r['sigma']:g}, seeds {r['seeds'][0]}-{r['seeds'][-1]} "
                f"({len(r['seeds'])}): {r['mean']:.3f} vs {r['ref_mean']:.3f}, {r['diff']:+.3f} [{r['diff_lo']:+.3f}, "
                f"{r['diff_hi']:+.3f}], p t {r['p']:.2g}, p sign-flip {r['p_sign_flip']:.2g}, TOST +-{EQUIV_MARGIN:g} "
                f"p {r['tost_p']:.2g}: " + ("significant" if r["significant"] else "not significant") + ", "
                + ("equivalent" if r["equivalent"] else "not shown equivalent") + ".")
        if c22["initial_mismatch"]:
            lines.append(f"Initial scores differ from the reference's at (sigma, seed) {c22['initial_mismatch']} "
                         "(rule 4).")
        if c22["held_out"]:
            lines.append(held_out_line(c22["held_out"], "survives" if c22["held_out"]["survives"] else
                                       "does not survive"))
        lines.append("Decision (rule 5): " + ("the asynchronous advice names bypass_seq_mask's settings."
                                              if c22["advise"] else "nothing changes."))
    lines += ["", "TRL's kl is k3 of its ratio: pi_theta / pi_rollout in trl_as_is, pi_theta / pi_prox (= 0) in this "
              "package's decoupled arms, whose gap is rollout_corr/kl (k1 of KL(pi_rollout || pi_theta)).", "",
              "| arm | runs | score (mean, sd) | TRL kl at step 1 (lag 0) | TRL kl (run mean) | rollout_corr/kl | "
              "lag_0/kl | staleness at dequeue | lag at the loss | dropped | collapses | s per run |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, g in a["regime"].items():
        lines.append(f"| {name} | {g['n']} | {g['score']:.3f}, {g['score_sd']:.3f} | {g['trl_kl_first']:.2e} | "
                     f"{g['trl_kl']:.2e} | {g['kl']:.2e} | {g['lag0_kl']:.2e} | {g['staleness']:.2f} | {g['lag']:.2f} "
                     f"| {g['dropped']:.0f} | {g['collapsed']} | {g['seconds']:.0f} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "analysis.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "analysis.json"), "w") as f:
        json.dump(a, f, indent=1, default=float)
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default=",".join(FAMILY_ARMS))
    p.add_argument("--seeds", default="185-194")
    p.add_argument("--sigma", type=float, default=SIGMA)
    p.add_argument("--out", default="outputs/async_mismatch")
    p.add_argument("--base_dir", default=None, help="the folder whose base/ holds mismatch_train's base_n256_s400.pt "
                   "and its warm-ups (default: OUT)")
    p.add_argument("--report_only", action="store_true", help="write OUT/analysis.md from OUT/runs; runs nothing")
    p.add_argument("--staleness_dir", default=None, help="async_staleness.py's output folder holding the "
                   "trl_default runs of pre-registration 18's rule 5 (read by the analysis)")
    p.add_argument("--import_results", default=None, metavar="CSV", help="first add a committed results CSV's runs "
                   "to OUT/runs (pre-registration 18 pairs with pre-registration 17's sigma-0 runs)")
    p.add_argument("--smoke", action="store_true", help="the suite's version: a tiny model, T = 11, 2 steps")
    p.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)  # arm seed url model_dir out
    a = p.parse_args(argv)
    if a.import_results:
        print(f"{import_results(a.import_results, a.out)} runs imported from {a.import_results}", flush=True)
    if a.report_only:
        print(report(a.out, a.staleness_dir))
        return
    sz, steps = (smoke_size(), SMOKE_STEPS) if a.smoke else (size(), STEPS)
    base = mt.base_model_path(a.base_dir or a.out, sz["n_digits"], sz["base_steps"])  # .../base/base_n256_s400.pt
    if a.worker:
        arm, seed, url, model_dir, out = a.worker
        run_one(arm, int(seed), a.sigma, url, model_dir, base, out, sz, steps)
        return
    if a.smoke:
        mt.in_child(mt.build_base, a.out, sz, base)
    seeds = mt.parse_seeds(a.seeds)
    runs = [(arm, seed) for seed in seeds for arm in a.arms.split(",")]  # seed by seed: whole paired seeds
    from trl_rollout_corr.testing.psum_task import build_model  # the package first: its CPU-torch guard

    from experiments.logit_noise import SIGMA_ENV
    from experiments.server import free_port, running_server

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", SIGMA_ENV: str(a.sigma),
           # the server loads experiments.logit_noise: this checkout's root on its path (experiments/ is not installed)
           "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(HERE), os.environ.get("PYTHONPATH")]))}
    os.makedirs(a.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as model_dir:
        served_model(build_model(sz["hidden"], sz["layers"], seed=0, num_heads=sz["heads"],
                                 n_digits=sz["n_digits"])).save_pretrained(model_dir)
        chat_tokenizer(sz).save_pretrained(model_dir)
        cmd = [sys.executable, "-m", "trl_rollout_corr", "vllm-serve-async", model_dir, "--port", str(port),
               "--dtype", "float32", "--gpu-memory-utilization", "0.02", "--logits-processors",
               "experiments.logit_noise:GaussianLogitNoise"]
        with running_server(cmd, port, Path(a.out) / f"server_sigma{a.sigma:g}.log", env):
            for arm, seed in runs:
                out = run_path(a.out, arm, a.sigma, seed)
                if os.path.exists(out):
                    continue
                worker = [sys.executable, os.path.abspath(__file__), "--sigma", str(a.sigma), "--out", a.out,
                          "--base_dir", a.base_dir or a.out, *(["--smoke"] if a.smoke else []), "--worker", arm,
                          str(seed), url, model_dir, out]
                proc = subprocess.run(worker, env=env, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"{arm} seed {seed} failed:\n{proc.stderr[-3000:]}", file=sys.stderr, flush=True)
                    continue
                r = json.load(open(out))
                print(f"{arm:20s} sigma={a.sigma:g} seed={seed} score={r['score']:.3f} lag={r['lag_mean']:.2f} "
                      f"kl={r['kl']:.2e} trl_kl={r['trl_kl']:.2e} {r['seconds']:.0f}s", flush=True)
    print(report(a.out, a.staleness_dir))


if __name__ == "__main__":
    main()
