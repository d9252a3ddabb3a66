"""Truncated support: top-k / top-p / min-p sampling seen from the training side.

An engine that samples with top-k, top-p or min-p draws from the *truncated* policy

    pi_rollout(y) = p(y) / M   for y in the kept set K,   0 otherwise,   M = sum_{v in K} p(v),

and reports log pi_rollout = log p - log M, while the trainer's log-softmax is over the full vocabulary.
The ratio pi_train / pi_rollout is then biased by M (e.g. mean ratio 0.9 at top_p = 0.8). The fix applies the
same processing to the training logits: temperature, then top-k, top-p, min-p (transformers' order), and
renormalizes over the kept set: log pi_train_trunc = log pi_train - log M_train. vLLM applies min-p *before*
top-k/top-p (``min_p_first=True``); transformers after.

Pure tensor functions; no TRL import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .criterion import StatFloats, stat_key
from .stats import METRIC_PREFIX, RolloutStats, count, masked_min, masked_sum

TRUNCATION_METRICS = ("kept_mass_mean", "kept_mass_min", "outside_support_fraction")
# working set of one chunk in logits elements: TRL's fused LM head tile (4096 tokens x 32768 vocab entries)
DEFAULT_CHUNK_ELEMENTS = 4096 * 32768 // 4  # the sort keeps ~4 (n, V) buffers alive
TRUNC_N = stat_key("trunc.n", __name__)
"""Valid tokens the kept mass M was computed on."""
TRUNC_KEPT_MASS_SUM = stat_key("trunc.kept_mass_sum", __name__)
"""sum_t M_t over them (float64)."""
TRUNC_OUTSIDE_N = stat_key("trunc.outside_n", __name__)
"""Those whose sampled token lies outside the training side's kept set K."""
TRUNC_KEPT_MASS_MIN = stat_key("trunc.kept_mass_min", __name__)
"""min_t M_t (min-reduced)."""


