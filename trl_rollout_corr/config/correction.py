"""RolloutCorrectionConfig: the fields, their validation, the named presets and (de)serialization."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from huggingface_hub import ModelHubMixin

from ..core.criteria import CRITERIA, correction_fields
from ..core.criterion import NONE_STRINGS, CorrectionField, none_if_unset, with_fields
from ..core.dppo import POLICY_LOSS_NAMES
from ..core.params import CorrectionParams
from ..core.losses import loss_anchor, weights_advantage
from .presets import PRESETS as PRESET_TABLE
from .presets import preset_fields
from .compat import (VERL_ARGUMENTS, VERL_PRESETS, is_band_string, is_criteria_string, parse_is_threshold,
                         translate_rollout_rs)

CONFIG_NAME = "rollout_correction_config.json"
__all__ = ["CONFIG_NAME", "MODE_FIELDS", "NONE_STRINGS", "RolloutCorrectionConfig", "none_if_unset"]


MODE_FIELDS: tuple[CorrectionField, ...] = (
    CorrectionField(
        "rollout_rs_exclude_from_baseline", "bool", False,
        "Leave the samples the correction rejects entirely (no kept token) out of their GRPO group's baseline (mean "
        "and std of the rewards) and give them advantage 0, so that 'rejected = treated as not drawn' also holds for "
        "the others' advantages. The rejection must be known when the advantages are formed: the trainer computes the "
        "correction at generation time (decoupled mode: one pi_old forward per generation batch; bypass mode: only "
        "with one optimizer step per generation batch). Needs a rejection.", "bool | None"),
    CorrectionField("bypass_mode", "bool", False, "pi_old := pi_rollout (2 policies, no extra forward pass).",
                    "bool | None"),
    CorrectionField("use_policy_gradient", "bool", False,
                    "REINFORCE with stop-grad IS weights instead of PPO-clip (bypass only).", "bool | None"),
)
"""The three fields that are no criterion's (the operating mode), declared once: ``RolloutCorrectionConfig`` and
the trainers' flat fields (``config/fields.py``) both derive them (``with_fields``)."""


