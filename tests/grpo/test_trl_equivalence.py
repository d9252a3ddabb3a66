"""A drop-in for TRL's GRPOTrainer.

* Equivalence: with the ``disabled`` preset (no weights, nothing rejected), loss, gradients and every metric TRL logs
  equal TRL 1.16's own ``GRPOTrainer`` on the same micro-batch, for every loss type and TRL option.
* Invariants against an independent float64 re-derivation of TRL's per-token losses: IS weights multiply each token's
  policy loss, rejected tokens leave the loss and every count, for every loss type and GSPO.
* The no-``args`` constructor builds a default ``RolloutCorrGRPOConfig`` as TRL builds its ``GRPOConfig``.

Cheap by design: each case generates one batch with a deterministic ``rollout_func`` and compares one ``compute_loss``
(forward + backward) of both trainers; ``test_train_logs_equal_trl`` runs ``train()`` once for the logging path.
"""

from __future__ import annotations

import copy
import math
import zlib

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from tests.support.trainer_utils import LogCollector, tiny_model_dir
from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer
from trl_rollout_corr.testing.toy_task import VOCAB, build_model, build_tokenizer, reverse_prompts

TOK = build_tokenizer()
EOS = 1
MAX_LEN = 6
ROWS = [{"prompt": p} for p in reverse_prompts(64, n_digits=4)]
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


def rollout_func_factory(env_mask: bool = False):
    """Completions and pi_rollout log-probs seeded by (prompt, copy): identical for both trainers.

    About half end with EOS (the rest are 'truncated' for mask_truncated_completions); with ``env_mask`` the second
    token of every other completion is an environment token.
    """
    def rollout_func(prompts, trainer):
        seen: dict[str, int] = {}
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        masks = []
        for prompt in prompts:
            copy_index = seen.get(prompt, 0)
            seen[prompt] = copy_index + 1
            gen = torch.Generator().manual_seed(zlib.crc32(f"{prompt}|{copy_index}".encode()))
            length = int(torch.randint(2, MAX_LEN + 1, (1,), generator=gen))
            ids = torch.randint(4, 14, (length,), generator=gen).tolist()
            if torch.rand(1, generator=gen).item() < 0.5:
                ids[-1] = EOS
            out["prompt_ids"].append(TOK(prompt)["input_ids"])
            out["completion_ids"].append(ids)
            out["logprobs"].append((-0.3 - 3.0 * torch.rand(length, generator=gen, dtype=torch.float64)).tolist())
            masks.append([0 if (t == 1 and copy_index % 2 == 0) else 1 for t in range(length)])
        if env_mask:
            out["env_mask"] = masks
        return out
    return rollout_func


def reward(completions, **_):
    return [(zlib.crc32(c.encode()) % 11) / 10.0 for c in completions]


def build_moe_model():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen2MoeConfig(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, router_aux_loss_coef=0.02,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=3)
    return Qwen2MoeForCausalLM(config)


def common_args(output_dir, **overrides):
    args = dict(output_dir=str(output_dir), per_device_train_batch_size=8, gradient_accumulation_steps=1,
                num_generations=4, max_completion_length=MAX_LEN, max_steps=1, learning_rate=1e-3, logging_steps=1,
                save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=0, dataloader_num_workers=0,
                vllm_importance_sampling_correction=False)
    args.update(overrides)
    return args


def build(cls, output_dir, model, env_mask=False, **overrides):
    config_cls = RolloutCorrGRPOConfig if cls is RolloutCorrGRPOTrainer else GRPOConfig
    extra = dict(rollout_correction_preset=overrides.pop("preset", "disabled")) if cls is RolloutCorrGRPOTrainer else {}
    args = config_cls(**common_args(output_dir, **overrides), **extra)
    return cls(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(ROWS),
               processing_class=TOK, rollout_func=rollout_func_factory(env_mask))


def perturb_(model, seed=1, scale=0.05):
    """Move the policy away from pi_old (the weights generation saw), identically in both trainers."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))


def one_micro_batch(trainer, rows):
    """TRL's own path to a micro-batch (generate, score, shuffle, split), as at the first step of train()."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    trainer._step = 0
    trainer._buffered_inputs = None
    torch.manual_seed(0)
    return trainer._prepare_inputs(copy.deepcopy(rows))


def loss_grads_metrics(trainer, rows, perturb=True):
    batch = one_micro_batch(trainer, rows)
    if perturb:
        perturb_(trainer.model)
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {k: list(v) for k, v in trainer._metrics["train"].items()}
    return batch, loss.detach(), grads, metrics


