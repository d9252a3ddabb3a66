"""Where pi_old comes from and when the correction is computed: decided once, from the config, for every batch.

The PPO anchor pi_old has three possible sources:

* ``"forward"``    decoupled mode: a no-grad forward of the policy over each generation batch, before any update
                   computed from it (TRL's own pi_old forward);
* ``"pi_theta"``   decoupled mode when each generation batch feeds exactly one optimizer step (TRL's test
                   ``gradient_accumulation_steps % (steps_per_generation * num_iterations) == 0``): then
                   pi_old = pi_theta at every micro-batch's loss, and pi_theta detached *is* pi_old (no forward);
* ``"pi_rollout"`` bypass mode: pi_old := pi_rollout.

rho = pi_train / pi_rollout (pi_train = pi_old, or pi_theta in bypass mode) is known per sample. Two statistics have
the scope of a whole **generation batch** (across processes) instead:

* IS batch normalization: w~ = w / mean(w), the mean over the generation batch;
* the kept-token count that ``dapo`` / ``cispo`` / ``vespo`` divide by, when RS or the veto can reject tokens;
* the second-moment mask's threshold (``rollout_m2_threshold``): which tokens it masks depends on the whole batch.

One more needs the correction at generation time whatever the split: ``rollout_rs_exclude_from_baseline`` (the
rejected samples leave their GRPO group's baseline), because TRL forms the advantages once per generation batch,
before any loss runs; it is exact wherever the rejection is known then (decoupled mode; bypass mode with one
optimizer step per generation batch) and refused elsewhere.

A micro-batch holds the whole generation batch only when ``steps_per_generation == 1``. Otherwise a batch-scope
statistic is computed at generation time, for every sample at once, from a no-grad forward of the policy; the
weights and masks then travel with the samples through TRL's buffering. A result therefore never depends on how a
generation batch is split into micro-batches, accumulation steps or processes.

Pure Python: no TRL import.
"""

from __future__ import annotations

from dataclasses import dataclass

from .correction import RolloutCorrectionConfig
from ..core.criteria import CRITERIA

PI_OLD_SOURCES = ("auto", "forward", "free")


@dataclass(frozen=True)
class CorrectionPlan:
    """How every generation batch of a trainer is corrected.

    Attributes:
        pi_old: ``"forward"`` | ``"pi_theta"`` | ``"pi_rollout"`` (see the module docstring).
        at_generation: the correction (weights, masks, metrics) is computed once per generation batch from a no-grad
            policy forward at generation time; otherwise in the loss, from the policy forward the loss runs anyway.
            So it is also whether each generation batch costs one no-grad policy forward beyond TRL's own step.
        batch_scope: the statistics in play whose scope is the generation batch (empty: none).
    """

    pi_old: str
    at_generation: bool
    batch_scope: tuple[str, ...] = ()

    def describe(self) -> str:
        where = ("at generation time, from one no-grad policy forward per generation batch" if self.at_generation
                 else "in the loss, from the policy forward the loss runs anyway (no extra forward)")
        scope = f"; generation-batch statistics: {', '.join(self.batch_scope)}" if self.batch_scope else ""
        return f"pi_old = {self.pi_old}; correction computed {where}{scope}"


def one_optimizer_step_per_generation_batch(gradient_accumulation_steps: int, steps_per_generation: int,
                                            num_iterations: int) -> bool:
    """Whether every micro-batch of a generation batch lands in one optimizer step, so pi_theta does not move while
    the batch is consumed (TRL's own test for skipping its pi_old forward)."""
    return gradient_accumulation_steps % (steps_per_generation * num_iterations) == 0


def batch_scope_statistics(cfg: RolloutCorrectionConfig, loss_type: str,
                           kept_token_normalizer_losses: tuple[str, ...]) -> tuple[str, ...]:
    """The statistics of this configuration whose scope is the generation batch: each criterion's
    (``Criterion.batch_scope``), the kept-token count of the losses that divide by it, the group baselines."""
    scope = [described for criterion in CRITERIA if (described := criterion.batch_scope(cfg)) is not None]
    if cfg.masks_tokens and loss_type in kept_token_normalizer_losses:
        scope.append(f"the kept-token count {loss_type} divides by (RS/veto reject tokens)")
    if cfg.rollout_rs_exclude_from_baseline:
        scope.append("the group baselines without the rejected samples (rollout_rs_exclude_from_baseline)")
    return tuple(scope)