@dataclass
@with_fields(correction_fields() + MODE_FIELDS, "config")
class RolloutCorrectionConfig(ModelHubMixin, library_name="trl_rollout_corr", tags=["rollout-correction", "trl"]):
    """How to correct for pi_rollout != pi_old: IS weights, rejection, veto, and the two operating modes.

    ``RolloutCorrectionConfig()`` (the fields' defaults) is decoupled PPO with token-level TIS, C = 2: the preset
    ``decoupled_token_is``. The trainers' configs do not start from it: each names its own default preset
    (``_RC_DEFAULT_PRESET``; docs/trainer.md, "The default correction").

    The criteria's fields (``rollout_is`` ... ``rollout_dppo_mask_high``) are declared, with their type, default, help
    and check, in their criterion's file (the list in ``trl_rollout_corr/core/criteria.py``); the three that are no
    criterion's (the mode: ``rollout_rs_exclude_from_baseline``, ``bypass_mode``, ``use_policy_gradient``) follow
    them, declared once in :data:`MODE_FIELDS`. Every field's meaning: docs/trainer.md, "Configuration fields". Presets:
    ``from_preset(name)`` or ``RolloutCorrectionConfig.<name>(...)`` (``trl_rollout_corr.config.presets``).

    Saved and shared as transformers' configs are: ``save_pretrained(dir)`` writes ``rollout_correction_config.json``,
    ``from_pretrained(dir | file | repo_id)`` reads it, ``push_to_hub(repo_id)`` uploads it (``huggingface_hub``'s
    ``ModelHubMixin``).

    Constructed with keyword arguments, one per field: the criteria's (``rollout_is`` ... ``rollout_dppo_mask_high``,
    ``trl_rollout_corr.core.criteria.correction_fields()``) then ``MODE_FIELDS``; each defaults as its
    ``CorrectionField`` says.

    Raises:
        ValueError: at construction, naming the field and the fix, for every invalid combination
            (``validate``).

    Papers behind the fields are listed in docs/concepts.md (References): truncated IS (IMPALA, arXiv:1802.01561;
    Yao et al.'s TIS), decoupled mode (Hilton et al., arXiv:2110.00641), rejection and the veto (Liu, Li et al.,
    "When Speed Kills Stability"; verl), IcePop (arXiv:2510.18855), M2PO (arXiv:2510.01161), DPPO
    (arXiv:2602.04879), the k1/k2/k3 criteria (Schulman, "Approximating KL Divergence").
    """

    # the criteria's fields (rollout_is ... rollout_dppo_mask_high) come first, declared in each criterion's file
    # (trl_rollout_corr/core/criteria.py lists them); then MODE_FIELDS, the fields that are no criterion's

    PRESETS: ClassVar[tuple[str, ...]] = tuple(PRESET_TABLE)  # this package's presets; verl's: preset_names()

    def __post_init__(self) -> None:
        self.validate()

    def __setattr__(self, name: str, value: Any) -> None:
        frozen_by = self.__dict__.get("_frozen_by")
        if frozen_by is not None and name in self.__dataclass_fields__:
            raise AttributeError(
                f"{name}: this RolloutCorrectionConfig belongs to {frozen_by} and is frozen (the correction was "
                "checked and planned from its values; a change here would bypass that). Change the args' fields "
                f"instead, before building the trainer (args.{name} = ... or args.update_rollout_correction(...)), "
                "or build a new trainer.")
        super().__setattr__(name, value)

    def frozen(self, owner: str) -> RolloutCorrectionConfig:
        """A validated copy whose fields can no longer change: what a trainer holds, so that the correction it runs
        is the one it planned.

        Args:
            owner: who holds the copy, named in the error a later assignment raises.

        Returns:
            The frozen copy; assigning one of its fields raises ``AttributeError`` naming ``owner``.
        """
        copy = dataclasses.replace(self)
        object.__setattr__(copy, "_frozen_by", owner)
        return copy

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check the fields and normalize verl's spellings (string thresholds, criteria strings in ``rollout_rs``).

        Raises:
            ValueError: naming the field and the fix, for every invalid combination.
        """
        if self.rollout_is is not None and not isinstance(self.rollout_is, str):
            raise ValueError(f"rollout_is must be a string or None, got {self.rollout_is!r}.")
        self.rollout_is = none_if_unset(self.rollout_is)
        self.rollout_rs = none_if_unset(self.rollout_rs)
        self._parse_is_threshold_string()
        if is_criteria_string(self.rollout_rs):  # verl's spelling: divergence criteria in rollout_rs
            if self.rollout_rs_criteria is not None or self.rollout_rs_threshold_lower is not None:
                raise ValueError(f"rollout_rs={self.rollout_rs!r} (verl's criteria spelling) together with "
                                 "rollout_rs_criteria or rollout_rs_threshold_lower: use one spelling.")
            self.rollout_rs_criteria, self.rollout_rs_criteria_threshold = translate_rollout_rs(
                self.rollout_rs, self.rollout_rs_threshold)
            self.rollout_rs = self.rollout_rs_threshold = None
        for criterion in CRITERIA:  # each checks (and normalizes) its own fields
            criterion.check(self)
        if self.rollout_rs_exclude_from_baseline and not self.masks_tokens:
            raise ValueError("rollout_rs_exclude_from_baseline=True but nothing can reject a sample (no criterion of "
                             "trl_rollout_corr/core/criteria.py removes tokens with these fields: "
                             f"{', '.join(c.name for c in CRITERIA)}; IS weights and a zeroed advantage reject "
                             "nothing), so it would change nothing: set a rejection (e.g. rollout_rs, "
                             "rollout_token_veto_threshold) or rollout_rs_exclude_from_baseline=False.")
        if self.use_policy_gradient and not self.bypass_mode:
            raise ValueError("use_policy_gradient=True requires bypass_mode=True (the policy-gradient loss uses "
                             "pi_old := pi_rollout); set bypass_mode=True or use_policy_gradient=False.")
        if self.rollout_is_batch_normalize and self.rollout_is is not None and not self.applies_is_weights:
            raise ValueError("rollout_is_batch_normalize=True with bypass_mode=True and use_policy_gradient=False: "
                             "bypass PPO applies no IS weight (its PPO ratio already is pi_theta/pi_rollout), so "
                             "normalizing the weights would change nothing but a metric. Set "
                             "rollout_is_batch_normalize=False, or use_policy_gradient=True.")

    def _parse_is_threshold_string(self) -> None:
        """verl's string IS threshold: ``"lower_upper"`` is IcePop (mask outside the band), ``"2.0"`` a number."""
        if not isinstance(self.rollout_is_threshold, str):
            return
        band = is_band_string(self.rollout_is_threshold)
        if band and self.rollout_is_threshold_lower is not None:
            raise ValueError(f"rollout_is_threshold={self.rollout_is_threshold!r} (verl's 'lower_upper' IcePop band) "
                             f"together with rollout_is_threshold_lower={self.rollout_is_threshold_lower!r}: use one "
                             "spelling (the band string, or a number with rollout_is_threshold_lower).")
        upper, lower = parse_is_threshold(self.rollout_is_threshold)
        self.rollout_is_threshold = upper
        if band:
            self.rollout_is_threshold_lower, self.rollout_is_bound = lower, "mask"

    @property
    def rs_threshold_lower(self) -> float | None:
        """The effective lower RS bound (``1 / rollout_rs_threshold`` when unset)."""
        if self.rollout_rs is None:
            return None
        if self.rollout_rs_threshold_lower is not None:
            return self.rollout_rs_threshold_lower
        return 1.0 / self.rollout_rs_threshold

    @property
    def loss_anchor(self) -> str:
        """The anchor of TRL's PPO ratio in this mode: pi_rollout, pi_old or pi_theta
        (``trl_rollout_corr.core.losses.loss_anchor``)."""
        return loss_anchor(self.bypass_mode, self.use_policy_gradient)

    @property
    def applies_is_weights(self) -> bool:
        """Whether IS weights multiply the loss (bypass PPO computes them for the metrics only)."""
        return self.rollout_is is not None and weights_advantage(self.loss_anchor)

    @property
    def is_enabled(self) -> bool:
        """Whether anything changes the loss (IS weights applied, RS, divergence criteria, veto, the M2 mask)."""
        return (self.applies_is_weights or self.masks_tokens or self.zeroes_advantages)

    @property
    def masks_tokens(self) -> bool:
        """Whether rejection (RS, divergence criteria, the all-token second-moment mask) or the veto can remove
        tokens from the loss and its token count."""
        return any(criterion.removes_tokens(self) for criterion in CRITERIA)

    @property
    def zeroes_advantages(self) -> bool:
        """Whether a criterion (M2PO's trust-region mask, DPPO) can set a token's advantage to 0 (the token kept in the
        loss's count): the trainers then hand the core the advantages."""
        return any(criterion.zeroes_advantages(self) for criterion in CRITERIA)

    @property
    def policy_loss(self) -> tuple[str, float, float, float] | None:
        """Decoupled DPPO's policy loss (``core/losses.py``) as ``(name, delta_low, delta_high, C)``; None elsewhere
        (bypass DPPO is the pipeline's criterion)."""
        if self.bypass_mode or self.rollout_dppo is None:
            return None
        return (POLICY_LOSS_NAMES[self.rollout_dppo], self.rollout_dppo_mask_low, self.rollout_dppo_mask_high,
                self.rollout_dppo_clip_ratio_c)

    def params(self) -> CorrectionParams:
        """The frozen view the core reads (``trl_rollout_corr.core.compute_rollout_correction_stats``), the RS
        lower bound resolved (``1 / rollout_rs_threshold`` where unset); decoupled DPPO left out (it is the policy
        loss, :attr:`policy_loss`, between pi_theta and pi_old, not a criterion on pi_old vs pi_rollout).

        Returns:
            The ``CorrectionParams`` of this config.
        """
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(CorrectionParams)}
        if not self.bypass_mode and self.rollout_dppo is not None:  # decoupled DPPO: the policy loss, not the pipeline
            values.update(rollout_dppo=None, rollout_dppo_mask_low=None, rollout_dppo_mask_high=None,
                          rollout_dppo_clip_ratio_c=None)
        return CorrectionParams(**{**values, "rollout_rs_threshold_lower": self.rs_threshold_lower})

    def pipeline_kwargs(self) -> dict[str, Any]:
        """``params`` as keyword arguments, e.g. of verl's signature,
        ``trl_rollout_corr.core.compute_rollout_correction_and_rejection_mask``.

        Returns:
            ``{field: value}`` of :meth:`params`.
        """
        return dataclasses.asdict(self.params())

    # ------------------------------------------------------------------ presets (config/presets.py)
    @classmethod
    def preset_names(cls) -> tuple[str, ...]:
        """This package's presets (``config/presets.py``), then verl's (``config/compat.py``).

        Returns:
            Every name ``from_preset`` accepts.
        """
        return cls.PRESETS + tuple(n for n in VERL_PRESETS if n not in cls.PRESETS)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> RolloutCorrectionConfig:
        """Build a preset by name, e.g. ``from_preset("decoupled_token_is", rollout_is_threshold=3.0)``.

        Args:
            name: one of ``preset_names``.
            **overrides: fields, or the preset's factory arguments; verl's names take verl's factory arguments too
                (``threshold``, ``is_threshold``, ``rs_threshold``).

        Returns:
            The validated config.

        Raises:
            ValueError: an unknown preset name, or an invalid combination.
        """
        if name in PRESET_TABLE:
            return cls(**preset_fields(name, **overrides))
        if name in VERL_PRESETS:
            fields = {VERL_ARGUMENTS.get(k, k): v for k, v in overrides.items()}
            return cls(**{**VERL_PRESETS[name], **fields})
        raise ValueError(f"Unknown rollout correction preset {name!r}. Choose one of: {', '.join(cls.preset_names())}.")

    # ------------------------------------------------------------------ (de)serialization
    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (what ``from_dict`` reads back).

        Returns:
            ``{field: value}`` of every field.
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RolloutCorrectionConfig:
        """Build from a dict; a ``preset`` key selects a preset that the other keys override.

        Args:
            data: field names to values, optionally ``preset`` and verl's ``loss_type`` (``"ppo_clip"`` /
                ``"reinforce"``, read as ``use_policy_gradient``).

        Returns:
            The validated config.

        Raises:
            ValueError: an unknown field, an unknown ``loss_type`` value, or an invalid combination.
        """
        data = dict(data)
        names = {f.name for f in dataclasses.fields(cls)}
        preset = data.pop("preset", None)
        if "loss_type" in data:  # verl's bypass-mode switch
            loss_type = data.pop("loss_type")
            if loss_type not in ("ppo_clip", "reinforce"):
                raise ValueError(f"loss_type={loss_type!r}: verl's values are 'ppo_clip' and 'reinforce' "
                                 "(use_policy_gradient=False / True here).")
            data.setdefault("use_policy_gradient", loss_type == "reinforce")
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"Unknown RolloutCorrectionConfig field(s) {unknown}; valid fields: {sorted(names)}.")
        return cls.from_preset(preset, **data) if preset else cls(**data)

    def to_json_string(self) -> str:
        """The fields as indented JSON with sorted keys (the saved file's text).

        Returns:
            The JSON text, newline-terminated.
        """
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json_string(cls, text: str) -> RolloutCorrectionConfig:
        """Build from a JSON object's text, as ``from_dict``.

        Args:
            text: a JSON object of fields (and optionally ``preset``).

        Returns:
            The validated config.
        """
        return cls.from_dict(json.loads(text))

    def to_yaml(self) -> str:
        """The fields as YAML with sorted keys.

        Returns:
            The YAML text.
        """
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=True)

    @classmethod
    def from_yaml(cls, text: str) -> RolloutCorrectionConfig:
        """Build from YAML text, as ``from_dict`` (empty text: the defaults).

        Args:
            text: a YAML mapping of fields (and optionally ``preset``).

        Returns:
            The validated config.
        """
        import yaml

        return cls.from_dict(yaml.safe_load(text) or {})

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> RolloutCorrectionConfig:
        """Load a ``.json``, ``.yaml`` or ``.yml`` file.

        Args:
            path: the file; a name ending in ``.yaml`` or ``.yml`` is read as YAML, anything else as JSON.

        Returns:
            The validated config.
        """
        with open(path, encoding="utf-8") as f:
            text = f.read()
        return cls.from_yaml(text) if str(path).endswith((".yaml", ".yml")) else cls.from_json_string(text)

    def save_pretrained(self, save_directory: str | os.PathLike, *, push_to_hub: bool = False,
                        repo_id: str | None = None, push_to_hub_kwargs: dict[str, Any] | None = None,
                        **mixin_kwargs: Any) -> str:
        """Write ``rollout_correction_config.json`` into ``save_directory`` (created if needed), and nothing else.

        Args:
            save_directory: the directory.
            push_to_hub: also upload the file to the Hub.
            repo_id: the Hub repo (default: the directory's name).
            push_to_hub_kwargs: keyword arguments of ``push_to_hub``.
            **mixin_kwargs: what ``ModelHubMixin`` passes (``config``, ``model_card_kwargs``); ignored.

        Returns:
            The path of the written file.

        Raises:
            TypeError: any other keyword argument.
        """
        unknown = set(mixin_kwargs) - {"config", "model_card_kwargs"}  # what ModelHubMixin.push_to_hub passes
        if unknown:
            raise TypeError(f"save_pretrained() got unexpected keyword argument(s) {sorted(unknown)}.")
        path = self._save_pretrained(Path(save_directory))
        if push_to_hub:
            self.push_to_hub(repo_id or Path(save_directory).name, **(push_to_hub_kwargs or {}))
        return str(path)

    def push_to_hub(self, repo_id: str, *, commit_message: str = "Upload rollout correction config",
                    **kwargs: Any) -> str:
        """Upload ``rollout_correction_config.json`` to the Hub repo ``repo_id`` (created if needed).

        Args:
            repo_id: the Hub repo.
            commit_message: the commit's message.
            **kwargs: the mixin's ``push_to_hub`` arguments (``private``, ``token``, ``branch``, ``create_pr``, ...).

        Returns:
            The commit URL.
        """
        return super().push_to_hub(repo_id, commit_message=commit_message, **kwargs)

    def _save_pretrained(self, save_directory: Path) -> Path:
        save_directory.mkdir(parents=True, exist_ok=True)
        path = save_directory / CONFIG_NAME
        path.write_text(self.to_json_string(), encoding="utf-8")
        return path

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | os.PathLike, **hub_kwargs: Any) -> RolloutCorrectionConfig:
        """Load from a directory, a config file, or a Hub repo id (downloaded with ``huggingface_hub``).

        Args:
            path_or_repo_id: a directory holding ``rollout_correction_config.json``, a ``.json`` / ``.yaml`` file,
                or a Hub repo id.
            **hub_kwargs: for a repo id, passed to ``hf_hub_download`` (``revision``, ``token``, ...).

        Returns:
            The validated config.

        Raises:
            FileNotFoundError: a directory without ``rollout_correction_config.json``.
        """
        path = str(path_or_repo_id)
        if os.path.isdir(path):
            file = os.path.join(path, CONFIG_NAME)
            if not os.path.isfile(file):
                raise FileNotFoundError(f"{path} has no {CONFIG_NAME}; save one with config.save_pretrained({path!r}).")
            return cls.from_file(file)
        if os.path.isfile(path):
            return cls.from_file(path)
        from huggingface_hub import hf_hub_download

        return cls.from_file(hf_hub_download(repo_id=path, filename=CONFIG_NAME, **hub_kwargs))


