"""RolloutCorrGRPOConfig and RolloutCorrGRPOTrainer: the correction wired into TRL 1.16's GRPO hooks.

Overrides (each calls ``super()``): ``_generate`` (validate pi_rollout), ``_generate_single_turn``
(capture pi_rollout on the transformers path), ``_generate_and_score_completions`` (decoupled with a pi_old
forward: pi_old, weights and masks once per generation batch), ``_get_per_token_logps_and_entropies`` (bypass:
skip the pi_old forward; hand compute_loss's forward to TRL's loss), ``compute_loss`` (the correction, then TRL's
own loss on the corrected micro-batch), ``log`` (reduce metrics once per log), ``save_model`` (publish the
resolved config).

Three ways to get pi_old (the PPO anchor) and rho = pi_train / pi_rollout:

* bypass: pi_old := pi_rollout, rho = pi_theta / pi_rollout at loss time, no pi_old forward;
* free decoupled (decoupled presets when each generation batch feeds one optimizer step, TRL's condition
  ``gradient_accumulation_steps % (steps_per_generation * num_iterations) == 0``, its default): pi_old = pi_theta
  at every micro-batch's loss, so rho = pi_old / pi_rollout is computed from pi_theta detached, no forward;
* decoupled with a forward (``num_iterations > 1`` or ``steps_per_generation > gradient_accumulation_steps``):
  one no-grad pi_old forward per generation batch.

At loss time, statistics with a batch scope (IS batch normalization, ``dapo``'s kept-token count with RS/veto)
cover the micro-batch across processes; with a forward, the generation batch across processes.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from trl import GRPOConfig, GRPOTrainer

from .config import RolloutCorrectionConfig
from .core import compute_rollout_correction_stats
from .core.stats import STAT_DTYPE, RolloutStats
from .core.truncation import SamplingTruncation, truncated_support_logprobs, truncation_stats
from .losses import corrected_loss_mask, kept_token_items, safe_anchor, weighted_advantages
from .rollout.capture import capture_sampling_logprobs, refuse_beam_search, validate_rollout_logprobs
from .rollout.support import KeptMassProbe

logger = logging.getLogger(__name__)
_CORRECTION_FIELDS = tuple(f.name for f in dataclasses.fields(RolloutCorrectionConfig))
_NONE_STRINGS = ("none", "null", "None")
_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
                    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


@dataclass
class RolloutCorrGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the rollout-correction fields (flat, CLI/YAML-parsable).

    Resolution order: ``rollout_correction_config`` (a saved config: directory, file or Hub repo id), else
    ``rollout_correction_preset``, else the ``RolloutCorrectionConfig`` defaults; then every correction field
    set here (not ``None``) overrides it. Use the string ``"none"`` to switch ``rollout_is``/``rollout_rs`` off
    explicitly. The resolved config is ``args.rollout_correction``.
    """

    rollout_correction_preset: str | None = field(default=None, metadata={"help": "Preset name, e.g. decoupled_token_is."})
    rollout_correction_config: str | None = field(default=None, metadata={"help": "Directory, file or Hub repo id of a saved RolloutCorrectionConfig."})
    rollout_is: str | None = field(default=None, metadata={"help": "IS level: token | sequence | none."})
    rollout_is_threshold: float | None = field(default=None, metadata={"help": "IS truncation C (default 2.0)."})
    rollout_is_batch_normalize: bool | None = field(default=None, metadata={"help": "Normalize IS weights to batch mean 1."})
    rollout_rs: str | None = field(default=None, metadata={"help": "RS level: token | sequence | geometric | none."})
    rollout_rs_threshold: float | None = field(default=None, metadata={"help": "RS upper bound."})
    rollout_rs_threshold_lower: float | None = field(default=None, metadata={"help": "RS lower bound (default 1/upper)."})
    rollout_token_veto_threshold: float | None = field(default=None, metadata={"help": "Veto a sequence if any rho < this."})
    bypass_mode: bool | None = field(default=None, metadata={"help": "pi_old := pi_rollout (no extra forward pass)."})
    use_policy_gradient: bool | None = field(default=None, metadata={"help": "REINFORCE loss (bypass only)."})
    rollout_rs_criteria: str | None = field(default=None, metadata={
        "help": "Divergence RS criteria, comma-separated: token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2/k3."})
    rollout_rs_criteria_threshold: str | None = field(default=None, metadata={
        "help": "One threshold per criterion, comma-separated: k1 'lower_upper' ratio bounds (or upper); k2/k3 upper."})
    truncated_support_correction: bool | None = field(default=None, metadata={
        "help": "Apply top-k/top-p/min-p to the training logits before the ratio with pi_rollout (default: on when "
                "any of them is set)."})
    vllm_importance_sampling_correction: bool = field(
        default=False, metadata={"help": "TRL's own vLLM IS correction; must stay False (this package corrects)."})
    vllm_dtype: str | None = field(default=None, metadata={
        "help": "dtype of the colocated vLLM engine (float32 | bfloat16 | float16 | auto). Default: TRL's behaviour "
                "(vLLM's 'auto', which runs a float32 checkpoint in bfloat16)."})
    vllm_sync_interval: int = field(default=1, metadata={
        "help": "Sync the vLLM engine's weights every k optimizer steps (k > 1: a stale engine, k-1 steps behind at "
                "most, as an asynchronous engine; fewer syncs)."})
    vllm_weight_sync_dir: str | None = field(default=None, metadata={
        "help": "Server mode on CPU: directory for the weight file handed to the server (default /dev/shm); the "
                "server must see the same path."})

    def __post_init__(self) -> None:
        if self.vllm_importance_sampling_correction:
            raise ValueError(
                "vllm_importance_sampling_correction=True would correct the same mismatch twice (TRL's own IS and this "
                "package's). Leave it False and pick a rollout correction preset or the rollout_* fields instead.")
        if self.vllm_dtype not in (None, "auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"vllm_dtype={self.vllm_dtype!r} is not supported; use float32, bfloat16, float16, auto "
                             "or leave it unset (TRL's behaviour).")
        if not isinstance(self.vllm_sync_interval, int) or self.vllm_sync_interval < 1:
            raise ValueError(f"vllm_sync_interval={self.vllm_sync_interval!r} must be an integer >= 1 (1 = sync the "
                             "vLLM engine every optimizer step).")
        if self.vllm_sync_interval > 1 and self.vllm_enable_sleep_mode:
            raise ValueError("vllm_sync_interval > 1 with vllm_enable_sleep_mode=True: sleep mode discards the engine's "
                             "weights and TRL re-pushes the current ones on wake-up, so the engine cannot stay stale. "
                             "Use one of the two.")
        super().__post_init__()
        self.rollout_correction = self.resolve_rollout_correction()

    def resolve_rollout_correction(self) -> RolloutCorrectionConfig:
        if self.rollout_correction_config:
            base = RolloutCorrectionConfig.from_pretrained(self.rollout_correction_config).to_dict()
        elif self.rollout_correction_preset:
            base = RolloutCorrectionConfig.from_preset(self.rollout_correction_preset).to_dict()
        else:
            base = RolloutCorrectionConfig().to_dict()
        explicit = {name: getattr(self, name) for name in _CORRECTION_FIELDS if getattr(self, name) is not None}
        for level in ("rollout_is", "rollout_rs"):
            if explicit.get(level) in _NONE_STRINGS:
                explicit[level] = None
        if "rollout_rs" in explicit and explicit["rollout_rs"] is None:
            # switching RS off also drops the preset's RS thresholds unless they were set here
            base["rollout_rs_threshold"] = explicit.get("rollout_rs_threshold")
            base["rollout_rs_threshold_lower"] = explicit.get("rollout_rs_threshold_lower")
        return RolloutCorrectionConfig(**{**base, **explicit})


