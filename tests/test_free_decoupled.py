"""Free decoupled (issue 13): when pi_old = pi_theta at every loss, decoupled presets skip the pi_old forward.

Where both scopes agree (one micro-batch per generation batch, one process), the loss, the gradients and every
rollout_corr/* metric equal the path with a pi_old forward (<= 1e-6). Forward counts: tests/test_trainer.py.
"""

from __future__ import annotations

import pytest
import torch

from test_trl_equivalence import ROWS, build, loss_grads_metrics
from trl_rollout_corr import RolloutCorrGRPOTrainer
from trl_rollout_corr.core.metrics import finalize_floats
from trl_rollout_corr.core.stats import RolloutStats
from trl_rollout_corr.tiny import build_model

CASES = {
    "token_is": dict(preset="decoupled_token_is", rollout_is_threshold=1.5),
    "seq_is_rs": dict(preset="decoupled_seq_is_rs", rollout_rs_threshold=20.0, rollout_rs_threshold_lower=0.05),
    "geo_rs_veto": dict(preset="decoupled_geo_rs", rollout_rs_threshold=2.5, rollout_rs_threshold_lower=0.3,
                        rollout_token_veto_threshold=0.15, loss_type="grpo"),
    "token_is_bn_rs_criteria": dict(preset="decoupled_token_is", rollout_is_batch_normalize=True, rollout_rs="token",
                                    rollout_rs_threshold=1.5, rollout_rs_threshold_lower=0.05,
                                    rollout_rs_criteria="seq_max_k2", rollout_rs_criteria_threshold="2.5"),
    "seq_is_bn_gspo": dict(preset="decoupled_seq_is", rollout_is_batch_normalize=True,
                           importance_sampling_level="sequence", loss_type="grpo"),
    "token_is_top_k": dict(preset="decoupled_token_is", top_k=5, loss_type="cispo", epsilon_high=3.0),
}


def correction_metrics(trainer):
    stats, trainer._rc_stats["train"] = trainer._rc_stats["train"], RolloutStats()
    return finalize_floats(stats.to_floats())


@pytest.mark.parametrize("case", list(CASES))
def test_free_decoupled_equals_the_pi_old_forward(tmp_path, case):
    trainer = build(RolloutCorrGRPOTrainer, tmp_path, build_model(hidden_size=32), **CASES[case])
    assert trainer._rc_free_decoupled
    results = {}
    for free in (True, False):
        trainer._rc_free_decoupled = free
        calls_before = trainer._rc_forward_calls
        batch, loss, grads, _ = loss_grads_metrics(trainer, ROWS[:8], perturb=False)
        results[free] = (loss, grads, correction_metrics(trainer), trainer._rc_forward_calls - calls_before)
        assert ("rc_keep_mask" in batch) is not free
    (f_loss, f_grads, f_metrics, f_calls), (d_loss, d_grads, d_metrics, d_calls) = results[True], results[False]
    assert (f_calls, d_calls) == (0, 1)  # the pi_old forward (one chunk of 8 rows) is what free decoupled saves
    assert f_loss.item() != 0.0
    torch.testing.assert_close(f_loss, d_loss, rtol=1e-6, atol=1e-7)
    for name, grad in d_grads.items():
        torch.testing.assert_close(f_grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    assert f_metrics.keys() == d_metrics.keys() and len(f_metrics) > 30
    for key, value in d_metrics.items():
        assert f_metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    if "rs" in case or "veto" in case:
        assert 0 < d_metrics["rollout_corr/rejected_token_fraction"] < 1  # the masks really act
    if "top_k" in case:
        assert d_metrics["rollout_corr/kept_mass_mean"] < 0.999  # the truncated-support fix acts in both paths


def test_pi_old_forward_kept_when_pi_old_differs(tmp_path):
    for overrides in (dict(num_iterations=2), dict(gradient_accumulation_steps=1, steps_per_generation=2)):
        trainer = build(RolloutCorrGRPOTrainer, tmp_path, build_model(hidden_size=32), preset="decoupled_token_is",
                        **overrides)
        assert not trainer._rc_free_decoupled, overrides
    trainer = build(RolloutCorrGRPOTrainer, tmp_path, build_model(hidden_size=32), preset="ppo_is_bypass")
    assert not trainer._rc_free_decoupled  # bypass has its own anchor (pi_rollout)
