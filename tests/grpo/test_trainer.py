"""Real trainer.train() runs on a tiny local model through TRL's GRPOTrainer plumbing."""

import logging
import math

import pytest
import torch

from tests.support.trainer_utils import make_trainer, spy_batches, tiny_model_dir
from trl_rollout_corr import RolloutCorrectionConfig, RolloutCorrGRPOConfig
from trl_rollout_corr.core.metrics import OFFPOLICY_METRICS, WEIGHT_FAMILY_METRICS
from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine

P = "rollout_corr/"


def train_logs(collector):
    return [log for log in collector.logs if "loss" in log]


def expected_metric_names(cfg: RolloutCorrectionConfig) -> set:
    names = {P + k for k in OFFPOLICY_METRICS} | {P + k for k in (
        "rollout_is_veto_fraction", "rollout_is_catastrophic_token_fraction", "invalid_logprob_fraction",
        "rejected_token_fraction")}
    if cfg.rollout_is:
        names |= {P + "rollout_is_" + k for k in WEIGHT_FAMILY_METRICS}
    if cfg.rollout_rs:
        names |= {P + "rollout_rs_" + k for k in WEIGHT_FAMILY_METRICS}
        names |= {P + "rollout_rs_masked_fraction", P + "rollout_rs_seq_masked_fraction"}
    if cfg.rollout_is_batch_normalize:
        names.add(P + "rollout_is_batch_norm_factor")
    if cfg.rollout_is and cfg.rollout_is_bound == "mask":
        names |= {P + "rollout_is_masked_fraction", P + "rollout_is_seq_masked_fraction"}
    if cfg.rollout_m2_threshold is not None:
        names |= {P + "rollout_m2", P + "rollout_m2_kept", P + "rollout_m2_masked_fraction"}
        if cfg.rollout_m2_scope == "trust_region":
            names |= {P + "rollout_m2_trust_region", P + "rollout_m2_trust_region_kept",
                      P + "rollout_m2_trust_region_fraction"}
    return names


@pytest.mark.parametrize("preset", RolloutCorrectionConfig.PRESETS)
def test_every_preset_trains_and_logs_full_metric_set(preset, tmp_path):
    trainer, col = make_trainer(tmp_path, preset=preset, max_steps=2,
                                rollout_sampler=EmulatedRolloutEngine("stale", lag=1))
    trainer.train()
    logs = train_logs(col)
    assert len(logs) == 2
    for log in logs:
        assert math.isfinite(log["loss"])
        assert expected_metric_names(trainer.rollout_correction) <= set(log)
        assert all(math.isfinite(v) for k, v in log.items() if k.startswith(P))


