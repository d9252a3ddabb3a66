"""``trl-rollout-corr probe``: measure the engine/trainer mismatch of *your* setup before training.

With the model, tokenizer, prompts, engine and sampler settings a ``train`` run would use (the same YAML and
arguments), it generates a few generation batches exactly as training would, scores them with the trainer's own
forward, and reports:

* the per-token log-ratio log rho = log pi_train - log pi_rollout (k1/k3 KL, quantiles, the low-probability tail),
  the same by completion-length bucket, and the distribution of T*KL per sequence (:mod:`.core.mismatch`);
* on a truncating sampler (top-k/top-p/min-p), the mismatch before and after the trainer renormalizes over the
  sampler's kept set (what the truncation alone contributes), and the kept mass;
* every correction's effective sample size, masked fractions and weight range computed on these very samples;
* the regime (T, per-token KL, T*KL) with standard errors (sequences as the units, :mod:`.core.mismatch`), the
  verdict row(s) it falls on (:func:`trl_rollout_corr.monitor.verdict.place`) or, where its 95% interval straddles a
  boundary, that its sample cannot decide and how many more batches would; configuration problems it can see.

Output: a terminal table, ``probe.json`` and ``probe.png`` (log rho histogram per length bucket, T*KL
distribution) in ``--probe_out``.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.metric_names import metric
from ..core.mismatch import LENGTH_BUCKETS, method_predictions, mismatch_by_source, mismatch_summary
from ..core.truncation import truncated_support_logprobs

#: the corrections the report predicts by default (TRL's default first)
DEFAULT_METHODS = ("trl_default", "trl_token_truncate", "trl_token_mask", "trl_sequence_truncate",
                   "decoupled_token_is", "decoupled_seq_is", "decoupled_seq_is_rs", "decoupled_geo_rs",
                   "ppo_is_bypass", "icepop")


#: completions the probe scores by default: at a coefficient of variation of a sequence's T*KL of ~1 (the known
#: engine of tests/cli/test_probe_uncertainty.py: per-token KL 1e-3, T <= 64), the SE of T*KL and of the per-token k3
#: is ~6.6% of the value at 256 completions (13% at 64, the old default of 2 batches of the recipes' 32), so the 95%
#: interval decides a verdict boundary unless the estimate is within ~13% of it (docs/probe.md, "How large a sample")
DEFAULT_SAMPLES = 256


def correction_params(name: str):
    """A preset by name, or ``trl_<mode>`` for TRL's ``vllm_importance_sampling_mode`` (C=3, TRL's defaults)."""
    from ..config.correction import RolloutCorrectionConfig
    from ..config.compat import TRL_MODES, translate_trl_correction

    mode = name.removeprefix("trl_")
    if mode != name and mode in TRL_MODES:
        return RolloutCorrectionConfig(**translate_trl_correction(True, mode)).params()
    return RolloutCorrectionConfig.from_preset(name).params()


@dataclass
class ProbeArguments:
    """The probe's own arguments (``trl-rollout-corr probe --config run.yaml --probe_batches 4``)."""

    probe_batches: int | None = field(default=None, metadata={
        "help": "Generation batches to generate and score (default: as many as --probe_samples completions need)."})
    probe_samples: int = field(default=DEFAULT_SAMPLES, metadata={
        "help": "Completions to generate and score when --probe_batches is not given (whole generation batches, at "
                "least this many; fewer if the dataset runs out). 256: the 95%% interval of T*KL and of the per-token "
                "KL is then about +-13%% of the value (docs/probe.md, \"How large a sample\")."})
    probe_stale: bool | None = field(default=None, metadata={
        "help": "Whether the engine's weights lag the policy in training (for the verdict row). Default: from the "
                "run (vllm_sync_interval > 1, a stale emulated engine)."})
    probe_asynchronous: bool = field(default=False, metadata={
        "help": "Place the run on the asynchronous trainer's verdict rows (a run with TRL's AsyncGRPOTrainer)."})
    probe_out: str | None = field(default=None, metadata={
        "help": "Directory for probe.json and probe.png (default: <output_dir>/probe)."})
    probe_methods: str = field(default=",".join(DEFAULT_METHODS), metadata={
        "help": "Comma-separated presets whose weights and masks are computed on the probe's samples."})
    probe_engine_dtype: str | None = field(default=None, metadata={
        "help": "The dtype the engine computes in (float32, bfloat16, float16), for the precision share when the "
                "probe cannot read it (a rollout_func, a custom sampler). Default: vLLM's, the emulated engine's, "
                "or the policy's own for transformers generate."})
    probe_split: bool = field(default=True, metadata={
        "help": "Split the mismatch by source: re-score each batch in the engine's dtype and one sample per "
                "forward (two more forwards per batch, and a copy of the model in the engine's dtype, made only "
                "where it fits on the device)."})


