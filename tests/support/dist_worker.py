"""One tiny RolloutCorrGRPOTrainer run, launched by tests/grpo/test_distributed.py under torchrun / accelerate launch.

Usage: python dist_worker.py OUT_JSON [--engine ddp|deepspeed] [--rollout fixed|generate] [--per_device B]
                             [--preset P] [--correction JSON] [--max_steps N] [--num_iterations N]

``--rollout fixed`` feeds completions and pi_rollout log-probs that are a pure function of the prompt (a
``rollout_func``), so a 1-process and a 2-process run see the same global batch. ``--rollout generate`` samples
with ``model.generate`` through a stale emulated engine (a full copy of the policy, gathered under ZeRO-3).
Rank 0 writes the logs, the world size and whether the parameters were really sharded to OUT_JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import zlib

import torch

import sys
if not __package__:  # run as a script (a test's subprocess): the repo root on sys.path, for the tests.* imports
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.support.worker_exit import end_worker  # noqa: E402
from datasets import Dataset

from tests.support.trainer_utils import count_policy_forwards
from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer
from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine
from trl_rollout_corr.testing.toy_task import build_model, build_tokenizer, reverse_prompts, reverse_reward

GLOBAL_BATCH = 16
NUM_GENERATIONS = 4
COMPLETION_LEN = 6


def fixed_rollout_func(tokenizer):
    """Completions and log-probs seeded by (prompt, copy index): identical whatever the world size."""
    def rollout_func(prompts, trainer):
        seen: dict[str, int] = {}
        prompt_ids, completion_ids, logprobs = [], [], []
        for prompt in prompts:
            copy_index = seen.get(prompt, 0)
            seen[prompt] = copy_index + 1
            gen = torch.Generator().manual_seed(zlib.crc32(f"{prompt}|{copy_index}".encode()))
            length = int(torch.randint(1, COMPLETION_LEN + 1, (1,), generator=gen))
            ids = torch.randint(4, 14, (length,), generator=gen).tolist()  # digit tokens
            lps = (-0.2 - 4.0 * torch.rand(length, generator=gen, dtype=torch.float64)).tolist()
            prompt_ids.append(tokenizer(prompt)["input_ids"])
            completion_ids.append(ids)
            logprobs.append(lps)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}
    return rollout_func


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--engine", default="ddp", choices=["ddp", "deepspeed"])
    parser.add_argument("--rollout", default="fixed", choices=["fixed", "generate"])
    parser.add_argument("--per_device", type=int, default=GLOBAL_BATCH)
    parser.add_argument("--preset", default=None)
    parser.add_argument("--correction", default="{}", help="JSON dict of rollout_* fields")
    parser.add_argument("--max_steps", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--num_iterations", type=int, default=1)
    parser.add_argument("--stopping_monitor", action="store_true",
                        help="attach a stopping RolloutCorrectionMonitor; every rank writes its alerts to OUT.rank<r>")
    parser.add_argument("--tied", action="store_true", help="tie the LM head to the input embeddings (Qwen2.5-0.5B)")
    parser.add_argument("--top_p", type=float, default=1.0, help="< 1: a truncating sampler (the kept-mass probe)")
    opts = parser.parse_args()

    tokenizer = build_tokenizer()
    model = build_model(hidden_size=32, seed=0)
    if opts.tied:  # the head is the embedding matrix: under ZeRO-3 it is gathered through embed_tokens
        from transformers import Qwen2ForCausalLM

        model.config.tie_word_embeddings = True
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(model.config)
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    device_kwargs = dict(use_cpu=True) if opts.engine == "ddp" else dict(use_cpu=False, ddp_backend="gloo")
    args = RolloutCorrGRPOConfig(
        output_dir=os.path.join(os.path.dirname(opts.out), "run"), per_device_train_batch_size=opts.per_device,
        gradient_accumulation_steps=1, num_generations=NUM_GENERATIONS, max_completion_length=COMPLETION_LEN,
        max_steps=opts.max_steps, learning_rate=opts.learning_rate, num_iterations=opts.num_iterations, logging_steps=1,
        save_strategy="no", report_to="none", top_p=opts.top_p,
        bf16=False, seed=0, temperature=1.0, dataloader_num_workers=0, rollout_correction_preset=opts.preset,
        **device_kwargs, **json.loads(opts.correction))
    sampler = EmulatedRolloutEngine("stale", lag=1) if opts.rollout == "generate" else None
    rollout_func = fixed_rollout_func(tokenizer) if opts.rollout == "fixed" else None
    collected: list[dict] = []

    from transformers import TrainerCallback

    class Collect(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            collected.append(dict(logs or {}))

    callbacks = [Collect()]
    if opts.stopping_monitor:
        from trl_rollout_corr import RolloutCorrectionMonitor

        monitor = RolloutCorrectionMonitor(warmup_steps=0, patience_steps=1, stop_on_alert=True, write_plot=False)
        callbacks.append(monitor)
    trainer = RolloutCorrGRPOTrainer(
        model=model, reward_funcs=reverse_reward, args=args,
        train_dataset=Dataset.from_dict({"prompt": reverse_prompts(64, n_digits=4)}), processing_class=tokenizer,
        rollout_func=rollout_func, rollout_sampler=sampler, callbacks=callbacks)
    forwards = count_policy_forwards(trainer.model)
    trainer.train()

    params = list(trainer.model.parameters())
    result = {
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage
        if trainer.accelerator.state.deepspeed_plugin is not None else None,
        "local_param_numel": sum(p.numel() for p in params),
        "full_param_numel": sum(getattr(p, "ds_numel", p.numel()) for p in params),
        "rollout_forward_calls": forwards["no_grad"],  # real no-grad forwards of the policy (pi_old)
        "logs": collected,
        "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
    }
    if trainer.accelerator.is_main_process:
        with open(opts.out, "w") as fh:
            json.dump(result, fh)
    if opts.stopping_monitor:  # every rank: what its own monitor decided
        with open(f"{opts.out}.rank{trainer.accelerator.process_index}", "w") as fh:
            json.dump({"alerts": [(a["step"], a["alert"]) for a in monitor.alerts],
                       "stopped_at": trainer.state.global_step}, fh)
    end_worker()


if __name__ == "__main__":
    main()