def _checked_rollout_func(rollout_func):
    """Validate a rollout_func's output before TRL reads it (TRL 1.16 fails deep inside on empty completions)."""
    def checked(prompts, trainer):
        output = rollout_func(prompts, trainer)
        for i, ids in enumerate(output.get("completion_ids") or []):
            if len(ids) == 0:
                raise ValueError(f"Sample {i}: the rollout_func returned an empty completion (no token ids). Return at "
                                 "least the EOS token (with its log-prob) for a completion that stopped immediately.")
        return output
    return checked


class RolloutCorrGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` that keeps pi_rollout with every completion and applies rollout correction in the loss.

    Args (beyond ``GRPOTrainer``'s):
        rollout_sampler: optional ``generate``-compatible object standing in for the rollout engine on the
            transformers path (see ``trl_rollout_corr.rollout.emulated``); it must have ``sync(policy, step)``
            and ``generate(**kwargs)``.
    """

    def __init__(self, model: Any, reward_funcs: Any = None, args: GRPOConfig | None = None, *rest: Any,
                 rollout_sampler: Any = None, **kwargs: Any) -> None:
        from .vllm.engine import vllm_engine_setup

        if args is None:  # the default config, named as TRL names its own
            from trl.trainer.utils import get_config_model_id

            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = RolloutCorrGRPOConfig(f"{model_name.split('/')[-1]}-GRPO")
        if not isinstance(args, RolloutCorrGRPOConfig):
            raise TypeError("RolloutCorrGRPOTrainer needs args=RolloutCorrGRPOConfig(...) (a GRPOConfig subclass with the "
                            f"rollout-correction fields), got {type(args).__name__}. Replace GRPOConfig by "
                            "RolloutCorrGRPOConfig with the same arguments.")
        with vllm_engine_setup(args):  # CPU-engine fixes and the engine dtype, only while TRL builds vLLM
            super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self.rollout_correction: RolloutCorrectionConfig = self.args.rollout_correction
        self.vllm_importance_sampling_correction = False  # we own the correction (see TRL P1)
        self.rollout_sampler = rollout_sampler
        if self.rollout_func is not None:
            self.rollout_func = _checked_rollout_func(self.rollout_func)
        self._check_supported()
        self._rc_stats = {"train": RolloutStats(), "eval": RolloutStats()}
        self._rc_skip_old_forward = False
        self._rc_forward_calls = 0  # no-grad policy forwards outside the loss (tests count them)
        # pi_old == pi_theta at every micro-batch's loss (TRL's own test for skipping its pi_old forward): decoupled
        # presets then correct at loss time from pi_theta detached, with no pi_old forward ("free decoupled")
        generate_every = self.args.steps_per_generation * self.num_iterations
        self._rc_free_decoupled = (not self.rollout_correction.bypass_mode
                                   and self.args.gradient_accumulation_steps % generate_every == 0)
        self._rc_in_loss = False
        self._rc_loss_forward: tuple | None = None  # compute_loss's forward, handed to TRL's loss
        self._rc_truncation = self._resolve_sampling_truncation()
        switch = self.args.truncated_support_correction
        self._rc_apply_truncation = self._rc_truncation is not None and switch is not False
        self._rc_probe_next_forward = False
        self._rc_support: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.use_vllm:  # engine dtype log, vllm_sync_interval, CPU server sync (trl_rollout_corr.vllm.engine)
            from .vllm.engine import finish_vllm_setup

            finish_vllm_setup(self)

    def _resolve_sampling_truncation(self) -> SamplingTruncation | None:
        """The sampler's temperature/top-k/top-p/min-p as generation really applies them, or None if no truncation."""
        gen_kwargs = self.args.generation_kwargs or {}
        min_p = gen_kwargs.get("min_p", self.min_p)
        if min_p is None and not self.use_vllm:  # transformers falls back to the model's generation config
            min_p = getattr(getattr(self.model, "generation_config", None), "min_p", None)
        truncation = SamplingTruncation(
            temperature=float(gen_kwargs.get("temperature", self.temperature)),
            top_k=int(gen_kwargs.get("top_k", self.top_k) or 0), top_p=float(gen_kwargs.get("top_p", self.top_p) or 1.0),
            min_p=min_p, min_p_first=self.use_vllm)  # vLLM applies min-p before top-k/top-p
        if (self.repetition_penalty or 1.0) != 1.0 and self.accelerator.is_main_process:
            logger.warning("repetition_penalty=%s changes pi_rollout in a way the trainer does not reproduce: the "
                           "ratio pi_train/pi_rollout is biased on repeated tokens. Prefer repetition_penalty=1.0.",
                           self.repetition_penalty)
        return truncation if truncation.truncates else None

    # ------------------------------------------------------------------ configuration checks
    def _check_supported(self) -> None:
        """Refuse only what contradicts the correction (every TRL loss type, GSPO, the entropy bonus and filter and
        TRL's off-policy mask compose with it: see :mod:`trl_rollout_corr.losses`)."""
        if self.use_transformers_continuous_batching:
            raise ValueError(
                "RolloutCorrGRPOTrainer does not support use_transformers_continuous_batching=True: TRL's continuous "
                "batching path returns no per-token log-probs, so there is no pi_rollout to correct against. Use plain "
                "generate (use_transformers_continuous_batching=False), vLLM or a rollout_func.")
        if not self.use_vllm and self.rollout_func is None:  # beam search has no pi_rollout: say so before training
            refuse_beam_search(self.generation_config.num_beams)

    # ------------------------------------------------------------------ distributed helpers
    def _rc_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if self.accelerator.num_processes == 1 or not dist.is_initialized():
            return tensor
        reduced = tensor.clone()
        dist.all_reduce(reduced, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return reduced

    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    # ------------------------------------------------------------------ capturing pi_rollout
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.use_vllm:  # TRL asks vLLM for processed log-probs already
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        policy = self.accelerator.unwrap_model(self.model_wrapped)
        sampler = None
        if self.rollout_sampler is not None:
            self.rollout_sampler.sync(policy, self.state.global_step)
            sampler = self.rollout_sampler.generate
        with capture_sampling_logprobs(policy, sampler) as captured:
            completion_ids, _ = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        logprobs = captured["logprobs"].cpu()  # (B, S)
        return completion_ids, [logprobs[i, : len(ids)].tolist() for i, ids in enumerate(completion_ids)]

    def _generate(self, prompts: list):
        result = super()._generate(prompts)
        completion_ids, logprobs = result[1], result[4]
        source = "rollout_func" if self.rollout_func is not None else ("vLLM" if self.use_vllm else "transformers generate")
        validate_rollout_logprobs(completion_ids, logprobs, source)
        return result

    # ------------------------------------------------------------------ generation-time correction (decoupled)
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        cached = self._rc_loss_forward
        if cached is not None and cached[0].shape == (input_ids.size(0), logits_to_keep):
            self._rc_loss_forward = None  # TRL's loss asks for the forward compute_loss already ran: hand it over
            return cached
        if not torch.is_grad_enabled() and not self._rc_in_loss:
            if self._rc_skip_old_forward:  # bypass: TRL asked for pi_old, which is pi_rollout here
                self._rc_skip_old_forward = False
                return input_ids.new_zeros(input_ids.size(0), logits_to_keep, dtype=torch.float32), None, None
            self._rc_forward_calls += 1
        if not self._rc_probe_next_forward:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        self._rc_probe_next_forward = False  # the training-side kept mass, from this forward's hidden states
        with KeptMassProbe(model, self._rc_truncation, logits_to_keep) as probe:
            result = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        self._rc_support = probe.result()
        return result

    def _ratio_logps(self, train_logps: torch.Tensor, loss_mask: torch.Tensor, mode: str) -> torch.Tensor:
        """The training log-probs to compare with pi_rollout: truncated to the sampler's support when enabled.

        Records kept_mass_mean/min and outside_support_fraction whenever the sampler truncates.
        """
        if self._rc_truncation is None:
            return train_logps
        log_mass, in_support = self._rc_support  # (B, T), (B, T)
        self._rc_support = None
        self._rc_stats[mode].update(truncation_stats(log_mass, in_support, loss_mask))
        if not self._rc_apply_truncation:
            return train_logps
        return truncated_support_logprobs(train_logps, log_mass, in_support)  # (B, T)

    def _generate_and_score_completions(self, inputs):
        """Decoupled with a pi_old forward: pi_old, weights and masks once per generation batch (they travel with the
        samples through TRL's buffering). Bypass and free decoupled correct in the loss instead."""
        cfg = self.rollout_correction
        generate_every = self.args.steps_per_generation * self.num_iterations
        # bypass needs no pi_old; with a truncating sampler, pi_old is computed below together with the kept mass
        own_old_forward = cfg.bypass_mode or self._rc_truncation is not None
        self._rc_skip_old_forward = own_old_forward and self.args.gradient_accumulation_steps % generate_every != 0
        output = super()._generate_and_score_completions(inputs)
        self._rc_skip_old_forward = False
        rollout = output["sampling_per_token_logps"]  # (B, T)
        loss_mask = output["completion_mask"] * output["tool_mask"] if "tool_mask" in output else output["completion_mask"]
        if cfg.bypass_mode:
            output["old_per_token_logps"] = rollout  # pi_old := pi_rollout; no forward pass
            return output
        if self._rc_free_decoupled:
            output.pop("old_per_token_logps", None)  # pi_old = pi_theta at the loss: no forward, nothing to carry
            return output
        old = output.get("old_per_token_logps")
        if old is None or self._rc_truncation is not None:
            self._rc_probe_next_forward = self._rc_truncation is not None
            old = self._compute_old_logps(output)  # (B, T)
            output["old_per_token_logps"] = old  # the PPO ratio pi_theta/pi_old stays on the full support
        result = compute_rollout_correction_stats(
            self._ratio_logps(old, loss_mask, self._mode()), rollout, loss_mask, **cfg.pipeline_kwargs(),
            reduce_fn=self._rc_reduce)
        self._rc_stats[self._mode()].update(result.stats)
        keep = result.modified_response_mask.to(loss_mask.dtype)  # (B, T)
        output["rc_keep_mask"] = keep
        if result.is_weights is not None:
            output["rc_is_weights"] = result.is_weights  # (B, T)
        output["num_items_in_batch"] = self.accelerator.gather(keep.sum()).sum()  # kept tokens, global
        return output

    @torch.no_grad()
    def _compute_old_logps(self, output: dict) -> torch.Tensor:
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)  # (B, P+T)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)  # (B, P+T)
        batch_size = self.args.per_device_train_batch_size if self.model.training else self.args.per_device_eval_batch_size
        mm = {k: output[k] for k in _MULTIMODAL_KEYS if k in output}
        logps, _, _ = self._get_per_token_logps_and_entropies(
            self.model, input_ids, attention_mask, output["completion_ids"].size(1), batch_size=batch_size, **mm)
        return logps

    # ------------------------------------------------------------------ the corrected loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's own loss on the corrected micro-batch (see :mod:`trl_rollout_corr.losses`).

        One grad-enabled policy forward (log pi_theta, entropies, MoE aux loss; plus the kept-mass probe when the
        correction runs now and the sampler truncates). The correction comes from generation time (decoupled with
        a pi_old forward) or is computed now from pi_theta detached (bypass: rho = pi_theta / pi_rollout; free
        decoupled: pi_old = pi_theta, rho = pi_old / pi_rollout). Then ``GRPOTrainer.compute_loss`` runs on a
        shallow copy of ``inputs`` with the kept mask in ``tool_mask``, A * w in ``advantages``, the PPO anchor in
        ``old_per_token_logps`` and the kept-token count in ``num_items_in_batch``; its call for the policy
        forward gets the cached result. Every loss type, GSPO, the entropy bonus and filter, the off-policy mask,
        the KL term, the aux loss and every TRL metric are TRL's.
        """
        cfg = self.rollout_correction
        mode = self._mode()
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)  # (B, P+T)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)  # (B, P+T)
        mm = {k: inputs.get(k) for k in _MULTIMODAL_KEYS}
        at_loss_time = cfg.bypass_mode or self._rc_free_decoupled
        self._rc_probe_next_forward = at_loss_time and self._rc_truncation is not None
        self._rc_in_loss = True
        try:
            forward = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True,
                compute_aux_loss=self.aux_loss_enabled, **mm)
        finally:
            self._rc_in_loss = False
        logps = forward[0]  # (B, T) log pi_theta, with grad
        tool_mask = inputs.get("tool_mask")
        loss_mask = inputs["completion_mask"] if tool_mask is None else inputs["completion_mask"] * tool_mask  # (B, T)
        patched = dict(inputs)
        if at_loss_time:
            keep, is_weights, anchor = self._correct_now(logps.detach(), inputs, loss_mask, mode)
            if cfg.masks_tokens:  # the kept-token count is only known now: this micro-batch, across processes
                kept = self._rc_reduce(keep.sum().to(torch.float32), "sum")
                spg = self.args.steps_per_generation if mode == "train" else 1
                patched["num_items_in_batch"] = kept_token_items(kept, spg)
        else:
            keep = inputs["rc_keep_mask"]  # (B, T)
            is_weights = inputs.get("rc_is_weights")  # (B, T) or None
            anchor = inputs["old_per_token_logps"]  # (B, T) pi_old
        kept_mask = loss_mask * keep.to(loss_mask.dtype)  # (B, T)
        patched["tool_mask"] = corrected_loss_mask(inputs["completion_mask"], tool_mask, keep)
        patched["advantages"] = weighted_advantages(inputs["advantages"], is_weights, cfg.rollout_is == "sequence")
        if anchor is not None:
            patched["old_per_token_logps"] = safe_anchor(anchor, logps, kept_mask)  # (B, T)
        else:
            patched.pop("old_per_token_logps", None)  # TRL then uses pi_theta detached
        if "sampling_per_token_logps" in patched:  # read by TRL's off-policy mask only
            sampling = patched["sampling_per_token_logps"]  # (B, T)
            patched["sampling_per_token_logps"] = torch.where(torch.isfinite(sampling), sampling, logps.detach())
        with torch.no_grad():
            n_kept = kept_mask.sum(dtype=STAT_DTYPE)
            self._rc_stats[mode].update(RolloutStats(sums={
                "loss.empty_micro_batches": (n_kept == 0).to(STAT_DTYPE),
                "loss.micro_batches": torch.ones((), dtype=STAT_DTYPE, device=n_kept.device)}))
        self._rc_loss_forward = forward
        try:
            return super().compute_loss(model, patched, return_outputs, num_items_in_batch)
        finally:
            self._rc_loss_forward = None

    def _correct_now(self, policy_logps: torch.Tensor, inputs: dict, loss_mask: torch.Tensor, mode: str):
        """Weights, kept mask and PPO anchor from pi_theta (detached) at loss time: bypass and free decoupled.

        rho = pi_theta / pi_rollout on the sampler's support (both modes: free decoupled has pi_old = pi_theta).
        Anchor: bypass PPO pi_rollout (shifted by log M on the truncated support, so TRL's ratio is
        pi_theta^trunc / pi_rollout); policy gradient and free decoupled: None (TRL uses pi_theta detached, ratio 1:
        the gradient of every TRL loss type is then -w A grad log pi_theta, i.e. REINFORCE with the IS weight).
        Returns ``(keep (B, T), is_weights (B, T) or None, anchor (B, T) or None)``.
        """
        cfg = self.rollout_correction
        rollout = inputs["sampling_per_token_logps"]  # (B, T)
        ratio_logps = self._ratio_logps(policy_logps, loss_mask, mode)  # (B, T)
        result = compute_rollout_correction_stats(
            ratio_logps, rollout, loss_mask, **cfg.pipeline_kwargs(), reduce_fn=self._rc_reduce)
        self._rc_stats[mode].update(result.stats)
        keep = result.modified_response_mask.to(loss_mask.dtype)  # (B, T)
        if not cfg.bypass_mode:
            return keep, result.is_weights, None  # free decoupled: PPO on pi_theta / pi_old, weights pi_old / pi_rollout
        if cfg.use_policy_gradient:
            return keep, result.is_weights, None
        # bypass PPO: pi_old := pi_rollout; IS feeds the metrics only
        return keep, None, rollout + (policy_logps - ratio_logps)  # (B, T) rollout + log M where truncated

    # ------------------------------------------------------------------ logging and saving
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        from .core.metrics import finalize_floats

        mode = self._mode()
        stats, self._rc_stats[mode] = self._rc_stats[mode], RolloutStats()
        if stats.sums:
            reduced = stats.all_reduce(self._rc_reduce)
            all_floats = reduced.to_floats()  # the one host sync of this logging step
            metrics = finalize_floats(all_floats)
            floats = {k[4:]: v for k, v in all_floats.items() if k.startswith("sum:loss.")}
            if "loss.micro_batches" in floats:  # entropy, clip_ratio/*, kl, aux_loss, ...: TRL's own (_metrics)
                empty = floats["loss.empty_micro_batches"]
                metrics["rollout_corr/all_rejected_micro_batches"] = empty
                if empty > 0 and self.accelerator.is_main_process:
                    logger.warning(
                        "Rollout correction rejected every token of %d of %d micro-batches since the last log "
                        "(rejected_token_fraction=%.3f); their loss is 0. Loosen rollout_rs_threshold / "
                        "rollout_token_veto_threshold or check the sampler.", int(empty),
                        int(floats["loss.micro_batches"]), metrics.get("rollout_corr/rejected_token_fraction", 1.0))
            if mode == "eval":
                metrics = {f"eval_{k}": v for k, v in metrics.items()}
            logs.update(metrics)  # in place, as TRL does: evaluate() returns this dict
        super().log(logs, start_time)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            self.rollout_correction.save_pretrained(output_dir or self.args.output_dir)
