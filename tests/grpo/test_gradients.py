"""Every preset and mode: each optimizer step's update equals a float64 re-derivation written here from the formulas.

For each case and training shape, a real ``train()`` runs two plain SGD steps (no clipping) from a fixed mismatched
engine (``test_invariance.mismatched_engine``: the policy's log-probs plus seeded noise). The test records the
parameters before each step, the micro-batches each step consumed and the generation batches they came from, and
recomputes the step's gradient independently:

* log-probs from a plain ``model(...).logits`` forward in float64 (not TRL's fused head, not this package);
* rho = pi_train / pi_rollout with pi_train = pi_old (the parameters the generation batch was scored with) in
  decoupled mode, pi_theta in bypass mode; IS weights w = min(exp(clamp(log rho)), C) at token or sequence level,
  batch normalization over the generation batch, RS bands, the veto, non-finite and missing pi_rollout;
* the loss of TRL 1.16 for ``dapo`` and ``grpo`` (PPO clip with the mode's anchor, REINFORCE for policy gradient, the
  k3 KL term with its bias correction, the entropy bonus), with TRL's normalizers and gradient-accumulation scaling.

The update must equal -lr times that gradient (relative difference <= 1e-4, float32 model). Shapes: one micro-batch
per generation batch (no extra forward), a generation batch split into 4 micro-batches (gradient accumulation 4),
``num_iterations=2`` (pi_old forward; the second step's ratio is != 1) and ``steps_per_generation=2`` (two optimizer
steps per generation batch).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.grpo.test_invariance import CASES as INVARIANCE_CASES
from tests.grpo.test_invariance import ROWS, TOK, mismatched_engine
from tests.support.trainer_utils import tiny_model_dir
from trl_rollout_corr import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer
from trl_rollout_corr.testing.toy_task import build_model, reverse_reward
from trl_rollout_corr.trl_hooks.grpo import KEPT_TOKEN_NORMALIZER_LOSSES

LR = 0.05
SHAPES = {
    "one_micro_batch": dict(per_device_train_batch_size=8, gradient_accumulation_steps=1),
    "accumulation_4": dict(per_device_train_batch_size=2, gradient_accumulation_steps=4),
    "num_iterations_2": dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, num_iterations=2),
    "steps_per_generation_2": dict(per_device_train_batch_size=4, gradient_accumulation_steps=1,
                                   steps_per_generation=2),
}
CASES = {
    "decoupled_token_is": dict(preset="decoupled_token_is", rollout_is_threshold=1.3),
    "decoupled_seq_is": dict(preset="decoupled_seq_is", rollout_is_threshold=1.5),
    "decoupled_seq_is_rs": dict(preset="decoupled_seq_is_rs", rollout_rs_threshold=1.6, rollout_rs_threshold_lower=0.6),
    "decoupled_geo_rs": INVARIANCE_CASES["geo_rs_veto_dapo"],
    "ppo_is_bypass": dict(preset="ppo_is_bypass", epsilon=0.1),
    "pg_is_truncated": dict(preset="pg_is", rollout_is_threshold=1.2),
    "pg_rs": INVARIANCE_CASES["bypass_pg_rs_dapo"],
    "disabled": dict(preset="disabled"),
    "token_is_bn_grpo": dict(preset="decoupled_token_is", rollout_is_batch_normalize=True, loss_type="grpo"),
    "seq_is_bn": INVARIANCE_CASES["seq_is_bn"],
    "token_rs_veto": dict(preset="decoupled_token_is", rollout_rs="token", rollout_rs_threshold=1.5,
                          rollout_token_veto_threshold=0.5),
    "pg_is_bn": INVARIANCE_CASES["bypass_pg_is_bn"],
    "bypass_token_rs_grpo": dict(preset="ppo_is_bypass", rollout_rs="token", rollout_rs_threshold=1.5,
                                 loss_type="grpo"),
    "beta_entropy_rs": dict(preset="decoupled_token_is", rollout_rs="token", rollout_rs_threshold=1.5, beta=0.1,
                            entropy_coef=0.05),
    "nan_and_missing": dict(preset="decoupled_token_is", rollout_is_batch_normalize=True,
                            engine=dict(nan_every=3, missing_every=4)),
    "trl_default": dict(preset="trl_default", rollout_is_threshold=1.5),  # the sequence mask bites at C=1.5
    "token_mask_two_sided": dict(preset="trl_default", rollout_is="token", rollout_is_threshold=1.3,
                                 rollout_is_threshold_lower=0.8),
    "token_truncate_two_sided": dict(preset="decoupled_token_is", rollout_is_threshold=1.3,
                                     rollout_is_threshold_lower=0.8),
    "second_moment_mask": dict(preset="decoupled_token_is", rollout_m2_threshold=0.02),
    "bypass_second_moment_mask": dict(preset="ppo_is_bypass", rollout_m2_threshold=0.02, loss_type="grpo"),
}


def refused(case: dict, shape: dict) -> bool:
    """Bypass with a generation-batch statistic and several optimizer steps per split batch is refused by design
    (tests/config/test_plan.py checks the refusal)."""
    from trl_rollout_corr.config.correction import RolloutCorrectionConfig
    from trl_rollout_corr.config.plan import plan_correction

    fields = {k: v for k, v in case.items() if k.startswith("rollout_")}
    rc = RolloutCorrectionConfig.from_preset(case["preset"], **fields)
    ga = shape["gradient_accumulation_steps"]
    try:
        plan_correction(rc, loss_type=case.get("loss_type", "dapo"), gradient_accumulation_steps=ga,
                        steps_per_generation=shape.get("steps_per_generation", ga),
                        num_iterations=shape.get("num_iterations", 1),
                        kept_token_normalizer_losses=KEPT_TOKEN_NORMALIZER_LOSSES)
    except ValueError:
        return True
    return False


PARAMS = [(c, s) for c in CASES for s in SHAPES if not refused(CASES[c], SHAPES[s])]


# ---------------------------------------------------------------------------------------------- recording a run
class Recorder:
    """Parameters before each optimizer step, the generation batches (with the parameters that scored them) and the
    micro-batches each step consumed."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.params_at_step: list[dict] = []
        self.generations: list[dict] = []
        self.micro_batches: list[tuple[int, int, dict]] = []  # (step, generation index, inputs)
        generate, compute_loss = trainer._generate_and_score_completions, trainer.compute_loss

        def scored(inputs):
            out = generate(inputs)
            self.generations.append({"params": self.snapshot(), **{k: v for k, v in out.items()}})
            return out

        def loss(model, inputs, *args, **kwargs):
            if trainer.model.training:
                self.micro_batches.append((trainer.state.global_step, len(self.generations) - 1, dict(inputs)))
            return compute_loss(model, inputs, *args, **kwargs)

        trainer._generate_and_score_completions = scored
        trainer.compute_loss = loss

    def snapshot(self) -> dict:
        return {n: p.detach().clone() for n, p in self.trainer.model.named_parameters()}