def collect(trainer: Any, batches: int | None, split: bool = True, engine_dtype: str | torch.dtype | None = None,
            samples: int = DEFAULT_SAMPLES) -> dict[str, Any]:
    """``batches`` generation batches from ``trainer``'s own dataloader, generated and scored as training would
    (``batches=None``: as many whole batches as ``samples`` completions need, fixed before any is scored by the
    count alone, so that the stopping rule does not depend on the values measured).

    Returns the concatenated (B, T) tensors of :meth:`RolloutCorrGRPOTrainer.score_generation_batch` (padded to the
    longest T with mask 0), on CPU, and under ``batches`` each batch as scored. With ``split``, each batch is also
    re-scored by the trainer's forward in the engine's dtype (``engine_dtype_logps``) and in another batch
    composition (``reshaped_logps``), and ``split`` describes how (:class:`SourceRescorer`).
    """
    if batches is not None and batches < 1:
        raise ValueError(f"probe_batches must be >= 1, got {batches}.")
    if batches is None and samples < 1:
        raise ValueError(f"probe_samples must be >= 1, got {samples}: the number of completions to score.")
    if trainer.train_dataset is None or len(trainer.train_dataset) == 0:
        raise ValueError("The probe needs prompts: the training dataset is empty (check --dataset_name and "
                         "--dataset_train_split).")
    scored = []
    rescorer = SourceRescorer(trainer, engine_dtype) if split else None
    loader = iter(trainer.get_train_dataloader())
    count = 0
    while (len(scored) < batches) if batches is not None else (count < samples):
        try:
            inputs = next(loader)
        except StopIteration:
            if not scored:
                raise ValueError("The training dataloader yielded no batch: the dataset has fewer prompts than "
                                 "one generation batch.") from None
            break
        batch = trainer.score_generation_batch(inputs)
        if rescorer is not None:
            batch.update(rescorer(batch))
        scored.append({k: (v.cpu() if torch.is_tensor(v) else v) for k, v in batch.items()})
        count += int(batch["mask"].size(0))
    if rescorer is not None:
        rescorer.close()
    width = max(b["mask"].size(1) for b in scored)
    out: dict[str, Any] = {"split": rescorer.describe() if rescorer is not None else None}
    for key in ("train_logps", "rollout_logps", "mask", "log_mass", "in_support", "engine_dtype_logps",
                "reshaped_logps"):
        if scored[0].get(key) is None:
            out[key] = None
            continue
        out[key] = torch.cat([torch.nn.functional.pad(b[key], (0, width - b[key].size(1))) for b in scored])
    out["rollout_seen"] = torch.cat([b["rollout_seen"] for b in scored])
    if all(b.get("advantages") is not None for b in scored):  # (B,) TRL's: M2PO's trust region reads them
        out["advantages"] = torch.cat([b["advantages"] for b in scored])
    # the trainer's own choices: whether its ratio uses pi_train renormalized over a truncated sampler's kept set,
    # and the correction it was configured with (a preset plus any field overridden)
    out["apply_truncation"] = bool(getattr(trainer, "_rc_apply_truncation", True))
    run = getattr(trainer, "rollout_correction", None)
    out["run_correction"] = run.params() if run is not None else None
    out["batches"] = scored  # each batch as scored (its input_ids and attention_mask included)
    return out


def probe_engine_dtype(trainer: Any) -> torch.dtype | None:
    """The dtype the engine computes in, where the probe can know it: vLLM's (``trainer.vllm_engine_dtype``), an
    emulated engine's (``bf16``/``fp16``, else the policy's), the policy's own for transformers ``generate`` (TRL
    generates without autocast); None for a ``rollout_func`` or another sampler."""
    policy_dtype = next(trainer.accelerator.unwrap_model(trainer.model).parameters()).dtype
    if getattr(trainer, "use_vllm", False):
        name = getattr(trainer, "vllm_engine_dtype", None)
        return getattr(torch, name, None) if isinstance(name, str) else None
    if getattr(trainer, "rollout_func", None) is not None:
        return None
    sampler = getattr(trainer, "rollout_sampler", None)
    if sampler is None:
        return policy_dtype
    from ..rollout.emulated import EmulatedRolloutEngine

    if isinstance(sampler, EmulatedRolloutEngine):
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(sampler.kind, policy_dtype)
    return None


def _as_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(
        dtype, dtype)
    if not isinstance(getattr(torch, name, None), torch.dtype) or not getattr(torch, name).is_floating_point:
        raise ValueError(f"probe_engine_dtype={dtype!r} is not a torch dtype: use float32, bfloat16 or float16.")
    return getattr(torch, name)


