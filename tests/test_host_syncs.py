"""Host synchronizations: the correction adds at most one per optimizer step to what TRL's own trainer does.

The loss is TRL's own ``_compute_loss``, which reads its metrics (entropy, clip ratios, kl, ...) with ``.item()``
per micro-batch; those syncs are TRL's and are the same in both trainers. This package's own code syncs once per
log (all rollout_corr/* metrics in one transfer), nothing per micro-batch.
"""

import sys
from pathlib import Path

import pytest
from trl import GRPOConfig, GRPOTrainer

from test_rollout_func import build, make_rollout_func
from trl_rollout_corr.testing.toy_task import reverse_reward

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from profiling import count_host_syncs  # noqa: E402  (a measuring tool: it patches torch.Tensor while open)

STEPS = 4


def trl_syncs(trainer, tmp_path):
    """TRL's GRPOTrainer on the same model, data, rollouts and batch shape: its syncs, every caller."""
    a = trainer.args
    kwargs = dict(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=a.per_device_train_batch_size,
                  gradient_accumulation_steps=a.gradient_accumulation_steps, num_generations=a.num_generations,
                  max_completion_length=a.max_completion_length, max_steps=STEPS, learning_rate=a.learning_rate,
                  logging_steps=a.logging_steps, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
                  seed=a.seed, temperature=a.temperature, dataloader_num_workers=0, loss_type=a.loss_type,
                  vllm_importance_sampling_correction=False)
    theirs = GRPOTrainer(model=trainer.model, reward_funcs=reverse_reward, args=GRPOConfig(**kwargs),
                         train_dataset=trainer.train_dataset, processing_class=trainer.processing_class,
                         rollout_func=make_rollout_func())
    with count_host_syncs(everywhere=True) as syncs:
        theirs.train()
    return sum(syncs.values())


@pytest.mark.parametrize("preset", ["decoupled_seq_is_rs", "pg_rs"])
def test_at_most_one_host_sync_per_optimizer_step_over_trl(tmp_path, preset):
    trainer, logs = build(tmp_path, make_rollout_func(), preset)
    trainer.args.max_steps = STEPS
    trainer.args.logging_steps = 1
    with count_host_syncs(everywhere=True) as everything:
        trainer.train()
    ours = {site: n for site, n in everything.items() if not site.startswith("ext:")}
    steps = trainer.state.global_step
    assert steps == STEPS
    assert 0 < sum(ours.values()) <= steps, dict(ours)  # the one transfer per log, nothing per micro-batch
    assert all("stats.py" in site for site in ours), dict(ours)
    assert sum(everything.values()) <= trl_syncs(trainer, tmp_path) + steps, dict(everything)


def test_the_counter_sees_a_sync_in_package_code():
    import torch

    from trl_rollout_corr.core.stats import RolloutStats

    with count_host_syncs() as syncs:
        RolloutStats(sums={"a": torch.tensor(1.0)}).to_floats()
        torch.tensor(2.0).item()  # not package code: not counted
    assert sum(syncs.values()) == 1
    with count_host_syncs(everywhere=True) as syncs:
        torch.tensor(2.0).item()
    assert sum(syncs.values()) == 1
