"""What this package assumes about TRL 1.16's ``AsyncGRPOTrainer`` (its loss, its weight sync), each checked where used.

* The micro-batch keys its ``compute_loss`` reads (:data:`LOSS_KEYS`), checked present by :func:`check_loss_inputs`.
* It runs one forward of the model on the packed row, ``model(input_ids=..., ...)``: :func:`packed_forward` runs it
  the same way for the trainer (slicing the row with the sizes the collator read on the CPU, where TRL's boolean
  masks are host syncs), and :class:`AnsweredForward` stands in for the model in TRL's ``compute_loss``, answers
  that call with the outputs the trainer already computed and raises on any other call, or one whose keywords differ
  in layout from the trainer's.
* It times that forward into the private step timer ``_step_forward_s`` (logged as ``perf/fwd_s``):
  :func:`add_forward_time` adds the time of the forward the trainer ran in its place, checking the timer is there.
* ``_sync_weight()`` publishes the policy to the server and bumps ``model_version``: :func:`sync_weight` calls it,
  and :func:`check_hooks` checks at construction that TRL still defines it (the override would never run otherwise).

A failed check raises :class:`~trl_rollout_corr.trl_hooks.base.TrlInternalsChanged`, naming the installed TRL
version.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .async_grpo_data import PACKED_SIZES
from .base import TrlInternalsChanged, require_hooks

# the private AsyncGRPOTrainer methods RolloutCorrAsyncGRPOTrainer overrides
OVERRIDDEN_HOOKS = ("_sync_weight",)
# the micro-batch keys TRL 1.16's compute_loss reads
LOSS_KEYS = ("input_ids", "attention_mask", "position_ids", "shift_labels", "token_index", "old_log_probs",
             "advantages", "segment_id", "global_n_tokens", "global_n_forward_tokens", "mean_seq_len",
             "tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k", "tree_max_seqlens")


def check_hooks(owner: type, cls: type) -> None:
    """Every private method in :data:`OVERRIDDEN_HOOKS` is still one ``owner`` inherits."""
    require_hooks(owner, cls, OVERRIDDEN_HOOKS)


def check_loss_inputs(inputs: dict[str, Any], added: tuple[str, ...] = ()) -> None:
    """The micro-batch at ``compute_loss`` has TRL's :data:`LOSS_KEYS` and the keys this package ``added``."""
    missing = [k for k in (*LOSS_KEYS, *added) if k not in inputs]
    if missing:
        raise TrlInternalsChanged(f"the async GRPO micro-batch has no {', '.join(missing)} at compute_loss")


def packed_sizes(inputs: dict[str, Any], rank: int) -> dict[str, int]:
    """This rank's packed-row sizes, by :data:`~.async_grpo_data.PACKED_SIZES` name, from the shapes of the
    micro-batch's ``rc_packed_sizes`` (host integers that the collator read on the CPU: no device read)."""
    carriers = inputs["rc_packed_sizes"]
    if not isinstance(carriers, (list, tuple)) or not 0 <= rank < len(carriers) \
            or not isinstance(carriers[rank], torch.Tensor) or carriers[rank].dim() != 2 + len(PACKED_SIZES):
        raise TrlInternalsChanged(f"the micro-batch's rc_packed_sizes reached compute_loss as "
                                  f"{type(carriers).__name__} without an entry for rank {rank}: the micro-batch took "
                                  "another path than DataCollatorForRollout and accelerate's dispatcher")
    return dict(zip(PACKED_SIZES, carriers[rank].shape[2:]))