#: free device memory the precision copy must leave for the re-scoring forward's activations and the allocator:
#: the larger of these bytes and this fraction of the device's memory
COPY_MARGIN_BYTES = 1 << 30
COPY_MARGIN_FRACTION = 0.1
#: the precision part's note for a sharded model (a copy would need the gathered weights)
SHARDED_NOTE = "not measured: ZeRO-3/FSDP shards the weights; run the probe without sharding"


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s weights are sharded: DeepSpeed ZeRO-3 (parameters carry ``ds_id``), FSDP2 (DTensors) or
    FSDP1 (torch marks its FlatParameters, and the original parameters it views with ``use_orig_params``,
    ``_fsdp_flattened``; ``unwrap_model`` leaves the nested FSDP1 units and their shards in place)."""
    return any(hasattr(p, "ds_id") or type(p).__name__ == "DTensor" or getattr(p, "_fsdp_flattened", False)
               for p in model.parameters())


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of most of ``model``'s parameter elements outside its LM head (TRL's ``cast_lm_head_to_fp32`` makes
    the head, and a tied embedding with it, float32 in a bf16 model); the first parameter's for a model whose
    parameters hold no elements here (ZeRO-3 shards)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_head = {id(p) for p in head.parameters()} if isinstance(head, torch.nn.Module) else set()
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if id(p) not in in_head:
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    if counts and max(counts.values()) > 0:
        return max(counts, key=counts.get)
    return next(model.parameters()).dtype


def copy_bytes_by_device(model: torch.nn.Module, dtype: torch.dtype) -> dict[torch.device, int]:
    """The bytes a copy of ``model`` with its floating parameters and buffers cast to ``dtype`` takes, per device
    (tied weights once; integer buffers at their own size)."""
    out: dict[torch.device, int] = {}
    for t in [*model.parameters(), *model.buffers()]:  # both iterators skip a tensor seen before
        size = torch.empty((), dtype=dtype).element_size() if t.is_floating_point() else t.element_size()
        out[t.device] = out.get(t.device, 0) + t.numel() * size
    return out


def copy_fits(need: dict[torch.device, int]) -> str | None:
    """None when a copy needing ``need`` bytes per device fits, else why not (the probe's note). On a CUDA device it
    must leave ``max(COPY_MARGIN_BYTES, COPY_MARGIN_FRACTION * total)`` free: free is the driver's
    ``torch.cuda.mem_get_info`` plus what torch's allocator holds unused (reserved - allocated). Other devices
    (the CPU) are not checked."""
    gib = float(1 << 30)
    for device, size in need.items():
        if device.type != "cuda":
            continue
        free, total = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        margin = max(COPY_MARGIN_BYTES, COPY_MARGIN_FRACTION * total)
        if size + margin > free:
            return (f"not measured: the copy of the model in the engine's dtype needs {size / gib:.2f} GiB on "
                    f"{device} and {free / gib:.2f} GiB is free there ({margin / gib:.2f} GiB kept for the "
                    "forward): skipped rather than run out of memory before training. To measure it, free memory "
                    "on the device (a lower vllm_gpu_memory_utilization with a colocated vLLM, a device with more "
                    "memory) or load the model in the engine's dtype (no copy then); --probe_split false skips "
                    "the split and its forwards")
    return None


def engine_dtype_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``model`` (its instance forwards, hooks and TRL's fused LM head go along) with every floating
    parameter and buffer cast to ``dtype``, built without a full-precision copy first: each tensor is cast from the
    original, which keeps its own bits (peak memory: the copy, not the copy plus a copy at the model's dtype)."""
    import copy

    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_floating_point():
            cast = t.detach().to(dtype)
            memo[id(t)] = torch.nn.Parameter(cast, requires_grad=False) if isinstance(t, torch.nn.Parameter) \
                else cast
    return copy.deepcopy(model, memo)


@contextmanager
def engine_precision_head(model: torch.nn.Module, dtype: torch.dtype, temperature: float):
    """While open, ``model``'s scoring forward projects its LM head as a ``dtype`` engine does, for a trainer with
    TRL's ``cast_lm_head_to_fp32`` (which scores with the head in float32, autocast off): TRL's fused head re-installed
    without the cast (logits = h W^T computed and rounded in the hidden states' dtype, then log-softmaxed in float32),
    and the head's weight and bias swapped for ``dtype`` copies (the float32 ones are put back, not cast in place).
    The log-probs then carry the head's rounding, which the precision part of the split attributes."""
    from ..trl_hooks.grpo import fused_lm_head

    target = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT: TRL patches the base
    head = target.get_output_embeddings()
    saved = {name: p for name, p in head.named_parameters(recurse=False) if name in ("weight", "bias")}
    forward = target.__dict__.get("forward")
    try:
        for name, param in saved.items():
            if param.dtype != dtype:
                setattr(head, name, torch.nn.Parameter(param.detach().to(dtype), requires_grad=False))
        fused_lm_head(target, temperature, cast_lm_head_to_fp32=False)
        yield
    finally:
        for name, param in saved.items():
            setattr(head, name, param)
        if forward is None:
            target.__dict__.pop("forward", None)
        else:
            target.forward = forward


class SourceRescorer:
    """Re-scores a scored generation batch with the trainer's own forward (TRL's ``_get_per_token_logps``, the
    fused LM head, the trainer's temperature) twice: (a) in the engine's dtype, weights and compute, autocast off
    (the policy itself when the engine's dtype is the policy's, else a copy cast to it, :func:`engine_dtype_copy`,
    built only when :func:`copy_fits` says it fits on the device); (b) at the trainer's own dtype in another batch
    composition: one sample per forward (the whole batch in reverse order when the trainer already scores one at a
    time). (a) is not done on a ZeRO-3 or FSDP model (a copy would need the gathered weights)."""

    def __init__(self, trainer: Any, engine_dtype: str | torch.dtype | None = None) -> None:
        self.trainer = trainer
        self.model = trainer.accelerator.unwrap_model(trainer.model)
        self.policy_dtype = model_dtype(self.model)
        args = trainer.args
        self.autocast = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        self.engine_dtype = _as_dtype(engine_dtype) or probe_engine_dtype(trainer)
        self.seconds = 0.0
        self._copy: torch.nn.Module | None = None
        self._prepared = False
        self._engine_head = False
        self.precision_note: str | None = None
        #: TRL's cast_lm_head_to_fp32: the trainer's head runs in float32, a lower-precision engine's does not
        self.head_fp32 = bool(getattr(args, "cast_lm_head_to_fp32", False))
        #: "measure" (re-score in the engine's dtype), "same" (the trainer's own forward is that), "skip"
        self.precision = "measure"
        if is_sharded(self.model):
            self.precision_note, self.precision = SHARDED_NOTE, "skip"
        elif self.engine_dtype is None:
            self.precision = "skip"
            self.precision_note = ("the engine's dtype is unknown (a rollout_func or another sampler): pass "
                                   "--probe_engine_dtype")
        elif self.autocast is None and self.engine_dtype == self.policy_dtype and not (
                self.head_fp32 and self.engine_dtype != torch.float32):
            self.precision = "same"
            self.precision_note = "the trainer computes in the engine's dtype already: nothing to separate"

    def _prepare(self) -> None:
        """Once, before the first engine-dtype forward: whether the model needs a copy in the engine's dtype and the
        LM head the engine's projection, and whether that fits on the device (:func:`copy_fits`); builds the copy."""
        self._prepared = True
        dtype = self.engine_dtype
        self._engine_head = self.head_fp32 and dtype != torch.float32
        need: dict[torch.device, int] = {}
        if dtype != self.policy_dtype:
            need = copy_bytes_by_device(self.model, dtype)
        elif self._engine_head:  # the policy itself, with a head in the engine's dtype for the forward
            head = self.model.get_output_embeddings()
            for p in head.parameters(recurse=False):
                need[p.device] = need.get(p.device, 0) + p.numel() * torch.empty((), dtype=dtype).element_size()
        self.precision_note = copy_fits(need)
        if self.precision_note is not None:
            self.precision = "skip"
        elif dtype != self.policy_dtype:
            self._copy = engine_dtype_copy(self.model, dtype)  # TRL's fused forward and hooks go along
            if self.head_fp32:
                # TRL's cast_lm_head_to_fp32 casts a tied embedding's output back to the model's dtype at
                # construction; in the copy it must stay in the engine's dtype, as in the engine
                self._copy.get_input_embeddings().register_forward_hook(
                    lambda module, args, output: output.to(dtype))

    def _forward(self, model: torch.nn.Module, batch: dict, batch_size: int, order: torch.Tensor | None = None,
                 autocast: bool = True) -> torch.Tensor:
        from ..grpo.trainer import RolloutCorrGRPOTrainer
        from ..trl_hooks import grpo as trl_grpo

        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]  # (B, P+T)
        if order is not None:
            input_ids, attention_mask = input_ids[order], attention_mask[order]  # (B, P+T)
        accelerator = self.trainer.accelerator
        device_type = input_ids.device.type
        was_training = model.training
        model.eval()
        if not autocast:  # TRL's forward enters accelerator.autocast(): off for the engine-dtype forward
            accelerator.autocast = lambda *a, **k: torch.autocast(device_type, enabled=False)
        try:
            with torch.no_grad():
                logps, _, _ = trl_grpo.per_token_logps(
                    self.trainer, RolloutCorrGRPOTrainer, model, input_ids, attention_mask, batch["mask"].size(1),
                    batch_size=batch_size, **(batch.get("model_inputs") or {}))  # (B, T)
        finally:
            accelerator.__dict__.pop("autocast", None)
            model.train(was_training)
        if order is not None:
            logps = logps[torch.argsort(order)]  # (B, T) back in the batch's order
        return logps

    def __call__(self, batch: dict) -> dict[str, torch.Tensor]:
        """``engine_dtype_logps`` (B, T) (the trainer's own ``train_logps`` when there is nothing to separate; absent
        when it cannot be measured) and ``reshaped_logps`` (B, T)."""
        import time

        start = time.perf_counter()
        out = {}
        size = batch["input_ids"].size(0)
        if self.precision == "measure":
            if not self._prepared:
                self._prepare()
            if self.precision == "measure":
                model = self._copy if self._copy is not None else self.model
                head = (engine_precision_head(model, self.engine_dtype, self.trainer.temperature)
                        if self._engine_head else nullcontext())
                with head:
                    out["engine_dtype_logps"] = self._forward(
                        model, batch, self.trainer.args.per_device_train_batch_size, autocast=False).float()  # (B, T)
        elif self.precision == "same":
            out["engine_dtype_logps"] = batch["train_logps"]  # (B, T) the same computation
        if self.trainer.args.per_device_train_batch_size > 1:
            out["reshaped_logps"] = self._forward(self.model, batch, 1)  # (B, T)
        else:
            out["reshaped_logps"] = self._forward(self.model, batch, size, order=torch.arange(size - 1, -1, -1))
        self.seconds += time.perf_counter() - start
        return out

    def close(self) -> None:
        self._copy = None

    def describe(self) -> dict[str, Any]:
        size = self.trainer.args.per_device_train_batch_size
        engine = str(self.engine_dtype).removeprefix("torch.")
        return {
            "trainer_dtype": str(self.policy_dtype).removeprefix("torch.")
            + (f" + autocast {str(self.autocast).removeprefix('torch.')}" if self.autocast else ""),
            "engine_dtype": None if self.engine_dtype is None else str(self.engine_dtype).removeprefix("torch."),
            "precision_note": self.precision_note,
            "lm_head": (f"float32 in the trainer (cast_lm_head_to_fp32), {engine} in the re-scoring, as the engine "
                        "projects it" if self._engine_head else None),
            "batch_shape_composition": (f"one sample per forward against {size}" if size > 1
                                        else "the whole batch in reverse order against one sample per forward"),
            "seconds": self.seconds,
        }


