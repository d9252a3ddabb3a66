"""What this package assumes about TRL 1.16's ``AsyncGRPOTrainer`` (its loss, its weight sync), each checked where used.

* The micro-batch keys its ``compute_loss`` reads (:data:`LOSS_KEYS`), checked present by :func:`check_loss_inputs`.
* It runs one forward of the model on the packed row, ``model(input_ids=..., ...)``: :func:`packed_forward` runs it
  the same way for the trainer, and :class:`AnsweredForward` stands in for the model in TRL's ``compute_loss``,
  answers that call with the outputs the trainer already computed and raises on any other call.
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


def packed_forward(model: Any, inputs: dict[str, Any], aux_loss_enabled: bool) -> tuple[Any, torch.Tensor, float]:
    """The policy forward on the micro-batch's packed row, called as TRL 1.16's ``compute_loss`` calls it (fused LM
    head, tree attention). Returns its outputs, the row's input_ids (1, N) and the seconds it took."""
    mask_bool = inputs["attention_mask"].bool()  # (1, N_pad)
    input_ids = inputs["input_ids"][mask_bool].unsqueeze(0)  # (1, N)
    tree_kwargs = {key: inputs[key][inputs[key] >= 0]
                   for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
    tree_kwargs["tree_max_seqlen_q"], tree_kwargs["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()
    router_kwargs = {"output_router_logits": True} if aux_loss_enabled else {}
    forward_start = time.time()
    outputs = model(input_ids=input_ids, position_ids=inputs["position_ids"][mask_bool].unsqueeze(0),
                    shift_labels=inputs["shift_labels"][mask_bool].unsqueeze(0), fused_lm_head=True,
                    **router_kwargs, **tree_kwargs)
    return outputs, input_ids, time.time() - forward_start


class AnsweredForward:
    """Stands in for the model in TRL's ``compute_loss``: answers its one forward with the outputs already computed,
    after checking that TRL asks for one forward of a packed row of the same shape (not its values: no sync)."""

    def __init__(self, outputs: Any, input_ids: torch.Tensor) -> None:
        self.outputs, self.input_ids, self.calls = outputs, input_ids, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        asked = kwargs.get("input_ids")
        # the same packed row, compared by its layout (shape, dtype, device), not its values: a value comparison
        # is a host sync per micro-batch
        if self.calls > 1 or args or not isinstance(asked, torch.Tensor) or (asked.shape, asked.dtype, asked.device) \
                != (self.input_ids.shape, self.input_ids.dtype, self.input_ids.device):
            raise TrlInternalsChanged("AsyncGRPOTrainer.compute_loss no longer runs one forward on the packed row "
                                      "(input_ids= keyword)")
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
