"""The ``trl-rollout-corr`` command.

    trl-rollout-corr                         the main job, on CPU: measure a top_p 0.8 vLLM engine with the probe,
                                             place it on the verdict table, train TRL's default next to what the
                                             row recommends (top_p 1), watch the monitor, draw the curves
    trl-rollout-corr demo [--seeds ...]      the same, with options (see ``demo --help``, docs/demo.md)
    trl-rollout-corr demo --int8_diagnostics the short INT8-sampler diagnostics mode
    trl-rollout-corr train --config recipes/decoupled_token_is.yaml [--field value ...]
                                             train a model: every `trl grpo` argument (model, PEFT, quantization,
                                             datasets, --reward_funcs name|module.function, accelerate launch
                                             options), the correction fields, --rollout_corr_monitor true
                                             (see ``train --help``)
    trl-rollout-corr probe --config run.yaml [--probe_samples 256] [--probe_out DIR]
                                             before training: generate and score a few batches of your setup
                                             (same arguments as train) and report the engine/trainer mismatch
    trl-rollout-corr tensors [--preset NAME] the correction on sample tensors
    trl-rollout-corr recipes DIR             write the shipped recipes (presets, accelerate/DeepSpeed/FSDP configs)
                                             to DIR, their paths made absolute: usable from any directory
    trl-rollout-corr vllm-serve --model DIR [trl vllm-serve options]
                                             a vLLM server for vllm_mode="server" (CPU engines included)
    trl-rollout-corr vllm-serve-async MODEL [vllm serve options]
                                             the vLLM server of TRL's asynchronous GRPO trainer (CPU included)
"""

from __future__ import annotations

import sys


def tensor_demo(preset: str) -> None:
    """Run the correction on sample log-probs of a drifted sampler and print weights, mask and metrics."""
    import torch

    from .. import RolloutCorrectionConfig, compute_rollout_correction_and_rejection_mask

    cfg = RolloutCorrectionConfig.from_preset(preset)
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 8, generator=g) * 2 - 0.1  # (B, T) pi_old log-probs
    rollout = (old + 0.3 * torch.randn(4, 8, generator=g)).clamp(max=-1e-3)  # (B, T) pi_rollout
    mask = (torch.arange(8)[None] < torch.tensor([[8], [5], [3], [8]])).float()  # (B, T)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])  # (B,) M2PO's trust region, grad_share_*
    # every field of the config, as the trainer passes them (verl's divergence criteria, bounds, M2 included)
    w, m, metrics = compute_rollout_correction_and_rejection_mask(old, rollout, mask, advantages=advantages,
                                                                  **cfg.pipeline_kwargs())
    print(f"preset {preset}: {cfg.to_dict()}")
    print("IS weights:\n", w)
    print("modified response mask:\n", m)
    for k, v in metrics.items():
        print(f"{k:50s} {v: .6g}")


def parse_train_args(argv: list[str]):
    """(script_args, training_args, model_args, monitor_args, dataset_args) of ``train`` (strict)."""
    from .train import parse_train_args as parse

    return parse(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return
    command = argv[0] if argv and not argv[0].startswith("-") else "demo"
    rest = argv[1:] if argv and not argv[0].startswith("-") else argv
    if command == "demo":
        from ..demo import run_demo_cli

        run_demo_cli(rest)
    elif command == "demo-probe":  # the demo's probe worker (started by the demo; the probe lives in cli/)
        from ..demo.truncation import main as demo_worker
        from .probe import probe, write_report

        demo_worker(rest, probe_tools=(probe, write_report))
    elif command == "train":
        from .train import main as train

        train(rest)
    elif command == "probe":
        from .probe import main as probe

        probe(rest)
    elif command == "vllm-serve":
        from ..vllm.serve import main as serve

        serve(rest)
    elif command == "vllm-serve-async":
        from ..vllm.serve_async import main as serve_async

        serve_async(rest)
    elif command == "recipes":
        from .recipes import main as recipes

        recipes(rest)
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