#: the key of the trainer's own correction in the report's ``methods`` (its preset with every field it overrides)
THIS_RUN = "this_run"


def analyse(data: dict[str, Any], methods: tuple[str, ...] = DEFAULT_METHODS) -> dict[str, Any]:
    """The report of :mod:`trl_rollout_corr.cli.probe` on collected tensors (see :func:`collect`).

    The methods see the ratio the trainer would form: log pi_train renormalized over a truncating sampler's kept set
    when the trainer renormalizes (``truncated_support_correction``, on by default), else raw. With the trainer's own
    correction in ``data["run_correction"]`` (:func:`collect` puts it there), ``methods[THIS_RUN]`` is what that
    trainer logs on the same batch (``rollout_corr/*``; tests/cli/test_probe_agreement.py).
    """
    seen = data["rollout_seen"].bool()  # (B,)
    if not seen.any():
        raise ValueError("The engine returned no log-probs for any sample, so there is no pi_rollout to compare: "
                         "with vLLM, check that the server runs --logprobs-mode processed_logprobs; with a "
                         "rollout_func, return 'logprobs' for every completion token.")
    mask = data["mask"] * seen[:, None].to(data["mask"].dtype)  # (B, T)
    train = data["train_logps"]  # (B, T)
    report: dict[str, Any] = {"samples": int(seen.numel()), "samples_without_rollout_logprobs": int((~seen).sum())}
    if data.get("log_mass") is not None:
        renormalized = truncated_support_logprobs(train, data["log_mass"], data["in_support"])  # (B, T)
        applied = data.get("apply_truncation", True)
        report["truncation"] = {
            "kept_mass_mean": float((data["log_mass"].exp() * mask).sum() / mask.sum()),
            "outside_support_fraction": float(((~data["in_support"].bool()) & mask.bool()).sum() / mask.sum()),
            "before_renormalization": mismatch_summary(train, data["rollout_logps"], mask)["tokens"],
            "after_renormalization": mismatch_summary(renormalized, data["rollout_logps"], mask)["tokens"],
            "applied_by_trainer": applied,
        }
        if applied:
            train = renormalized
    data["ratio_logps"] = train  # what the ratio uses: pi_train, renormalized over the kept set if the trainer does
    report.update(mismatch_summary(train, data["rollout_logps"], mask))
    if data.get("split") is not None:
        report["sources"] = {
            **mismatch_by_source(data["train_logps"], train, data["rollout_logps"], mask,
                                 data.get("engine_dtype_logps"), data.get("reshaped_logps")),
            **data["split"]}
        if "truncation" in report:
            report["sources"]["truncation_k3"] = (report["truncation"]["before_renormalization"]["k3"]
                                                  - report["truncation"]["after_renormalization"]["k3"])
    corrections = {name: correction_params(name) for name in methods}
    if data.get("run_correction") is not None:
        corrections = {THIS_RUN: data["run_correction"], **corrections}
    report["methods"] = method_predictions(train, data["rollout_logps"], mask, corrections,
                                           advantages=data.get("advantages"))
    seqs = report["sequences"]
    report["regime"] = {"T": seqs.get("mean_length"), "per_token_kl": report["tokens"]["k3"],
                        "per_token_kl_se": report["tokens"]["k3_se"], "T_times_kl": seqs.get("t_kl_mean"),
                        "T_times_kl_se": seqs.get("t_kl_se", float("nan"))}
    return report


