"""Tiny RolloutCorrGRPOTrainer runs on the real vLLM engine, one rank of a 2-process launch (tests/vllm/test_vllm.py).

Usage: python vllm_dist_worker.py OUT_PREFIX --model_dir DIR --mode server|colocate [--port P]
                                  --runs PRESET:SYNC_INTERVAL[,PRESET:SYNC_INTERVAL...]

Each run trains 3 steps (learning rate 1e-2, so the policy really moves) with the engine in float32 and its weights
synced every SYNC_INTERVAL optimizer steps. Every rank writes OUT_PREFIX.rank<r>.json: per run, the world size, the
steps its engine was synced at, the log-probs each of its own correction calls saw (pi_train, pi_rollout and the
loss mask of its samples: the test re-derives the global metrics from both ranks' rows), and on rank 0 the logs.
"""

from __future__ import annotations

import argparse
import json

from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer  # first: the package's CPU fixes
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from trl_rollout_corr.testing.toy_task import reverse_prompts  # noqa: E402


def length_reward(completions, **kwargs):
    """Varies within every group (the untrained model rarely reverses digits): the policy really moves."""
    return [len(completion) / 12.0 for completion in completions]


class RecordingTrainer(RolloutCorrGRPOTrainer):
    """Records what each correction call of this rank saw (its own samples only)."""

    recorded: list

    def _correction(self, train_logps, batch, loss_mask, support, mode):
        if mode == "train":
            self.recorded.append(dict(step=self.state.global_step, train=train_logps.double().tolist(),
                                      rollout=batch["sampling_per_token_logps"].double().tolist(),
                                      mask=loss_mask.tolist()))
        return super()._correction(train_logps, batch, loss_mask, support, mode)


class Collect(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def train_once(opts, preset: str, sync_interval: int, index: int) -> dict:
    engine = (dict(vllm_mode="server", vllm_server_host="127.0.0.1", vllm_server_port=opts.port,
                   vllm_server_timeout=60) if opts.mode == "server" else
              dict(vllm_mode="colocate", vllm_gpu_memory_utilization=0.01, vllm_dtype="float32"))
    args = RolloutCorrGRPOConfig(
        output_dir=f"{opts.out}.run{index}", per_device_train_batch_size=4, gradient_accumulation_steps=1,
        num_generations=4, max_completion_length=6, max_steps=3, learning_rate=1e-2, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=0, temperature=1.0,
        dataloader_num_workers=0, rollout_correction_preset=preset, use_vllm=True, vllm_sync_interval=sync_interval,
        **engine)
    collect = Collect()
    trainer = RecordingTrainer(model=opts.model_dir, reward_funcs=length_reward, args=args,
                               train_dataset=Dataset.from_dict({"prompt": reverse_prompts(64, n_digits=4)}),
                               callbacks=[collect])
    trainer.recorded = []
    trainer.train()
    return dict(preset=preset, sync_interval=sync_interval, world_size=trainer.accelerator.num_processes,
                rank=trainer.accelerator.process_index, distributed_type=str(trainer.accelerator.distributed_type),
                engine_dtype=getattr(trainer, "vllm_engine_dtype", None), sync_steps=trainer.vllm_sync_steps,
                recorded=trainer.recorded, logs=collect.logs if trainer.accelerator.is_main_process else None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--mode", choices=["server", "colocate"], required=True)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--runs", required=True)
    opts = parser.parse_args()
    results = []
    for index, run in enumerate(opts.runs.split(",")):
        preset, interval = run.split(":")
        results.append(train_once(opts, preset, int(interval), index))
    rank = results[0]["rank"]
    with open(f"{opts.out}.rank{rank}.json", "w") as fh:
        json.dump(results, fh)
    import torch.distributed as dist

    if opts.mode == "server" and dist.is_available() and dist.is_initialized():
        # tear gloo down before interpreter exit (see dist_worker.py); with colocated engines vLLM's own exit hook
        # does it (it destroys its groups, then the default one: destroying that first makes its hook fail)
        dist.barrier()
        dist.destroy_process_group()
    # then the interpreter exits normally: the package's exit hook (trl_rollout_corr/runtime/distributed_exit.py)
    # prevents the
    # teardown abort once seen here ("terminate called without an active exception") and the test checks rc == 0


if __name__ == "__main__":
    main()
