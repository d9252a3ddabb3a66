"""The rollout-correction fields of a TRL config, shared by the synchronous and the asynchronous trainer's configs.

A config class mixes :class:`RolloutCorrectionFields` into TRL's own config (``GRPOConfig``, ``AsyncGRPOConfig``).
Resolution and freezing are plain functions:

* :func:`resolve_correction`: saved config, else preset, else the class's default; then every correction field the
  user set overrides it; checked (``_check_resolved``) and written back into the flat fields, so ``to_dict()``, the
  hyper-parameters ``report_to`` records and a saved ``training_args`` show what runs. It runs at construction, when
  ``args.rollout_correction`` is read after a field changed, and when a trainer is built (before TRL's ``__init__``).
* :func:`freeze_correction`: what a trainer calls once built; from then on a change to an input of the correction
  raises, naming the trainer.

An assignment after construction is only noted (:func:`check_change`, called by the one ``__setattr__`` left, a
guard): it takes effect, or raises naming the field, at the next resolution (at the latest the trainer's
construction). The guard stays because only ``__setattr__`` can refuse an assignment when it is made: TRL's own
correction fields after construction, and any input of the correction once a trainer holds it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .correction import MODE_FIELDS, NONE_STRINGS, RolloutCorrectionConfig, none_if_unset
from ..core.criteria import CRITERIA, correction_fields
from ..core.criterion import with_fields
from .compat import is_band_string, is_criteria_string

CORRECTION_FIELDS = tuple(f.name for f in dataclasses.fields(RolloutCorrectionConfig))
# the fields whose off value is None: "none" (a CLI flag, a YAML value, or in Python) sets it off, over a preset's
# value; None (the flat fields' default) means "not set here"
SWITCHABLE_OFF = ("rollout_is", *(f.name for f in dataclasses.fields(RolloutCorrectionConfig) if f.default is None))
NUMBER_FIELDS = tuple(f.name for f in dataclasses.fields(RolloutCorrectionConfig) if "float" in str(f.type))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RolloutCorrectionConfig)}
_NUMBER = re.compile(r"[+-]?((\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|inf|infinity)", re.IGNORECASE)  # no "_", no ","


def _explicit_value(name: str, value: Any, rollout_rs: Any = None) -> Any:
    """A value set on the flat field, as the correction reads it: "none" -> None (off) where None is the field's
    off value; a number given as a string (a CLI flag, a YAML ``1e-4``) -> float. ``rollout_rs_threshold`` keeps
    verl's threshold strings (``"0.5_2"``, ``"0.01,0.5_2"``) where ``rollout_rs`` is verl's criteria spelling;
    ``rollout_is_threshold`` keeps verl's ``"lower_upper"`` IcePop band (``"0.5_5.0"``)."""
    if name in SWITCHABLE_OFF:
        value = none_if_unset(value)
    if name in NUMBER_FIELDS and isinstance(value, str):
        if _NUMBER.fullmatch(value.strip()):
            return float(value)
        if name == "rollout_rs_threshold" and is_criteria_string(rollout_rs):
            return value
        if name == "rollout_is_threshold" and is_band_string(value):
            return value
        off = " or 'none' to switch it off" if name in SWITCHABLE_OFF else ""
        verl = (" (verl's 'lower_upper' bounds go with verl's criteria in rollout_rs, or in rollout_is_threshold for "
                "IcePop)" if "_" in value else "")
        raise ValueError(f"{name}={value!r}: use a number{off}{verl}.")
    return value


