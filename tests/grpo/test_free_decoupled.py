"""pi_old_source: the pi_old forward and pi_theta detached ("free") give the same step where both are exact.

With one micro-batch per generation batch (steps_per_generation=1, one optimizer step per batch), pi_old = pi_theta
at the loss and every generation-batch statistic is in the micro-batch: the loss, the gradients and every
rollout_corr/* metric of the two sources agree (<= 1e-6), and "free" runs no policy forward outside the loss.
"""

from __future__ import annotations

import pytest
import torch

from tests.grpo.test_trl_equivalence import ROWS, build, loss_grads_metrics
from tests.support.trainer_utils import count_policy_forwards
from trl_rollout_corr import RolloutCorrGRPOTrainer
from trl_rollout_corr.core.metrics import finalize_floats
from trl_rollout_corr.core.stats import RolloutStats
from trl_rollout_corr.testing.toy_task import build_model

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
    "token_is_rs_vespo": dict(preset="decoupled_token_is", rollout_rs="token", rollout_rs_threshold=3.0,
                              loss_type="vespo"),
}


def correction_metrics(trainer):
    stats, trainer._rc_stats["train"] = trainer._rc_stats["train"], RolloutStats()
    return finalize_floats(stats.to_floats())


@pytest.mark.parametrize("case", list(CASES))
def test_free_equals_the_pi_old_forward(tmp_path, case):
    results = {}
    for source in ("free", "forward"):
        trainer = build(RolloutCorrGRPOTrainer, tmp_path / source, build_model(hidden_size=32), pi_old_source=source,
                        **CASES[case])
        forwards = count_policy_forwards(trainer.model)
        batch, loss, grads, _ = loss_grads_metrics(trainer, ROWS[:8], perturb=False)
        results[source] = (loss, grads, correction_metrics(trainer), forwards["no_grad"])
        assert ("rc_keep_mask" in batch) is (source == "forward")
    (f_loss, f_grads, f_metrics, f_calls), (d_loss, d_grads, d_metrics, d_calls) = results["free"], results["forward"]
    assert (f_calls, d_calls) == (0, 1)  # the pi_old forward (one chunk of 8 rows) is what "free" saves
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