def plan_correction(
    cfg: RolloutCorrectionConfig,
    *,
    pi_old_source: str = "auto",
    loss_type: str = "dapo",
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int = 1,
    num_iterations: int = 1,
    kept_token_normalizer_losses: tuple[str, ...],
) -> CorrectionPlan:
    """Choose where pi_old comes from and where the correction is computed; raise for what cannot be exact.

    ``pi_old_source``: ``"auto"`` (no extra forward unless a generation-batch statistic needs one), ``"forward"``
    (always the pi_old forward, decoupled mode) or ``"free"`` (never: an error where it would change the result).
    ``kept_token_normalizer_losses``: the loss types that divide by the kept-token count (TRL's, from
    :data:`trl_rollout_corr.trl_hooks.grpo.KEPT_TOKEN_NORMALIZER_LOSSES`: this module imports nothing from TRL).
    """
    if pi_old_source not in PI_OLD_SOURCES:
        raise ValueError(f"pi_old_source={pi_old_source!r}: use one of {', '.join(PI_OLD_SOURCES)}.")
    shape = (f"gradient_accumulation_steps={gradient_accumulation_steps}, steps_per_generation="
             f"{steps_per_generation}, num_iterations={num_iterations}")
    one_step = one_optimizer_step_per_generation_batch(gradient_accumulation_steps, steps_per_generation,
                                                       num_iterations)
    whole_batch = steps_per_generation == 1  # each micro-batch is the whole (local) generation batch
    scope = batch_scope_statistics(cfg, loss_type, kept_token_normalizer_losses)
    # the advantages are formed at generation time: a rejection that shapes them must be known then
    loss_time_exact = (not scope or whole_batch) and not cfg.rollout_rs_exclude_from_baseline

    if cfg.bypass_mode:
        if pi_old_source != "auto":
            raise ValueError(f"pi_old_source={pi_old_source!r} with bypass_mode=True: bypass mode takes pi_old := "
                             "pi_rollout, so there is no pi_old to compute. Leave pi_old_source='auto'.")
        if loss_time_exact:
            return CorrectionPlan("pi_rollout", at_generation=False, batch_scope=scope)
        if cfg.rollout_rs_exclude_from_baseline and not one_step:
            raise ValueError(
                f"rollout_rs_exclude_from_baseline=True with bypass_mode=True and {shape}: TRL forms the advantages "
                "once per generation batch, but the bypass rejection is decided on pi_theta/pi_rollout, and pi_theta "
                "moves at every optimizer step within the generation batch, so which samples are rejected is not "
                "known when the baselines are formed. Use decoupled mode (bypass_mode=False: the rejection is decided "
                "on pi_old, fixed per generation batch), one optimizer step per generation batch (num_iterations=1, "
                "steps_per_generation <= gradient_accumulation_steps), or rollout_rs_exclude_from_baseline=False.")
        if one_step:  # pi_theta at generation time = pi_theta at every micro-batch's loss
            return CorrectionPlan("pi_rollout", at_generation=True, batch_scope=scope)
        raise ValueError(
            f"bypass_mode=True with {' and '.join(scope)} and {shape}: the bypass ratio pi_theta/pi_rollout changes "
            "at every optimizer step within a generation batch, so a statistic over the generation batch has no "
            "single value. Use decoupled mode (pi_old is fixed per generation batch), steps_per_generation=1, one "
            "optimizer step per generation batch (num_iterations=1, steps_per_generation <= "
            "gradient_accumulation_steps), a loss_type with a per-sequence or per-micro-batch normalizer (grpo, "
            "bnpo, dr_grpo, sapo, luspo), or rollout_is_batch_normalize=False.")

    if pi_old_source == "forward":
        return CorrectionPlan("forward", at_generation=True, batch_scope=scope)
    if pi_old_source == "free":
        if cfg.rollout_rs_exclude_from_baseline:
            raise ValueError(
                "pi_old_source='free' with rollout_rs_exclude_from_baseline=True: the rejected samples leave the "
                "group baselines TRL forms at generation time, so the rejection (decided on pi_old) must be computed "
                "then, from a pi_old forward. Use pi_old_source='auto' (or 'forward'), or "
                "rollout_rs_exclude_from_baseline=False.")
        if not one_step:
            raise ValueError(
                f"pi_old_source='free' with {shape}: a generation batch feeds several optimizer steps, so pi_theta "
                "moves away from pi_old before the later micro-batches and pi_old must be computed by a forward. Use "
                "pi_old_source='auto' (or 'forward').")
        if not loss_time_exact:
            raise ValueError(
                f"pi_old_source='free' with {' and '.join(scope)} and steps_per_generation={steps_per_generation}: "
                "these statistics span the whole generation batch, which no single micro-batch holds, so they need "
                "pi_old for every sample before the first micro-batch's loss (a forward). Use pi_old_source='auto' "
                "(a forward only in this case) or steps_per_generation=1.")
        return CorrectionPlan("pi_theta", at_generation=False, batch_scope=scope)
    if one_step and loss_time_exact:
        return CorrectionPlan("pi_theta", at_generation=False, batch_scope=scope)
    return CorrectionPlan("forward", at_generation=True, batch_scope=scope)


def check_composition(cfg: RolloutCorrectionConfig, loss_type: str, importance_sampling_level: str) -> None:
    """Refuse TRL losses whose meaning the correction would change silently (each error says why and the fix)."""
    # (VESPO takes the per-token ratio into its sequence weight phi, not as a token weight: no conflict there)
    if (importance_sampling_level == "sequence" and cfg.rollout_is == "token" and cfg.applies_is_weights
            and loss_type != "vespo"):
        raise ValueError(
            "importance_sampling_level='sequence' (GSPO) optimizes one clipped ratio per sequence, so a per-token IS "
            "weight has no defined place in its objective. Use rollout_is='sequence' (one weight per sequence, "
            "w = min(prod_t rho_t, C)) or rollout_is='none'.")
    if loss_type == "vespo" and cfg.rollout_is == "sequence" and not cfg.bypass_mode:
        raise ValueError(
            "loss_type='vespo' weights each sequence by its own function phi of the sampler ratio, built from "
            "per-token ratios (TRL accepts only its token IS modes for VESPO). Use rollout_is='token' (phi sees "
            "min(rho_t, C) per token) or rollout_is='none' (phi sees pi_theta/pi_old only).")
