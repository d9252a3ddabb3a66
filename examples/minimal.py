"""Minimal Trainer-style script: GRPO with rollout correction on a tiny local model (CPU, seconds).

The engine samples with 4-bit weights (an emulated engine: a persistent gap, no staleness) and the trainer runs TRL's
default correction (no preset: TRL 1.16's own sequence_mask, C = 3), the verdict table's advice for a synchronous
engine (README, docs/evidence.md). Set ``rollout_correction_preset`` only where ``trl-rollout-corr probe`` places your
run on another row (docs/probe.md).
"""

import sys

from datasets import Dataset

from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer
from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine
from trl_rollout_corr.testing.toy_task import build_model, build_tokenizer, reverse_prompts, reverse_reward

args = RolloutCorrGRPOConfig(
    output_dir=sys.argv[1] if len(sys.argv) > 1 else "outputs/minimal",
    # no rollout_correction_preset: TRL's default correction (a preset, or rollout_* fields, would replace it)
    per_device_train_batch_size=16, num_generations=4, max_completion_length=8, max_steps=3,
    learning_rate=1e-3, logging_steps=1, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
)
trainer = RolloutCorrGRPOTrainer(
    model=build_model(hidden_size=32),
    reward_funcs=reverse_reward,
    args=args,
    train_dataset=Dataset.from_dict({"prompt": reverse_prompts(64, n_digits=4)}),
    processing_class=build_tokenizer(),
    rollout_sampler=EmulatedRolloutEngine("wq4"),  # 4-bit weights; omit to sample with the policy itself
)
trainer.train()
print({k: v for k, v in trainer.state.log_history[-2].items() if k.startswith("rollout_corr/k")})
