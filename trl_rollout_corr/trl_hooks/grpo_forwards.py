"""TRL's calls to ``GRPOTrainer._get_per_token_logps_and_entropies``, answered from an explicit plan.

``_generate_and_score_completions`` asks for the pi_old forward (under TRL's own condition,
:func:`~trl_rollout_corr.trl_hooks.grpo.trl_runs_pi_old_forward`) and then the reference-model forward
(``beta != 0``), both without grad; ``_compute_loss`` asks once for the micro-batch's policy forward.
:class:`TrlForwardCalls` answers those calls from an explicit list of expected calls and raises
:class:`~trl_rollout_corr.trl_hooks.base.TrlInternalsChanged` on any other order, model or count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.criterion import StatFloats, stat_key
from .base import TrlInternalsChanged


@dataclass
class _Expected:
    name: str  # "pi_old" | "ref"
    model: Any
    placeholder: bool  # True: answered with a NaN placeholder; False: TRL's own forward runs


@dataclass
class ScoringCalls:
    """The forwards TRL is expected to request while scoring one generation batch, and what they were answered."""

    expected: list[_Expected]
    answered: list[str] = field(default_factory=list)
    placeholders: dict[str, torch.Tensor] = field(default_factory=dict)
    rollout_seen: list[bool] | None = None  # per sample: whether pi_rollout was seen (set by the trainer's _generate)


@dataclass
class _LossForward:
    model: Any
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits_to_keep: int
    inputs: dict[str, Any]
    result: tuple
    grad: bool = True
    used: bool = False


class TrlForwardCalls:
    """Answers TRL's calls to ``_get_per_token_logps_and_entropies`` from an explicit plan, and checks their order.

    * :meth:`scoring` wraps ``GRPOTrainer._generate_and_score_completions``: TRL's pi_old forward is replaced by a
      placeholder (this trainer computes pi_old itself, or does not need it), the reference forward runs; any other
      call, or a missing one, raises.
    * :meth:`loss` wraps ``GRPOTrainer.compute_loss``: TRL's request for the policy forward gets the forward the
      trainer already ran for the same model and tensors; it must be requested exactly once. The request is matched
      without a host sync: the model, ``logits_to_keep``, grad mode and model inputs by identity, ``input_ids`` and
      ``attention_mask`` by shape, dtype and device. Their values (TRL concatenates its own copies) are compared on
      the device: :meth:`take_mismatch` hands the trainer a 0-dim flag, read with the metrics at the next log
      (:data:`FORWARD_MISMATCH`), where a mismatch raises. (``torch.equal`` here was a host sync per micro-batch.)
    Calls outside both scopes run TRL's forward unchanged.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self.input_names = names
        self._scoring: ScoringCalls | None = None
        self._loss: _LossForward | None = None
        self._mismatch: torch.Tensor | None = None  # () bool on the device: a cached answer for other values

    def take_mismatch(self) -> torch.Tensor | None:
        """Whether a cached forward was handed over for tensors of other values since the last call (0-dim bool on
        the device, not read here: the trainer reads it with its metrics, see :data:`FORWARD_MISMATCH`)."""
        mismatch, self._mismatch = self._mismatch, None
        return mismatch

    @property
    def active_scoring(self) -> ScoringCalls | None:
        return self._scoring

    @contextlib.contextmanager
    def scoring(self, *, pi_old_model: Any | None, ref_model: Any | None) -> Iterator[ScoringCalls]:
        """Scope of one ``_generate_and_score_completions``: TRL's pi_old forward (if ``pi_old_model``) becomes a
        placeholder, the reference forward (if ``ref_model``) runs."""
        expected = []
        if pi_old_model is not None:
            expected.append(_Expected("pi_old", pi_old_model, placeholder=True))
        if ref_model is not None:
            expected.append(_Expected("ref", ref_model, placeholder=False))
        scope = ScoringCalls(expected)
        self._scoring = scope
        try:
            yield scope
        finally:
            self._scoring = None
        missing = [e.name for e in scope.expected[len(scope.answered):]]
        if missing:
            raise TrlInternalsChanged(
                f"GRPOTrainer._generate_and_score_completions did not request the {' and '.join(missing)} forward(s) "
                f"it requests under this configuration (requested: {scope.answered or 'none'})")

    def _placeholder(self, input_ids: torch.Tensor, width: int) -> tuple:
        tensor = input_ids.new_full((input_ids.size(0), width), float("nan"), dtype=torch.float32)  # (B, T) unread
        self._scoring.placeholders["pi_old"] = tensor
        return tensor, None, None

    def check_scored_output(self, output: dict[str, Any], scope: ScoringCalls) -> None:
        """``old_per_token_logps`` is the placeholder where TRL made the pi_old call, absent otherwise; drop it."""
        placeholder = scope.placeholders.get("pi_old")
        old = output.pop("old_per_token_logps", None)
        if placeholder is None and old is not None:
            raise TrlInternalsChanged("GRPOTrainer._generate_and_score_completions returned old_per_token_logps "
                                      "without requesting a pi_old forward")
        if placeholder is not None and old is not placeholder:
            raise TrlInternalsChanged("GRPOTrainer._generate_and_score_completions did not return its pi_old forward "
                                      "as old_per_token_logps")

    @contextlib.contextmanager
    def loss(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
             inputs: dict[str, Any], result: tuple) -> Iterator[None]:
        """Scope of one ``GRPOTrainer.compute_loss``: its policy forward is ``result``, requested exactly once."""
        self._loss = _LossForward(model, input_ids, attention_mask, logits_to_keep, inputs, result,
                                  grad=torch.is_grad_enabled())
        try:
            yield
            used = self._loss.used
        finally:
            self._loss = None
        if not used:
            raise TrlInternalsChanged("GRPOTrainer.compute_loss did not request the micro-batch's policy forward "
                                      "through _get_per_token_logps_and_entropies (the correction would be lost)")

    def answer(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
               kwargs: dict[str, Any]) -> tuple | None:
        """The answer to one TRL call, or None where TRL's own forward must run (the caller runs it:
        :func:`~trl_rollout_corr.trl_hooks.grpo.answer_forward`; nothing here calls back into the trainer)."""
        if self._scoring is not None:
            scope = self._scoring
            if torch.is_grad_enabled() or len(scope.answered) == len(scope.expected):
                raise TrlInternalsChanged(
                    f"GRPOTrainer._generate_and_score_completions requested an unexpected forward (grad "
                    f"{'on' if torch.is_grad_enabled() else 'off'}) after {scope.answered or 'none'}; expected "
                    f"{[e.name for e in scope.expected]}")
            nxt = scope.expected[len(scope.answered)]
            if model is not nxt.model:
                raise TrlInternalsChanged(
                    f"GRPOTrainer._generate_and_score_completions requested a forward of "
                    f"{type(model).__name__} where this package expects the {nxt.name} forward (of "
                    f"{type(nxt.model).__name__}) after {scope.answered or 'none'}")
            scope.answered.append(nxt.name)
            return self._placeholder(input_ids, logits_to_keep) if nxt.placeholder else None
        cached = self._loss
        if cached is not None and not cached.used and self._is_cached_forward(cached, model, input_ids,
                                                                               attention_mask, logits_to_keep, kwargs):
            cached.used = True
            return cached.result
        return None

    def _is_cached_forward(self, cached: _LossForward, model: Any, input_ids: torch.Tensor,
                           attention_mask: torch.Tensor, logits_to_keep: int, kwargs: dict[str, Any]) -> bool:
        same = (model is cached.model and logits_to_keep == cached.logits_to_keep
                and torch.is_grad_enabled() == cached.grad
                and all(kwargs.get(name) is cached.inputs.get(name) for name in self.input_names)
                and _same_layout(input_ids, cached.input_ids) and _same_layout(attention_mask, cached.attention_mask))
        if same and not (input_ids is cached.input_ids and attention_mask is cached.attention_mask):
            with torch.no_grad():  # on the device: no host sync
                differs = (input_ids != cached.input_ids).any() | (attention_mask != cached.attention_mask).any()
            self._mismatch = differs if self._mismatch is None else self._mismatch | differs
        return same


FORWARD_MISMATCH = stat_key("loss.forward_mismatch", __name__)
"""The key under which the trainer carries :meth:`TrlForwardCalls.take_mismatch` in its statistics (a max); its
metrics transfer, once per log, raises :class:`~trl_rollout_corr.trl_hooks.base.TrlInternalsChanged` when it is
set: TRL asked for the policy forward of other token values than the trainer ran."""


def check_forward_mismatch(floats: dict[str, float]) -> None:
    """Raise if the statistics' transfer (``RolloutStats.to_floats``) says a cached forward answered other values."""
    if StatFloats(floats).max(FORWARD_MISMATCH, 0.0) > 0:  # absent (no cached answer compared values): 0
        raise TrlInternalsChanged(
            "GRPOTrainer.compute_loss requested the micro-batch's policy forward for input_ids/attention_mask of the "
            "same shape but other values than the micro-batch the trainer ran it for (its loss used the wrong forward "
            "since the last log)")


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