def train(tmp_path, model, case, shape):
    from datasets import Dataset
    from transformers import TrainerCallback

    overrides = {k: v for k, v in case.items() if k not in ("preset", "engine")}
    args = RolloutCorrGRPOConfig(
        output_dir=str(tmp_path), num_generations=4, max_completion_length=6, max_steps=2, learning_rate=LR,
        optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, bf16=False, seed=0, dataloader_num_workers=0, disable_tqdm=True,
        rollout_correction_preset=case["preset"], **shape, **overrides)
    trainer = RolloutCorrGRPOTrainer(model=model, reward_funcs=reverse_reward, args=args,
                                     train_dataset=Dataset.from_dict(ROWS), processing_class=TOK,
                                     rollout_func=mismatched_engine(**case.get("engine", {})))
    recorder = Recorder(trainer)

    class AtStepBegin(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            recorder.params_at_step.append(recorder.snapshot())

    trainer.add_callback(AtStepBegin())
    reference_params = recorder.snapshot()  # the reference model of beta > 0 is the initial policy
    trainer.train()
    final = recorder.snapshot()
    return trainer, recorder, reference_params, final


# ---------------------------------------------------------------------------------------------- the re-derivation
def load(model, params):
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])


def forward64(model, batch, entropy=False):
    """log pi(a_t) (B, T) in float64 (and the entropies) by a plain forward of ``model`` as it is."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)  # (B, P+T)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)  # (B, P+T)
    width = batch["completion_ids"].size(1)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, -width - 1:-1].double()  # (B, T, V)
    logp_all = torch.log_softmax(logits, dim=-1)  # (B, T, V)
    logps = logp_all.gather(-1, batch["completion_ids"][..., None]).squeeze(-1)  # (B, T)
    if not entropy:
        return logps
    return logps, -(logp_all.exp() * logp_all).sum(-1)  # (B, T)


def logps_at(model, params, batch):
    """log pi_params(a_t), no grad.   (B, T)"""
    load(model, params)
    with torch.no_grad():
        return forward64(model, batch)


def m2_cut(log_rho, valid, tau):
    """The second-moment mask's cut: the smallest v = (log rho)^2 dropped from the sorted values (inf: none)."""
    ordered = sorted((log_rho.clamp(-20, 20)[valid] ** 2).tolist())
    k = len(ordered)
    while k > 0 and sum(ordered[:k]) / k > tau:
        k -= 1
    return ordered[k] if k < len(ordered) else math.inf


