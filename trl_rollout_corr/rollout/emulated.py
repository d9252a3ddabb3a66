"""Emulated mismatched rollout engines for the transformers path (stress tests and the CPU demo).

A sampler is a separate copy of the policy that follows it the way a real engine's weight sync would:
``sync(policy, step)`` is called before every generation. Kinds:

* ``stale`` (``lag=k``): the weights of k optimizer steps earlier (asynchronous rollouts);
* ``bf16`` / ``fp16``: the current weights cast to low precision;
* ``int8``: dynamic INT8 quantization of every ``nn.Linear`` (``torch.ao``; CPU only: refused on another device);
* ``wq<N>``: per-output-channel symmetric N-bit fake quantization of every ``nn.Linear`` weight (any device).

Memory: the engine is one full copy of the policy on the policy's device (under ZeRO-3 built from the config there,
while every rank gathers the whole policy for the copy). A stale engine also keeps up to ``lag + 1`` snapshots of the
policy's state dict on the CPU (host memory: ``lag + 1`` times the model's size), and they travel in every
checkpoint (:mod:`trl_rollout_corr.training.resume`).
"""

from __future__ import annotations

import collections
import contextlib
import copy
from typing import Any

import torch


class EmulatedRolloutEngine:
    """A mismatched copy of the policy that samples instead of it; its processed log-probs are captured."""

    def __init__(self, kind: str = "stale", lag: int = 4, bits: int = 4) -> None:
        if kind.startswith("wq") and kind[2:].isdigit():
            kind, bits = "wq", int(kind[2:])
        if kind not in ("stale", "bf16", "fp16", "int8", "wq", "none"):
            raise ValueError(f"Unknown emulated engine kind {kind!r}: use stale, bf16, fp16, int8, wq<N> or none.")
        if kind == "stale" and lag < 1:
            raise ValueError(f"lag must be >= 1 for a stale engine, got {lag}.")
        self.kind, self.lag, self.bits = kind, lag, bits
        self._snapshots: collections.deque = collections.deque()  # (optimizer step, state dict), oldest first
        self._last_step: int | None = None
        self._engine: torch.nn.Module | None = None

    def __repr__(self) -> str:
        return f"EmulatedRolloutEngine(kind={self.kind!r}, lag={self.lag}, bits={self.bits})"

    @torch.no_grad()
    def sync(self, policy: torch.nn.Module, step: int) -> None:
        """Weight sync, called before each generation with the optimizer step count."""
        if self._engine is not None and step == self._last_step:
            return
        self._last_step = step
        sharded = is_zero3_sharded(policy)
        device = _device_of(policy)
        if self.kind == "int8" and device.type != "cpu":
            raise ValueError(f"EmulatedRolloutEngine('int8') quantizes with torch.ao.quantization.quantize_dynamic, "
                             f"whose INT8 kernels run on the CPU only, and the policy is on {device}: use 'wq8' "
                             "(8-bit fake quantization of every Linear weight, on any device), or train on the CPU.")
        with gathered_parameters(policy, sharded):
            if self.kind == "stale":  # the snapshots live on the CPU: lag + 1 copies of the model
                state = self._stale_state(step, {k: v.detach().to("cpu", copy=True)
                                                 for k, v in policy.state_dict().items()})
            else:  # loaded into the engine inside the gather (a ZeRO-3 partition is released on exit): no copy
                state = policy.state_dict()
            if sharded and (self._engine is None or self.kind == "int8"):
                # a ZeRO-3 module holds empty shards and DeepSpeed hooks: build a plain, full copy from its config,
                # on the policy's device
                with torch.device(device):
                    engine = type(policy)(policy.config)
                engine = engine.to(next(iter(state.values())).dtype).eval()
            elif self._engine is None or self.kind == "int8":
                engine = copy.deepcopy(policy)
                # trainers patch instance-level forwards (TRL's fused LM head) that close over the *policy*:
                # drop them so that the copy runs its own weights
                for module in engine.modules():
                    module.__dict__.pop("forward", None)
                    module.__dict__.pop("generate", None)
                engine.eval()
            else:
                engine = self._engine
            engine.load_state_dict(state)  # copies into the engine's device (from the CPU for a stale one)
            del state
        if self.kind in ("bf16", "fp16"):
            engine = engine.to(torch.bfloat16 if self.kind == "bf16" else torch.float16)
            _keep_embedding_output_in(engine, engine.get_input_embeddings().weight.dtype)
        elif self.kind == "int8":
            engine = torch.ao.quantization.quantize_dynamic(engine, {torch.nn.Linear}, dtype=torch.qint8)
        elif self.kind == "wq":
            for module in engine.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(fake_quantize(module.weight, self.bits))
        self._engine = engine

    def _stale_state(self, step: int, state: dict) -> dict:
        """The policy of optimizer step ``step - lag``: the newest snapshot taken at or before that step (the first
        one until then). Snapshots exist only where a sync happened, so the engine lags exactly ``lag`` steps when
        a generation happened at ``step - lag`` (every step with TRL's defaults), and at most ``lag`` + the
        generation interval otherwise."""
        self._snapshots.append((step, state))
        target = step - self.lag
        while len(self._snapshots) > 1 and self._snapshots[1][0] <= target:
            self._snapshots.popleft()  # a newer snapshot is still old enough
        return self._snapshots[0][1]

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to sample as an uninterrupted one would: the stale kind's snapshots (up to
        ``lag + 1`` full state dicts of the policy, CPU tensors; the other kinds rebuild everything from the current
        policy at each sync and save none). Saved with each checkpoint by the trainer."""
        return {"kind": self.kind, "lag": self.lag, "bits": self.bits, "snapshots": list(self._snapshots)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = {k: state.get(k) for k in ("kind", "lag", "bits")}
        if saved != {"kind": self.kind, "lag": self.lag, "bits": self.bits}:
            raise ValueError(f"The checkpoint's rollout engine is EmulatedRolloutEngine({saved}), this run's is "
                             f"{self!r}: resume with the engine the checkpoint was trained with.")
        self._snapshots = collections.deque(state["snapshots"])
        self._engine, self._last_step = None, None  # the next sync rebuilds the engine from the restored snapshots

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        if self._engine is None:
            raise RuntimeError("EmulatedRolloutEngine.generate called before sync(policy, step).")
        return self._engine.generate(*args, **kwargs)


def _keep_embedding_output_in(engine: torch.nn.Module, dtype: torch.dtype) -> None:
    """A low-precision copy of a policy whose input embedding carries TRL's ``cast_lm_head_to_fp32`` hook (a tied
    model: the hook casts the embedding's output back to the *policy's* dtype) would feed fp32 activations to its
    bf16/fp16 layers: cast them to the engine's dtype after every other hook, once per copy."""
    embedding = engine.get_input_embeddings()
    if embedding is None or getattr(embedding, "_rc_engine_dtype_hook", False):
        return
    embedding.register_forward_hook(lambda module, args, output: output.to(dtype))
    embedding._rc_engine_dtype_hook = True


def _device_of(module: torch.nn.Module) -> torch.device:
    """The device of the module's first parameter (a ZeRO-3 partition's too), the CPU for a module without any."""
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def is_zero3_sharded(module: torch.nn.Module) -> bool:
    """True when DeepSpeed ZeRO-3 partitions this module's parameters (they carry a ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def gathered_parameters(module: torch.nn.Module, sharded: bool):
    """Context in which a ZeRO-3 module's full parameters are materialized on every rank (read-only)."""
    if not sharded:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)


def fake_quantize(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric per-output-channel N-bit quantize-dequantize: round(W / s) * s, s = max|W_row| / (2^(N-1) - 1)."""
    levels = 2 ** (bits - 1) - 1
    scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / levels  # (out, 1)
    return torch.round(weight / scale).clamp(-levels, levels) * scale  # (out, in)
