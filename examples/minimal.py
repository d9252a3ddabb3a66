"""Minimal Trainer-style script: GRPO with rollout correction on a tiny local model (CPU, seconds)."""

import sys

from datasets import Dataset

from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer
from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine
from trl_rollout_corr.testing.toy_task import build_model, build_tokenizer, reverse_prompts, reverse_reward

args = RolloutCorrGRPOConfig(
    output_dir=sys.argv[1] if len(sys.argv) > 1 else "outputs/minimal",
    rollout_correction_preset="decoupled_token_is",  # or any preset; rollout_* fields override it
    per_device_train_batch_size=16, num_generations=4, max_completion_length=8, max_steps=3,
    learning_rate=1e-3, logging_steps=1, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
)
trainer = RolloutCorrGRPOTrainer(
    model=build_model(hidden_size=32),
    reward_funcs=reverse_reward,
    args=args,
    train_dataset=Dataset.from_dict({"prompt": reverse_prompts(64, n_digits=4)}),
    processing_class=build_tokenizer(),
    rollout_sampler=EmulatedRolloutEngine("stale", lag=1),  # omit to sample with the policy itself
)
trainer.train()
print({k: v for k, v in trainer.state.log_history[-2].items() if k.startswith("rollout_corr/k")})
