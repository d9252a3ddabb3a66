"""Reducible statistics: the host-sync-free form of every rollout-correction metric.

Every metric is a closed-form function of three kinds of device scalars:

* ``sums``  -- added across micro-batches and ranks (token counts, sums of weights, ...),
* ``maxes`` -- max-reduced,
* ``mins``  -- min-reduced.

Per-micro-batch code only builds 0-dim float64 tensors; :meth:`RolloutStats.all_reduce` runs three
collectives when logging and :func:`finalize_stats` turns the reduced scalars into floats with a
single host transfer. A logged value therefore equals the value computed on the concatenation of
everything every rank saw since the last log -- never a mean of per-rank means.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable

import torch

STAT_DTYPE = torch.float64
SAFETY_BOUND = 20.0
"""Log-space clamp before any ``exp``: exp(+-20) ~ 4.85e8 / 2.06e-9, finite in every float dtype."""
METRIC_PREFIX = "rollout_corr/"
"""The namespace of every metric this package logs: ``rollout_corr/<name>``."""
SUM, MAX, MIN = "sum:", "max:", "min:"
"""The tags of :meth:`RolloutStats.to_floats`'s keys: ``"sum:<name>"``, ``"max:<name>"``, ``"min:<name>"``."""
ReduceFn = Callable[[torch.Tensor, str], torch.Tensor]
"""``reduce_fn(tensor, op)`` with ``op`` in ``{"sum", "max", "min"}``; returns the reduced tensor."""


@dataclass
class RolloutStats:
    """Named 0-dim device tensors grouped by how they reduce."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    maxes: dict[str, torch.Tensor] = field(default_factory=dict)
    mins: dict[str, torch.Tensor] = field(default_factory=dict)

    def update(self, other: RolloutStats) -> RolloutStats:
        """Fold ``other`` into ``self`` in place (sum / max / min per key) and return ``self``."""
        for name, value in other.sums.items():
            self.sums[name] = self.sums[name] + value if name in self.sums else value
        for name, value in other.maxes.items():
            self.maxes[name] = torch.maximum(self.maxes[name], value) if name in self.maxes else value
        for name, value in other.mins.items():
            self.mins[name] = torch.minimum(self.mins[name], value) if name in self.mins else value
        return self

    def all_reduce(self, reduce_fn: ReduceFn | None) -> RolloutStats:
        """Reduce across processes with three collectives (keys sorted, so every rank agrees)."""
        if reduce_fn is None:
            return self
        reduced = RolloutStats()
        for group, op, out in ((self.sums, "sum", reduced.sums), (self.maxes, "max", reduced.maxes),
                               (self.mins, "min", reduced.mins)):
            if not group:
                continue
            names = sorted(group)
            stacked = reduce_fn(torch.stack([group[n].to(STAT_DTYPE) for n in names]), op)  # (K,)
            out.update({n: stacked[i] for i, n in enumerate(names)})
        return reduced

    def to_floats(self) -> dict[str, float]:
        """One host transfer for everything: ``{"sum:name": v, "max:name": v, "min:name": v}``."""
        keys, values = [], []
        for tag, group in ((SUM, self.sums), (MAX, self.maxes), (MIN, self.mins)):
            for name in sorted(group):
                keys.append(tag + name)
                values.append(group[name].to(STAT_DTYPE).reshape(()))
        if not values:
            return {}
        host = torch.stack(values).cpu().tolist()  # the single sync
        return dict(zip(keys, host))


def summed(floats: dict[str, float], family: str) -> dict[str, float]:
    """The summed statistics of ``family`` (e.g. ``"loss."``) in :meth:`RolloutStats.to_floats`'s output, by name:
    ``{"loss.micro_batches": v, ...}`` (the ``"sum:"`` tag removed by name, not by position)."""
    return {key.removeprefix(SUM): value for key, value in floats.items() if key.startswith(SUM + family)}


def safe_div(num: float, den: float, empty: float = 0.0) -> float:
    """num / den, ``empty`` where den <= 0: a metric over an empty batch (no token, no sequence) reports 0.0.

    The package's one divide helper for metrics: every finalize step and report divides through it. ``empty`` is
    ``float("nan")`` where a report must tell "no data" from a measured 0 (``core/mismatch.py``).
    """
    return num / den if den > 0 else empty


def extreme_or_zero(value: float, n: float) -> float:
    """``value`` where ``n > 0``, else 0.0: a reduced max / min over an empty batch (its -inf / +inf sentinel, see
    :func:`masked_max`) reports 0.0."""
    return value if n > 0 else 0.0


def process_all_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """A :data:`ReduceFn` over every process of the default group (``op`` in sum / max / min); the tensor itself
    when there is one process or no process group."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tensor
    reduced = tensor.clone()
    dist.all_reduce(reduced, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return reduced


def count(mask: torch.Tensor) -> torch.Tensor:
    """Number of True entries of a boolean mask, as a float64 statistic (0-dim)."""
    return mask.sum(dtype=STAT_DTYPE)


def count_rows(mask: torch.Tensor) -> torch.Tensor:
    """Number of rows of a (B, T) boolean mask with at least one True entry, float64 (0-dim)."""
    return mask.any(1).sum(dtype=STAT_DTYPE)


def stat_constant(value: float, like: torch.Tensor) -> torch.Tensor:
    """A float64 0-dim statistic on ``like``'s device."""
    return torch.full((), value, dtype=STAT_DTYPE, device=like.device)


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_{i,t} x_{i,t} m_{i,t} in float64 (0-dim)."""
    return torch.where(mask, x, torch.zeros_like(x)).sum(dtype=STAT_DTYPE)


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """max over masked entries (-inf when empty), float64 0-dim."""
    sentinel = x.new_full((1,), -float("inf"))  # (1,) keeps empty batches reducible
    return torch.cat([torch.where(mask, x, sentinel).flatten(), sentinel]).amax().to(STAT_DTYPE)


def masked_min(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """min over masked entries (+inf when empty), float64 0-dim."""
    sentinel = x.new_full((1,), float("inf"))  # (1,)
    return torch.cat([torch.where(mask, x, sentinel).flatten(), sentinel]).amin().to(STAT_DTYPE)


def per_sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mean_t x_{i,t} over valid tokens of each row; 0 for rows without a valid token.  (B,)"""
    tokens = mask.sum(1)  # (B,)
    total = torch.where(mask, x, torch.zeros_like(x)).sum(1)  # (B,)
    return total / tokens.clamp(min=1)