@pytest.mark.parametrize("source", ["free", "forward"])
def test_alignment_on_policy_fp32(tmp_path, source):
    trainer, col = make_trainer(tmp_path, preset="decoupled_token_is", max_steps=1, pi_old_source=source)
    assert trainer.correction_plan.pi_old == ("pi_theta" if source == "free" else "forward")
    batches = spy_batches(trainer)
    trainer.train()
    if source == "forward":
        captured = batches[0]
        mask = captured["completion_mask"].bool()
        diff = (captured["sampling_per_token_logps"] - captured["old_per_token_logps"]).abs()[mask]
        assert diff.max() < 1e-4
    log = train_logs(col)[0]
    assert abs(log[P + "kl"]) < 1e-5 and log[P + "rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
    assert log[P + "rollout_is_max"] < 1.001


def test_mismatched_sampler_moves_diagnostics(tmp_path):
    trainer, col = make_trainer(tmp_path, preset="decoupled_token_is", max_steps=2,
                                rollout_sampler=EmulatedRolloutEngine("wq3"))
    trainer.train()
    log = train_logs(col)[-1]
    # KL(pi_rollout || pi_old) estimated under pi_rollout's own samples: k1 and k3 > 0 (chi2 is noisy at this size)
    assert log[P + "kl"] > 1e-4 and log[P + "k3_kl"] > 1e-5
    assert log[P + "rollout_is_std"] > 1e-4 and log[P + "mean_prob_diff"] > 1e-4
    assert log[P + "rollout_is_eff_sample_size"] < 1.0


def count_no_grad_forwards(trainer):
    model = trainer.model
    calls = {"n": 0}
    original = model.forward

    def counting(*args, **kwargs):
        if not torch.is_grad_enabled() and kwargs.get("fused_lm_head"):
            calls["n"] += 1
        return original(*args, **kwargs)

    model.forward = counting
    return calls


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_no_pi_old_forward_unless_pi_old_differs(tmp_path, num_iterations):
    """Bypass never runs the pi_old forward; decoupled runs one per generation batch only when pi_old != pi_theta."""
    counts = {}
    for preset in ("decoupled_token_is", "ppo_is_bypass"):
        trainer, _ = make_trainer(tmp_path / preset, preset=preset, max_steps=2 * num_iterations,
                                  num_iterations=num_iterations)
        calls = count_no_grad_forwards(trainer)
        trainer.train()
        counts[preset] = calls["n"]
    generations = 2
    # num_iterations=1: pi_old = pi_theta at the loss (free decoupled); 2: one forward per generation batch (8 rows)
    assert counts["decoupled_token_is"] == (0 if num_iterations == 1 else generations)
    assert counts["ppo_is_bypass"] == 0


def test_decoupled_token_is_equals_trl_token_truncate(tmp_path):
    """Same batch, same model: our loss and gradients == TRL's built-in vLLM token_truncate IS with clip_max=C."""
    from trl import GRPOTrainer

    C = 1.05
    trainer, _ = make_trainer(tmp_path, preset="decoupled_token_is", rollout_is_threshold=C, max_steps=1,
                              rollout_sampler=EmulatedRolloutEngine("wq3"), loss_type="dapo", pi_old_source="forward")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer inside train()
    batch = trainer._generate_and_score_completions(trainer.train_dataset.select(range(8)).to_list())
    assert (batch["rc_is_weights"] < C - 1e-6).any() and (batch["rc_is_weights"] >= C - 1e-6).any()

    def loss_and_grad(fn, inputs):
        trainer.model.zero_grad()
        loss = fn(inputs)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]

    ours = loss_and_grad(lambda b: trainer.compute_loss(trainer.model, b), batch)
    # TRL's own path: vLLM IS on with token_truncate, fed the same old/sampling log-probs
    old, sampling = batch["old_per_token_logps"], batch["sampling_per_token_logps"]
    mask = batch["completion_mask"]
    ratio = torch.exp((old - sampling) * mask).clamp(max=C)
    trl_batch = {k: v for k, v in batch.items() if not k.startswith("rc_")}
    trl_batch["importance_sampling_ratio"] = ratio
    trl_batch["num_items_in_batch"] = mask.sum()
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    try:
        theirs = loss_and_grad(lambda b: GRPOTrainer._compute_loss(trainer, trainer.model, b), trl_batch)
    finally:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = False, False
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-7)
    for a, b in zip(ours[1], theirs[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_types_ga_iterations_and_beta(loss_type, tmp_path_factory):
    model_dir = tiny_model_dir(tmp_path_factory.mktemp("model"))
    for preset in ("decoupled_seq_is_rs", "pg_is"):
        trainer, col = make_trainer(tmp_path_factory.mktemp(preset), model=model_dir, preset=preset,
                                    loss_type=loss_type, max_steps=2, gradient_accumulation_steps=2,
                                    per_device_train_batch_size=4, num_iterations=2, beta=0.04,
                                    rollout_sampler=EmulatedRolloutEngine("stale", lag=1))
        trainer.train()
        logs = train_logs(col)
        assert all(math.isfinite(log["loss"]) and "kl" in log for log in logs)


def test_peft_lora_trains(tmp_path):
    from peft import LoraConfig

    trainer, col = make_trainer(tmp_path, preset="decoupled_token_is", max_steps=2)
    from trl_rollout_corr import RolloutCorrGRPOTrainer
    from trl_rollout_corr.testing.toy_task import build_model, build_tokenizer, reverse_reward

    lora = RolloutCorrGRPOTrainer(model=build_model(hidden_size=32), reward_funcs=reverse_reward, args=trainer.args,
                                  train_dataset=trainer.train_dataset, processing_class=build_tokenizer(),
                                  peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
                                  callbacks=[col])
    lora.train()
    assert all(math.isfinite(log["loss"]) for log in train_logs(col))
    assert P + "kl" in train_logs(col)[-1]


def test_all_rejected_batch_gives_zero_loss_and_warning(tmp_path, caplog):
    # a token rejection band that nothing satisfies under a strongly quantized sampler
    trainer, col = make_trainer(tmp_path, rollout_is="none", rollout_rs="token", rollout_rs_threshold=1.0 + 1e-9,
                                rollout_rs_threshold_lower=1.0, max_steps=1,
                                rollout_sampler=EmulatedRolloutEngine("wq2"))
    with caplog.at_level(logging.WARNING, logger="trl_rollout_corr.grpo.trainer"):
        trainer.train()
    log = train_logs(col)[0]
    assert log["loss"] == 0.0
    assert log[P + "rejected_token_fraction"] == 1.0
    assert log[P + "all_rejected_micro_batches"] == 1.0
    assert "rejected every token" in caplog.text


def test_config_preset_overrides_and_refusals(tmp_path):
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    cfg = RolloutCorrGRPOConfig(**base, rollout_correction_preset="decoupled_seq_is_rs", rollout_rs_threshold=5.0)
    assert cfg.rollout_correction.rollout_rs_threshold == 5.0 and cfg.rollout_correction.rollout_is == "sequence"
    cfg = RolloutCorrGRPOConfig(**base, rollout_correction_preset="decoupled_seq_is_rs", rollout_rs="none")
    assert cfg.rollout_correction.rollout_rs is None and cfg.rollout_correction.rollout_rs_threshold is None
    # no preset: TRL 1.16's own default, sequence_mask with C=3
    assert RolloutCorrGRPOConfig(**base).rollout_correction == RolloutCorrectionConfig(
        rollout_is="sequence", rollout_is_bound="mask", rollout_is_threshold=3.0)
    assert not RolloutCorrGRPOConfig(**base).vllm_importance_sampling_correction
    with pytest.raises(ValueError, match="Unknown rollout correction preset 'bogus'"):
        RolloutCorrGRPOConfig(**base, rollout_correction_preset="bogus")
    # TRL's own switch on with a preset named: two corrections, refused (alone it is TRL's correction, translated)
    with pytest.raises(ValueError, match="vllm_importance_sampling_correction=True.*name one correction"):
        RolloutCorrGRPOConfig(**base, vllm_importance_sampling_correction=True, rollout_correction_preset="pg_is")
    assert RolloutCorrGRPOConfig(**base, vllm_importance_sampling_correction=True).rollout_correction == \
        RolloutCorrectionConfig.trl_default()
    with pytest.raises(ValueError, match="use_policy_gradient=True requires bypass_mode"):
        RolloutCorrGRPOConfig(**base, use_policy_gradient=True)
    saved = RolloutCorrectionConfig.pg_rs().save_pretrained(tmp_path / "hub_like")
    assert open(saved).read() == RolloutCorrectionConfig.pg_rs().to_json_string()  # the file the Hub would get
    cfg = RolloutCorrGRPOConfig(**base, rollout_correction_config=str(tmp_path / "hub_like"))
    assert cfg.rollout_correction == RolloutCorrectionConfig.pg_rs()


def test_only_contradicting_trl_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="continuous batching path returns no per-token log-probs"):
        make_trainer(tmp_path, use_transformers_continuous_batching=True)
    with pytest.raises(ValueError, match="name one correction"):
        make_trainer(tmp_path, preset="decoupled_token_is", vllm_importance_sampling_correction=True)
    # each of these composes with the correction (tests/grpo/test_trl_equivalence.py checks them against TRL)
    for setting in (dict(loss_type="cispo"), dict(loss_type="sapo"), dict(loss_type="luspo"), dict(loss_type="vespo"),
                    dict(entropy_coef=0.01), dict(top_entropy_quantile=0.5), dict(off_policy_mask_threshold=0.5)):
        make_trainer(tmp_path, preset="decoupled_token_is", **setting)
    make_trainer(tmp_path, preset="decoupled_seq_is", importance_sampling_level="sequence", loss_type="grpo")
    # GSPO has one ratio per sequence: a per-token weight has no place in it (tests/grpo/test_compositions.py)
    with pytest.raises(ValueError, match="GSPO.*rollout_is='sequence'"):
        make_trainer(tmp_path, preset="decoupled_token_is", importance_sampling_level="sequence", loss_type="grpo")


def test_resolved_config_saved_with_model(tmp_path):
    trainer, _ = make_trainer(tmp_path, preset="pg_rs", max_steps=1)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    assert RolloutCorrectionConfig.from_pretrained(tmp_path / "final") == RolloutCorrectionConfig.pg_rs()
