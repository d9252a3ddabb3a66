"""RolloutCorrectionMonitor: alerts once per episode, clean stop with a checkpoint, CSV/PNG, state across resume."""

import csv
import logging
import os

import pytest
from transformers import TrainerControl, TrainerState

from trainer_utils import make_trainer
from trl_rollout_corr import RolloutCorrectionMonitor
from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine


class Args:
    def __init__(self, output_dir, bypass=False):
        self.output_dir = str(output_dir)

        class RC:
            bypass_mode = bypass
        self.rollout_correction = RC()


def feed(monitor, args, rows):
    state, control = TrainerState(), TrainerControl()
    monitor.on_train_begin(args, state, control)
    fired = []
    for step, row in enumerate(rows, 1):
        state.global_step = step
        before = len(monitor.alerts)
        monitor.on_log(args, state, control, logs=row)
        fired.append([a["alert"] for a in monitor.alerts[before:]])
    return fired, control


def row(kl=0.0, k3=0.0, chi2=0.0, rejected=0.0, entropy=1.0, reward=0.5):
    return {"rollout_corr/kl": kl, "rollout_corr/k3_kl": k3, "rollout_corr/chi2_token": chi2,
            "rollout_corr/chi2_seq": 0.0, "rollout_corr/rejected_token_fraction": rejected,
            "entropy": entropy, "reward": reward}


def test_threshold_alerts_fire_once_per_episode_and_rearm(tmp_path):
    monitor = RolloutCorrectionMonitor(write_plot=False)
    fired, _ = feed(monitor, Args(tmp_path), [row(k3=0.1), row(k3=0.2), row(k3=0.0), row(k3=0.3, rejected=0.9)])
    assert fired == [["k3_kl"], [], [], ["k3_kl", "rejected_fraction"]]


def test_negative_kl_and_entropy_reward_trends(tmp_path):
    monitor = RolloutCorrectionMonitor(negative_kl_patience=3, trend_window=3, write_plot=False)
    rows = [row(kl=-0.01, entropy=1.0, reward=0.6), row(kl=-0.02, entropy=1.1, reward=0.5),
            row(kl=-0.01, entropy=1.3, reward=0.4)]
    fired, _ = feed(monitor, Args(tmp_path), rows)
    assert fired[:2] == [[], []] and sorted(fired[2]) == ["entropy_up_reward_down", "negative_kl"]


def test_bypass_under_persistent_mismatch_advises_a_decoupled_preset(tmp_path, caplog):
    rows = [row(kl=0.03)] * 3
    fired, _ = feed(RolloutCorrectionMonitor(bypass_patience=3, write_plot=False), Args(tmp_path, bypass=False), rows)
    assert fired == [[], [], []]  # a decoupled run is not warned
    monitor = RolloutCorrectionMonitor(bypass_patience=3, write_plot=False)
    with caplog.at_level(logging.WARNING):
        fired, _ = feed(monitor, Args(tmp_path, bypass=True), rows)
    assert fired == [[], [], ["bypass_persistent_mismatch"]]
    assert "decoupled_token_is" in caplog.text and "0.03" in caplog.text


def test_stop_on_a_chosen_alert_only(tmp_path):
    monitor = RolloutCorrectionMonitor(stop_on_alert=["rejected_fraction"], write_plot=False)
    fired, control = feed(monitor, Args(tmp_path), [row(k3=0.2)])
    assert fired == [["k3_kl"]] and not control.should_training_stop  # warned, not a stop reason
    fired, control = feed(monitor, Args(tmp_path), [row(k3=0.2, rejected=0.9)])
    assert control.should_training_stop and control.should_save


@pytest.mark.parametrize("kwargs,match", [({"k3_kl_threshold": -1}, "k3_kl_threshold"),
                                          ({"bypass_patience": 0}, "bypass_patience"),
                                          ({"stop_on_alert": ["k3"]}, "unknown alerts")])
def test_bad_monitor_settings_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutCorrectionMonitor(**kwargs)


def test_stop_leaves_a_checkpoint_csv_and_png_and_resume_does_not_rewarn(tmp_path, caplog):
    """A persistently mismatched (3-bit) sampler and a k3 threshold set very low: the run stops at step 1."""
    out = tmp_path / "run"

    def build(max_steps):
        monitor = RolloutCorrectionMonitor(k3_kl_threshold=1e-9, stop_on_alert=True)
        trainer, logs = make_trainer(out, preset="decoupled_token_is", max_steps=max_steps, callbacks=[monitor],
                                     rollout_sampler=EmulatedRolloutEngine("wq3"), save_strategy="no")
        return trainer, monitor, logs

    trainer, monitor, _ = build(6)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert trainer.state.global_step == 1
    assert [a["alert"] for a in monitor.alerts] == ["k3_kl"]
    checkpoint = out / "checkpoint-1"
    assert (checkpoint / "trainer_state.json").exists()
    assert (checkpoint / "rollout_correction_config.json").exists()
    with open(out / "rollout_corr_metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [float(r["step"]) for r in rows] == [1.0] and "rollout_corr/k3_kl" in rows[0]
    assert os.path.getsize(out / "rollout_corr_metrics.png") > 1000

    resumed, monitor2, _ = build(4)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4  # continued past the alert: the episode was already reported
    assert [a["alert"] for a in monitor2.alerts] == ["k3_kl"]  # restored history, nothing new
    assert "RolloutCorrectionMonitor [k3_kl]" not in caplog.text
    with open(out / "rollout_corr_metrics.csv") as fh:
        assert [float(r["step"]) for r in csv.DictReader(fh)] == [1.0, 2.0, 3.0, 4.0]
    assert monitor2.open_episodes == ["k3_kl"]  # the mismatch persists: still the same episode
