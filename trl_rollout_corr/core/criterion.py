"""The criterion interface: a correction method is one file.

A criterion is one way of correcting for pi_rollout != pi_train (IS weights, rejection, the veto, the divergence
criteria, the second-moment mask). Its file owns everything about it:

* its **fields** (:class:`CorrectionField`: name, type, default, help), from which
  :class:`~trl_rollout_corr.RolloutCorrectionConfig`, the trainers' flat config fields and
  :class:`~trl_rollout_corr.core.CorrectionParams` are all derived (:func:`with_fields`);
* its **check** of those fields at construction (:meth:`Criterion.check`, an error naming the field and the fix);
* its **keep-mask or weights** (:meth:`Criterion.apply`, on the :class:`CorrectionState` of one call of
  :func:`~trl_rollout_corr.core.compute_rollout_correction_stats`);
* its **statistics**, by names declared once (:func:`stat_key`) and read back through :class:`StatFloats`, which
  raises for a name nothing declared (a typo fails, it does not give a missing metric);
* its **metric names** (:attr:`Criterion.metrics`, the registry ``core/metric_names.py`` unions them) and its
  **finalize** step (:meth:`Criterion.finalize`);
* whether it needs **batch-scope statistics** (:meth:`Criterion.batch_scope`, read by ``plan.py``) and whether it can
  remove tokens (:meth:`Criterion.removes_tokens`) or zero advantages (:meth:`Criterion.zeroes_advantages`);
* which of its fields **switch it off** and which fields go back to their defaults then
  (:attr:`Criterion.switches`, read by the trainers' configs when a flat field says ``"none"`` over a preset).

``core/criteria.py`` lists the criteria in the order the pipeline applies them. Notation: rho_t = pi_train(a_t) /
pi_rollout(a_t) with pi_train = pi_old (decoupled mode) or pi_theta detached (bypass mode); C a bound. Pure Python and
PyTorch: no TRL import.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .stats import MAX, MIN, SUM, ReduceFn, RolloutStats

NONE_STRINGS = ("none", "null", "None", "")
_SAME: Any = object()  # CorrectionField.params_*: as the config's


def none_if_unset(value: Any) -> Any:
    """The strings a CLI or YAML file uses to switch a level off ("none", "null", "") read as ``None``.

    Args:
        value: any field value.

    Returns:
        ``None`` for one of ``NONE_STRINGS``, else ``value`` unchanged.
    """
    return None if isinstance(value, str) and value in NONE_STRINGS else value


def require_positive(name: str, value: Any, hint: str, allow_inf: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a number > 0 (finite unless ``allow_inf``)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0
            or (math.isinf(value) and not allow_inf)):
        kind = "a number > 0 (inf allowed)" if allow_inf else "a finite number > 0"
        raise ValueError(f"{name} must be {kind}, got {value!r} ({hint}).")


# ---------------------------------------------------------------------------------------------------- fields
@dataclass(frozen=True)
class CorrectionField:
    """One field of the correction, declared once, in the file of the criterion that reads it.

    Attributes:
        name: the field's name (the same in every config and in ``CorrectionParams``).
        type: its annotation on ``RolloutCorrectionConfig`` (e.g. ``"float | None"``).
        default: its default there.
        help: the trainers' flat (CLI) field's help text.
        flat_type: its annotation on the trainers' flat fields (default ``None`` = "not set here"); e.g.
            ``"float | str | None"`` for a number a CLI may give as a string.
        params_type: its annotation on ``CorrectionParams`` (default: ``type``).
        params_default: its default on ``CorrectionParams`` (default: ``default``); ``rollout_is`` is ``"token"`` in
            a config and ``None`` (no IS) for a caller of the core that spells the fields out.
    """

    name: str
    type: str
    default: Any
    help: str
    flat_type: str
    params_type: Any = _SAME
    params_default: Any = _SAME

    def annotation(self, form: str) -> str:
        """The annotation of the field on the ``"config"``, ``"flat"`` or ``"params"`` form."""
        if form == "flat":
            return self.flat_type
        if form == "params" and self.params_type is not _SAME:
            return self.params_type
        return self.type

    def dataclass_field(self, form: str) -> dataclasses.Field:
        """The ``dataclasses.field`` of the field on the ``"config"``, ``"flat"`` or ``"params"`` form."""
        if form == "flat":
            return dataclasses.field(default=None, metadata={"help": self.help})
        if form == "params" and self.params_default is not _SAME:
            return dataclasses.field(default=self.params_default)
        return dataclasses.field(default=self.default)


FORMS = ("config", "flat", "params")


def with_fields(fields: tuple[CorrectionField, ...], form: str, after: str | None = None):
    """Class decorator (apply below ``@dataclass``): adds ``fields`` to the class's annotations and defaults, in
    their order, so that ``@dataclass`` makes them its fields. ``after``: the name of the class's own field they
    follow (``None``: first).

    Args:
        fields: the fields (usually ``correction_fields()``).
        form: ``"config"`` (``RolloutCorrectionConfig``), ``"flat"`` (the trainers' config mixin: every default
            ``None``, the help as metadata) or ``"params"`` (``CorrectionParams``).
        after: the class's own field the correction's fields follow.

    Returns:
        The decorator.
    """
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}.")

    def decorate(cls: type) -> type:
        own = dict(cls.__dict__.get("__annotations__", {}))
        clash = sorted(set(own) & {f.name for f in fields})
        if clash:
            raise TypeError(f"{cls.__name__} declares {clash} itself: a correction field is declared once, by its "
                            "criterion (trl_rollout_corr/core/criteria.py lists them).")
        added = {f.name: f.annotation(form) for f in fields}
        names = list(own)
        at = 0 if after is None else names.index(after) + 1
        cls.__annotations__ = {**{n: own[n] for n in names[:at]}, **added, **{n: own[n] for n in names[at:]}}
        for f in fields:
            setattr(cls, f.name, f.dataclass_field(form))
        return cls

    return decorate


# ---------------------------------------------------------------------------------------------------- statistics
_DECLARED: dict[str, str] = {}


def stat_key(name: str, owner: str) -> str:
    """Declare the statistic ``name`` (a key of :class:`~.stats.RolloutStats`), once, by module ``owner``; returns it.

    The pipeline writes a statistic under the returned constant and the finalize step reads it back through
    :class:`StatFloats` with the same constant: a misspelled constant is a ``NameError``, a misspelled string a
    ``KeyError`` naming it.

    Raises:
        ValueError: ``name`` already declared by another module.
    """
    if _DECLARED.setdefault(name, owner) != owner:
        raise ValueError(f"statistic {name!r} is declared by {_DECLARED[name]} and again by {owner}: declare it once.")
    return name


def declared_stat_keys() -> frozenset[str]:
    """Every statistic name declared so far (the core's modules declare theirs at import)."""
    return frozenset(_DECLARED)


class StatFloats:
    """Reduced statistics as floats (:meth:`RolloutStats.to_floats`), read by declared name.

    Reading a name nothing declared with :func:`stat_key` raises ``KeyError`` naming it: a typo in a key fails where
    it is read instead of giving a missing (or zero) metric.
    """

    def __init__(self, floats: dict[str, float]) -> None:
        self.floats = floats

    @staticmethod
    def _declared(name: str) -> str:
        if name not in _DECLARED:
            raise KeyError(f"statistic {name!r} is not declared (core/criterion.py stat_key); known: "
                           f"{sorted(_DECLARED)}")
        return name

    def has(self, name: str) -> bool:
        """Whether the summed statistic ``name`` is present (its producer ran)."""
        return SUM + self._declared(name) in self.floats

    def sum(self, name: str, default: float | None = None) -> float:
        """The summed statistic ``name``; ``default`` where absent (``None``: absent raises ``KeyError``)."""
        key = SUM + self._declared(name)
        return self.floats[key] if default is None else self.floats.get(key, default)

    def max(self, name: str, default: float | None = None) -> float:
        """The max-reduced statistic ``name``; ``default`` where absent (``None``: absent raises ``KeyError``)."""
        key = MAX + self._declared(name)
        return self.floats[key] if default is None else self.floats.get(key, default)

    def min(self, name: str) -> float:
        """The min-reduced statistic ``name``."""
        return self.floats[MIN + self._declared(name)]


# the pipeline's own counts (every criterion's fractions divide by them)
TOK_N = stat_key("mask.tok_n", __name__)
"""Valid tokens: in the mask, pi_rollout known, every log-prob of the sequence finite."""
SEQ_N = stat_key("mask.seq_n", __name__)
"""Sequences with a valid token."""


# ---------------------------------------------------------------------------------------------------- criterion
@dataclass
class CorrectionState:
    """What the criteria read and write during one call of the pipeline (device tensors only, no host sync).

    A criterion reads the log-probs and the tokens they are valid on, and writes its result only through the methods
    below, which combine with what the criteria before it wrote (AND into the kept mask, OR into the zeroed
    advantages, product of the weights): no criterion can overwrite another's result, so the order of ``CRITERIA``
    decides nothing but the order of the fields and checks.

    Read:
        train_log_prob: (B, T) log pi_train(a_t) (pi_old in decoupled mode, pi_theta detached in bypass mode),
            float32, 0 where a log-prob is not finite.
        rollout_log_prob: (B, T) log pi_rollout(a_t), float32, 0 where a log-prob is not finite.
        log_ratio: (B, T) log rho_t = train_log_prob - rollout_log_prob.
        valid: (B, T) bool: in the mask, pi_rollout known, every log-prob of the sequence finite.
        advantages: (B,) or (B, T) TRL's A before any correction, or ``None`` (the call brought none).
        reduce_fn: the all-reduce across processes (``None``: this process only).
        mask_dtype: the input mask's dtype (the dtype of the masks handed back).
        stats: the statistics, written under names declared with :func:`stat_key`.

    Written (through the methods only):
        keep: (B, T) bool, the tokens left in the loss and its token count (:meth:`reject` ANDs into it).
        advantage_zeroed: (B, T) bool or ``None``: tokens whose advantage is set to 0, kept in the loss's count
            (:meth:`zero_advantages` ORs into it); :attr:`advantage_mask` is its complement in ``mask_dtype``.
        is_weights: (B, T) or ``None``: the IS weights (:meth:`multiply_weights` multiplies into them).
        pinned: (B, T) bool: IS weight clipped to a bound (:meth:`pin` ORs into it).
        weight_zeroed: (B, T) bool: IS weight set to 0 (:meth:`zero_weights` ORs into it).
    """

    train_log_prob: torch.Tensor  # (B, T)
    rollout_log_prob: torch.Tensor  # (B, T)
    valid: torch.Tensor  # (B, T) bool
    stats: RolloutStats
    mask_dtype: torch.dtype
    reduce_fn: ReduceFn | None = None
    advantages: torch.Tensor | None = None  # (B,) or (B, T)
    log_ratio: torch.Tensor = dataclasses.field(init=False)  # (B, T)
    keep: torch.Tensor = dataclasses.field(init=False)  # (B, T) bool
    pinned: torch.Tensor = dataclasses.field(init=False)  # (B, T) bool
    weight_zeroed: torch.Tensor = dataclasses.field(init=False)  # (B, T) bool
    is_weights: torch.Tensor | None = dataclasses.field(init=False, default=None)  # (B, T)
    advantage_zeroed: torch.Tensor | None = dataclasses.field(init=False, default=None)  # (B, T) bool

    def __post_init__(self) -> None:
        self.log_ratio = self.train_log_prob - self.rollout_log_prob  # (B, T)
        self.keep = self.valid  # (B, T) nothing rejected yet
        self.pinned = torch.zeros_like(self.valid)  # (B, T)
        self.weight_zeroed = torch.zeros_like(self.valid)  # (B, T)

    def reject(self, rejected: torch.Tensor) -> None:
        """Remove ``rejected`` (B, T) bool from the loss and its token count: keep <- keep AND NOT rejected."""
        self.keep = self.keep & ~rejected  # (B, T)

    def zero_advantages(self, zeroed: torch.Tensor) -> None:
        """Set the advantage of ``zeroed`` (B, T) bool to 0, the tokens kept in the loss's count: zeroed OR'd into
        what the criteria before set."""
        self.advantage_zeroed = zeroed if self.advantage_zeroed is None else self.advantage_zeroed | zeroed  # (B, T)

    def multiply_weights(self, weights: torch.Tensor) -> None:
        """Multiply the IS weights by ``weights`` (B, T) (the first criterion's weights are taken as they are)."""
        self.is_weights = weights if self.is_weights is None else self.is_weights * weights  # (B, T)

    def pin(self, pinned: torch.Tensor) -> None:
        """Mark ``pinned`` (B, T) bool as tokens whose IS weight was clipped to a bound (ORed; the gradient share)."""
        self.pinned = self.pinned | pinned  # (B, T)

    def zero_weights(self, zeroed: torch.Tensor) -> None:
        """Mark ``zeroed`` (B, T) bool as tokens whose IS weight was set to 0 (ORed; the gradient share)."""
        self.weight_zeroed = self.weight_zeroed | zeroed  # (B, T)

    @property
    def advantage_mask(self) -> torch.Tensor | None:
        """(B, T) 0/1 in ``mask_dtype``: 0 where a criterion zeroed the advantage; ``None`` where none did."""
        return None if self.advantage_zeroed is None else (~self.advantage_zeroed).to(self.mask_dtype)  # (B, T)


class Criterion:
    """One correction method. Subclasses set the class attributes and override what applies to them.

    Attributes:
        name: a short name (the ordered list's entry, the docs' paragraph).
        fields: the correction fields it reads (declared here only).
        metrics: the metric names (without ``rollout_corr/``) its finalize step can emit.
        switches: the fields that switch it off, and the fields reset with them.
    """

    name: ClassVar[str]
    fields: ClassVar[tuple[CorrectionField, ...]] = ()
    metrics: ClassVar[tuple[str, ...]] = ()
    switches: ClassVar[dict[str, tuple[str, ...]]] = {}
    """Its fields whose ``None`` switches (part of) it off, each with the fields that then go back to their defaults
    when a trainer's flat fields switch it off over a preset or saved config (unless they are set too)."""

    def check(self, cfg: Any) -> None:
        """Validate (and normalize) this criterion's fields at construction; every check of them lives here, also
        those that read the mode fields (``bypass_mode``, ``rollout_rs_exclude_from_baseline``).

        Args:
            cfg: the ``RolloutCorrectionConfig`` being validated (its fields may be normalized in place).

        Raises:
            ValueError: naming the field and the fix.
        """

    def check_call(self, params: Any, advantages: torch.Tensor | None) -> None:
        """Refuse a call of the pipeline this criterion cannot serve (before any tensor work).

        Args:
            params: the call's ``CorrectionParams``.
            advantages: (B,) or (B, T), or ``None`` where the call brought none.

        Raises:
            ValueError: what the call lacks, and how to give it.
        """

    def apply(self, params: Any, state: CorrectionState) -> None:
        """Compute the criterion's mask, zeroed advantages or weights and its statistics into ``state`` (nothing when
        it is off), through the state's combining methods only (``reject``, ``zero_advantages``,
        ``multiply_weights``, ``pin``, ``zero_weights``).

        Args:
            params: the call's ``CorrectionParams``.
            state: the :class:`CorrectionState` of this call: (B, T) log-probs, valid tokens, advantages.
        """
        raise NotImplementedError

    def finalize(self, f: StatFloats) -> dict[str, float]:
        """Its metrics from the reduced statistics (only those whose statistics are present).

        Args:
            f: the reduced statistics, read by declared name.

        Returns:
            ``{"rollout_corr/<name>": float}``, names from :attr:`metrics`.
        """
        return {}

    def removes_tokens(self, cfg: Any) -> bool:
        """Whether, with ``cfg``'s fields, it can remove tokens from the loss and its token count (a rejection)."""
        return False

    def zeroes_advantages(self, cfg: Any) -> bool:
        """Whether, with ``cfg``'s fields, it can set a token's advantage to 0 (the token kept in the loss's count):
        the trainers then hand the core the advantages."""
        return False

    def batch_scope(self, cfg: Any) -> str | None:
        """The statistic of ``cfg``'s configuration whose scope is the whole generation batch, described (read by
        ``config/plan.py``); ``None`` where there is none."""
        return None