@dataclass
@with_fields(correction_fields() + MODE_FIELDS, "flat", after="rollout_correction_config")
class RolloutCorrectionFields:
    """The correction fields (flat, CLI/YAML-parsable). Mix in before TRL's config class.

    After the preset and the saved-config path come the criteria's fields (declared in each criterion's file,
    ``trl_rollout_corr/core/criteria.py``; here with default ``None``, "not set here", and their help), then the
    mode fields (declared once, ``config/correction.py`` ``MODE_FIELDS``), then ``require_rollout_logprobs``."""

    rollout_correction_preset: str | None = field(default=None, metadata={
        "help": "Preset name, e.g. decoupled_token_is."})
    rollout_correction_config: str | None = field(default=None, metadata={
        "help": "Directory, file or Hub repo id of a saved RolloutCorrectionConfig."})
    require_rollout_logprobs: bool = field(default=False, metadata={
        "help": "Raise instead of training a sample uncorrected when its sampler's per-token log-probs are missing "
                "(a mocked, wrapped or remote generate; a rollout_func that returns none)."})

    # TRL's config class this is mixed into (this package's own fields are the ones it does not have)
    _RC_TRL_CONFIG: ClassVar[type]
    # TRL fields the correction's checks depend on: a change is resolved and checked again (resolve_correction)
    _RC_PLAN_INPUTS: ClassVar[tuple[str, ...]] = ()
    # the correction with no preset and no saved config: each trainer config names its own, the one source of its
    # default (docs/trainer.md, "The default correction", lists them; tests/repo/test_docs.py keeps the two equal)
    _RC_DEFAULT_PRESET: ClassVar[str]

    # ------------------------------------------------------------------ hooks for the subclass
    def _check_own_fields(self) -> None:
        """Check this package's non-correction fields (raise ValueError naming the field)."""

    def _check_resolved(self, resolved: RolloutCorrectionConfig) -> None:
        """Check the resolved correction against TRL's fields (raise ValueError naming the field and the fix)."""

    def _refuse_change(self, name: str, value: Any) -> None:
        """Raise for a change after construction that must never be made (e.g. TRL's own correction switched on)."""

    def _default_correction(self) -> dict[str, Any]:
        """The base correction when neither a saved config nor a preset is named (see ``_RC_DEFAULT_PRESET``)."""
        return RolloutCorrectionConfig.from_preset(self._RC_DEFAULT_PRESET).to_dict()

    # ------------------------------------------------------------------ construction
    def _rc_begin_post_init(self) -> None:
        """Call first in ``__post_init__``: records the correction fields the user set."""
        object.__setattr__(self, "_rc_constructed", False)
        self._check_own_fields()
        # the correction fields the user set (the flat fields are overwritten with the resolved values)
        self._rc_explicit = {name: getattr(self, name) for name in CORRECTION_FIELDS if getattr(self, name) is not None}

    def _rc_end_post_init(self) -> None:
        """Call last in ``__post_init__`` (after TRL's): resolves, checks and writes back the correction."""
        self._rc_frozen_by: str | None = None
        self._rc_changed: frozenset[str] = frozenset()
        resolve_correction(self)
        object.__setattr__(self, "_rc_constructed", True)

    @classmethod
    def _rc_own_fields(cls) -> frozenset[str]:
        trl_fields = {f.name for f in dataclasses.fields(cls._RC_TRL_CONFIG)}
        return frozenset(f.name for f in dataclasses.fields(cls) if f.name not in trl_fields)

    @property
    def rollout_correction(self) -> RolloutCorrectionConfig:
        """The resolved correction, for the current field values (``resolve_correction``): resolved again, checked
        and written back into the flat fields where one of them changed since the last resolution, else the last
        one. Frozen: change the args' fields instead.

        Raises:
            ValueError: the changed fields are invalid, naming the field and the fix.
        """
        return resolve_correction(self)

    # ------------------------------------------------------------------ later changes
    def __setattr__(self, name: str, value: Any) -> None:
        """Only a guard, no resolution: after construction it notes which of the correction's inputs changed (the
        next ``resolve_correction``, at the latest the trainer's construction, resolves and checks them) and refuses
        what ``check_change`` refuses (TRL's own correction fields, and any input of the correction once a trainer
        was built on these args). Python offers no other hook that could refuse an assignment when it is made."""
        if self.__dict__.get("_rc_constructed", False):
            check_change(self, name, value)
        object.__setattr__(self, name, value)

    def update_rollout_correction(self, **changes: Any) -> None:
        """Change several fields and resolve the correction now (they are checked together), e.g.
        ``args.update_rollout_correction(rollout_rs="token", rollout_rs_threshold=2.0)``: the correction fields,
        the preset, the saved-config path, this package's other fields and the TRL fields the checks depend on. An
        invalid combination raises and leaves the config as it was. (Assigning the fields one by one works too: they
        are resolved and checked together when the correction is next read or a trainer is built.)"""
        own = self._rc_own_fields()
        allowed = own | set(self._RC_PLAN_INPUTS)
        unknown = sorted(set(changes) - allowed)
        if unknown:
            also = f" and {', '.join(self._RC_PLAN_INPUTS)}" if self._RC_PLAN_INPUTS else ""
            raise ValueError(f"update_rollout_correction() takes this package's fields{also}; got {unknown}.")
        saved = dict(self.__dict__)
        try:
            for name, value in changes.items():
                setattr(self, name, value)
            resolve_correction(self)
        except Exception:
            self.__dict__.clear()
            self.__dict__.update(saved)
            raise


# ---------------------------------------------------------------------- resolution and freezing (plain functions)
def check_change(args: RolloutCorrectionFields, name: str, value: Any) -> None:
    """What ``args.<name> = value`` may do after construction: refused where the subclass refuses it
    (``_refuse_change``: TRL's own correction fields) or where a trainer was built on ``args`` and ``name`` is an
    input of its correction (this package's fields, the TRL fields the plan depends on) with a new value; otherwise
    noted in ``args._rc_changed`` when it is an input of the correction (the next :func:`resolve_correction`
    resolves it).

    Raises:
        ValueError: ``_refuse_change`` refuses it.
        AttributeError: a trainer holds the correction resolved from the old value.
    """
    args._refuse_change(name, value)
    if name not in args._rc_own_fields() and name not in args._RC_PLAN_INPUTS:
        return
    if name == "require_rollout_logprobs":
        return  # read live by the trainer, no input of the correction
    frozen_by = args.__dict__.get("_rc_frozen_by")
    if frozen_by is None:
        object.__setattr__(args, "_rc_changed", args.__dict__.get("_rc_changed", frozenset()) | {name})
    elif getattr(args, name) != value:
        what = "planned the correction from it" if name in args._RC_PLAN_INPUTS else "resolved the correction"
        raise AttributeError(
            f"{name} changed after {frozen_by} was built on these args: the trainer {what} at construction and "
            "would not see the change. Set it before building the trainer (or build a new trainer with the changed "
            "args).")


