"""GSM8K-style GRPO with rollout correction on a GPU, sampling with vLLM (colocate).

    accelerate launch examples/gsm8k_vllm.py                          # TRL's default correction
    accelerate launch examples/gsm8k_vllm.py --preset ppo_is_bypass   # only where the probe places the run on that row

It runs TRL's default correction (no preset: TRL 1.16's own sequence_mask, C = 3), the verdict table's default row
(README, docs/evidence.md): no correction was measured to train better there (T 49-257, per-token KL 1e-3-1.3e-2, a
465k-parameter model on a CPU; not measured on a GPU). Measure your own regime first (``trl-rollout-corr probe``,
docs/probe.md); ``--preset`` names another preset where the probe's row says so.

vLLM returns each sampled token's processed log-prob; TRL hands them over as ``sampling_per_token_logps``
and RolloutCorrGRPOTrainer corrects with them: with no preset it applies TRL's own default correction, once (TRL's
vllm_importance_sampling_* fields read False / None after construction, so TRL's code does not apply it a second time;
docs/trainer.md, "TRL's own correction, and the default").
"""

import argparse

from datasets import load_dataset

from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer
from trl_rollout_corr.cli.rewards import math_answer_reward

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
parser.add_argument("--preset", default=None, help="a rollout correction preset (default: TRL's own correction)")
parser.add_argument("--output_dir", default="outputs/gsm8k")
cli = parser.parse_args()

dataset = load_dataset("openai/gsm8k", "main", split="train").rename_column("question", "prompt")
args = RolloutCorrGRPOConfig(
    output_dir=cli.output_dir,
    rollout_correction_preset=cli.preset,
    use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
    bf16=True, per_device_train_batch_size=8, gradient_accumulation_steps=4, num_generations=8,
    max_completion_length=512, learning_rate=1e-6, max_steps=500, logging_steps=10, report_to="none",
)
trainer = RolloutCorrGRPOTrainer(model=cli.model, reward_funcs=math_answer_reward, args=args, train_dataset=dataset)
trainer.train()
trainer.save_model(cli.output_dir)  # also writes rollout_correction_config.json next to the weights
