"""The registry of every metric name this package logs: ``metric("kl")`` is the logged key ``rollout_corr/kl``.

Code outside the core's finalizers never spells a full key by hand: it asks :func:`metric`, which raises
``ValueError`` for a name the package cannot emit. A reader of a renamed or misspelt metric therefore fails where it
is defined (usually at import), not silently at run time by finding nothing in the logs.

The names are each correction criterion's (``Criterion.metrics``, the list in ``core/criteria.py``), the core's
other tuples (``core/metrics.py``, ``core/lag.py``, ``core/truncation.py``, ``core/group_baseline.py``,
``core/impact.py``) and the one the trainers add themselves;
``tests/repo/test_docs.py`` checks that they are exactly the names the core emits and docs/metrics.md lists. Pure: no
TRL import.
"""

from __future__ import annotations

import re

from .criteria import criterion_metrics
from .group_baseline import BASELINE_METRICS
from .impact import GRAD_SHARE_METRICS, LENGTH_METRICS, T_KL_METRICS
from .lag import LAG_METRICS, LAG_SUMMARY_METRICS
from .metrics import ALWAYS_METRICS, OFFPOLICY_METRICS
from .stats import METRIC_PREFIX
from .truncation import TRUNCATION_METRICS

TRAINER_METRICS = ("all_rejected_micro_batches",)
"""Written by the trainers' ``log`` (micro-batches whose every token was rejected), not by the core's finalizers."""

METRIC_NAMES: frozenset[str] = frozenset((
    *criterion_metrics(), *OFFPOLICY_METRICS, *ALWAYS_METRICS,
    *TRUNCATION_METRICS, *LAG_SUMMARY_METRICS, *TRAINER_METRICS, *BASELINE_METRICS,
    *GRAD_SHARE_METRICS, *LENGTH_METRICS, *T_KL_METRICS,
))
"""Every name (without the prefix) but the per-lag ones, ``lag_<k>/<name>`` (see :func:`is_metric`)."""

_PER_LAG = re.compile(r"lag_(0|[1-9][0-9]*)/(.+)")


def is_metric(name: str) -> bool:
    """Whether ``name`` (without the prefix) is a metric the package can log."""
    if name in METRIC_NAMES:
        return True
    per_lag = _PER_LAG.fullmatch(name)
    return per_lag is not None and per_lag.group(2) in LAG_METRICS


def metric(name: str) -> str:
    """The logged key of metric ``name``: ``METRIC_PREFIX + name``; ``ValueError`` naming it if the package cannot
    emit it."""
    if not isinstance(name, str) or not is_metric(name):
        raise ValueError(f"{name!r} is not a metric trl_rollout_corr logs (the names are listed in docs/metrics.md "
                         f"and registered in trl_rollout_corr/core/metric_names.py; give it without {METRIC_PREFIX!r})")
    return METRIC_PREFIX + name