def engine_is_stale(trainer: Any) -> bool:
    """Whether the run's engine lags the policy in training: a colocated vLLM synced every ``vllm_sync_interval`` > 1
    optimizer steps, or the emulated ``stale`` engine. (The probe itself measures at lag 0.)"""
    from ..rollout.emulated import EmulatedRolloutEngine

    args = trainer.args
    if getattr(trainer, "use_vllm", False) and int(getattr(args, "vllm_sync_interval", 1) or 1) > 1:
        return True
    sampler = getattr(trainer, "rollout_sampler", None)
    return isinstance(sampler, EmulatedRolloutEngine) and sampler.kind == "stale"


def sampler_truncates(trainer: Any) -> bool:
    """Whether the training sampler truncates as the truncating-sampler verdict row means it: top_p < 1 or min_p > 0
    (top-k alone is not that row's: monitor/advice.py)."""
    top_p = getattr(trainer, "top_p", None)
    min_p = getattr(trainer, "min_p", None)
    return (top_p is not None and float(top_p) < 1.0) or (min_p is not None and float(min_p) > 0.0)


def placement(report: dict[str, Any], batches: int, truncates: bool, stale: bool, asynchronous: bool = False
              ) -> dict[str, Any]:
    """The verdict row(s) the report's regime falls on (:func:`trl_rollout_corr.monitor.verdict.place`) as probe.json
    keeps it: the rows' keys, ``decided``, each boundary with its 95% interval and side, and ``more_batches`` (how
    many more generation batches than the ``batches`` scored would decide, from the SE's 1/sqrt(n): None when decided
    or when no number of batches can be named)."""
    from ..monitor.verdict import place

    r = report["regime"]
    p = place(r["T"], r["per_token_kl"], r["per_token_kl_se"], r["T_times_kl"], r["T_times_kl_se"],
              truncates=truncates, stale=stale, asynchronous=asynchronous)
    factor = p.sample_factor
    more = None
    if factor is not None and math.isfinite(factor):
        more = max(1, math.ceil(batches * factor) - batches)
    return {"rows": [row.key for row in p.rows], "decided": p.decided, "sample_factor": factor,
            "more_batches": more, "batches": batches, "truncates": truncates, "stale": stale,
            "asynchronous": asynchronous,
            "boundaries": [{"quantity": b.quantity, "bound": b.bound, "estimate": b.estimate, "se": b.se,
                            "interval": list(b.interval), "side": b.side} for b in p.boundaries]}


_QUANTITY = {"per_token_kl": "per-token KL (lag 0)", "t_kl": "T*KL"}


