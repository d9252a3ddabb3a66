"""Everything this package assumes about TRL's ``GRPOTrainer`` internals, in one file, each checked where it is used.

Written against TRL 1.16. What is assumed, and how it is checked:

* ``_generate(prompts)`` returns a tuple whose field names :func:`generate_result_fields` reads from the ``return``
  statement of TRL's source; :func:`unpack_generate_result` checks the length and the types of the fields read.
* ``_generate_and_score_completions`` asks ``_get_per_token_logps_and_entropies`` for the pi_old forward (under
  TRL's own condition, :func:`trl_runs_pi_old_forward`) and then the reference-model forward (``beta != 0``), both
  without grad; ``_compute_loss`` asks it once for the micro-batch's policy forward. :class:`TrlForwardCalls` answers
  those calls from an explicit list of expected calls and raises on any other order, model or count.
* The model-input keyword arguments of a forward are the parameters of ``_get_per_token_logps_and_entropies``
  after its control arguments: :func:`forward_input_names` reads them from TRL's signature.
* The loss types whose ``_compute_loss`` divides by ``num_items_in_batch`` (``dapo``, ``cispo``, ``vespo`` in TRL
  1.16): :func:`kept_token_normalizer_losses` reads them from the source of TRL's ``_compute_loss``.
* Keys added to the output of ``_generate_and_score_completions`` (tensors with a leading batch dimension) reach
  ``compute_loss`` through TRL's shuffling and splitting: the trainer checks that they arrive.

Every check reads the method the trainer really inherits (:func:`inherited_method`: the next definition after this
package's class in the instance's MRO, what ``super()`` calls), never ``trl.GRPOTrainer``: that name can be rebound
(a patching library, a test harness, this package's class swapped into TRL's namespace) without TRL having changed.

A failed check raises :class:`TrlInternalsChanged`, naming the installed TRL version.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

TESTED_TRL = "1.16"
_FORWARD_CONTROL_ARGS = ("self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
                         "compute_entropy", "compute_aux_loss")


class TrlInternalsChanged(RuntimeError):
    """TRL no longer behaves as this package assumes (see :mod:`trl_rollout_corr._trl`)."""

    def __init__(self, what: str) -> None:
        import trl

        super().__init__(f"{what} (installed TRL {trl.__version__}; trl_rollout_corr was written against TRL "
                         f"{TESTED_TRL}: pin trl to {TESTED_TRL}.x or report this).")


def inherited_method(owner: type, name: str, cls: type | None = None) -> Callable:
    """The function ``super(owner, self).<name>`` calls for ``type(self) = cls`` (default ``owner``): the first
    definition of ``name`` after ``owner`` in ``cls``'s MRO."""
    mro = (cls or owner).__mro__
    for klass in mro[mro.index(owner) + 1:]:
        if name in vars(klass):
            return inspect.unwrap(vars(klass)[name])
    raise TrlInternalsChanged(f"no base class of {owner.__name__} defines {name}")


def forward_input_names(owner: type, cls: type | None = None) -> tuple[str, ...]:
    """The model-input keyword arguments of ``GRPOTrainer._get_per_token_logps_and_entropies`` (pixel_values, ...)."""
    params = list(inspect.signature(inherited_method(owner, "_get_per_token_logps_and_entropies", cls)).parameters)
    if tuple(params[: len(_FORWARD_CONTROL_ARGS)]) != _FORWARD_CONTROL_ARGS:
        raise TrlInternalsChanged(f"GRPOTrainer._get_per_token_logps_and_entropies takes {params}, expected "
                                  f"{list(_FORWARD_CONTROL_ARGS)} first")
    return tuple(params[len(_FORWARD_CONTROL_ARGS):])


def kept_token_normalizer_losses(owner: type, cls: type | None = None) -> tuple[str, ...]:
    """The loss types whose ``GRPOTrainer._compute_loss`` divides by ``num_items_in_batch``, read from its source."""
    return _kept_token_normalizer_losses(inherited_method(owner, "_compute_loss", cls))


@functools.lru_cache(maxsize=8)
def _kept_token_normalizer_losses(compute_loss: Callable) -> tuple[str, ...]:
    source = inspect.getsource(compute_loss)
    for match in re.finditer(r"self\.loss_type in \[([^\]]*)\]:(.*?)(?=\n\s*elif |\n\s*else:)", source, re.S):
        if 'inputs["num_items_in_batch"]' in match.group(2):
            return tuple(sorted(re.findall(r"[\"'](\w+)[\"']", match.group(1))))
    raise TrlInternalsChanged("GRPOTrainer._compute_loss has no loss-type branch that divides by "
                              "inputs['num_items_in_batch']")


