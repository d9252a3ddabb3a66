"""One SGD step per (case, split) under torchrun: the two-process half of tests/grpo/test_invariance.py.

Usage: torchrun --nproc_per_node 2 invariance_worker.py OUT.pt --cases a,b --splits 4x1,2x2,1x4
       accelerate launch --config_file DS.yaml invariance_worker.py OUT.pt --cases a --splits 4x1 --engine deepspeed

Each case of ``test_invariance.CASES`` runs one real ``train()`` step for every split (per-device batch x
gradient accumulation; the global generation batch is 8 samples over the two processes). Rank 0 saves
{case: {split: {"update": flat parameter update, "metrics": rollout_corr/* of the step, "world_size": n}}}.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

import sys
if not __package__:  # run as a script (a test's subprocess): the repo root on sys.path, for the tests.* imports
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.support.worker_exit import end_worker  # noqa: E402

from tests.grpo.test_invariance import CASES, one_sgd_step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--cases", required=True)
    parser.add_argument("--splits", default="4x1,2x2,1x4")
    parser.add_argument("--engine", default="ddp", choices=["ddp", "deepspeed", "fsdp"])
    opts = parser.parse_args()
    # DeepSpeed on CPU: gloo through accelerate (use_cpu=True would start no DeepSpeed engine); FSDP: GPUs only
    device = {"deepspeed": dict(use_cpu=False, ddp_backend="gloo"), "fsdp": dict(use_cpu=False)}.get(opts.engine, {})
    results: dict = {}
    root = tempfile.mkdtemp(prefix=f"invariance_rank{os.environ.get('RANK', '0')}_")
    for case in opts.cases.split(","):
        for split in opts.splits.split(","):
            per_device, accumulation = (int(x) for x in split.split("x"))
            trainer, update, log, forwards = one_sgd_step(os.path.join(root, f"{case}_{split}"), per_device,
                                                          accumulation, disable_tqdm=True, **device, **CASES[case])
            results.setdefault(case, {})[split] = {
                "update": update, "world_size": trainer.accelerator.num_processes, "no_grad_forwards": forwards,
                "grad_norm": log["grad_norm"], "distributed_type": str(trainer.accelerator.distributed_type),
                "at_generation": trainer.correction_plan.at_generation,
                "sharded": any(hasattr(p, "full_tensor") or hasattr(p, "ds_id") for p in trainer.model.parameters()),
                "metrics": {k: v for k, v in log.items() if k.startswith("rollout_corr/")}}
            if trainer.accelerator.is_main_process:
                torch.save(results, opts.out)
    end_worker()


if __name__ == "__main__":
    main()