def format_placement(place: dict[str, Any] | None) -> list[str]:
    """The verdict lines of the terminal table: each row's text quoted from ``VERDICTS``, or that the sample cannot
    decide between rows and how many more batches would."""
    if not place:
        return []
    from ..monitor.advice import REMEDIES
    from ..monitor.verdict import EVIDENCE_PAGE, verdict

    stale = REMEDIES.get("stale")

    def quote(key: str) -> str:
        row = verdict(key)
        # a row on the monitor's stale remedy names each of its equally confirmed settings, the first one first
        settings = stale.settings if stale is not None and row.setting in stale.settings else (row.setting,)
        setting = f" ({' or '.join(s for s in settings if s)})" if row.setting else ""
        return (f"  [{key}] {row.situation}: {row.advice}{setting}. Measured at T {row.T}, per-token KL "
                f"{row.per_token_kl}, T*KL {row.t_kl}, {row.model}; {row.confirmation} ({row.evidence}).")

    tested = "; ".join(f"{_QUANTITY[b['quantity']]} {b['estimate']:.3g} [{b['interval'][0]:.3g}, "
                       f"{b['interval'][1]:.3g}] against {b['bound']:g}" for b in place["boundaries"])
    engine = ("an asynchronous trainer" if place["asynchronous"] else "a stale engine" if place["stale"]
              else "a synchronous engine")
    lines = ["", f"Verdict ({EVIDENCE_PAGE}; {engine}{', a truncating sampler' if place['truncates'] else ''}; "
             f"95% intervals: {tested}):"]
    if place["decided"]:
        lines += [quote(key) for key in place["rows"]]
    else:
        undecided = [b for b in place["boundaries"] if b["side"] is None]
        lines.append("  This sample cannot decide between these rows: the 95% interval of "
                     + " and of ".join(f"{_QUANTITY[b['quantity']]} straddles {b['bound']:g}" for b in undecided)
                     + ":")
        lines += [quote(key) for key in place["rows"]]
        if place["more_batches"] is not None:
            total = place["batches"] + place["more_batches"]
            lines.append(f"  About {place['sample_factor']:.2g} times this sample would decide: --probe_batches "
                         f"{total} ({place['more_batches']} more generation batches).")
        elif place["sample_factor"] == math.inf:
            lines.append("  The estimate sits on the boundary: no sample size decides; the rows on both sides apply.")
        else:
            lines.append("  Its standard error is unknown (fewer than 2 sequences): probe more batches.")
    if place["stale"] and not place["asynchronous"]:
        lines.append("  The probe measures at lag 0: the stale run's T*KL grows with the lag; watch "
                     f"{metric('k3_kl')} during training (docs/monitor.md).")
    return lines


def configuration_notes(trainer: Any) -> list[str]:
    """What the probe can see about the setup that biases pi_rollout or the comparison."""
    args = trainer.args
    notes = []
    train_dtype = next(trainer.model.parameters()).dtype
    autocast = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    notes.append(f"trainer parameters {train_dtype}, autocast {autocast or 'off'}"
                 + (f", vLLM dtype {getattr(args, 'vllm_dtype', None) or 'auto'}" if args.use_vllm else ""))
    from ..grpo.trainer import pi_rollout_modifiers

    for setting in pi_rollout_modifiers(args, trainer.repetition_penalty):
        notes.append(f"{setting} changes pi_rollout in a way the trainer does not reproduce: the ratios of the "
                     "tokens it touches are biased")
    return notes


def probe(trainer: Any, batches: int | None = None, methods: tuple[str, ...] = DEFAULT_METHODS, split: bool = True,
          engine_dtype: str | torch.dtype | None = None, samples: int = DEFAULT_SAMPLES, stale: bool | None = None,
          asynchronous: bool = False) -> dict[str, Any]:
    """Generate and score ``batches`` generation batches (None: enough for ``samples`` completions) with ``trainer``
    and report the mismatch (a dict) and the verdict row(s) it falls on (``placement``; ``stale`` None: from the run,
    :func:`engine_is_stale`); with ``split``, the mismatch by source too (:class:`SourceRescorer`, ``engine_dtype`` as
    ``--probe_engine_dtype``)."""
    import time

    start = time.perf_counter()
    data = collect(trainer, batches, split, engine_dtype, samples)
    report = analyse(data, methods)
    report["configuration"] = configuration_notes(trainer)
    report["placement"] = placement(report, len(data["batches"]), sampler_truncates(trainer),
                                    engine_is_stale(trainer) if stale is None else stale, asynchronous)
    report["map_cell"] = nearest_map_cell(report["regime"])
    report["seconds"] = time.perf_counter() - start
    report["_log_rho"] = _log_rho_by_bucket(data)
    return report


def _log_rho_by_bucket(data: dict[str, Any]) -> dict[str, list[float]]:
    """log rho of every valid token, grouped by its sequence's length bucket (for the plot)."""
    from ..core.mismatch import bucket_label

    mask = data["mask"].bool() & data["rollout_seen"].bool()[:, None]  # (B, T)
    log_rho = (data.get("ratio_logps", data["train_logps"]) - data["rollout_logps"]).double()  # (B, T)
    lengths = mask.sum(1)  # (B,)
    edges = [0, *LENGTH_BUCKETS]
    out = {}
    for lower, upper in zip(edges, [*edges[1:], None]):
        rows = (lengths >= lower) & (lengths < upper if upper is not None else True)  # (B,)
        values = log_rho[rows][mask[rows]]
        values = values[torch.isfinite(values)]
        if values.numel():
            out[bucket_label(lower, upper)] = values.tolist()
    return out


#: the estimator map's committed results (a checkout of the repository: trl_rollout_corr/cli/probe.py -> the
#: checkout's root; not in an installed wheel)
MAP_CSV = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "experiments",
                       "results", "estimator_map", "estimator_map.csv")


