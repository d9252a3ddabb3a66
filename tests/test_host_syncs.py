"""The correction and its metrics request at most one host synchronization per optimizer step."""

import pytest

from test_rollout_func import build, make_rollout_func
from trl_rollout_corr.profiling import count_host_syncs


@pytest.mark.parametrize("preset", ["decoupled_seq_is_rs", "pg_rs"])
def test_at_most_one_host_sync_per_optimizer_step(tmp_path, preset):
    trainer, logs = build(tmp_path, make_rollout_func(), preset)
    trainer.args.max_steps = 4
    trainer.args.logging_steps = 1
    with count_host_syncs() as syncs:
        trainer.train()
    steps = trainer.state.global_step
    assert steps == 4
    assert 0 < sum(syncs.values()) <= steps, dict(syncs)  # the one transfer per log, nothing per micro-batch
    assert all("stats.py" in site for site in syncs), dict(syncs)


def test_the_counter_sees_a_sync_in_package_code():
    import torch

    from trl_rollout_corr.core.stats import RolloutStats

    with count_host_syncs() as syncs:
        RolloutStats(sums={"a": torch.tensor(1.0)}).to_floats()
        torch.tensor(2.0).item()  # not package code: not counted
    assert sum(syncs.values()) == 1