def assert_same_as_trl(tmp_path, model_factory=lambda: build_model(hidden_size=32), env_mask=False, **overrides):
    generation_rows = ROWS[:8 * overrides.get("steps_per_generation", overrides.get("gradient_accumulation_steps", 1))]
    theirs = build(GRPOTrainer, tmp_path / "trl", model_factory(), env_mask, **overrides)
    ours = build(RolloutCorrGRPOTrainer, tmp_path / "ours", model_factory(), env_mask, **overrides)
    t_batch, t_loss, t_grads, t_metrics = loss_grads_metrics(theirs, generation_rows)
    o_batch, o_loss, o_grads, o_metrics = loss_grads_metrics(ours, generation_rows)
    torch.testing.assert_close(o_batch["completion_ids"], t_batch["completion_ids"], rtol=0, atol=0)
    assert t_loss.item() != 0.0
    torch.testing.assert_close(o_loss, t_loss, rtol=1e-6, atol=1e-7)
    assert o_grads.keys() == t_grads.keys() and t_grads
    for name, grad in t_grads.items():
        torch.testing.assert_close(o_grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    missing = set(t_metrics) - set(o_metrics)
    assert not missing, f"TRL logs {sorted(missing)} and we do not"
    for key, values in t_metrics.items():
        assert o_metrics[key] == pytest.approx(values, rel=1e-6, abs=1e-9, nan_ok=True), key
    return ours, t_metrics, o_batch


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_disabled_preset_equals_trl_for_every_loss_type(tmp_path, loss_type):
    # two generation steps per batch: the dapo/cispo/vespo normalizer spans micro-batches; num_iterations=2: ratio != 1
    assert_same_as_trl(tmp_path, loss_type=loss_type, num_iterations=2, gradient_accumulation_steps=2)


OPTION_CASES = {
    "beta": dict(beta=0.04, loss_type="grpo"),
    "beta_no_bias_correction": dict(beta=0.04, use_bias_correction_kl=False, num_iterations=2),
    "num_iterations_2": dict(num_iterations=2, loss_type="bnpo"),
    "mask_truncated_completions_grpo": dict(mask_truncated_completions=True, loss_type="grpo"),
    "mask_truncated_completions_dapo": dict(mask_truncated_completions=True, num_iterations=2),
    "top_entropy_quantile": dict(top_entropy_quantile=0.5, loss_type="grpo"),
    "entropy_bonus": dict(entropy_coef=0.05, loss_type="dr_grpo"),
    "adaptive_entropy": dict(use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=10.0),
    "gspo": dict(importance_sampling_level="sequence", loss_type="grpo", num_iterations=2),
    "gspo_luspo": dict(importance_sampling_level="sequence", loss_type="luspo", num_iterations=2),
    "off_policy_mask": dict(off_policy_mask_threshold=0.05, num_iterations=2),
    "two_sided_clip": dict(delta=1.05, epsilon=0.01, num_iterations=2),
    "tool_mask": dict(env_mask=True, loss_type="grpo", num_iterations=2),
}


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_disabled_preset_equals_trl_with_trl_options(tmp_path_factory, case):
    overrides = dict(OPTION_CASES[case])
    tmp_path = tmp_path_factory.mktemp(case)
    if overrides.get("beta"):  # TRL builds the reference model from a path
        model_dir = tiny_model_dir(tmp_path_factory.mktemp("model"))
        overrides["model_factory"] = lambda: model_dir
    _, metrics, batch = assert_same_as_trl(tmp_path, **overrides)
    if case.startswith("mask_truncated"):
        assert (batch["completion_mask"].sum(-1) == 0).any()  # TRL itself masks whole sequences here
    if case == "tool_mask":
        assert (batch["tool_mask"] == 0).any()
    if case == "beta":
        assert "kl" in metrics


def test_disabled_preset_equals_trl_with_moe_aux_loss(tmp_path):
    ours, metrics, _ = assert_same_as_trl(tmp_path, model_factory=build_moe_model, loss_type="grpo")
    assert ours.aux_loss_enabled and "aux_loss" in metrics  # aux_loss is logged, as TRL logs it


def test_train_logs_equal_trl(tmp_path):
    """Two optimizer steps of real train() with GA=2: every key TRL logs, same value (timings aside)."""
    logs = {}
    for cls in (GRPOTrainer, RolloutCorrGRPOTrainer):
        trainer = build(cls, tmp_path / cls.__name__, build_model(hidden_size=32), loss_type="grpo", max_steps=2,
                        gradient_accumulation_steps=2, mask_truncated_completions=True, beta=0.0)
        collector = LogCollector()
        trainer.add_callback(collector)
        torch.manual_seed(0)
        trainer.train()
        logs[cls.__name__] = [log for log in collector.logs if "loss" in log]
    theirs, ours = logs["GRPOTrainer"], logs["RolloutCorrGRPOTrainer"]
    assert len(theirs) == len(ours) == 2
    timing = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
    for t_log, o_log in zip(theirs, ours):
        assert {"clip_ratio/low_min", "clip_ratio/high_max", "entropy"} <= set(t_log)  # TRL's per-sequence clip metrics
        for key, value in t_log.items():
            if key not in timing:
                assert o_log[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_no_args_builds_a_default_config_like_trl(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # the default config asks for bf16, which transformers refuses on a machine without a bf16 GPU: pretend there is one
    import transformers.training_args

    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    dataset = Dataset.from_list(ROWS)
    theirs = GRPOTrainer(model=build_model(hidden_size=32), reward_funcs=reward, train_dataset=dataset,
                         processing_class=TOK)
    ours = RolloutCorrGRPOTrainer(model=build_model(hidden_size=32), reward_funcs=reward, train_dataset=dataset,
                                  processing_class=TOK)
    assert isinstance(ours.args, RolloutCorrGRPOConfig)
    assert ours.args.output_dir == theirs.args.output_dir
    assert ours.rollout_correction == RolloutCorrGRPOConfig(output_dir="x").rollout_correction
    with pytest.raises(TypeError, match="Replace GRPOConfig by RolloutCorrGRPOConfig"):
        RolloutCorrGRPOTrainer(model=build_model(hidden_size=32), reward_funcs=reward, args=GRPOConfig("x"),
                               train_dataset=dataset, processing_class=TOK)


# ---------------------------------------------------------------------------------------------- the invariants

def policy_logps(trainer, batch) -> torch.Tensor:
    """log pi_theta(a_t) of the micro-batch, with grad: the input of the float64 reference losses.   (B, T)"""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)  # (B, P+T)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)  # (B, P+T)
    logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention,
                                                             batch["completion_ids"].size(1))
    return logps

def reference_loss(loss_type, logps, old, adv, w, mask, eps_low, eps_high, sequence_level, args, num_items,
                   sampler_ratio=None):
    """TRL 1.16's per-token losses re-derived in float64, times the IS weight w, aggregated over the kept mask.

    VESPO: ``sampler_ratio`` (B, T) enters phi's sequence log-ratio, as TRL's vLLM correction hands it over."""
    logps, old, w, mask = (x.double() for x in (logps, old, w, mask))
    adv = adv.double().unsqueeze(1)  # (B, 1)
    log_ratio = logps - old  # (B, T)
    if sequence_level:
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)).unsqueeze(1)  # (B, 1)
    r = torch.exp(log_ratio)
    if loss_type == "cispo":
        per_token = -torch.clamp(r, max=eps_high).detach() * adv * logps
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, args.sapo_temperature_pos, args.sapo_temperature_neg)
        per_token = -torch.sigmoid(tau * (r - 1)) * 4 / tau * adv
    elif loss_type == "vespo":
        seq_log = (torch.clamp(logps - old, -20, 20) * mask).sum(-1, keepdim=True)  # (B, 1)
        if sampler_ratio is not None:
            seq_log = seq_log + torch.log(sampler_ratio.double()).clamp(math.log(1e-8), 20.0).sum(-1, keepdim=True)
        log_w = torch.clamp(seq_log, math.log(1e-8), 20.0)
        k = torch.where(adv >= 0, args.vespo_k_pos, args.vespo_k_neg)
        lam = torch.where(adv >= 0, args.vespo_lambda_pos, args.vespo_lambda_neg)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).detach()
        per_token = -phi * adv * logps
    else:
        per_token = -torch.min(r * adv, torch.clamp(r, 1 - eps_low, 1 + eps_high) * adv)
    per_token = per_token * w  # the invariant: the weight multiplies each token's loss
    if loss_type in ("grpo", "sapo"):
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (mask.size(0) * MAX_LEN)
    if loss_type == "luspo":
        return (per_token * mask).sum(-1).mean()
    return (per_token * mask).sum() / num_items  # dapo, cispo, vespo


