"""What the core reads of a rollout correction: a small frozen view of the config.

:class:`~trl_rollout_corr.RolloutCorrectionConfig` builds it (``config.params()``: the RS lower bound resolved to
``1 / rollout_rs_threshold`` where unset); a caller of the core without a config spells the fields out
(``CorrectionParams(rollout_is="token")``). Pure Python: no TRL import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CorrectionParams:
    """The fields of :func:`~trl_rollout_corr.core.compute_rollout_correction_stats` (see
    :class:`~trl_rollout_corr.RolloutCorrectionConfig` for their meaning; the defaults are the function's)."""

    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_is_threshold_lower: float | None = None
    rollout_is_bound: str = "truncate"
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | None = None
    rollout_rs_threshold_lower: float | None = None
    rollout_token_veto_threshold: float | None = None
    rollout_rs_criteria: Any = None  # names (comma-separated or a list) or parsed DivergenceCriterion objects
    rollout_rs_criteria_threshold: Any = None
    rollout_m2_threshold: float | None = None
    rollout_m2_scope: str = "all"