def nearest_map_cell(regime: dict[str, float], path: str = MAP_CSV) -> dict[str, Any] | None:
    """The estimator map's cell nearest to the user's regime: the smallest |log T - log T_u| + |log T*KL - log
    T*KL_u| over the map's (T, source, level) cells (experiments/estimator_map.py; docs/evidence.md, "Estimator
    map"). Returns the cell's regime and each method's row, or None when the map's CSV is not there."""
    import csv

    if not os.path.isfile(path) or not regime.get("T") or not regime.get("T_times_kl"):
        return None
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    cells: dict[tuple, list[dict]] = {}
    for row in rows:
        cells.setdefault((row["T"], row["source"], row["level"]), []).append(row)
    floor = 1e-9

    def distance(key):
        first = cells[key][0]
        return (abs(math.log(float(key[0]) / regime["T"]))
                + abs(math.log(max(float(first["t_kl"]), floor) / max(regime["T_times_kl"], floor))))

    key = min(cells, key=distance)
    first = cells[key][0]
    methods = {r["method"]: {k: float(r[k]) for k in ("mse", "bias2", "bias2_se", "relvar", "ess_token", "masked_seq")}
               for r in cells[key]}
    return {"T": int(key[0]), "source": key[1], "level": key[2], "per_token_kl": float(first["kl_k3"]),
            "T_times_kl": float(first["t_kl"]), "methods": methods, "csv": path}


def format_map_cell(cell: dict[str, Any] | None) -> list[str]:
    if cell is None:
        return ["The estimator map's results are not in this installation: see docs/evidence.md (\"Estimator map\")."]
    ranked = sorted(cell["methods"].items(), key=lambda kv: kv[1]["mse"])
    resolved = [name for name, m in ranked if m["bias2_se"] > 0 and m["bias2"] >= 2 * m["bias2_se"]]
    lines = [f"Nearest estimator-map cell: T {cell['T']}, source {cell['source']} {cell['level']}, per-token KL "
             f"{cell['per_token_kl']:.2g}, T*KL {cell['T_times_kl']:.2g} (output-layer gradient, batch 64, a ~0.1M "
             "model; MSE in units of the on-policy gradient's batch noise):",
             f"  {'method':26} {'MSE':>7} {'bias^2':>12} {'variance':>8} {'masked seq':>10}"]
    for name, m in ranked[:6]:
        lines.append(f"  {name:26} {m['mse']:>7.3g} {m['bias2']:>6.2g}+-{m['bias2_se']:<5.2g} {m['relvar']:>8.3g} "
                     f"{m['masked_seq']:>10.1%}")
    lines.append("  bias resolved (>= 2 s.e.) for: " + (", ".join(resolved) if resolved else "no method")
                 + ". The map ranks estimators on one batch; whether that trains better is the training "
                 "benchmark's question (docs/evidence.md).")
    return lines


def format_sources(report: dict[str, Any]) -> list[str]:
    """The mismatch-by-source lines of the terminal table (nothing without ``report["sources"]``)."""
    src = report.get("sources")
    if not src:
        return []

    def row(label, part, what):
        if part is None:
            return f"  {label:26} {'-':>10} {'':>7}  {what}"
        return f"  {label:26} {part['k3']:>10.3g} {part['share_of_k3']:>7.1%}  {what}"

    engine = src["engine_dtype"] or "unknown"
    lines = ["", f"mismatch by source (k3 per token; share of the k3 above; small independent parts add "
             f"approximately; re-scoring took {src['seconds']:.1f} s):"]
    if "truncation_k3" in src:
        lines.append(f"  {'truncated sampling':26} {src['truncation_k3']:>10.3g} {'':>7}  "
                     + ("removed by the trainer's renormalization (not in the share)"
                        if report["truncation"]["applied_by_trainer"] else "kept: the trainer does not renormalize"))
    lines.append(row(f"precision ({engine})", src["precision"],
                     src["precision_note"] or f"the trainer ({src['trainer_dtype']}) re-scored in {engine}"
                     + (" (LM head too: the trainer's is float32, cast_lm_head_to_fp32)" if src.get("lm_head") else
                        "")))
    lines.append(row("batch shape", src["batch_shape"], f"the trainer re-scored, {src['batch_shape_composition']}"))
    lines.append(row("remainder", src["remainder"], "kernels, the engine's batch composition, quantization, "
                     "staleness, ... (log rho with the trainer in the engine's dtype)"))
    return lines


