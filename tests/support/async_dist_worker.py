"""One RolloutCorrAsyncGRPOTrainer run on a fixed rollout queue, launched by tests/async_grpo/test_async_correction.py
under torchrun. Usage: python async_dist_worker.py OUT_JSON MODEL_DIR PRESET PER_DEVICE

Every process builds the same queue (only rank 0's is read: TRL dispatches the micro-batch); rank 0 writes the logged
metrics, the world size seen inside the run and the final parameters."""

from __future__ import annotations

import trl_rollout_corr  # noqa: F401

import json
import os
import sys
import tempfile

import torch

if not __package__:  # run as a script (a test's subprocess): the repo root on sys.path, for the tests.* imports
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.support.worker_exit import end_worker  # noqa: E402

from tests.support.async_stub import build_trainer, make_samples  # noqa: E402


def main() -> None:
    out, model_dir, preset, per_device = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    samples = make_samples(model_dir, n_groups=6, noise=0.4, seed=11)
    trainer, _ = build_trainer(model_dir, samples, tempfile.mkdtemp(), max_steps=2,
                               per_device_train_batch_size=per_device, rollout_correction_preset=preset,
                               rollout_is_batch_normalize=True, learning_rate=1e-2,
                               optim="sgd")  # SGD: the update is lr x the gradient (Adam would amplify float noise)
    trainer.train()
    if trainer.accelerator.is_main_process:
        keep = ("loss", "grad_norm")
        logs = [{k: v for k, v in log.items() if k.startswith("rollout_corr/") or k in keep}
                for log in trainer.state.log_history if "loss" in log]
        model = trainer.accelerator.unwrap_model(trainer.model)
        params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
        with open(out, "w") as f:
            json.dump({"world_size": trainer.accelerator.num_processes, "logs": logs, "params": params}, f)
    end_worker()


if __name__ == "__main__":
    main()
