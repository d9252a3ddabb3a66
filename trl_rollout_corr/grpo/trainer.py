"""RolloutCorrGRPOTrainer: the correction wired into TRL's GRPO hooks.

Data flow, one generation batch at a time:

1. ``_generate_single_turn`` (transformers path) captures pi_rollout from ``generate``'s own sampling distribution;
   vLLM and a ``rollout_func`` hand it over. ``_generate`` checks it per sample (missing, misaligned).
2. ``_generate_and_score_completions`` runs TRL's scoring. TRL's own pi_old forward is never used: the trainer's
   :class:`~trl_rollout_corr.config.plan.CorrectionPlan` decides, once, whether one no-grad policy forward per
   generation
   batch is needed (decoupled pi_old when pi_theta moves within the batch, or a statistic over the whole generation
   batch). If so, weights, kept mask and PPO anchor are computed here and travel with the samples.
3. ``compute_loss`` runs the policy forward, computes the correction now if it was not computed at generation
   time (rho from pi_theta detached), and runs TRL's own ``compute_loss`` on a corrected copy of the micro-batch
   (:mod:`trl_rollout_corr.core.losses`); TRL's request for the policy forward gets the one already run.
4. ``log`` reduces the ``rollout_corr/*`` statistics across processes once per logging step.

Every assumption about TRL's call order and data layout lives in :mod:`trl_rollout_corr.trl_hooks` and is checked
when used.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer

from ..core.group_baseline import baseline_stats, fully_rejected, group_advantages
from ..core.pipeline import rollout_usable_mask
from ..core.metric_names import metric
from ..core.stats import STAT_DTYPE, RolloutStats, process_all_reduce
from ..core.truncation import SamplingTruncation
from ..training.correction_trainer import CorrectionTrainerMixin, micro_batch_counts, require_correction_config
from .config import RolloutCorrGRPOConfig
from ..core.dppo import decoupled_dppo_stats
from ..core.losses import (Correction, batch_correction, corrected_loss_mask, loss_patch, policy_loss_advantages,
                           policy_loss_terms)
from ..training.resume import resolve_checkpoint, restore_rollout_state, save_rollout_state
from ..rollout.capture import capture_sampling_logprobs, refuse_beam_search
from ..rollout.logprobs import check_rollout_logprobs
from ..rollout.support import KeptMassProbe
from ..monitor.advice import truncation_advice
from ..trl_hooks import TrlInternalsChanged
from ..trl_hooks import grpo as trl_grpo
from ..trl_hooks.grpo import KEPT_TOKEN_NORMALIZER_LOSSES, checkpoint_dir, forward_input_names, trl_runs_pi_old_forward
from ..trl_hooks.grpo_forwards import FORWARD_MISMATCH, TrlForwardCalls

logger = logging.getLogger(__name__)

__all__ = ["RolloutCorrGRPOConfig", "RolloutCorrGRPOTrainer"]


def _checked_rollout_func(rollout_func):
    """Validate a rollout_func's output before TRL reads it (TRL fails deep inside on empty completions)."""
    def checked(prompts, trainer):
        output = rollout_func(prompts, trainer)
        for i, ids in enumerate(output.get("completion_ids") or []):
            if len(ids) == 0:
                raise ValueError(f"Sample {i}: the rollout_func returned an empty completion (no token ids). Return at "
                                 "least the EOS token (with its log-prob) for a completion that stopped immediately.")
        return output
    return checked


# Sampler settings (vLLM SamplingParams and transformers GenerationConfig names, through generation_kwargs) that change
# the distribution tokens are sampled from beyond temperature and top-k/top-p/min-p, with their neutral value: the
# trainer does not reproduce them, so pi_rollout is not the distribution pi_train is compared with.
PI_ROLLOUT_MODIFIERS: dict[str, Any] = {
    "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None,
    "bad_words": None, "allowed_token_ids": None, "min_tokens": 0, "structured_outputs": None,
    "guided_decoding": None, "logits_processors": None, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "sequence_bias": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "min_new_tokens": 0, "min_length": 0, "exponential_decay_length_penalty": None,
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
}


