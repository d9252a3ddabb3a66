"""The one ordered list of correction criteria: what :func:`~trl_rollout_corr.core.compute_rollout_correction_stats`
applies, what the configs declare as fields, what the plan and the metric registry ask.

Each entry is a :class:`~.criterion.Criterion` defined in its method's file. Every criterion reads the same valid
tokens and log-ratio (none sees another's result), so the order decides only the order of the fields and of the
checks; the kept mask is the AND of the rejections. Adding a method: one new file with its criterion, one line here
(docs/architecture.md, "Adding a correction method"). Pure Python: no TRL import.
"""

from __future__ import annotations

from .criterion import CorrectionField, Criterion
from .divergence import DIVERGENCE
from .dppo import DPPO
from .rejection import REJECTION, VETO
from .second_moment import SECOND_MOMENT
from .weights import IS_WEIGHTS

CRITERIA: tuple[Criterion, ...] = (
    IS_WEIGHTS,  # truncated / masked IS weights (weights.py)
    REJECTION,  # rejection sampling: token, sequence, geometric (rejection.py)
    VETO,  # the catastrophic-token veto (rejection.py)
    DIVERGENCE,  # k1/k2/k3 divergence criteria (divergence.py)
    SECOND_MOMENT,  # the second-moment mask, M2PO's trust region (second_moment.py)
    DPPO,  # DPPO's divergence trust region, Binary-TV / Binary-KL (dppo.py)
)


def correction_fields() -> tuple[CorrectionField, ...]:
    """Every criterion's fields, in the list's order (each declared once: a repeated name raises)."""
    fields = tuple(f for criterion in CRITERIA for f in criterion.fields)
    names = [f.name for f in fields]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise TypeError(f"correction fields declared by two criteria: {repeated}.")
    return fields


def criterion_metrics() -> tuple[str, ...]:
    """Every metric name (without the prefix) a criterion can log."""
    return tuple(name for criterion in CRITERIA for name in criterion.metrics)
