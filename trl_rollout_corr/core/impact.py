""""Does it hurt?" diagnostics: how much of the gradient the correction touched, and where the mismatch sits.

Notation as in the rest of the core: log rho_t = log pi_train(a_t) - log pi_rollout(a_t) on the sampled tokens,
k3_t = rho_t - 1 - log rho_t with log rho_t safety-bounded to [-20, 20] (the ``k3_kl`` metric's per-token term),
A_t the advantage of the token's sample as TRL formed it (before the correction weights, masks or recomputes it),
m_t the trained tokens (the loss mask: completion tokens, tool output excluded).

1. Gradient share. A policy-gradient term is w_t A_t grad log pi_theta(a_t); its size proxy here is |A_t| (the
   weight left out: what the share measures is which tokens the correction changed, not by how much). Over the
   trained tokens:

   * ``grad_share_pinned`` = sum_{t pinned} |A_t| / sum_t m_t |A_t|, pinned: kept in the gradient with an IS weight
     clipped to a bound (rho > C, or rho < C_lower when a lower clip is set; ``rollout_is_bound="truncate"``);
   * ``grad_share_masked`` = sum_{t dropped} |A_t| / sum_t m_t |A_t|, dropped: the correction removed the token's
     gradient (rejected by RS / criteria / veto / second-moment mask or a non-finite log-prob, IS weight set to 0 by
     ``rollout_is_bound="mask"``, advantage zeroed by M2PO's trust region).

   Samples whose advantage is 0 (a GRPO group with equal rewards) carry no gradient and weigh nothing here.
2. Mismatch per completion length: ``k3_kl_len_<lo>_<hi>`` = sum k3_t / number of tokens, over the sequences whose
   length T (their valid tokens) is in the bucket [lo, hi] (buckets :data:`LENGTH_BUCKETS`); a bucket without a
   token since the last log is not reported.
3. T*KL = sum_t k3_t over one sequence's valid tokens. A sequence weight's log, sum_t log rho_t, has variance ~2 T*KL
   under a small mismatch, and the ESS of log-normal sequence weights is exp(-Var) (docs/probe.md): past T*KL = 1
   that is below exp(-2) ~ 0.14. ``t_kl_above_1_fraction`` = share of sequences with T*KL > 1; ``t_kl_mean`` and
   ``t_kl_max`` over sequences.

Pure PyTorch, no host sync: every function returns :class:`~.stats.RolloutStats`.
"""

from __future__ import annotations

import torch

from .criterion import StatFloats, stat_key
from .stats import METRIC_PREFIX as PREFIX
from .stats import STAT_DTYPE, RolloutStats, count, count_rows, extreme_or_zero, masked_max, masked_sum, safe_div
from .weights import SAFETY_BOUND

#: completion-length buckets (tokens): [0, 64), [64, 256), [256, 1024), [1024, 4096), [4096, inf)
LENGTH_BUCKETS: tuple[int, ...] = (64, 256, 1024, 4096)
#: the T*KL above which a sequence counts in ``t_kl_above_1_fraction`` (sequence-weight ESS ~ exp(-2 T*KL) < 0.14)
T_KL_THRESHOLD = 1.0


def bucket_names(buckets: tuple[int, ...] = LENGTH_BUCKETS) -> tuple[str, ...]:
    """``len_0_63``, ``len_64_255``, ..., ``len_ge_4096``: one name per bucket, in order."""
    edges = (0, *buckets)
    return (*(f"len_{lo}_{hi - 1}" for lo, hi in zip(edges, edges[1:])), f"len_ge_{edges[-1]}")


SHARE_ABS_ADV = stat_key("share.abs_adv_sum", __name__)
"""sum_t m_t |A_t| over the trained tokens."""
SHARE_PINNED = stat_key("share.pinned_abs_adv_sum", __name__)
"""sum |A_t| over the pinned tokens (IS weight clipped to a bound)."""
SHARE_DROPPED = stat_key("share.dropped_abs_adv_sum", __name__)
"""sum |A_t| over the dropped tokens (gradient removed)."""
TKL_SEQ_N = stat_key("tkl.seq_n", __name__)
"""Sequences with a valid token."""
TKL_SUM = stat_key("tkl.sum", __name__)
"""sum over sequences of T*KL."""
TKL_ABOVE_N = stat_key("tkl.above_n", __name__)
"""Sequences with T*KL > :data:`T_KL_THRESHOLD`."""
TKL_MAX = stat_key("tkl.max", __name__)
"""max over sequences of T*KL (a max)."""