def pi_rollout_modifiers(args: Any, repetition_penalty: float | None = None) -> list[str]:
    """``name=value`` of every sampler setting that changes pi_rollout in a way the trainer does not reproduce: the
    repetition penalty, the settings of :data:`PI_ROLLOUT_MODIFIERS` in ``generation_kwargs`` away from their neutral
    value, and TRL's ``vllm_structured_outputs_regex``.

    Args:
        args: the trainer's config (``generation_kwargs``, ``vllm_structured_outputs_regex``).
        repetition_penalty: the config's ``repetition_penalty`` field (``generation_kwargs`` win over it, as in TRL).

    Returns:
        The settings found, e.g. ``["repetition_penalty=1.1"]``; empty where pi_rollout is reproducible.
    """
    kwargs = dict(getattr(args, "generation_kwargs", None) or {})
    penalty = kwargs.pop("repetition_penalty", repetition_penalty)  # generation_kwargs win over the field, as in TRL
    found = [] if penalty in (None, 1.0) else [f"repetition_penalty={penalty}"]
    for name, value in kwargs.items():
        if name in PI_ROLLOUT_MODIFIERS and value not in (None, PI_ROLLOUT_MODIFIERS[name], {}, [], ()):
            found.append(f"{name}={value!r}")
    if getattr(args, "vllm_structured_outputs_regex", None):
        found.append(f"vllm_structured_outputs_regex={args.vllm_structured_outputs_regex!r}")
    return found


