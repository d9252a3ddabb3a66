"""Training-side kept mass of a truncated sampler, measured during the trainer's own forward pass.

:class:`KeptMassProbe` hooks the causal LM's backbone for the duration of one log-prob computation: each forward
hands its last hidden states (detached) to :func:`~trl_rollout_corr.core.truncation.log_kept_mass`, which projects
them through the LM head in row chunks (no (B, T, V) logits tensor, no second backbone pass). The result is
log M and "sampled token inside the kept set" for the last ``logits_to_keep`` positions, in batch order.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..core.truncation import DEFAULT_CHUNK_ELEMENTS, SamplingTruncation, log_kept_mass


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The underlying ``PreTrainedModel`` behind DDP / DeepSpeed (``.module``) and PEFT wrappers."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


class KeptMassProbe:
    """``with KeptMassProbe(model, truncation, logits_to_keep) as probe: <forwards>``; then ``probe.result()``."""

    def __init__(self, model: torch.nn.Module, truncation: SamplingTruncation, logits_to_keep: int,
                 chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> None:
        self.lm = _causal_lm(model)
        self.truncation = truncation
        self.logits_to_keep = logits_to_keep
        self.chunk_elements = chunk_elements
        text_config = self.lm.config.get_text_config() if hasattr(self.lm.config, "get_text_config") else self.lm.config
        self.softcap = getattr(text_config, "final_logit_softcapping", None)
        self.logit_scale = getattr(text_config, "logit_scale", None) or 1.0
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
        with _gathered(head):
            weight, bias = head.weight, head.bias  # (V, H), (V,)
            rows = max(1, self.chunk_elements // weight.size(0))
            for start in range(0, flat_hidden.size(0), rows):
                # the projection in the head's dtype (as the fused LM head does), the truncation in float32
                logits = (flat_hidden[start:start + rows].to(weight.dtype) @ weight.t()).float()  # (n, V)
                if bias is not None:
                    logits = logits + bias.float()
                logits = logits * self.logit_scale
                if self.softcap is not None:
                    logits = self.softcap * torch.tanh(logits / self.softcap)
                chunk_mass, chunk_in = log_kept_mass(logits, flat_targets[start:start + rows].to(logits.device),
                                                     self.truncation, self.chunk_elements)
                log_mass.append(chunk_mass)
                in_support.append(chunk_in)
        self._log_mass.append(torch.cat(log_mass).view(targets.shape))  # (b, k)
        self._in_support.append(torch.cat(in_support).view(targets.shape))  # (b, k)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(log_kept_mass (B, T) float32, in_support (B, T) bool) over every forward seen, in order."""
        if not self._log_mass:
            raise RuntimeError("KeptMassProbe saw no forward pass of the model's backbone.")
        return torch.cat(self._log_mass), torch.cat(self._in_support)


def _gathered(module: torch.nn.Module):
    """Materialize a ZeRO-3-partitioned LM head for the projection (read-only); a no-op otherwise."""
    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
