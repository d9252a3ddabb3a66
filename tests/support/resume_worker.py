"""One tiny RolloutCorrGRPOTrainer run on the emulated stale engine, with the monitor, launched by
tests/training/test_resume.py: uninterrupted, SIGKILLed right after a checkpoint, or resumed from one.

Usage: python resume_worker.py OUT_DIR RESULT_JSON [--max_steps N] [--kill_after_save STEP] [--resume CHECKPOINT]

Writes RESULT_JSON (the rollout_corr/* metrics per step, the loss, the monitor's state, the engine's snapshot steps)
and OUT_DIR/params.pt (the final parameters); a killed run writes nothing but its checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
from transformers import TrainerCallback

import sys
if not __package__:  # run as a script (a test's subprocess): the repo root on sys.path, for the tests.* imports
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.support.trainer_utils import make_trainer
from trl_rollout_corr import RolloutCorrectionMonitor
from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine

LAG = 2


class KillAfterSave(TrainerCallback):
    """SIGKILL this process once the checkpoint of ``step`` is on disk (no cleanup, as an OOM kill or a preemption)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("result")
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--kill_after_save", type=int, default=None)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    monitor = RolloutCorrectionMonitor(warmup_steps=0, smoothing_steps=1, patience_steps=1, rollout_lag=LAG,
                                       write_csv=False, write_plot=False)
    callbacks = [monitor] + ([KillAfterSave(args.kill_after_save)] if args.kill_after_save else [])
    engine = EmulatedRolloutEngine("stale", lag=LAG)
    trainer, logs = make_trainer(args.out_dir, preset="decoupled_token_is", max_steps=args.max_steps,
                                 callbacks=callbacks, rollout_sampler=engine, learning_rate=2e-2,
                                 save_strategy="steps", save_steps=2)
    trainer.train(resume_from_checkpoint=args.resume)
    trainer.save_model()  # the final save: the model and its config, not the engine's state (checkpoints only)
    steps = {}
    for entry in logs.logs:
        if "loss" in entry:
            steps[int(round(entry["epoch"] * 32))] = {k: v for k, v in entry.items()
                                                      if k.startswith("rollout_corr/") or k in ("loss", "reward")}
    torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
               os.path.join(args.out_dir, "params.pt"))
    with open(args.result, "w") as f:
        json.dump({"steps": steps, "monitor": monitor.state()["attributes"],
                   "snapshot_steps": [step for step, _ in engine.state_dict()["snapshots"]],
                   "correction": trainer.rollout_correction.to_dict()}, f, default=str)


if __name__ == "__main__":
    main()
