"""Compositions with a defined meaning, each against a float64 re-derivation written here from the formulas.

* GSPO (importance_sampling_level="sequence") + sequence IS: one weight w_i = min(prod_t rho_t, C) per sequence on
  GSPO's per-sequence clipped objective; TRL's clip metrics stay per-sequence fractions.
* VESPO + token IS: phi sees the truncated sampler ratio, phi(pi_theta/pi_old * prod_t min(rho_t, C)), A unweighted.
* Non-finite rollout log-probs: the sample leaves the loss *and* dapo's token count.
* Bypass: rejected tokens leave the policy term, the KL term and the entropy bonus (every term, as in decoupled
  mode), and the PPO anchor is pi_rollout.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.grpo.test_invariance import mismatched_engine
from tests.grpo.test_trl_equivalence import ROWS, one_micro_batch, perturb_, policy_logps
from tests.support.trainer_utils import tiny_model_dir
from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer
from trl_rollout_corr.testing.toy_task import build_model, build_tokenizer, reverse_reward

TOK = build_tokenizer()


def build(tmp_path, model=None, engine=None, **overrides):
    from datasets import Dataset

    args = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, gradient_accumulation_steps=1,
                num_generations=4, max_completion_length=6, max_steps=1, learning_rate=1e-3, logging_steps=1,
                save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=0, dataloader_num_workers=0)
    args.update(overrides)
    return RolloutCorrGRPOTrainer(model=model or build_model(hidden_size=32), reward_funcs=reverse_reward,
                                  args=RolloutCorrGRPOConfig(**args), train_dataset=Dataset.from_list(ROWS),
                                  processing_class=TOK, rollout_func=mismatched_engine(**(engine or {})))


def loss_and_grads(trainer, batch):
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach().double(), [p.grad.clone() for p in trainer.model.parameters()]


def assert_reference(trainer, loss, grads, expected):
    trainer.model.zero_grad()
    expected.backward()
    assert loss.item() != 0.0
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-7)
    for ours, p in zip(grads, trainer.model.parameters()):
        torch.testing.assert_close(ours, p.grad.to(ours.dtype), rtol=1e-4, atol=1e-7)


def test_gspo_gets_one_sequence_weight_and_keeps_per_sequence_clip_metrics(tmp_path):
    C = 1.3
    trainer = build(tmp_path, rollout_correction_preset="decoupled_seq_is", rollout_is_threshold=C,
                    importance_sampling_level="sequence", loss_type="grpo", num_iterations=2, epsilon=0.02)
    batch = one_micro_batch(trainer, ROWS[:8])
    old = policy_logps(trainer, batch).detach().double()  # (B, T) pi_old: the policy before the update
    perturb_(trainer.model)
    loss, grads = loss_and_grads(trainer, batch)
    clip_metrics = {k: trainer._metrics["train"][k][-1] for k in ("clip_ratio/region_mean", "clip_ratio/low_min")}

    logps = policy_logps(trainer, batch).double()  # (B, T) pi_theta, with grad
    mask = batch["completion_mask"].double()  # (B, T)
    rollout = batch["sampling_per_token_logps"].double()  # (B, T)
    adv = batch["advantages"].double().unsqueeze(1)  # (B, 1)
    w = torch.exp(((old - rollout) * mask).sum(-1, keepdim=True).clamp(-20, 20)).clamp(max=C)  # (B, 1)
    assert w.min() < C and (w == C).any()  # truncation active on some sequences only
    s = torch.exp(((logps - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True))  # (B, 1) GSPO ratio
    eps = trainer.epsilon_low
    per_seq = -torch.min(s * adv * w, s.clamp(1 - eps, 1 + eps) * adv * w)  # (B, 1)
    assert_reference(trainer, loss, grads, per_seq.mean())  # grpo over sequences (per-token mean of a constant)
    s = s.detach()
    clipped = ((s < 1 - eps) & (adv < 0)) | ((s > 1 + eps) & (adv > 0))  # (B, 1): one decision per sequence
    assert 0 < clipped.double().mean() < 1
    assert clip_metrics["clip_ratio/region_mean"] == pytest.approx(clipped.double().mean().item(), abs=1e-6)


def test_vespo_sees_the_truncated_sampler_ratio(tmp_path):
    C = 1.2
    trainer = build(tmp_path, rollout_correction_preset="decoupled_token_is", rollout_is_threshold=C,
                    loss_type="vespo")
    batch = one_micro_batch(trainer, ROWS[:8])  # free: pi_old = pi_theta at the loss
    loss, grads = loss_and_grads(trainer, batch)
    phi_metric = trainer._metrics["train"]["vespo/phi_seq_mean"][-1]

    logps = policy_logps(trainer, batch).double()  # (B, T)
    mask = batch["completion_mask"].double()  # (B, T)
    adv = batch["advantages"].double().unsqueeze(1)  # (B, 1)
    w = torch.exp((logps.detach() - batch["sampling_per_token_logps"].double()).clamp(-20, 20)).clamp(max=C)  # (B, T)
    log_w = (torch.log(w) * mask).sum(-1, keepdim=True).clamp(math.log(1e-8), 20.0)  # (B, 1), pi_theta/pi_old = 1
    args = trainer.args
    k = torch.where(adv >= 0, args.vespo_k_pos, args.vespo_k_neg)
    lam = torch.where(adv >= 0, args.vespo_lambda_pos, args.vespo_lambda_neg)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))  # (B, 1) gamma weight
    assert phi.std() > 1e-3  # the sampler ratio really moves phi (it would be phi(1) = 1 for every sequence)
    expected = (-phi * adv * logps * mask).sum() / mask.sum()  # dapo normalizer: the batch's tokens
    assert_reference(trainer, loss, grads, expected)
    assert phi_metric == pytest.approx(phi.mean().item(), rel=1e-5)


def test_a_non_finite_rollout_logprob_leaves_the_loss_and_the_token_count(tmp_path):
    C = 2.0
    trainer = build(tmp_path, rollout_correction_preset="decoupled_token_is", loss_type="dapo",
                    engine=dict(nan_every=3))
    batch = one_micro_batch(trainer, ROWS[:8])
    rollout = batch["sampling_per_token_logps"].double()  # (B, T)
    mask = batch["completion_mask"].double()  # (B, T)
    bad = ((mask > 0) & ~torch.isfinite(rollout)).any(-1, keepdim=True)  # (B, 1)
    assert 0 < bad.sum() < len(bad)
    kept = mask * ~bad  # (B, T)
    assert batch["num_items_in_batch"].item() == kept.sum().item()  # dapo's count without the rejected samples
    loss, grads = loss_and_grads(trainer, batch)

    logps = policy_logps(trainer, batch).double()  # (B, T)
    adv = batch["advantages"].double().unsqueeze(1)  # (B, 1)
    w = torch.exp((logps.detach() - torch.nan_to_num(rollout)).clamp(-20, 20)).clamp(max=C)  # (B, T)
    r = torch.exp(logps - logps.detach())  # (B, T) = 1, pi_old = pi_theta
    eps_low, eps_high = trainer.epsilon_low, trainer.epsilon_high
    per_token = -torch.min(r * adv * w, r.clamp(1 - eps_low, 1 + eps_high) * adv * w)  # (B, T)
    assert_reference(trainer, loss, grads, (per_token * kept).sum() / kept.sum())


def test_bypass_rejection_leaves_every_term_and_clips_against_pi_rollout(tmp_path_factory):
    """ppo_is_bypass + token RS, beta > 0, entropy bonus: rejected tokens are out of the policy, KL and entropy terms;
    the PPO ratio is pi_theta / pi_rollout (a test that fails if the anchor were pi_theta or pi_old)."""
    model_dir = tiny_model_dir(tmp_path_factory.mktemp("model"))
    beta, coef = 0.1, 0.05
    trainer = build(tmp_path_factory.mktemp("run"), model=model_dir, rollout_correction_preset="ppo_is_bypass",
                    rollout_rs="token", rollout_rs_threshold=1.25, loss_type="dapo", beta=beta, entropy_coef=coef,
                    epsilon=0.1)
    batch = one_micro_batch(trainer, ROWS[:8])
    perturb_(trainer.model, scale=0.02)
    loss, grads = loss_and_grads(trainer, batch)

    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)  # (B, P+T)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)  # (B, P+T)
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, input_ids, attention, batch["completion_ids"].size(1), compute_entropy=True)
    logps, entropies = logps.double(), entropies.double()  # (B, T)
    mask = batch["completion_mask"].double()  # (B, T)
    rollout = batch["sampling_per_token_logps"].double()  # (B, T)
    rho = torch.exp((logps.detach() - rollout).clamp(-20, 20))  # (B, T) pi_theta / pi_rollout
    kept = mask * ((rho >= 1 / 1.25) & (rho <= 1.25))  # (B, T) token RS
    assert 0 < kept.sum() < mask.sum()
    adv = batch["advantages"].double().unsqueeze(1)  # (B, 1)
    r = torch.exp(logps - rollout)  # (B, T) PPO ratio against pi_rollout
    eps = trainer.epsilon_low
    policy = -torch.min(r * adv, r.clamp(1 - eps, 1 + eps) * adv)  # (B, T)
    ref = batch["ref_per_token_logps"].double()  # (B, T)
    kl = (torch.exp(ref - logps) - (ref - logps) - 1) * r  # (B, T) k3, TRL's bias correction by the PPO ratio
    expected = ((policy + beta * kl) * kept).sum() / kept.sum() - coef * (entropies * kept).sum() / kept.sum()
    assert_reference(trainer, loss, grads, expected)


# ---------------------------------------------------------------------------------------------- every composition
COMPOSITIONS = {
    **{loss_type: dict(loss_type=loss_type) for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo",
                                                              "luspo")},
    "gspo": dict(importance_sampling_level="sequence", loss_type="grpo", rollout_is="sequence"),
    "entropy_bonus": dict(entropy_coef=0.05),
    "entropy_filter": dict(top_entropy_quantile=0.5),
    "off_policy_mask": dict(off_policy_mask_threshold=0.02),
    "two_sided_clip": dict(delta=1.05, epsilon=0.01),
}


@pytest.mark.parametrize("case", list(COMPOSITIONS))
def test_every_composition_equals_trl_with_the_same_weights_injected_and_trains(tmp_path, case):
    """TRL's own loss, run on its vLLM-IS path with our IS weights as its importance_sampling_ratio and our kept mask
    as its tool mask, equals ours (loss and gradients); then the composition trains two real steps."""
    from trl import GRPOTrainer

    overrides = dict(rollout_correction_preset="decoupled_token_is", rollout_is_threshold=1.3, rollout_rs="token",
                     rollout_rs_threshold=1.6, num_iterations=2, **COMPOSITIONS[case])
    trainer = build(tmp_path, **overrides)
    batch = one_micro_batch(trainer, ROWS[:8])  # pi_old forward: rc_* travel with the batch
    perturb_(trainer.model, scale=0.02)
    keep = batch["rc_keep_mask"]  # (B, T)
    assert 0 < keep.sum() < batch["completion_mask"].sum()
    ours = loss_and_grads(trainer, batch)

    weights = batch["rc_is_weights"]  # (B, T)
    trl_batch = {k: v for k, v in batch.items() if not k.startswith("rc_")}
    trl_batch["importance_sampling_ratio"] = weights.amax(1, keepdim=True) if case == "gspo" else weights
    trl_batch["tool_mask"] = keep  # TRL's loss mask: completion_mask * tool_mask
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    try:
        trainer.model.zero_grad()
        loss = GRPOTrainer._compute_loss(trainer, trainer.model, trl_batch)
        loss.backward()
        theirs = loss.detach().double(), [p.grad.clone() for p in trainer.model.parameters()]
    finally:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = False, False
    assert ours[0].item() != 0.0
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-7)
    for a, b in zip(ours[1], theirs[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)

    trainer = build(tmp_path / "train", max_steps=2, **overrides)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(math.isfinite(log["loss"]) for log in logs)
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
    assert 0 < logs[0]["rollout_corr/rejected_token_fraction"] < 1  # once per generation batch (num_iterations=2)