def format_report(report: dict[str, Any]) -> str:
    """The terminal table."""
    tok, seq = report["tokens"], report["sequences"]
    lines = [f"Probe: {report['samples']} samples ({report['samples_without_rollout_logprobs']} without engine "
             f"log-probs), {tok['count']} tokens, {report['seconds']:.1f} s",
             *(f"  setup: {note}" for note in report.get("configuration", [])),
             "",
             f"per-token KL(pi_rollout || pi_train): k3 {tok['k3']:.3g} +- {tok.get('k3_se', math.nan):.2g}, k1 "
             f"{tok['k1']:.3g} +- {tok.get('k1_se', math.nan):.2g} (+- one standard error, sequences as units); "
             f"max |log rho| "
             f"{tok['max_abs_log_rho']:.3g}; log rho 0.1%/50%/99.9%: {tok['log_rho_quantiles']['q0.001']:.3g} / "
             f"{tok['log_rho_quantiles']['q0.5']:.3g} / {tok['log_rho_quantiles']['q0.999']:.3g}",
             f"low-probability tokens (pi_train < 1e-3): {tok['low_prob_token_fraction']:.2%} of tokens, "
             f"{tok['low_prob_share_of_k3']:.2%} of the KL",
             f"sequences: mean T {seq['mean_length']:.0f}, T*KL mean {seq['t_kl_mean']:.3g} +- "
             f"{seq.get('t_kl_se', math.nan):.2g} (median "
             f"{seq['t_kl_quantiles']['q0.5']:.3g}, 99%: {seq['t_kl_quantiles']['q0.99']:.3g}); sequence-weight ESS "
             f"{seq['seq_ess']:.3f} (log-normal prediction exp(-Var sum log rho) = {seq['seq_ess_lognormal']:.3f})"]
    if "truncation" in report:
        tr = report["truncation"]
        lines.append(f"truncated sampling: kept mass {tr['kept_mass_mean']:.3f}; k3 before renormalizing "
                     f"{tr['before_renormalization']['k3']:.3g}, after {tr['after_renormalization']['k3']:.3g}"
                     + ("" if tr.get("applied_by_trainer", True) else
                        " (truncated_support_correction=False: the trainer's ratio keeps the truncation's share, "
                        "and so do the lines above and the methods)"))
    lines += format_sources(report)
    lines += ["", f"{'length':>10} {'seqs':>6} {'mean T':>7} {'k3/token':>10} {'T*KL':>9} {'seq ESS':>8}"]
    for label, b in report["by_length"].items():
        lines.append(f"{label:>10} {b['count']:>6} {b['mean_length']:>7.0f} {b['k3']:>10.3g} {b['t_kl_mean']:>9.3g} "
                     f"{b['seq_ess']:>8.3f}")
    lines += ["", f"{'method (on these samples)':28} {'ESS':>6} {'w min':>8} {'w max':>8} {'w = 0':>7} "
              f"{'pinned at C':>11} {'rejected tok':>12} {'rejected seq':>12}"]
    for name, m in report["methods"].items():
        def g(key, fmt=".3f", m=m):
            return format(m[key], fmt) if key in m else "-"
        lines.append(f"{name:28} {g('rollout_is_eff_sample_size'):>6} {g('weight_min', '.3g'):>8} "
                     f"{g('weight_max', '.3g'):>8} {g('weight_zero_fraction', '.1%'):>7} "
                     f"{g('rollout_is_ratio_fraction_high', '.1%'):>11} {g('rejected_token_fraction', '.2%'):>12} "
                     f"{g('rollout_rs_seq_masked_fraction', '.2%'):>12}")
    r = report["regime"]
    lines += ["", f"Your regime: T ~ {r['T']:.0f} tokens, per-token KL ~ {r['per_token_kl']:.2g} +- "
              f"{r.get('per_token_kl_se', math.nan):.2g}, T*KL ~ {r['T_times_kl']:.2g} +- "
              f"{r.get('T_times_kl_se', math.nan):.2g}."]
    lines += format_placement(report.get("placement"))
    lines += format_map_cell(report.get("map_cell"))
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: str) -> list[str]:
    """``probe.json`` and (with matplotlib) ``probe.png`` in ``out_dir``; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    log_rho = report.get("_log_rho", {})
    path = os.path.join(out_dir, "probe.json")
    with open(path, "w") as f:
        json.dump({k: v for k, v in report.items() if not k.startswith("_")}, f, indent=2, default=float)
    written = [path]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, values in log_rho.items():
        axes[0].hist(values, bins=60, histtype="step", density=True, label=f"T {label}")
    axes[0].set_yscale("log")
    axes[0].set_xlabel("log rho = log pi_train - log pi_rollout per token (after renormalizing a truncated support)")
    axes[0].legend()
    quantiles = report["sequences"].get("t_kl_quantiles", {})
    if quantiles:
        axes[1].plot([float(k[1:]) for k in quantiles], list(quantiles.values()), marker="o")
        axes[1].set_xscale("logit")
        axes[1].set_yscale("symlog", linthresh=1e-3)
        axes[1].set_xlabel("quantile over sequences")
        axes[1].set_ylabel("T*KL of a sequence (sum of k3)")
    fig.tight_layout()
    png = os.path.join(out_dir, "probe.png")
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return [*written, png]


def main(argv: list[str]) -> None:
    """``trl-rollout-corr probe``: ``train``'s arguments (``--config run.yaml`` ...) plus :class:`ProbeArguments`."""
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser

    from ..grpo.config import RolloutCorrGRPOConfig
    from ..monitor.args import MonitorArguments
    from .train import TrainScriptArguments, build_trainer

    parser = TrlParser((TrainScriptArguments, RolloutCorrGRPOConfig, ModelConfig, MonitorArguments,
                        DatasetMixtureConfig, ProbeArguments), prog="trl-rollout-corr probe")
    script_args, training_args, model_args, monitor_args, dataset_args, probe_args = \
        parser.parse_args_and_config(args=argv)
    trainer = build_trainer(script_args, training_args, model_args, monitor_args, dataset_args, monitor=False)
    methods = tuple(m.strip() for m in probe_args.probe_methods.split(",") if m.strip())
    report = probe(trainer, probe_args.probe_batches, methods, probe_args.probe_split, probe_args.probe_engine_dtype,
                   probe_args.probe_samples, probe_args.probe_stale, probe_args.probe_asynchronous)
    print(format_report(report))
    out = probe_args.probe_out or os.path.join(training_args.output_dir, "probe")
    for path in write_report(report, out):
        print(f"wrote {path}")
    if not math.isfinite(report["tokens"]["k3"]):
        raise SystemExit("The probe found no valid token to measure (every sample had a non-finite log-prob).")