def _preset_factory(name: str) -> classmethod:
    """``RolloutCorrectionConfig.<name>(*arguments, **overrides)`` for the preset ``name`` of
    :data:`~trl_rollout_corr.config.presets.PRESETS`: its arguments (positional or keyword, defaults from the table)
    and any field as an override, as ``from_preset(name, ...)``."""
    preset = PRESET_TABLE[name]
    parameters = [inspect.Parameter("cls", inspect.Parameter.POSITIONAL_ONLY)]
    parameters += [inspect.Parameter(arg, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=float)
                   for arg, default in preset.arguments.items()]
    parameters.append(inspect.Parameter("overrides", inspect.Parameter.VAR_KEYWORD, annotation=Any))
    signature = inspect.Signature(parameters, return_annotation=RolloutCorrectionConfig)

    def factory(cls: type[RolloutCorrectionConfig], *args: Any, **kwargs: Any) -> RolloutCorrectionConfig:
        bound = signature.bind(cls, *args, **kwargs)
        overrides = bound.arguments.pop("overrides", {})
        bound.arguments.pop("cls")
        return cls.from_preset(name, **bound.arguments, **overrides)

    factory.__name__ = factory.__qualname__ = name
    factory.__doc__ = preset.summary
    factory.__signature__ = signature
    return classmethod(factory)


for _name in PRESET_TABLE:  # one factory per preset, from the table
    setattr(RolloutCorrectionConfig, _name, _preset_factory(_name))
del _name