def resolve_correction(args: RolloutCorrectionFields) -> RolloutCorrectionConfig:
    """The correction ``args`` describes, resolved, checked and written back into its flat fields.

    Resolution: ``rollout_correction_config`` (a saved config), else ``rollout_correction_preset``, else the
    config class's default (``_default_correction``); then every correction field the user set overrides it (a
    method switched off with ``"none"`` drops the base's settings of it). Run at construction, when
    ``args.rollout_correction`` is read after a field changed, and by the trainers at construction (before TRL's
    own ``__init__``) and in :func:`freeze_correction`. Nothing is written unless every check passes.

    Args:
        args: the config (a :class:`RolloutCorrectionFields` subclass).

    Returns:
        The resolved correction, frozen (``args.rollout_correction``).

    Raises:
        ValueError: an invalid field or combination, naming the field and the fix (and the fields changed since the
            last resolution, if any).
    """
    changed = args.__dict__.get("_rc_changed", frozenset())
    resolved = args.__dict__.get("_rc_resolved")
    if resolved is not None and not changed:
        return resolved
    explicit = dict(args.__dict__.get("_rc_explicit", {}))
    for name in sorted(changed & set(CORRECTION_FIELDS)):
        value = getattr(args, name)
        if value is None:
            explicit.pop(name, None)  # None: "not set here" again, the base's value
        else:
            explicit[name] = value
    try:
        if changed:  # at construction _rc_begin_post_init checked them
            args._check_own_fields()
        resolved = _resolve(args, explicit)
        args._check_resolved(resolved)  # raises where it is not exact
    except ValueError as error:
        if not changed:
            raise
        names = ", ".join(f"args.{name}" for name in sorted(changed))
        raise ValueError(f"{error} (checked when the correction was resolved again: {names} changed after the "
                         "config was built.)") from None
    switched_off = {name for name, value in explicit.items()
                    if name in SWITCHABLE_OFF and isinstance(value, str) and value in NONE_STRINGS}
    for name, value in resolved.to_dict().items():
        if value is None and (name in ("rollout_is", "rollout_rs") or name in switched_off):
            value = "none"  # written back as set: a YAML of these fields rebuilds the same correction
        object.__setattr__(args, name, value)
    object.__setattr__(args, "_rc_explicit", explicit)
    object.__setattr__(args, "_rc_changed", frozenset())
    # frozen: a change goes through the flat fields (resolved and checked again), never around them
    object.__setattr__(args, "_rc_resolved", resolved.frozen(type(args).__name__))
    return args._rc_resolved


def freeze_correction(args: RolloutCorrectionFields, owner: str) -> RolloutCorrectionConfig:
    """Resolve ``args``' correction (:func:`resolve_correction`) and freeze it: from now on a change to an input of
    the correction raises, naming ``owner`` (``check_change``). What a trainer calls once it is built.

    Args:
        args: the config.
        owner: the trainer's class name.

    Returns:
        The trainer's own frozen copy of the correction.
    """
    resolved = resolve_correction(args)
    object.__setattr__(args, "_rc_frozen_by", owner)
    return resolved.frozen(owner)


def _resolve(args: RolloutCorrectionFields, given: dict[str, Any]) -> RolloutCorrectionConfig:
    """The base correction (saved config, else preset, else the default) with the fields in ``given`` over it."""
    if args.rollout_correction_config:
        base = RolloutCorrectionConfig.from_pretrained(args.rollout_correction_config).to_dict()
    elif args.rollout_correction_preset:
        base = RolloutCorrectionConfig.from_preset(args.rollout_correction_preset).to_dict()
    else:
        base = args._default_correction()
    rollout_rs = none_if_unset(given.get("rollout_rs", base.get("rollout_rs")))
    explicit = {name: _explicit_value(name, value, rollout_rs) for name, value in given.items()}
    if is_band_string(explicit.get("rollout_is_threshold")):
        # verl's IcePop band sets the lower bound and the bound mode itself
        base["rollout_is_threshold_lower"] = explicit.get("rollout_is_threshold_lower")
        base["rollout_is_bound"] = explicit.get("rollout_is_bound", "mask")
    for criterion in CRITERIA:  # a method switched off here drops the base's settings of it not set here
        for switch, dependents in criterion.switches.items():
            if switch in explicit and explicit[switch] is None:
                base.update({name: explicit.get(name, _DEFAULTS[name]) for name in dependents})
    return RolloutCorrectionConfig(**{**base, **explicit})
