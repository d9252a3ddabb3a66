"""Where pi_old comes from and where the correction is computed (trl_rollout_corr.config.plan), and what is refused."""

from __future__ import annotations

import pytest

from trl_rollout_corr import RolloutCorrectionConfig as Cfg
from trl_rollout_corr import RolloutCorrGRPOConfig
from trl_rollout_corr.config.plan import check_composition, plan_correction
from trl_rollout_corr.trl_hooks.grpo import KEPT_TOKEN_NORMALIZER_LOSSES

BN = dict(rollout_is_batch_normalize=True)
RS = dict(rollout_rs="token", rollout_rs_threshold=2.0)


def plan(cfg, **shape):
    return plan_correction(cfg, kept_token_normalizer_losses=KEPT_TOKEN_NORMALIZER_LOSSES, **shape)


@pytest.mark.parametrize("cfg,shape,expected", [
    # TRL's default shape (one micro-batch per generation batch): never an extra forward
    (Cfg.decoupled_token_is(), dict(), ("pi_theta", False)),
    (Cfg.decoupled_token_is(**BN), dict(), ("pi_theta", False)),
    (Cfg.decoupled_geo_rs(), dict(loss_type="dapo"), ("pi_theta", False)),
    # gradient accumulation over the generation batch: a forward only for a generation-batch statistic
    (Cfg.decoupled_token_is(), dict(gradient_accumulation_steps=4, steps_per_generation=4), ("pi_theta", False)),
    (Cfg.decoupled_token_is(**BN), dict(gradient_accumulation_steps=4, steps_per_generation=4), ("forward", True)),
    (Cfg.decoupled_token_is(**RS), dict(gradient_accumulation_steps=4, steps_per_generation=4, loss_type="dapo"),
     ("forward", True)),
    (Cfg.decoupled_token_is(**RS), dict(gradient_accumulation_steps=4, steps_per_generation=4, loss_type="grpo"),
     ("pi_theta", False)),  # grpo's normalizer is per sequence: nothing spans the generation batch
    (Cfg.decoupled_seq_is(**BN), dict(gradient_accumulation_steps=4, steps_per_generation=1), ("pi_theta", False)),
    # pi_theta moves within the generation batch: pi_old needs its forward
    (Cfg.decoupled_token_is(), dict(num_iterations=2), ("forward", True)),
    (Cfg.decoupled_token_is(), dict(gradient_accumulation_steps=1, steps_per_generation=2), ("forward", True)),
    # bypass: pi_old := pi_rollout; a forward only for a generation-batch statistic over several micro-batches
    (Cfg.ppo_is_bypass(), dict(num_iterations=2), ("pi_rollout", False)),
    (Cfg.pg_rs(), dict(loss_type="dapo"), ("pi_rollout", False)),
    (Cfg.pg_rs(), dict(loss_type="dapo", gradient_accumulation_steps=2, steps_per_generation=2), ("pi_rollout", True)),
    (Cfg.pg_is(**BN), dict(num_iterations=2), ("pi_rollout", False)),  # each micro-batch holds the whole batch
    (Cfg.pg_rs(), dict(loss_type="grpo", num_iterations=2, gradient_accumulation_steps=2, steps_per_generation=2),
     ("pi_rollout", False)),
])
def test_auto_plan(cfg, shape, expected):
    p = plan(cfg, **shape)
    assert (p.pi_old, p.at_generation) == expected
    assert "pi_old = " in p.describe()


