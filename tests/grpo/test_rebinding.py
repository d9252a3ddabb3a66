"""A rebound ``trl.GRPOTrainer`` (a library patching TRL in place, a test harness, this package's class swapped into
TRL's namespace) changes nothing: every check of TRL's internals reads the class the trainer really inherits from.

Each case rebinds TRL's public names the way a patching library does (``trl``, ``trl.trainer`` and the defining
module), then trains the package's trainer a step and checks that the correction ran.
"""

from __future__ import annotations

import trl_rollout_corr  # noqa: F401  (first: its CPU-torch guard)

import os

import pytest
import trl
import trl.trainer
import trl.trainer.grpo_trainer as grpo_module
from trl import GRPOConfig, GRPOTrainer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from tests.support.trainer_utils import make_trainer  # noqa: E402
from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer  # noqa: E402
from trl_rollout_corr.trl_hooks.grpo import forward_input_names  # noqa: E402


class PatchedGRPOTrainer(GRPOTrainer):
    """What a patching library installs: TRL's methods wrapped, with signatures and sources of its own."""

    def _generate(self, prompts):
        result = super()._generate(prompts)
        return result

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    def _compute_loss(self, model, inputs):
        return super()._compute_loss(model, inputs)


class PatchedGRPOConfig(GRPOConfig):
    pass


def rebind(monkeypatch, modules, names: dict) -> None:
    for module in modules:
        for name, value in names.items():
            monkeypatch.setattr(module, name, value)


@pytest.mark.parametrize("rebound_to", ["this package's classes", "a patching library's subclasses"])
def test_the_trainer_trains_with_trl_grpo_trainer_rebound(tmp_path, monkeypatch, rebound_to):
    pair = ((RolloutCorrGRPOTrainer, RolloutCorrGRPOConfig) if rebound_to.startswith("this")
            else (PatchedGRPOTrainer, PatchedGRPOConfig))
    rebind(monkeypatch, (trl, trl.trainer, grpo_module), {"GRPOTrainer": pair[0], "GRPOConfig": pair[1]})
    assert trl.GRPOTrainer is pair[0]
    # what the checks read is TRL's own method, whatever the public name points at
    assert "pixel_values" in forward_input_names(RolloutCorrGRPOTrainer)
    trainer, logs = make_trainer(tmp_path, preset="decoupled_token_is", max_steps=1, loss_type="dapo")
    trainer.train()
    assert any("rollout_corr/rollout_is_mean" in entry for entry in logs.logs)


@pytest.mark.parametrize("rebound_to", ["this package's classes", "a patching library's subclasses"])
def test_the_async_trainer_trains_with_trl_async_grpo_trainer_rebound(tmp_path, monkeypatch, rebound_to):
    import trl.experimental.async_grpo as async_package
    import trl.experimental.async_grpo.async_grpo_trainer as async_module
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from tests.support.async_stub import build_model_dir, build_trainer, make_samples
    from trl_rollout_corr import RolloutCorrAsyncGRPOConfig, RolloutCorrAsyncGRPOTrainer

    class PatchedAsyncGRPOTrainer(AsyncGRPOTrainer):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    class PatchedAsyncGRPOConfig(AsyncGRPOConfig):
        pass

    pair = ((RolloutCorrAsyncGRPOTrainer, RolloutCorrAsyncGRPOConfig) if rebound_to.startswith("this")
            else (PatchedAsyncGRPOTrainer, PatchedAsyncGRPOConfig))
    rebind(monkeypatch, (async_package, async_module), {"AsyncGRPOTrainer": pair[0], "AsyncGRPOConfig": pair[1]})
    model_dir = build_model_dir(str(tmp_path / "model"))
    trainer, _ = build_trainer(model_dir, make_samples(model_dir, n_groups=2, noise=0.3), str(tmp_path / "run"),
                               max_steps=1, rollout_correction_preset="decoupled_token_is", bypass_mode=False)
    trainer.train()
    assert "rollout_corr/rollout_is_mean" in trainer.state.log_history[0]
