"""The ``trl-rollout-corr`` command."""

from __future__ import annotations

import argparse
import sys


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


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="trl-rollout-corr", description=__doc__)
    parser.add_argument("--tensor-demo", default="decoupled_seq_is_rs", help="preset to run on sample tensors")
    args = parser.parse_args(argv)
    tensor_demo(args.tensor_demo)


if __name__ == "__main__":
    main()
