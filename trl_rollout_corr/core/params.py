"""What the core reads of a rollout correction: a small frozen view of the config.

:class:`~trl_rollout_corr.RolloutCorrectionConfig` builds it (``config.params()``: the RS lower bound resolved to
``1 / rollout_rs_threshold`` where unset); a caller of the core without a config spells the fields out
(``CorrectionParams(rollout_is="token")``). Its fields are the criteria's (``core/criteria.py``), declared once in
each criterion's file. Pure Python: no TRL import.
"""

from __future__ import annotations

from dataclasses import dataclass

from .criteria import correction_fields
from .criterion import with_fields


@dataclass(frozen=True)
@with_fields(correction_fields(), "params")
class CorrectionParams:
    """The fields of :func:`~trl_rollout_corr.core.compute_rollout_correction_stats`: every criterion's fields (see
    :class:`~trl_rollout_corr.RolloutCorrectionConfig` for their meaning), with the function's defaults (no IS:
    ``rollout_is=None``)."""