def corrected_quantities(cfg, train_logps, rollout, mask, cut=None):
    """(IS weights or None, kept mask, per-row validity) from pi_train and pi_rollout, rows of one batch (float64).

    ``cut``: the second-moment mask's cut of the generation batch (None: this batch's own)."""
    missing = (torch.isnan(rollout) | ~mask).all(1) & mask.any(1)  # (B,) no pi_rollout at all: uncorrected
    finite = torch.isfinite(rollout) & torch.isfinite(train_logps)
    valid_row = ~((mask & ~finite).any(1)) & ~missing  # (B,)
    valid = mask & valid_row[:, None]  # (B, T)
    log_rho = torch.where(valid, train_logps - torch.nan_to_num(rollout), torch.zeros_like(train_logps))  # (B, T)
    keep = valid.clone()
    seq = log_rho.sum(1, keepdim=True)  # (B, 1)
    if cfg.rollout_rs is not None:
        lower = cfg.rollout_rs_threshold_lower
        lower = 1 / cfg.rollout_rs_threshold if lower is None else lower
        stat = {"token": log_rho, "sequence": seq.expand_as(log_rho),
                "geometric": (seq / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(log_rho)}[cfg.rollout_rs]
        stat = stat.clamp(-20, 20)
        keep &= (stat >= math.log(lower)) & (stat <= math.log(cfg.rollout_rs_threshold))
    if cfg.rollout_token_veto_threshold is not None:
        keep &= ~((log_rho < math.log(cfg.rollout_token_veto_threshold)) & valid).any(1, keepdim=True)
    if cfg.rollout_m2_threshold is not None:
        cut = m2_cut(log_rho, valid, cfg.rollout_m2_threshold) if cut is None else cut
        keep &= log_rho.clamp(-20, 20) ** 2 < cut
    if cfg.rollout_rs_criteria == "token_k3":  # k3 = rho - 1 - log rho <= threshold
        keep &= (torch.exp(log_rho) - 1 - log_rho) <= float(cfg.rollout_rs_criteria_threshold)
    weights = None
    if cfg.rollout_is is not None:
        raw = log_rho if cfg.rollout_is == "token" else seq.expand_as(log_rho)
        rho = torch.exp(raw.clamp(-20, 20))  # (B, T)
        lower = cfg.rollout_is_threshold_lower
        if cfg.rollout_is_bound == "mask":  # rho where C_lower <= rho <= C, else 0 (the token stays in the mask)
            inside = (rho <= cfg.rollout_is_threshold) & (rho >= (lower if lower is not None else 0.0))
            weights = torch.where(inside, rho, torch.zeros_like(rho)) * valid  # (B, T)
        else:  # clamp(rho, C_lower, C)
            weights = rho.clamp(min=lower, max=cfg.rollout_is_threshold) * valid  # (B, T)
    keep |= mask & missing[:, None]
    return weights, keep, valid, missing


def batch_norm_mean(cfg, weights, valid):
    if cfg.rollout_is == "token":
        return weights[valid].sum() / valid.sum()
    rows = valid.any(1)
    return ((weights * valid).sum(1)[rows] / valid.sum(1)[rows]).sum() / rows.sum()


def reference_gradient(trainer, recorder, step, model, reference_params):
    """d(loss of optimizer step ``step``)/d(theta) re-derived in float64 from the recorded batches."""
    cfg, args = trainer.rollout_correction, trainer.args
    theta = recorder.params_at_step[step]
    ga, spg = args.gradient_accumulation_steps, args.steps_per_generation
    grads = None
    for mb_step, gen_index, mb in recorder.micro_batches:
        if mb_step != step:
            continue
        generation = recorder.generations[gen_index]
        gen_mask = generation["completion_mask"].bool()
        # the generation batch's statistics, from pi_train (pi_old; pi_theta in bypass mode) over all its samples
        gen_train = logps_at(model, theta if cfg.bypass_mode else generation["params"], generation)
        gen_w, gen_keep, gen_valid, _ = corrected_quantities(
            cfg, gen_train, generation["sampling_per_token_logps"].double(), gen_mask)
        cut = None
        if cfg.rollout_m2_threshold is not None:  # a generation-batch statistic, like the batch-norm mean
            gen_log_rho = torch.nan_to_num(gen_train - generation["sampling_per_token_logps"].double())
            cut = m2_cut(gen_log_rho, gen_valid, cfg.rollout_m2_threshold)
        norm = batch_norm_mean(cfg, gen_w, gen_valid) if cfg.rollout_is_batch_normalize else 1.0
        n_kept = gen_keep.sum()
        # this micro-batch: pi_old (the parameters that scored its generation batch), pi_ref, then pi_theta with grad
        mask = mb["completion_mask"].bool()
        old = logps_at(model, generation["params"], mb)
        ref = logps_at(model, reference_params, mb) if trainer.beta != 0.0 else None
        load(model, theta)
        for p in model.parameters():
            p.grad = None
        logps, entropy = forward64(model, mb, entropy=True)  # (B, T) with grad
        sampling = mb["sampling_per_token_logps"].double()  # (B, T)
        w, keep, valid, missing = corrected_quantities(cfg, logps.detach() if cfg.bypass_mode else old, sampling, mask,
                                                       cut)
        applies_w = w is not None and (not cfg.bypass_mode or cfg.use_policy_gradient)
        if applies_w:
            w = torch.where(missing[:, None] & mask, torch.ones_like(w), w / norm)  # no pi_rollout: weight 1
            if cfg.rollout_is == "sequence":
                w = w.amax(1, keepdim=True)  # (B, 1) one weight per sequence
        else:
            w = torch.ones_like(logps)
        if cfg.bypass_mode and not cfg.use_policy_gradient:
            anchor = torch.where(torch.isfinite(sampling), sampling, logps.detach())  # PPO clipped on pi_rollout
        elif cfg.bypass_mode:
            anchor = logps.detach()  # policy gradient: ratio 1, gradient -w A grad log pi_theta
        else:
            anchor = old
        adv = mb["advantages"].double()[:, None]  # (B, 1)
        r = torch.exp(logps - anchor)  # (B, T)
        eps_low, eps_high = trainer.epsilon_low, trainer.epsilon_high
        per_token = -torch.min(r * adv * w, r.clamp(1 - eps_low, 1 + eps_high) * adv * w)  # (B, T)
        if ref is not None:  # k3 to the reference, with TRL's bias correction by the PPO ratio
            per_token = per_token + trainer.beta * (torch.exp(ref - logps) - (ref - logps) - 1) * r
        kept = (mask & keep).double()  # (B, T)
        if trainer.loss_type == "grpo":
            loss = ((per_token * kept).sum(1) / kept.sum(1).clamp(min=1)).mean() / ga
        else:  # dapo: TRL's normalizer, num_items_in_batch (kept tokens of the generation batch) * GA / spg
            loss = (per_token * kept).sum() / (n_kept.clamp(min=1) * ga / spg)
        if trainer.entropy_coef:
            loss = loss - trainer.entropy_coef * (entropy * kept).sum() / kept.sum().clamp(min=1) / ga
        loss.backward()
        step_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        grads = step_grads if grads is None else {n: grads[n] + g for n, g in step_grads.items()}
    return grads


@pytest.mark.parametrize("case,shape", PARAMS, ids=[f"{c}-{s}" for c, s in PARAMS])
def test_each_step_matches_the_float64_re_derivation(tmp_path_factory, case, shape):
    spec = CASES[case]
    model_dir = tiny_model_dir(tmp_path_factory.mktemp("model")) if spec.get("beta") else None
    trainer, recorder, reference_params, final = train(tmp_path_factory.mktemp(case), model_dir or build_model(
        hidden_size=32), spec, SHAPES[shape])
    model = build_model(hidden_size=32).double()
    after = recorder.params_at_step[1:] + [final]
    for step in range(2):
        grads = reference_gradient(trainer, recorder, step, model, reference_params)
        update = torch.cat([(after[step][n] - recorder.params_at_step[step][n]).flatten().double() for n in grads])
        expected = torch.cat([(-LR * g).flatten() for g in grads.values()])
        assert update.abs().max() > 1e-6, (case, shape, step)  # the step really moves the policy
        assert ((update - expected).norm() / expected.norm()).item() <= 1e-4, (case, shape, step)
