"""A run killed (SIGKILL) right after a checkpoint and resumed from it trains as the uninterrupted run: the same
rollout_corr/* metrics and parameters (CPU runs are deterministic), the emulated stale engine's lag schedule
continuing from the saved snapshots, the monitor's state carried over, the correction compared; the vLLM sync
schedule's resume rule by hand. (The asynchronous trainer's policy versions across a resume:
tests/async_grpo/test_async_cpu.py, against the real server, where TRL restores them.)"""

from __future__ import annotations

import trl_rollout_corr  # noqa: F401  (first: its CPU-torch guard)

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trl_rollout_corr.training.resume import STATE_NAME, correction_changes, vllm_weights_lost_at_resume

HERE = Path(__file__).resolve().parents[1]


def worker(out_dir: Path, *flags: str) -> subprocess.Popen:
    # this checkout's package and its tests.support helpers first (not whatever copy the environment has installed);
    # tests/ itself stays off the path (its folders vllm/, benchmarks/ and experiments/ would shadow those packages)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
    return subprocess.Popen([sys.executable, str(HERE / "support" / "resume_worker.py"), str(out_dir),
                             str(out_dir / "result.json"),
                             *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen) -> tuple[int, str]:
    output, _ = process.communicate(timeout=600)
    return process.returncode, output


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    full, crashed = worker(root / "full"), worker(root / "crashed", "--kill_after_save", "2")
    (full_rc, full_out), (crashed_rc, crashed_out) = finish(full), finish(crashed)
    assert full_rc == 0, full_out[-3000:]
    assert crashed_rc == -signal.SIGKILL, crashed_out[-3000:]
    assert not (root / "crashed" / "result.json").exists()  # it died before the end
    checkpoint = root / "crashed" / "checkpoint-2"
    resumed_rc, resumed_out = finish(worker(root / "resumed", "--resume", str(checkpoint)))
    assert resumed_rc == 0, resumed_out[-3000:]
    read = lambda name: json.loads((root / name / "result.json").read_text())  # noqa: E731
    return {"full": read("full"), "resumed": read("resumed"), "root": root, "checkpoint": checkpoint,
            "resumed_output": resumed_out}


def test_a_killed_and_resumed_run_equals_the_uninterrupted_one(runs):
    full, resumed = runs["full"]["steps"], runs["resumed"]["steps"]
    assert sorted(resumed) == ["3", "4"]
    assert full["3"]["rollout_corr/k3_kl"] > 1e-3  # the stale engine really lags (a resume at lag 0 would show ~0)
    for step in ("3", "4"):
        diffs = {k: (v, resumed[step].get(k)) for k, v in full[step].items()
                 if resumed[step].get(k) != pytest.approx(v, rel=1e-5, abs=1e-7)}
        assert not diffs, (step, diffs)
    params_full = torch.load(runs["root"] / "full" / "params.pt")
    params_resumed = torch.load(runs["root"] / "resumed" / "params.pt")
    assert all(torch.allclose(params_full[k], params_resumed[k], rtol=1e-5, atol=1e-7) for k in params_full)


def test_the_stale_engine_the_monitor_and_the_correction_continue(runs):
    full, resumed = runs["full"], runs["resumed"]
    assert (runs["checkpoint"] / STATE_NAME).exists()
    assert resumed["snapshot_steps"] == full["snapshot_steps"]
    # the engine's state is in checkpoints only: the final save_model (what a user pushes) does not carry it
    assert (runs["root"] / "full" / "checkpoint-4" / STATE_NAME).exists()
    assert not (runs["root"] / "full" / STATE_NAME).exists()
    assert resumed["monitor"] == full["monitor"]
    assert resumed["correction"] == full["correction"]
    assert "other than the checkpoint's" not in runs["resumed_output"]
    assert "no rollout engine state" not in runs["resumed_output"]


def test_a_changed_correction_is_named_at_resume_and_the_same_one_is_quiet(runs, tmp_path, caplog):
    from tests.support.trainer_utils import make_trainer
    from trl_rollout_corr.training.resume import restore_rollout_state

    for preset, speaks in (("decoupled_token_is", False), ("ppo_is_bypass", True)):
        trainer, _ = make_trainer(tmp_path / preset, preset=preset)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trl_rollout_corr.training.resume"):
            restore_rollout_state(trainer, str(runs["checkpoint"]))
        assert ("bypass_mode: False -> True" in caplog.text) is speaks, caplog.text


def test_an_engine_other_than_the_checkpoint_s_is_refused(runs, tmp_path):
    from tests.support.trainer_utils import make_trainer
    from trl_rollout_corr.training.resume import restore_rollout_state
    from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine

    trainer, _ = make_trainer(tmp_path, preset="decoupled_token_is", rollout_sampler=EmulatedRolloutEngine("stale", 4))
    with pytest.raises(ValueError, match="resume with the engine the checkpoint was trained with"):
        restore_rollout_state(trainer, str(runs["checkpoint"]))


@pytest.mark.parametrize("history,step,interval,lost", [
    ([0, 8], 16, 8, False),     # the uninterrupted run syncs at 16 too
    ([0, 8], 10, 8, True),      # it would keep step 8's weights, which are not saved
    ([0, 1, 2], 3, 1, False),   # every step (TRL's default)
    ([], 4, 8, False),          # nothing synced yet
])
def test_which_resumes_lose_the_vllm_engine_s_weights(history, step, interval, lost):
    assert vllm_weights_lost_at_resume(history, step, interval) is lost


def test_a_resumed_vllm_sync_schedule_keeps_its_phase(tmp_path):
    """The schedule itself (vllm.engine) across a resume at step 10 with interval 8: the uninterrupted run syncs at
    0, 8, 16, 24; the resumed one loads the checkpoint's weights once at 10 and then syncs at 16, 24 as well."""
    from types import SimpleNamespace

    from trl_rollout_corr.training.resume import restore_rollout_state, save_rollout_state
    from trl_rollout_corr.vllm.engine import _install_sync_schedule

    def fake_trainer():
        engine_loads = []
        trainer = SimpleNamespace(state=SimpleNamespace(global_step=0), use_vllm=True, rollout_sampler=None,
                                  args=SimpleNamespace(vllm_sync_interval=8),
                                  accelerator=SimpleNamespace(is_main_process=True),
                                  vllm_generation=SimpleNamespace(mode="colocate", sync_weights=None))
        trainer.vllm_generation.sync_weights = lambda: engine_loads.append(trainer.state.global_step)
        _install_sync_schedule(trainer, 8)
        return trainer, engine_loads

    def run(trainer, steps):
        for step in steps:
            trainer.state.global_step = step
            trainer.vllm_generation.sync_weights()  # TRL calls it before each step's generation

    full, full_loads = fake_trainer()
    run(full, range(0, 26))
    part, _ = fake_trainer()
    run(part, range(0, 10))
    checkpoint = tmp_path / "checkpoint-10"
    checkpoint.mkdir()
    save_rollout_state(str(checkpoint), None, part.vllm_sync_steps)
    (checkpoint / "trainer_state.json").write_text('{"global_step": 10}')
    resumed, resumed_loads = fake_trainer()
    restore_rollout_state(resumed, str(checkpoint))
    run(resumed, range(10, 26))
    assert full_loads == [0, 8, 16, 24]
    assert resumed_loads == [10, 16, 24] and resumed.vllm_sync_steps == [0, 8, 16, 24]


def test_correction_changes_by_hand():
    assert correction_changes({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": None}) == {"b": (2, 3)}