def test_forward_and_free_sources():
    assert plan(Cfg.decoupled_token_is(), pi_old_source="forward").pi_old == "forward"
    assert plan(Cfg.decoupled_token_is(**BN), pi_old_source="free").pi_old == "pi_theta"
    with pytest.raises(ValueError, match="pi_old_source='free' with gradient_accumulation_steps=1, "
                                         "steps_per_generation=1, num_iterations=2.*pi_theta moves"):
        plan(Cfg.decoupled_token_is(), pi_old_source="free", num_iterations=2)
    with pytest.raises(ValueError,
                       match="pi_old_source='free' with rollout_is_batch_normalize.*steps_per_generation=4"):
        plan(Cfg.decoupled_token_is(**BN), pi_old_source="free", gradient_accumulation_steps=4, steps_per_generation=4)
    with pytest.raises(ValueError, match="pi_old_source='forward' with bypass_mode=True.*Leave pi_old_source='auto'"):
        plan(Cfg.ppo_is_bypass(), pi_old_source="forward")
    with pytest.raises(ValueError, match="pi_old_source='sometimes'"):
        plan(Cfg.decoupled_token_is(), pi_old_source="sometimes")


def test_bypass_statistic_without_a_single_value_is_refused():
    with pytest.raises(ValueError, match="bypass_mode=True with the kept-token count dapo divides by.*changes at every "
                                         "optimizer step"):
        plan(Cfg.pg_rs(), loss_type="dapo", num_iterations=2, gradient_accumulation_steps=2, steps_per_generation=2)


def test_compositions_refused_with_the_reason():
    with pytest.raises(ValueError, match="GSPO.*per-token IS weight.*rollout_is='sequence'"):
        check_composition(Cfg.decoupled_token_is(), "grpo", "sequence")
    check_composition(Cfg.decoupled_seq_is(), "grpo", "sequence")
    check_composition(Cfg.ppo_is_bypass(), "grpo", "sequence")  # bypass PPO applies no IS weight
    with pytest.raises(ValueError, match="vespo.*rollout_is='token'"):
        check_composition(Cfg.decoupled_seq_is(), "vespo", "token")
    check_composition(Cfg.pg_is(), "vespo", "token")  # policy gradient: w multiplies A, VESPO's phi sees ratio 1


def test_the_trainer_config_fails_at_construction_naming_the_field(tmp_path):
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    cfg = RolloutCorrGRPOConfig(**base, rollout_correction_preset="decoupled_token_is", rollout_is_batch_normalize=True,
                                gradient_accumulation_steps=4)
    assert cfg.correction_plan().pi_old == "forward" and cfg.pi_old_source == "auto"
    with pytest.raises(ValueError, match="pi_old_source='free'"):
        RolloutCorrGRPOConfig(**base, rollout_correction_preset="decoupled_token_is", pi_old_source="free",
                              num_iterations=2)
    with pytest.raises(ValueError, match="pi_old_source='never'"):
        RolloutCorrGRPOConfig(**base, pi_old_source="never")
    with pytest.raises(ValueError, match="GSPO"):
        RolloutCorrGRPOConfig(**base, rollout_correction_preset="decoupled_token_is",
                              importance_sampling_level="sequence", loss_type="grpo")


def test_the_config_plans_once_per_resolution_and_again_after_a_change(tmp_path, monkeypatch):
    """``correction_plan()`` returns the plan the last resolution made (``plan_correction`` is not run a second time
    with the same arguments), and a changed plan input is planned again: decoupled TIS with one optimizer step per
    generation batch needs no pi_old forward (pi_old = pi_theta); with num_iterations=2 pi_theta moves within the
    batch, so pi_old comes from a forward."""
    from trl_rollout_corr.grpo import config as grpo_config

    calls = []
    real = grpo_config.plan_correction
    monkeypatch.setattr(grpo_config, "plan_correction", lambda *a, **k: calls.append(k) or real(*a, **k))
    cfg = RolloutCorrGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                rollout_correction_preset="decoupled_token_is")
    assert len(calls) == 1
    assert cfg.correction_plan().pi_old == "pi_theta" and cfg.correction_plan().pi_old == "pi_theta"
    assert len(calls) == 1  # no second planning with the same arguments
    cfg.num_iterations = 2
    assert cfg.correction_plan().pi_old == "forward" and len(calls) == 2