INVARIANT_CASES = [(lt, "token") for lt in LOSS_TYPES] + [("grpo", "sequence"), ("luspo", "sequence")]


@pytest.mark.parametrize("loss_type,level", INVARIANT_CASES, ids=[f"{lt}-{lv}" for lt, lv in INVARIANT_CASES])
def test_is_weights_multiply_each_token_and_rejected_tokens_leave_every_count(tmp_path, loss_type, level):
    """IS weights multiply each token's policy loss (GSPO: one weight per sequence), rejected tokens leave every count;
    VESPO's phi sees the truncated sampler ratio instead, exactly as TRL's own vLLM correction feeds it."""
    preset = "decoupled_seq_is" if level == "sequence" else "decoupled_token_is"
    trainer = build(RolloutCorrGRPOTrainer, tmp_path, build_model(hidden_size=32), preset=preset,
                    loss_type=loss_type, importance_sampling_level=level, num_iterations=2)
    batch = one_micro_batch(trainer, ROWS[:8])  # decoupled with a pi_old forward: rc_* ride with the batch
    perturb_(trainer.model)
    mask = batch["completion_mask"].float()  # (B, T)
    gen = torch.Generator().manual_seed(3)
    w = (0.2 + 1.8 * torch.rand(mask.shape, generator=gen)) * mask  # (B, T) IS weights, > 0 on valid tokens
    if level == "sequence":
        w = w.amax(-1, keepdim=True) * mask  # (B, T) one weight per sequence
    keep = (torch.rand(mask.shape, generator=gen) > 0.3).float() * mask  # (B, T) some tokens rejected
    keep[0] = 0.0  # and one whole sequence
    kept = keep.sum()
    vespo = loss_type == "vespo"
    batch.update(rc_keep_mask=keep.long(), num_items_in_batch=kept)
    batch["rc_sampler_ratio" if vespo else "rc_is_weights"] = torch.where(keep.bool(), w, 1.0) if vespo else w
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    ours = [p.grad.clone() for p in trainer.model.parameters()]

    trainer.model.zero_grad()
    logps = policy_logps(trainer, batch)  # (B, T) with grad
    expected = reference_loss(loss_type, logps, batch["old_per_token_logps"], batch["advantages"],
                              torch.ones_like(w) if vespo else w, keep, trainer.epsilon_low, trainer.epsilon_high,
                              level == "sequence", trainer.args, kept,
                              sampler_ratio=torch.where(keep.bool(), w, 1.0) if vespo else None)
    expected.backward()
    assert loss.item() != 0.0
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-7)
    for a, p in zip(ours, trainer.model.parameters()):
        # two float32 paths to one gradient: elements near 0 differ by float32 rounding of the summed terms (seen:
        # 1.4e-7 in one element of 16 for luspo-sequence); a missing weight or a rejected token left in moves
        # elements by >= 1e-3
        torch.testing.assert_close(a, p.grad.to(a.dtype), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "sapo", "vespo"])