def packed_forward(model: Any, inputs: dict[str, Any], aux_loss_enabled: bool,
                   rank: int) -> tuple[Any, dict[str, Any], float]:
    """The policy forward on this rank's packed row, called as TRL 1.16's ``compute_loss`` calls it (fused LM head,
    tree attention), with no host sync. Returns its outputs, the keywords it was called with and the seconds it took.

    TRL strips the inter-rank padding with boolean masks (``input_ids[attention_mask.bool()]``,
    ``tree_kv_index[tree_kv_index >= 0]``, ..., and ``tree_max_seqlens[0].tolist()``): on a GPU each is a host sync.
    The collator pads every row at its end (checked on the CPU batch, ``async_grpo_data._packed_sizes``), so those
    masks are prefixes whose lengths it has read: here they are slices of those lengths (the same values)."""
    sizes = packed_sizes(inputs, rank)
    n = sizes["input_ids"]  # N: the row's tokens
    tree_kwargs = {key: inputs[key][0, :sizes[key]]  # (L,) as TRL's inputs[key][inputs[key] >= 0]
                   for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
    tree_kwargs["tree_max_seqlen_q"] = sizes["tree_max_seqlen_q"]  # as TRL's tree_max_seqlens[0].tolist()
    tree_kwargs["tree_max_seqlen_k"] = sizes["tree_max_seqlen_k"]
    router_kwargs = {"output_router_logits": True} if aux_loss_enabled else {}
    kwargs = dict(input_ids=inputs["input_ids"][:, :n],  # (1, N) as TRL's input_ids[mask].unsqueeze(0)
                  position_ids=inputs["position_ids"][:, :n],  # (1, N)
                  shift_labels=inputs["shift_labels"][:, :n],  # (1, N)
                  fused_lm_head=True, **router_kwargs, **tree_kwargs)
    forward_start = time.time()
    outputs = model(**kwargs)
    return outputs, kwargs, time.time() - forward_start


class AnsweredForward:
    """Stands in for the model in TRL's ``compute_loss``: answers its one forward with the outputs already computed,
    after checking that TRL asks for one forward with the same keywords: tensors of the same layout (shape, dtype,
    device; their values are not compared: that is a host sync per micro-batch), the other values equal. TRL's own
    masks gave its tensors their shapes, so this also checks the sizes the trainer's forward sliced with."""

    def __init__(self, outputs: Any, kwargs: dict[str, Any]) -> None:
        self.outputs, self.kwargs, self.calls = outputs, kwargs, 0

    @staticmethod
    def _layout(value: Any) -> Any:
        return (value.shape, value.dtype, value.device) if isinstance(value, torch.Tensor) else value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls > 1 or args or not isinstance(kwargs.get("input_ids"), torch.Tensor):
            raise TrlInternalsChanged("AsyncGRPOTrainer.compute_loss no longer runs one forward on the packed row "
                                      "(input_ids= keyword)")
        asked = {key: self._layout(value) for key, value in kwargs.items()}
        ran = {key: self._layout(value) for key, value in self.kwargs.items()}
        if asked != ran:
            differ = sorted(key for key in asked.keys() | ran.keys() if asked.get(key) != ran.get(key))
            raise TrlInternalsChanged(f"AsyncGRPOTrainer.compute_loss no longer runs one forward on the packed row "
                                      f"as the trainer ran it: {', '.join(differ)} differ (asked "
                                      f"{[asked.get(k) for k in differ]}, ran {[ran.get(k) for k in differ]})")
        return self.outputs


def add_forward_time(trainer: Any, seconds: float) -> None:
    """Add ``seconds`` to TRL's timer of this step's forwards (it timed the answered call, not the real forward)."""
    timer = getattr(trainer, "_step_forward_s", None)
    if not isinstance(timer, float):
        raise TrlInternalsChanged(f"AsyncGRPOTrainer has no float _step_forward_s (found {type(timer).__name__}): the "
                                  "rollout-correction trainer adds its forward's time to it")
    trainer._step_forward_s = timer + seconds


def sync_weight(trainer: Any, owner: type) -> None:
    """``AsyncGRPOTrainer._sync_weight()``: publish the current policy to vLLM and bump ``model_version``."""
    super(owner, trainer)._sync_weight()
