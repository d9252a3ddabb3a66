"""The ``trl-rollout-corr`` command.

    trl-rollout-corr                         the embedded CPU demo (stale sampler: uncorrected vs corrected)
    trl-rollout-corr demo [--steps ...]      the same, with options (see ``demo --help``)
    trl-rollout-corr demo --int8_diagnostics the short INT8-sampler diagnostics mode
    trl-rollout-corr train --config recipes/decoupled_token_is.yaml [--field value ...]
                                             train a model (TrlParser: YAML config + command-line overrides;
                                             --rollout_corr_monitor true attaches RolloutCorrectionMonitor)
    trl-rollout-corr tensors [--preset NAME] the correction on sample tensors
    trl-rollout-corr vllm-serve --model DIR [trl vllm-serve options]
                                             a vLLM server for vllm_mode="server" (CPU engines included)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field


@dataclass
class ScriptArguments:
    """Model-independent arguments of ``trl-rollout-corr train``."""

    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset id or local path; none = the tiny reverse task."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset config name (e.g. 'main' for gsm8k)."})
    dataset_train_split: str = field(default="train")
    prompt_column: str = field(default="prompt", metadata={"help": "Column renamed to 'prompt' (e.g. 'question')."})
    reward: str = field(default="reverse", metadata={"help": "Reward function: reverse | math_answer."})
    rollout_engine: str | None = field(default=None, metadata={"help": "Emulated engine on the transformers path: stale | bf16 | fp16 | int8 | wq<N>."})
    rollout_engine_lag: int = field(default=4, metadata={"help": "Optimizer steps a stale engine lags behind."})


def tensor_demo(preset: str) -> None:
    """Run the correction on sample log-probs of a drifted sampler and print weights, mask and metrics."""
    import torch

    from . import RolloutCorrectionConfig, compute_rollout_correction_and_rejection_mask

    cfg = RolloutCorrectionConfig.from_preset(preset)
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 8, generator=g) * 2 - 0.1  # (B, T) pi_old log-probs
    rollout = (old + 0.3 * torch.randn(4, 8, generator=g)).clamp(max=-1e-3)  # (B, T) pi_rollout
    mask = (torch.arange(8)[None] < torch.tensor([[8], [5], [3], [8]])).float()  # (B, T)
    w, m, metrics = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is=cfg.rollout_is, rollout_is_threshold=cfg.rollout_is_threshold,
        rollout_rs=cfg.rollout_rs, rollout_rs_threshold=cfg.rollout_rs_threshold,
        rollout_rs_threshold_lower=cfg.rollout_rs_threshold_lower,
        rollout_token_veto_threshold=cfg.rollout_token_veto_threshold,
        rollout_is_batch_normalize=cfg.rollout_is_batch_normalize)
    print(f"preset {preset}: {cfg.to_dict()}")
    print("IS weights:\n", w)
    print("modified response mask:\n", m)
    for k, v in metrics.items():
        print(f"{k:50s} {v: .6g}")


def parse_train_args(argv: list[str]):
    from trl import ModelConfig, TrlParser

    from .monitor.args import MonitorArguments
    from .trainer import RolloutCorrGRPOConfig

    parser = TrlParser((ScriptArguments, RolloutCorrGRPOConfig, ModelConfig, MonitorArguments))
    return parser.parse_args_and_config(args=argv)


def train(argv: list[str]) -> None:
    script_args, training_args, model_args, monitor_args = parse_train_args(argv)[:4]
    if not model_args.model_name_or_path:
        from .demo import run_demo_cli

        print("No --model_name_or_path: running the embedded CPU demo instead.")
        run_demo_cli([])
        return
    from datasets import Dataset, load_dataset

    from .rewards import REWARDS
    from .rollout.emulated import EmulatedRolloutEngine
    from .demo.tiny import reverse_prompts
    from .trainer import RolloutCorrGRPOTrainer

    if script_args.reward not in REWARDS:
        raise ValueError(f"--reward {script_args.reward!r} is unknown; choose one of {sorted(REWARDS)}.")
    if script_args.dataset_name:
        dataset = load_dataset(script_args.dataset_name, script_args.dataset_config, split=script_args.dataset_train_split)
        if script_args.prompt_column != "prompt":
            dataset = dataset.rename_column(script_args.prompt_column, "prompt")
    else:
        dataset = Dataset.from_dict({"prompt": reverse_prompts(4096)})
    sampler = EmulatedRolloutEngine(script_args.rollout_engine, lag=script_args.rollout_engine_lag) \
        if script_args.rollout_engine else None
    monitor = monitor_args.build(script_args.rollout_engine, script_args.rollout_engine_lag)
    trainer = RolloutCorrGRPOTrainer(model=model_args.model_name_or_path, reward_funcs=REWARDS[script_args.reward],
                                     args=training_args, train_dataset=dataset, rollout_sampler=sampler,
                                     callbacks=[monitor] if monitor else None)
    trainer.train()
    trainer.save_model(training_args.output_dir)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and not argv[0].startswith("-") else "demo"
    rest = argv[1:] if argv and not argv[0].startswith("-") else argv
    if command in ("-h", "--help", "help"):
        print(__doc__)
    elif command == "demo":
        from .demo import run_demo_cli

        run_demo_cli(rest)
    elif command == "train":
        train(rest)
    elif command == "vllm-serve":
        from .vllm.serve import main as serve

        serve(rest)
    elif command == "tensors":
        import argparse

        p = argparse.ArgumentParser(prog="trl-rollout-corr tensors")
        p.add_argument("--preset", default="decoupled_seq_is_rs")
        tensor_demo(p.parse_args(rest).preset)
    else:
        print(__doc__)
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