def test_policy_gradient_mode_has_the_reinforce_gradient(tmp_path, loss_type):
    """use_policy_gradient: gradient = that of -sg(w) A log pi_theta, w = min(prod_t pi_theta / pi_rollout, C)."""
    trainer = build(RolloutCorrGRPOTrainer, tmp_path, build_model(hidden_size=32), preset="pg_is", loss_type=loss_type,
                    rollout_is_threshold=1e6)
    batch = one_micro_batch(trainer, ROWS[:8])
    trainer.model.zero_grad()
    trainer.compute_loss(trainer.model, batch).backward()
    ours = [p.grad.clone() for p in trainer.model.parameters()]
    trainer.model.zero_grad()
    logps = policy_logps(trainer, batch)  # (B, T) with grad
    mask = batch["completion_mask"].double()  # (B, T)
    log_w = ((logps.detach().double() - batch["sampling_per_token_logps"].double()) * mask).sum(-1, keepdim=True)
    w = torch.exp(log_w.clamp(-20, 20)).clamp(max=1e6)  # (B, 1) sequence IS weight, untruncated here
    assert w.max() / w.min() > 10  # the weights really differ between sequences
    per_token = -w * batch["advantages"].double().unsqueeze(1) * logps.double()  # (B, T)
    if loss_type in ("grpo", "sapo"):
        expected = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    else:
        expected = (per_token * mask).sum() / batch["num_items_in_batch"]
    expected.backward()
    for a, p in zip(ours, trainer.model.parameters()):
        torch.testing.assert_close(a, p.grad.to(a.dtype), rtol=1e-4, atol=1e-7)


def test_evaluate_returns_the_same_metrics_as_trl(tmp_path):
    """evaluate() on the same eval set: TRL's eval metrics (loss, entropy, clip ratios, ...) equal, ours added."""
    results = {}
    for cls in (GRPOTrainer, RolloutCorrGRPOTrainer):
        trainer = build(cls, tmp_path / cls.__name__, build_model(hidden_size=32), per_device_eval_batch_size=8,
                        num_generations_eval=4)
        torch.manual_seed(0)
        results[cls] = trainer.evaluate(eval_dataset=Dataset.from_list(ROWS[:16]))
    theirs, ours = results[GRPOTrainer], results[RolloutCorrGRPOTrainer]
    assert {"eval_loss", "eval_entropy", "eval_clip_ratio/low_min"} <= set(theirs)
    for key, value in theirs.items():
        if not key.endswith(("_runtime", "_per_second", "_preparation_time")):
            assert ours[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert "eval_rollout_corr/kl" in ours