def length_key(bucket: int, name: str) -> str:
    """The statistic ``len.<bucket>.<name>`` (``tok_n``, ``k3_sum``) of length bucket ``bucket``, declared here (one
    per bucket: the buckets are an argument)."""
    return stat_key(f"len.{bucket}.{name}", __name__)


GRAD_SHARE_METRICS = ("grad_share_pinned", "grad_share_masked")
LENGTH_METRICS = tuple(f"k3_kl_{name}" for name in bucket_names())
T_KL_METRICS = ("t_kl_mean", "t_kl_max", "t_kl_above_1_fraction")


def gradient_share_stats(advantages: torch.Tensor, mask: torch.Tensor, pinned: torch.Tensor,
                         dropped: torch.Tensor) -> RolloutStats:
    """Sums of |A_t| over the trained tokens, the pinned ones and the dropped ones (see the module docstring).

    ``advantages``: (B,), (B, 1) or (B, T); ``mask``, ``pinned``, ``dropped``: (B, T) bool (pinned and dropped are
    taken inside ``mask``).
    """
    mask = mask.bool()  # (B, T)
    a = advantages.detach().to(STAT_DTYPE).abs()  # (B,), (B, 1) or (B, T)
    a = (a.reshape(-1, 1) if a.dim() == 1 else a).expand(mask.shape)  # (B, T)
    return RolloutStats(sums={
        SHARE_ABS_ADV: masked_sum(a, mask),
        SHARE_PINNED: masked_sum(a, mask & pinned.bool()),
        SHARE_DROPPED: masked_sum(a, mask & dropped.bool()),
    })


def length_stats(log_ratio: torch.Tensor, valid: torch.Tensor,
                 buckets: tuple[int, ...] = LENGTH_BUCKETS) -> RolloutStats:
    """Per-length-bucket sums of k3 and token counts, and the per-sequence T*KL sums (see the module docstring).

    ``log_ratio``: (B, T) log rho (any value off ``valid``); ``valid``: (B, T) bool, the tokens that count.
    """
    valid = valid.bool()  # (B, T)
    bounded = log_ratio.detach().to(STAT_DTYPE).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (B, T)
    k3 = torch.where(valid, torch.expm1(bounded) - bounded, torch.zeros_like(bounded))  # (B, T)
    lengths = valid.sum(1)  # (B,)
    t_kl = k3.sum(1)  # (B,) T*KL per sequence
    has_tokens = lengths > 0  # (B,)
    edges = (0, *buckets)
    sums = {}
    for i, lower in enumerate(edges):
        in_bucket = (lengths >= lower) & (lengths < edges[i + 1] if i + 1 < len(edges) else has_tokens)  # (B,)
        tokens = valid & in_bucket.unsqueeze(1)  # (B, T)
        sums[length_key(i, "tok_n")] = count(tokens)
        sums[length_key(i, "k3_sum")] = masked_sum(k3, tokens)
    sums[TKL_SEQ_N] = count_rows(valid)
    sums[TKL_SUM] = masked_sum(t_kl, has_tokens)
    sums[TKL_ABOVE_N] = count(has_tokens & (t_kl > T_KL_THRESHOLD))
    return RolloutStats(sums=sums, maxes={TKL_MAX: masked_max(t_kl, has_tokens)})


def finalize_impact(floats: dict[str, float], buckets: tuple[int, ...] = LENGTH_BUCKETS) -> dict[str, float]:
    """``{"rollout_corr/<name>": float}`` from reduced statistics (:meth:`RolloutStats.to_floats` form, read by
    declared name through :class:`~.criterion.StatFloats`); only the families present."""
    f = StatFloats(floats)
    metrics: dict[str, float] = {}
    if f.has(SHARE_ABS_ADV):
        total = f.sum(SHARE_ABS_ADV)
        metrics[PREFIX + "grad_share_pinned"] = safe_div(f.sum(SHARE_PINNED), total)
        metrics[PREFIX + "grad_share_masked"] = safe_div(f.sum(SHARE_DROPPED), total)
    if f.has(TKL_SEQ_N):
        seq_n = f.sum(TKL_SEQ_N)
        metrics[PREFIX + "t_kl_mean"] = safe_div(f.sum(TKL_SUM), seq_n)
        metrics[PREFIX + "t_kl_max"] = extreme_or_zero(f.max(TKL_MAX), seq_n)
        metrics[PREFIX + "t_kl_above_1_fraction"] = safe_div(f.sum(TKL_ABOVE_N), seq_n)
        for i, name in enumerate(bucket_names(buckets)):
            tok_n = f.sum(length_key(i, "tok_n"), 0.0)
            if tok_n > 0:
                metrics[f"{PREFIX}k3_kl_{name}"] = f.sum(length_key(i, "k3_sum")) / tok_n
    return metrics