@dataclass(frozen=True)
class SamplingTruncation:
    """The sampler's processing: temperature, top-k, top-p, min-p.

    Attributes:
        temperature: T > 0; the logits are divided by it first.
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set of mass >= top_p (1 = off).
        min_p: keep p >= min_p * p_max (None/0 = off).
        min_p_first: apply min-p before top-k/top-p (vLLM's order) instead of after (transformers' order).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None
    min_p_first: bool = False

    @property
    def truncates(self) -> bool:
        """Whether the processing removes any token.

        Returns:
            ``True`` where top-k, top-p or min-p is on (a temperature alone truncates nothing).
        """
        return self.top_k > 0 or self.top_p < 1.0 or bool(self.min_p and self.min_p > 0)



def _apply_min_p(z: torch.Tensor, min_p: float) -> torch.Tensor:
    """Remove p < min_p * p_max (the most likely token always stays)."""
    probs = z.softmax(dim=1)  # (N, V)
    remove = probs < min_p * probs.amax(dim=1, keepdim=True)  # (N, V)
    remove.scatter_(1, probs.argmax(dim=1, keepdim=True), False)
    return z.masked_fill(remove, -math.inf)


def truncated_logits(scaled_logits: torch.Tensor, truncation: SamplingTruncation) -> torch.Tensor:
    """Apply top-k, then top-p, then min-p (or min-p first) to logits already divided by the temperature.

    Removed entries become -inf; ties at the top-k boundary are kept; top-p removes the tokens whose ascending
    cumulative probability is <= 1 - top_p and always keeps the most likely one; min-p removes p < min_p * p_max.

    Args:
        scaled_logits: z / T.   (N, V)
        truncation: the sampler's processing.

    Returns:
        The logits with the removed entries at -inf (the kept set K finite).   (N, V)
    """
    z = scaled_logits  # (N, V)
    if truncation.min_p and truncation.min_p_first:
        z = _apply_min_p(z, truncation.min_p)  # (N, V)
    if truncation.top_k > 0:
        kth = torch.topk(z, min(truncation.top_k, z.size(1))).values[:, -1:]  # (N, 1)
        z = z.masked_fill(z < kth, -math.inf)
    if truncation.top_p < 1.0:  # pragma: no mutate (top_p = 1 keeps every token: the branch would be a no-op)
        sorted_z, order = torch.sort(z)  # (N, V) ascending
        cumulative = sorted_z.softmax(dim=1).cumsum(dim=1)  # (N, V)
        remove_sorted = cumulative <= 1.0 - truncation.top_p  # (N, V)
        remove_sorted[:, -1] = False  # keep the most likely token
        remove = torch.zeros_like(remove_sorted).scatter(1, order, remove_sorted)  # (N, V)
        z = z.masked_fill(remove, -math.inf)
    if truncation.min_p and not truncation.min_p_first:
        z = _apply_min_p(z, truncation.min_p)  # (N, V)
    return z


@torch.no_grad()
def log_kept_mass(logits: torch.Tensor, targets: torch.Tensor, truncation: SamplingTruncation,
                  chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: log M = logsumexp_{v in K}(z_v) - logsumexp_v(z_v) with z = logits / T, and whether y in K.

    Args:
        logits: (N, V) raw logits (any float dtype; computed in float32).
        targets: (N,) the sampled token ids y.
    Returns:
        (log_kept_mass (N,) float32 <= 0, in_support (N,) bool). Processed in row chunks so that no more than
        ``chunk_elements`` logits are transformed at once.
    """
    n_rows, vocab = logits.shape
    rows = max(1, chunk_elements // max(vocab, 1))
    log_mass, in_support = [], []
    for start in range(0, n_rows, rows):
        z = logits[start:start + rows].float() / truncation.temperature  # (n, V)
        kept = truncated_logits(z, truncation)  # (n, V)
        log_mass.append(torch.logsumexp(kept, dim=-1) - torch.logsumexp(z, dim=-1))  # (n,)
        target = targets[start:start + rows].unsqueeze(-1)  # (n, 1)
        in_support.append(torch.isfinite(kept.gather(-1, target)).squeeze(-1))  # (n,)
    if not log_mass:
        return logits.new_zeros(0, dtype=torch.float32), torch.zeros(0, dtype=torch.bool, device=logits.device)
    return torch.cat(log_mass).clamp(max=0.0), torch.cat(in_support)


def truncated_support_logprobs(full_logprobs: torch.Tensor, log_mass: torch.Tensor,
                               in_support: torch.Tensor) -> torch.Tensor:
    """log pi_trunc = log pi - log M on tokens inside the kept set K.

    A sampled token that the training side would have cut (y not in K: the two sides disagree at the boundary)
    keeps its full-support log-prob, so its ratio is ~M instead of 0; such tokens are counted in
    ``outside_support_fraction``. ``log_mass`` enters as a constant (no gradient through M).

    Args:
        full_logprobs: log pi_train over the full vocabulary.   (B, T)
        log_mass: log M (:func:`log_kept_mass`).   (B, T)
        in_support: whether the sampled token is in K.   (B, T) bool

    Returns:
        log pi_train renormalized over K, in ``full_logprobs``' dtype.   (B, T)
    """
    shift = torch.where(in_support, log_mass.detach(), torch.zeros_like(log_mass))  # (B, T)
    return full_logprobs - shift.to(full_logprobs.dtype)  # (B, T)


def truncation_stats(log_mass: torch.Tensor, in_support: torch.Tensor, mask: torch.Tensor) -> RolloutStats:
    """Device sums for kept_mass_mean (token mean of M), kept_mass_min and outside_support_fraction.

    Args:
        log_mass: log M.   (B, T)
        in_support: whether the sampled token is in K.   (B, T) bool
        mask: the tokens counted, any dtype.   (B, T)

    Returns:
        ``RolloutStats`` under :data:`TRUNC_N`, :data:`TRUNC_KEPT_MASS_SUM`, :data:`TRUNC_OUTSIDE_N`,
        :data:`TRUNC_KEPT_MASS_MIN` (float64 0-dim).
    """
    valid = mask.bool()  # (B, T)
    mass = log_mass.double().exp()  # (B, T) float64: summed over many tokens
    return RolloutStats(
        sums={TRUNC_N: count(valid), TRUNC_KEPT_MASS_SUM: masked_sum(mass, valid),
              TRUNC_OUTSIDE_N: count(valid & ~in_support)},
        mins={TRUNC_KEPT_MASS_MIN: masked_min(mass, valid)},
    )


def finalize_truncation(floats: dict[str, float]) -> dict[str, float]:
    """rollout_corr/kept_mass_mean, kept_mass_min, outside_support_fraction from reduced sums (0.0 when empty), read
    by declared name through :class:`~.criterion.StatFloats`; nothing where the truncation statistics are absent.

    Args:
        floats: the reduced statistics (:meth:`RolloutStats.to_floats` form).

    Returns:
        ``{"rollout_corr/<name>": float}`` for the names of :data:`TRUNCATION_METRICS`, or ``{}``.
    """
    f = StatFloats(floats)
    if not f.has(TRUNC_N):
        return {}
    n = f.sum(TRUNC_N)
    if n <= 0:
        return {METRIC_PREFIX + name: 0.0 for name in TRUNCATION_METRICS}
    return {METRIC_PREFIX + "kept_mass_mean": f.sum(TRUNC_KEPT_MASS_SUM) / n,
            METRIC_PREFIX + "kept_mass_min": f.min(TRUNC_KEPT_MASS_MIN),
            METRIC_PREFIX + "outside_support_fraction": f.sum(TRUNC_OUTSIDE_N) / n}