class RolloutCorrGRPOTrainer(CorrectionTrainerMixin, GRPOTrainer):
    """``GRPOTrainer`` that keeps pi_rollout with every completion and applies rollout correction in the loss.

    The loss is TRL's own, on a micro-batch patched by :func:`~trl_rollout_corr.core.losses.loss_patch`: per token,
    A' = A * w * z with w = min(rho, C) (rho = pi_old / pi_rollout in decoupled mode, pi_theta / pi_rollout in
    bypass policy gradient; no w in bypass PPO, whose ratio pi_theta / pi_rollout already is rho), rejected tokens
    out of TRL's loss mask, and the anchor of TRL's ratio pi_theta / anchor set by
    :func:`~trl_rollout_corr.core.losses.loss_anchor`.

    Args:
        model: TRL's ``model`` (a model id or a ``PreTrainedModel``).
        reward_funcs: TRL's reward functions.
        args: a :class:`RolloutCorrGRPOConfig` (``GRPOConfig`` plus the correction fields); None: the default
            config named after the model, as TRL names its own.
        *rest: TRL's further positional arguments (datasets, processing class, ...).
        rollout_sampler: optional ``generate``-compatible object standing in for the rollout engine on the
            transformers path (see ``trl_rollout_corr.rollout.emulated``); it must have ``sync(policy, step)``
            and ``generate(**kwargs)``.
        **kwargs: TRL's keyword arguments.

    Raises:
        TypeError: ``args`` is not a :class:`RolloutCorrGRPOConfig`.
        ValueError: an invalid correction field, or a setting that contradicts the correction (continuous
            batching, beam search), naming the fix.
    """

    def __init__(self, model: Any, reward_funcs: Any = None, args: GRPOConfig | None = None, *rest: Any,
                 rollout_sampler: Any = None, **kwargs: Any) -> None:
        from ..runtime.versions import check_version
        from ..vllm.engine import vllm_engine_setup

        check_version("trl")
        trl_grpo.check_hooks(__class__, type(self))
        if args is None:  # the default config, named as TRL names its own
            model_name = model if isinstance(model, str) else trl_grpo.config_model_id(model.config)
            args = RolloutCorrGRPOConfig(f"{model_name.split('/')[-1]}-GRPO")
        require_correction_config(args, RolloutCorrGRPOConfig, "RolloutCorrGRPOTrainer")
        if args.use_vllm:
            check_version("vllm")
        with vllm_engine_setup(args) as vllm_setup:  # CPU fixes, engine dtype, control token: while TRL builds vLLM
            super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self.correction_plan = self.args.correction_plan()
        self._rc_freeze()  # the correction this trainer planned: a change to args raises from now on
        self.rollout_sampler = rollout_sampler
        if self.rollout_func is not None:
            self.rollout_func = _checked_rollout_func(self.rollout_func)
        self._check_supported()
        self._trl_forwards = TrlForwardCalls(forward_input_names(__class__, type(self)))
        self._rc_stats = {"train": RolloutStats(), "eval": RolloutStats()}
        self._rc_truncation = self._resolve_sampling_truncation()
        self._rc_apply_truncation = (self._rc_truncation is not None
                                     and self.args.truncated_support_correction is not False)
        self._rc_warned_missing = False
        self._rc_rewards = None  # TRL's rewards of the batch being scored (rollout_rs_exclude_from_baseline)
        if self.accelerator.is_main_process:
            logger.info("Rollout correction: %s", self.correction_plan.describe())
            if self._rc_truncation is not None:  # measured: experiments/vllm_truncation.py (pre-registrations 20-24)
                t = self._rc_truncation
                logger.warning(truncation_advice(t.top_k, t.top_p, t.min_p))
        if self.use_vllm:  # engine dtype log, vllm_sync_interval, CPU server sync (trl_rollout_corr.vllm.engine)
            from ..vllm.engine import finish_vllm_setup

            finish_vllm_setup(self, vllm_setup)

    def _resolve_sampling_truncation(self) -> SamplingTruncation | None:
        """The sampler's temperature/top-k/top-p/min-p as generation really applies them, or None if no truncation."""
        gen_kwargs = self.args.generation_kwargs or {}
        min_p = gen_kwargs.get("min_p", self.min_p)
        if min_p is None and not self.use_vllm:  # transformers falls back to the model's generation config
            min_p = getattr(getattr(self.model, "generation_config", None), "min_p", None)
        truncation = SamplingTruncation(
            temperature=float(gen_kwargs.get("temperature", self.temperature)),
            top_k=int(gen_kwargs.get("top_k", self.top_k) or 0),
            top_p=float(gen_kwargs.get("top_p", self.top_p) or 1.0),
            min_p=min_p, min_p_first=self.use_vllm)  # vLLM applies min-p before top-k/top-p
        modifiers = pi_rollout_modifiers(self.args, self.repetition_penalty)
        if modifiers and self.accelerator.is_main_process:
            logger.warning("%s change pi_rollout in a way the trainer does not reproduce (penalties, logit biases, "
                           "banned or forced tokens, constrained decoding): the ratio pi_train/pi_rollout is biased on "
                           "the tokens they touch. Prefer to leave them unset.", ", ".join(modifiers))
        return truncation if truncation.truncates else None

    def _check_supported(self) -> None:
        """Refuse only what contradicts the correction (TRL's loss types, GSPO, the entropy bonus and filter and the
        off-policy mask compose with it: see :mod:`trl_rollout_corr.core.losses`)."""
        if self.use_transformers_continuous_batching:
            raise ValueError(
                "RolloutCorrGRPOTrainer does not support use_transformers_continuous_batching=True: TRL's continuous "
                "batching path returns no per-token log-probs, so there is no pi_rollout to correct against. Use plain "
                "generate (use_transformers_continuous_batching=False), vLLM or a rollout_func.")
        if not self.use_vllm and self.rollout_func is None:  # beam search has no pi_rollout: say so before training
            refuse_beam_search(self.generation_config.num_beams)
        if self.rollout_correction.policy_loss is not None and self.loss_type == "vespo":
            raise ValueError("loss_type='vespo' with decoupled DPPO (rollout_dppo set, bypass_mode=False): DPPO is the "
                             "policy loss between pi_theta and pi_old, and VESPO's phi reads that ratio itself. Use "
                             "another loss_type (e.g. 'dapo'), or bypass_mode=True (dppo_tv_bypass, dppo_kl_bypass).")

    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    # ------------------------------------------------------------------ 1. capturing and checking pi_rollout
    def _generate_single_turn(self, *args, **kwargs):
        """TRL's call, passed on unchanged (checked by :func:`trl_rollout_corr.trl_hooks.grpo.generate_single_turn`)."""
        if self.use_vllm:  # TRL asks vLLM for processed log-probs already
            return trl_grpo.generate_single_turn(self, __class__, args, kwargs)
        policy = self.accelerator.unwrap_model(self.model_wrapped)
        sampler = None
        if self.rollout_sampler is not None:
            self.rollout_sampler.sync(policy, self.state.global_step)
            sampler = self.rollout_sampler.generate
        with capture_sampling_logprobs(policy, sampler) as captured:
            completion_ids, _ = trl_grpo.generate_single_turn(self, __class__, args, kwargs)
        logprobs = captured.get("logprobs")  # (B, S), NaN rows where the distribution was not seen
        if logprobs is None:
            return completion_ids, [[float("nan")] * len(ids) for ids in completion_ids]
        logprobs = logprobs.cpu()
        return completion_ids, [logprobs[i, : len(ids)].tolist() for i, ids in enumerate(completion_ids)]

    def _generate(self, prompts: list):
        fields = trl_grpo.generate(self, __class__, prompts)
        source = ("rollout_func" if self.rollout_func is not None
                  else "vLLM" if self.use_vllm else "transformers generate")
        logprobs, seen = check_rollout_logprobs(fields["completion_ids"], fields["logprobs"], source,
                                                require=self.args.require_rollout_logprobs,
                                                nan_marks_missing=source == "transformers generate")
        if not all(seen) and not self._rc_warned_missing:
            self._rc_warned_missing = True
            logger.warning("%d of %d samples have no rollout log-probs (%s): they train uncorrected (IS weight 1, "
                           "nothing rejected), as TRL would, and are counted in %s. Set require_rollout_logprobs=True "
                           "to make this an error. (Warned once.)", seen.count(False), len(seen), source,
                           metric("missing_rollout_logprobs_fraction"))
        scope = self._trl_forwards.active_scoring
        if scope is not None:
            scope.rollout_seen = seen
        fields["logprobs"] = logprobs
        return tuple(fields.values())

    # ------------------------------------------------------------------ 2. scoring a generation batch
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """TRL's calls only (this trainer's own forwards call ``GRPOTrainer``'s directly): see ``TrlForwardCalls``."""
        return trl_grpo.answer_forward(self, __class__, self._trl_forwards, model, input_ids, attention_mask,
                                       logits_to_keep, args, kwargs)

    def _generate_and_score_completions(self, inputs):
        return self._rc_generate_and_score(inputs)

    def _rc_generate_and_score(self, inputs):
        """TRL's generation and scoring, pi_rollout checked, the correction computed here if the plan says so."""
        mode = self._mode()
        ref_model = (self.ref_model if self.ref_model is not None else self.model) if self.beta != 0.0 else None
        with self._trl_forwards.scoring(pi_old_model=self.model if trl_runs_pi_old_forward(self) else None,
                                        ref_model=ref_model) as scope:
            output = trl_grpo.generate_and_score(self, __class__, inputs)
        self._trl_forwards.check_scored_output(output, scope)
        if scope.rollout_seen is None or "sampling_per_token_logps" not in output:
            raise TrlInternalsChanged("GRPOTrainer._generate_and_score_completions did not pass the rollout log-probs "
                                      "through _generate into sampling_per_token_logps")
        device = output["completion_ids"].device
        output["rc_rollout_seen"] = torch.tensor(scope.rollout_seen, dtype=torch.bool, device=device)  # (B,)
        loss_mask = output["completion_mask"]  # (B, T)
        if "tool_mask" in output:
            loss_mask = loss_mask * output["tool_mask"]  # (B, T)
        if mode == "train" and self.correction_plan.at_generation:
            correction = self._correct_generation_batch(output, loss_mask)
            output["rc_keep_mask"] = correction.keep  # (B, T)
            for key, value in (("rc_is_weights", correction.is_weights), ("old_per_token_logps", correction.anchor),
                               ("rc_sampler_ratio", correction.sampler_ratio),
                               ("rc_advantage_mask", correction.advantage_mask)):
                if value is not None:
                    output[key] = value  # (B, T)
            output["num_items_in_batch"] = self.accelerator.gather(correction.keep.sum()).sum()  # kept tokens, global
            if self.rollout_correction.rollout_rs_exclude_from_baseline:
                output["advantages"] = self._baseline_without_rejected(output["advantages"], correction.keep,
                                                                       loss_mask)  # (B,)
        elif self.loss_type in KEPT_TOKEN_NORMALIZER_LOSSES:
            # samples with a non-finite pi_rollout leave the count
            usable = rollout_usable_mask(output["sampling_per_token_logps"], loss_mask, output["rc_rollout_seen"])
            output["num_items_in_batch"] = self.accelerator.gather(usable.sum()).sum()
        return output

    def _calculate_rewards(self, *args, **kwargs):
        """TRL's rewards per function (all processes), kept for :meth:`_baseline_without_rejected`."""
        self._rc_rewards = trl_grpo.calculate_rewards(self, __class__, args, kwargs)  # (N, F)
        return self._rc_rewards

    @torch.no_grad()
    def _baseline_without_rejected(self, advantages: torch.Tensor, keep: torch.Tensor,
                                   loss_mask: torch.Tensor) -> torch.Tensor:
        """This process's advantages with every fully rejected sample (all processes) left out of its group's
        baseline and given advantage 0 (:func:`~trl_rollout_corr.core.group_baseline.group_advantages`).   (B,)

        First checks that TRL's formula, re-applied to TRL's own rewards with nothing left out, gives TRL's
        advantages (a TRL whose formula changed raises ``TrlInternalsChanged`` instead of training on another one).
        """
        rewards, self._rc_rewards = self._rc_rewards, None  # (N, F)
        if rewards is None:
            raise TrlInternalsChanged("GRPOTrainer._generate_and_score_completions formed advantages without calling "
                                      "_calculate_rewards")
        settings = trl_grpo.advantage_settings(self)
        start = self.accelerator.process_index * advantages.size(0)
        local = slice(start, start + advantages.size(0))  # TRL's process slice
        trl_formula = group_advantages(rewards, **settings)[local]  # (B,)
        if not torch.allclose(trl_formula, advantages.to(trl_formula.dtype), rtol=1e-5, atol=1e-6):
            raise TrlInternalsChanged("GRPOTrainer's advantages are not TRL 1.16's group formula re-applied to its "
                                      "rewards, so rollout_rs_exclude_from_baseline cannot recompute them")
        rejected = self.accelerator.gather(fully_rejected(keep, loss_mask).to(torch.int32)).bool()  # (N,)
        once = float(self.accelerator.is_main_process)  # the counts are global already: count them once
        counts = baseline_stats(rejected)
        self._rc_stats["train"].update(RolloutStats(sums={k: v * once for k, v in counts.sums.items()}))
        return group_advantages(rewards, **settings, excluded=rejected)[local].to(advantages.dtype)  # (B,)

    @torch.no_grad()
    def _correct_generation_batch(self, output: dict, loss_mask: torch.Tensor) -> Correction:
        """One no-grad policy forward over the local generation batch, then the correction for all of it."""
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)  # (B, P+T)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)  # (B, P+T)
        model_inputs = {k: output[k] for k in self._trl_forwards.input_names if k in output}
        with trl_grpo.gradient_checkpointing_disabled(self.model, self.args.gradient_checkpointing_kwargs):
            (logps, _, _), support = self._policy_forward(
                self.model, input_ids, attention_mask, output["completion_ids"].size(1), model_inputs,
                batch_size=self.args.per_device_train_batch_size)
        return self._correction(logps, output, loss_mask, support, "train")  # (B, T) each

    @torch.no_grad()
    def score_generation_batch(self, inputs: list[dict]) -> dict[str, Any]:
        """One generation batch as training produces it, scored by the trainer's own forward (the probe's data).

        Generation (vLLM, a ``rollout_func``, an emulated engine or ``generate``) and TRL's scoring run as in a
        training step, with the model in eval mode and no correction; then the policy forward that training would
        run (same dtype, autocast, attention implementation and LM head; a truncating sampler's kept mass included).

        Args:
            inputs: one generation batch of dataset rows (``{"prompt": ..., ...}``), as the train dataloader yields.

        Returns:
            ``train_logps`` (B, T) log pi_train, ``rollout_logps`` (B, T) log pi_rollout, ``mask`` (B, T) completion
            tokens (tool output excluded), ``rollout_seen`` (B,) whether the engine returned log-probs for the
            sample, ``log_mass`` and ``in_support`` (B, T) (None unless the sampler truncates), ``input_ids`` and
            ``attention_mask`` (B, P+T) (prompt and completion, as the forward saw them), ``model_inputs`` (the
            forward's other inputs: images, token types; empty for text), ``advantages`` (B,) TRL's.
        """
        was_training = self.model.training
        self.model.eval()
        try:
            output = self._rc_generate_and_score(inputs)
            input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)  # (B, P+T)
            attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)  # (B, P+T)
            model_inputs = {k: output[k] for k in self._trl_forwards.input_names if k in output}
            (logps, _, _), support = self._policy_forward(
                self.model, input_ids, attention_mask, output["completion_ids"].size(1), model_inputs,
                batch_size=self.args.per_device_train_batch_size)
        finally:
            self.model.train(was_training)
        mask = output["completion_mask"]  # (B, T)
        if "tool_mask" in output:
            mask = mask * output["tool_mask"]  # (B, T)
        log_mass, in_support = support if support is not None else (None, None)
        return {"train_logps": logps, "rollout_logps": output["sampling_per_token_logps"], "mask": mask,
                "rollout_seen": output["rc_rollout_seen"], "log_mass": log_mass, "in_support": in_support,
                "input_ids": input_ids, "attention_mask": attention_mask, "model_inputs": model_inputs,
                "advantages": output["advantages"]}

    def _policy_forward(self, model, input_ids, attention_mask, logits_to_keep, model_inputs, **kwargs):
        """TRL's forward (log-probs, entropies, aux loss), plus the sampler's kept mass when it truncates."""
        if self._rc_truncation is None:
            return trl_grpo.per_token_logps(self, __class__, model, input_ids, attention_mask, logits_to_keep,
                                            **kwargs, **model_inputs), None
        with KeptMassProbe(model, self._rc_truncation, logits_to_keep,
                           cast_lm_head_to_fp32=bool(self.args.cast_lm_head_to_fp32)) as probe:
            result = trl_grpo.per_token_logps(self, __class__, model, input_ids, attention_mask, logits_to_keep,
                                              **kwargs, **model_inputs)
        return result, probe.result()

    def _correction(self, train_logps: torch.Tensor, batch: dict, loss_mask: torch.Tensor, support,
                    mode: str) -> Correction:
        """The correction of ``batch`` from pi_train = ``train_logps`` and pi_rollout
        (:func:`~trl_rollout_corr.core.losses.batch_correction`), its statistics added to this mode's.

        pi_train is pi_old (decoupled: a forward, or pi_theta detached when pi_old = pi_theta) or pi_theta
        (bypass); on a truncating sampler the ratio uses pi_train renormalized over the sampler's kept set. The
        anchor is the generation-time forward only when the plan's ``pi_old`` is ``"forward"`` (training).
        """
        cfg = self.rollout_correction
        correction, stats = batch_correction(
            train_logps, batch["sampling_per_token_logps"], loss_mask, cfg.params(), anchor_mode=cfg.loss_anchor,
            forward_anchor=self.correction_plan.pi_old == "forward" and mode == "train",
            vespo=self.loss_type == "vespo", advantages=batch["advantages"],  # TRL's A, before any correction
            rollout_seen=batch.get("rc_rollout_seen"), support=support, renormalize=self._rc_apply_truncation,
            reduce_fn=process_all_reduce)
        self._rc_stats[mode].update(stats)
        return correction

    # ------------------------------------------------------------------ 3. the corrected loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's own loss on the corrected micro-batch, orchestrated downward: the policy forward from ``trl_hooks``
        (with the kept-mass probe of ``rollout`` when the sampler truncates), the correction from ``core`` (carried
        from generation time, or :func:`~trl_rollout_corr.core.losses.batch_correction` now), the patched inputs
        from ``core.losses``, TRL's loss from ``trl_hooks`` (:func:`~trl_rollout_corr.trl_hooks.grpo.trl_loss`).

        Args:
            model: the (wrapped) policy.
            inputs: one micro-batch of TRL's buffered generation batch: TRL's keys ((B, P) prompt, (B, T)
                completion, (B,) advantages, (B, T) sampling_per_token_logps) plus this trainer's ``rc_*`` keys.
            return_outputs, num_items_in_batch: TRL's.

        Returns:
            TRL's loss (a 0-dim tensor with grad).
        """
        mode = self._mode()
        carried = mode == "train" and self.correction_plan.at_generation
        lost = [k for k in ("rc_rollout_seen", "rc_keep_mask" if carried else None) if k and k not in inputs]
        if lost:
            raise TrlInternalsChanged(f"{', '.join(lost)}, added to the generation batch by this trainer, did not "
                                      "reach compute_loss through TRL's buffering of the generation batch")
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)  # (B, P+T)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)  # (B, P+T)
        model_inputs = {k: inputs.get(k) for k in self._trl_forwards.input_names}
        if carried:
            forward = trl_grpo.per_token_logps(
                self, __class__, model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True,
                compute_aux_loss=self.aux_loss_enabled, **model_inputs)
            support = None
        else:
            forward, support = self._policy_forward(model, input_ids, attention_mask, completion_ids.size(1),
                                                    model_inputs, compute_entropy=True,
                                                    compute_aux_loss=self.aux_loss_enabled)
        logps = forward[0]  # (B, T) log pi_theta, with grad
        tool_mask = inputs.get("tool_mask")
        loss_mask = inputs["completion_mask"] if tool_mask is None else inputs["completion_mask"] * tool_mask  # (B, T)
        if carried:
            correction = Correction(inputs["rc_keep_mask"], inputs.get("rc_is_weights"),
                                    inputs.get("old_per_token_logps"), inputs.get("rc_sampler_ratio"),
                                    inputs.get("rc_advantage_mask"))
        else:
            correction = self._correction(logps.detach(), inputs, loss_mask, support, mode)
        patched = self._corrected_inputs(inputs, correction, logps, loss_mask, tool_mask, whole_batch=not carried)
        with torch.no_grad():  # each process counts its own micro-batches
            self._rc_stats[mode].update(micro_batch_counts((loss_mask * correction.keep).sum(dtype=STAT_DTYPE)))
        loss, mismatch = trl_grpo.trl_loss(self, __class__, self._trl_forwards, model, inputs, patched, forward,
                                           input_ids, attention_mask, return_outputs, num_items_in_batch)
        if mismatch is not None:
            self._rc_stats[mode].update(RolloutStats(maxes={FORWARD_MISMATCH: mismatch.to(STAT_DTYPE)}))
        return loss

    def _corrected_inputs(self, inputs: dict, correction: Correction, logps: torch.Tensor, loss_mask: torch.Tensor,
                          tool_mask: torch.Tensor | None, whole_batch: bool) -> dict:
        """A shallow copy of the micro-batch in which TRL's loss sees the correction."""
        cfg = self.rollout_correction
        patched = dict(inputs)
        kept_mask = loss_mask * correction.keep.to(loss_mask.dtype)  # (B, T)
        patched["tool_mask"] = corrected_loss_mask(inputs["completion_mask"], tool_mask, correction.keep)  # (B, T)
        patch = loss_patch(inputs["advantages"], correction, logps, kept_mask, cfg.rollout_is == "sequence")
        patched["advantages"] = patch.advantages  # (B,), (B, 1) or (B, T)
        if patch.anchor is not None and cfg.policy_loss is None:
            patched["old_per_token_logps"] = patch.anchor  # (B, T)
        else:
            patched.pop("old_per_token_logps", None)  # TRL then uses pi_theta detached
        if cfg.policy_loss is not None:  # decoupled DPPO: A'' = A w z c, r = 1 (core.losses policy losses)
            name, low, high, clip_c = cfg.policy_loss
            pi_old = logps.detach() if correction.anchor is None else correction.anchor  # (B, T)
            kept = kept_mask.bool()  # (B, T)
            terms = policy_loss_terms(name, logps.detach(), pi_old, kept, inputs["advantages"], low=low, high=high,
                                      clip_ratio_c=clip_c)  # (B, T) each
            patched["advantages"] = policy_loss_advantages(patch.advantages, terms, None)  # (B, T)
            with torch.no_grad():
                self._rc_stats[self._mode()].update(decoupled_dppo_stats(
                    logps.detach(), pi_old, kept, inputs["advantages"], cfg.rollout_dppo, low, high))
        if correction.sampler_ratio is not None:
            patched["importance_sampling_ratio"] = correction.sampler_ratio  # (B, T), read by VESPO only
        sampling = patched["sampling_per_token_logps"]  # (B, T) read by TRL's off-policy mask only
        patched["sampling_per_token_logps"] = torch.where(torch.isfinite(sampling), sampling, logps.detach())
        if whole_batch and cfg.masks_tokens and self.loss_type in KEPT_TOKEN_NORMALIZER_LOSSES:
            # the micro-batch is the whole generation batch here (plan): its kept tokens, across processes
            patched["num_items_in_batch"] = process_all_reduce(kept_mask.sum().to(torch.float32), "sum")
        return patched

    # ------------------------------------------------------------------ 4. logging and saving
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log, with the correction's metrics of the steps since the last log added (reduced across processes,
        one host sync; ``eval_``-prefixed in evaluation).

        Args:
            logs: the row TRL logs (updated in place, as TRL does: ``evaluate()`` returns it).
            start_time: as TRL's.
        """
        mode = self._mode()
        stats, self._rc_stats[mode] = self._rc_stats[mode], RolloutStats()
        if stats.sums:
            metrics = self._rc_metrics(stats)
            if mode == "eval":
                metrics = {f"eval_{k}": v for k, v in metrics.items()}
            logs.update(metrics)  # in place, as TRL does: evaluate() returns this dict
        super().log(logs, start_time)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """TRL's checkpoint, plus the engine's state (in checkpoints only: never pushed with the model)."""
        trl_grpo.save_checkpoint(self, __class__, model, trial)
        if self.args.should_save:
            save_rollout_state(checkpoint_dir(self, __class__, trial), self.rollout_sampler,
                               getattr(self, "vllm_sync_steps", None))

    # ------------------------------------------------------------------ 5. resuming (trl_rollout_corr.training.resume)
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``Trainer.train``; resuming from a checkpoint first restores the engine's state and compares the saved
        correction with this one (:func:`~trl_rollout_corr.training.resume.restore_rollout_state`).

        Args:
            resume_from_checkpoint: as ``Trainer.train``'s (a directory, ``True`` for the last one, or ``None``).
            *args, **kwargs: passed to ``Trainer.train``.

        Returns:
            ``Trainer.train``'s ``TrainOutput``.
        """
        checkpoint = resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
        if checkpoint is not None:
            restore_rollout_state(self, checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)