def generate_result_fields(owner: type, cls: type | None = None) -> tuple[str, ...]:
    """The names of the values ``GRPOTrainer._generate`` returns, in order, read from its ``return`` statement."""
    return _generate_result_fields(inherited_method(owner, "_generate", cls))


@functools.lru_cache(maxsize=8)
def _generate_result_fields(generate: Callable) -> tuple[str, ...]:
    returns = re.findall(r"\n\s*return ([\w, ]+)\n", inspect.getsource(generate))
    fields = tuple(name.strip() for name in returns[-1].split(",")) if returns else ()
    if not {"completion_ids", "logprobs"} <= set(fields):
        raise TrlInternalsChanged(f"GRPOTrainer._generate's return statement names {fields or 'nothing'}, without "
                                  "completion_ids and logprobs")
    return fields


def checkpoint_dir(trainer: Any, trial: Any) -> str:
    """The directory ``Trainer._save_checkpoint`` writes this step's checkpoint into (as TRL's own override reads
    it)."""
    import os

    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    return os.path.join(trainer._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")


def trl_runs_pi_old_forward(trainer: Any) -> bool:
    """TRL's own condition for computing old_per_token_logps in ``_generate_and_score_completions``."""
    generate_every = trainer.args.steps_per_generation * trainer.num_iterations
    return (trainer.args.gradient_accumulation_steps % generate_every != 0
            or (trainer.use_vllm and trainer.vllm_importance_sampling_correction))


def unpack_generate_result(result: Any, owner: type, cls: type | None = None) -> dict[str, Any]:
    """``GRPOTrainer._generate``'s tuple as a dict named by :func:`generate_result_fields`, after checking it."""
    names = generate_result_fields(owner, cls)
    if not isinstance(result, tuple) or len(result) != len(names):
        raise TrlInternalsChanged(f"GRPOTrainer._generate returned {type(result).__name__} of length "
                                  f"{len(result) if isinstance(result, tuple) else '?'}, expected the "
                                  f"{len(names)}-tuple {names} its source returns")
    fields = dict(zip(names, result))
    completion_ids, logprobs = fields["completion_ids"], fields["logprobs"]
    if not isinstance(completion_ids, list) or (logprobs is not None and not isinstance(logprobs, list)):
        raise TrlInternalsChanged(f"GRPOTrainer._generate returned completion_ids of type "
                                  f"{type(completion_ids).__name__} and logprobs of type {type(logprobs).__name__}, "
                                  "expected lists")
    return fields


@dataclass
class _Expected:
    name: str  # "pi_old" | "ref"
    model: Any
    answer: Callable[[Callable[[], Any], torch.Tensor, int], Any]  # (run TRL's forward, input_ids, logits_to_keep)


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
      trainer already ran for the same model and tensors (matched by identity and equality, not shape); it must be
      requested exactly once.
    Calls outside both scopes run TRL's forward unchanged.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self.input_names = names
        self._scoring: ScoringCalls | None = None
        self._loss: _LossForward | None = None

    @property
    def active_scoring(self) -> ScoringCalls | None:
        return self._scoring

    @contextlib.contextmanager
    def scoring(self, *, pi_old_model: Any | None, ref_model: Any | None) -> Iterator[ScoringCalls]:
        """Scope of one ``_generate_and_score_completions``: TRL's pi_old forward (if ``pi_old_model``) becomes a
        placeholder, the reference forward (if ``ref_model``) runs."""
        expected = []
        if pi_old_model is not None:
            expected.append(_Expected("pi_old", pi_old_model, self._placeholder))
        if ref_model is not None:
            expected.append(_Expected("ref", ref_model, lambda run, input_ids, width: run()))
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

    def _placeholder(self, run: Callable[[], Any], input_ids: torch.Tensor, width: int) -> tuple:
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
               kwargs: dict[str, Any], run: Callable[[], Any]) -> Any:
        """The result for one TRL call; ``run()`` runs TRL's own forward."""
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
            return nxt.answer(run, input_ids, logits_to_keep)
        cached = self._loss
        if cached is not None and not cached.used and self._is_cached_forward(cached, model, input_ids,
                                                                               attention_mask, logits_to_keep, kwargs):
            cached.used = True
            return cached.result
        return run()

    def _is_cached_forward(self, cached: _LossForward, model: Any, input_ids: torch.Tensor,
                           attention_mask: torch.Tensor, logits_to_keep: int, kwargs: dict[str, Any]) -> bool:
        return (model is cached.model and logits_to_keep == cached.logits_to_keep
                and torch.is_grad_enabled() == cached.grad
                and all(kwargs.get(name) is cached.inputs.get(name) for name in self.input_names)
                and torch.equal(input_ids, cached.input_ids) and torch.equal(attention_mask, cached.attention_mask))
