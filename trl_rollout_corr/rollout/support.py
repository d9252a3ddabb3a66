"""Training-side kept mass of a truncated sampler, measured during the trainer's own forward pass.

:class:`KeptMassProbe` hooks the causal LM's backbone for the duration of one log-prob computation: each forward
hands its last hidden states (detached) to :func:`~trl_rollout_corr.core.truncation.log_kept_mass`, which projects
them through the LM head in row chunks (no (B, T, V) logits tensor, no second backbone pass). The result is
log M and "sampled token inside the kept set" for the last ``logits_to_keep`` positions, in batch order.

The projection reproduces TRL 1.16's fused LM head (``trl.trainer.utils.add_fused_lm_head``): the same logit
multiplier (:func:`logit_multiplier`), the same compute dtype (the autocast dtype, or float32 with
``cast_lm_head_to_fp32``), the bias added in that dtype, then scale, softcap and temperature in float32. The head is
read as the fused head reads it: an FSDP2 ``DTensor`` through ``full_tensor()``, a ZeRO-3 partition gathered for the
projection unless it is already ``AVAILABLE`` (a tied weight that ``embed_tokens`` holds gathered: gathering it again
would re-partition it on exit, under ``embed_tokens``' active-submodule tracking).
"""

from __future__ import annotations

import contextlib
from typing import Any

import sys

import torch

from ..core.truncation import DEFAULT_CHUNK_ELEMENTS, SamplingTruncation, log_kept_mass


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The underlying ``PreTrainedModel`` behind DDP / DeepSpeed (``.module``) and PEFT wrappers."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def logit_multiplier(text_config: Any) -> float:
    """The factor the logits are multiplied by before the softcap, resolved as TRL 1.16's fused head resolves it.

    ``logit_scale`` (None: unscaled; a real 0.0 is kept), else ``output_multiplier``, else ``lm_head_multiplier``
    (Falcon-H1), else ``logits_scaling`` (HyperCLOVA X multiplies by it; Granite and MiniCPM3 divide by it), else 1.
    """
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    logits_scaling = getattr(text_config, "logits_scaling", None)
    if scale is None and logits_scaling is not None:
        scale = logits_scaling if getattr(text_config, "model_type", None) == "hyperclovax" else 1 / logits_scaling
    return 1.0 if scale is None else float(scale)


class KeptMassProbe:
    """``with KeptMassProbe(model, truncation, logits_to_keep) as probe: <forwards>``; then ``probe.result()``.

    ``cast_lm_head_to_fp32``: the trainer's flag of that name (TRL then projects in float32 outside autocast).
    ``chunk_elements``: logits transformed at once (None: :func:`probe_chunk_elements` of the head's device).
    """

    def __init__(self, model: torch.nn.Module, truncation: SamplingTruncation, logits_to_keep: int,
                 chunk_elements: int | None = None, cast_lm_head_to_fp32: bool = False) -> None:
        self.lm = _causal_lm(model)
        self.truncation = truncation
        self.logits_to_keep = logits_to_keep
        self.chunk_elements = chunk_elements
        self.cast_lm_head_to_fp32 = cast_lm_head_to_fp32
        text_config = self.lm.config.get_text_config() if hasattr(self.lm.config, "get_text_config") else self.lm.config
        self.softcap = getattr(text_config, "final_logit_softcapping", None)
        self.logit_scale = logit_multiplier(text_config)
        self._log_mass: list[torch.Tensor] = []
        self._in_support: list[torch.Tensor] = []
        self._handle = None

    def __enter__(self) -> KeptMassProbe:
        self._handle = self.lm.base_model.register_forward_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    @torch.no_grad()
    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)  # (b, L)
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]  # (b, L, H)
        k = self.logits_to_keep
        hidden = hidden[:, -k - 1:-1].detach()  # (b, k, H): position t predicts token t + 1
        targets = input_ids[:, -k:]  # (b, k)
        head = self.lm.get_output_embeddings()
        log_mass, in_support = [], []
        flat_hidden = hidden.reshape(-1, hidden.size(-1))  # (b*k, H)
        flat_targets = targets.reshape(-1)  # (b*k,)
        device = flat_hidden.device
        # TRL's fused head: the autocast dtype (or the hidden states' own) unless the head is cast to float32
        if self.cast_lm_head_to_fp32:
            compute_dtype = torch.float32
        elif torch.is_autocast_enabled(device.type):
            compute_dtype = torch.get_autocast_dtype(device.type)
        else:
            compute_dtype = flat_hidden.dtype
        weight, bias = head.weight, head.bias  # (V, H), (V,)
        if _is_dtensor(weight):  # FSDP2: the sharded head as one tensor on every rank (a collective)
            weight = weight.full_tensor()  # (V, H)
            if bias is not None:
                bias = bias.full_tensor()  # (V,)
        with _gathered(weight, bias), torch.autocast(device.type, enabled=False):
            chunk_elements = self.chunk_elements or probe_chunk_elements(weight.device)
            rows = max(1, chunk_elements // weight.size(0))
            w = weight.to(compute_dtype)  # (V, H)
            b = None if bias is None else bias.to(compute_dtype)  # (V,)
            for start in range(0, flat_hidden.size(0), rows):
                logits = flat_hidden[start:start + rows].to(device=w.device, dtype=compute_dtype) @ w.t()  # (n, V)
                if b is not None:
                    logits = logits + b
                logits = logits.float() * self.logit_scale  # (n, V)
                if self.softcap is not None:
                    logits = self.softcap * torch.tanh(logits / self.softcap)
                chunk_mass, chunk_in = log_kept_mass(logits, flat_targets[start:start + rows].to(logits.device),
                                                     self.truncation, chunk_elements)
                log_mass.append(chunk_mass)
                in_support.append(chunk_in)
        self._log_mass.append(torch.cat(log_mass).view(targets.shape))  # (b, k)
        self._in_support.append(torch.cat(in_support).view(targets.shape))  # (b, k)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(log_kept_mass (B, T) float32, in_support (B, T) bool) over every forward seen, in order."""
        if not self._log_mass:
            raise RuntimeError("KeptMassProbe saw no forward pass of the model's backbone.")
        return torch.cat(self._log_mass), torch.cat(self._in_support)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    """An FSDP2 ``DTensor`` (its module is loaded whenever one exists: importing it here would cost ~1.5 s)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def probe_chunk_elements(device: torch.device) -> int:
    """Logits per chunk: :data:`DEFAULT_CHUNK_ELEMENTS` (about 1.2 GB of working set) on the CPU; on a CUDA device a
    quarter of its free memory at ~40 bytes per logit (the sort's buffers), between that default and 8 times it."""
    if device.type != "cuda":
        return DEFAULT_CHUNK_ELEMENTS
    free_bytes, _ = torch.cuda.mem_get_info(device)  # a driver query: it does not wait for the stream
    return int(min(max(free_bytes // 4 // 40, DEFAULT_CHUNK_ELEMENTS), 8 * DEFAULT_CHUNK_ELEMENTS))


def _gathered(*params: torch.Tensor | None):
    """Materialize a ZeRO-3-partitioned LM head for the projection (read-only); a no-op otherwise.

    As TRL's ``maybe_gather_lm_head_ctx``: parameters already ``AVAILABLE`` (a tied head that ``embed_tokens`` holds
    gathered) are left alone, and a parameter passed twice is gathered once.
    """
    to_gather = {id(p): p for p in params if p is not None and hasattr(p, "ds_id")
                 and getattr(getattr(p, "ds_status", None), "name", None) != "AVAILABLE"}
    if not to_gather:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(to_gather.values()), modifier_rank=None)
