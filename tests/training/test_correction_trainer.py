"""The layer both trainers share (trl_rollout_corr.training.correction_trainer): counts by hand, the args check, and
that
neither trainer writes the shared part again."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer
from trl_rollout_corr.async_grpo import RolloutCorrAsyncGRPOConfig, RolloutCorrAsyncGRPOTrainer
from trl_rollout_corr.core.stats import RolloutStats
from trl_rollout_corr.training.correction_trainer import (ALL_REJECTED, CorrectionTrainerMixin, micro_batch_counts,
                                                 require_correction_config)

SHARED = ("_rc_freeze", "_rc_metrics", "save_model")


@pytest.mark.parametrize("trainer", [RolloutCorrGRPOTrainer, RolloutCorrAsyncGRPOTrainer])
def test_both_trainers_take_the_shared_layer_and_do_not_write_it_again(trainer):
    assert issubclass(trainer, CorrectionTrainerMixin)
    assert trainer.__mro__.index(CorrectionTrainerMixin) == 1  # before TRL's trainer: its save_model wraps TRL's
    assert not [name for name in SHARED if name in vars(trainer)]


def test_micro_batch_counts_by_hand():
    stats = RolloutStats()
    for n_kept, counted in ((torch.tensor(0.0), 1.0), (torch.tensor(3.0), 1.0), (torch.tensor(0.0), 0.0)):
        stats.update(micro_batch_counts(n_kept, counted))
    assert {k: float(v) for k, v in stats.sums.items()} == {"loss.empty_micro_batches": 1.0,
                                                            "loss.micro_batches": 2.0}


class _Host(CorrectionTrainerMixin):
    def __init__(self, main: bool) -> None:
        self.accelerator = SimpleNamespace(is_main_process=main)


def _rejecting_stats(empty: float, micro_batches: float) -> RolloutStats:
    return RolloutStats(sums={"loss.empty_micro_batches": torch.tensor(empty, dtype=torch.float64),
                              "loss.micro_batches": torch.tensor(micro_batches, dtype=torch.float64)})


def test_metrics_count_empty_micro_batches_and_warn_on_the_main_process_only(caplog):
    with caplog.at_level(logging.WARNING):
        assert _Host(True)._rc_metrics(_rejecting_stats(2.0, 5.0)) == {ALL_REJECTED: 2.0}
        assert "rejected every token of 2 of 5 micro-batches" in caplog.text
        assert CorrectionTrainerMixin._RC_ALL_REJECTED_REMEDY in caplog.text
        caplog.clear()
        assert _Host(False)._rc_metrics(_rejecting_stats(2.0, 5.0)) == {ALL_REJECTED: 2.0}
        assert _Host(True)._rc_metrics(_rejecting_stats(0.0, 5.0)) == {ALL_REJECTED: 0.0}
        assert _Host(True)._rc_metrics(RolloutStats()) == {}  # no loss counted: no count reported
    assert "rejected every token" not in caplog.text


@pytest.mark.parametrize("config, trainer, trl_name", [
    (RolloutCorrGRPOConfig, "RolloutCorrGRPOTrainer", "a GRPOConfig"),
    (RolloutCorrAsyncGRPOConfig, "RolloutCorrAsyncGRPOTrainer", "an AsyncGRPOConfig"),
])
def test_require_correction_config_names_the_fix(config, trainer, trl_name):
    with pytest.raises(TypeError, match=rf"{trainer} needs args={config.__name__}\(\.\.\.\) \({trl_name} subclass "
                                        rf".*got dict\. Replace .* by {config.__name__} with the same arguments"):
        require_correction_config({}, config, trainer)
