"""GRPO group baselines without the rejected samples (``rollout_rs_exclude_from_baseline``).

This package defines rejection as "treated as not drawn". A sample the correction rejects entirely still sets its
group's baseline when the advantages come from TRL before the correction: with rewards r_1..r_G of a group,

    A_i = (r_i - mean_j r_j) / (std_j r_j + 1e-4)        (TRL's ``scale_rewards="group"``)

counts the rejected r_j in the mean and the std. Left out (the set R of samples with no kept token), the group's
baseline is that of the samples actually trained on:

    A_i = (r_i - mean_{j not in R} r_j) / (std_{j not in R} r_j + 1e-4),   A_i = 0 for i in R,

with std the unbiased (n - 1) standard deviation, and a group with fewer than two samples left giving 0 where its
std is needed. :func:`group_advantages` is TRL 1.16's advantage formula
(``GRPOTrainer._generate_and_score_completions``: ``multi_objective_aggregation`` ``"sum_then_normalize"`` /
``"normalize_then_sum"``, ``scale_rewards`` ``"group"`` / ``"batch"`` / ``"none"``) with the excluded rows' rewards
set to NaN, which is how TRL itself leaves an unscorable completion out of its baselines (NaN-aware mean and std,
advantage 0). The trainer checks on every batch that the formula with nothing excluded gives TRL's own advantages,
so a change in TRL cannot go unseen.

The same open problem in verl: verl-project/verl#6375 and #6452 ("a fully rejected response still enters its
group's GRPO baseline"). Pure tensor code: no TRL import.
"""

from __future__ import annotations

import torch

from .criterion import StatFloats, stat_key
from .stats import METRIC_PREFIX, STAT_DTYPE, RolloutStats, count, safe_div

BASELINE_METRICS = ("rollout_rs_baseline_excluded_fraction",)
"""The share of the generation batch's samples left out of the group baselines (every token rejected)."""
BASELINE_N = stat_key("baseline.n", __name__)
"""Samples of the generation batch (all processes, counted once)."""
BASELINE_EXCLUDED_N = stat_key("baseline.excluded_n", __name__)
"""Of those, the samples left out of their group's baseline."""


def nan_std(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased standard deviation ignoring NaNs; NaN where fewer than two values are left (TRL's ``nanstd``)."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True).to(values.dtype)  # float32 as TRL's on its rewards
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    if keepdim:
        return std
    return std.squeeze() if dim is None else std.squeeze(dim)


def group_advantages(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, num_generations: int,
                     scale_rewards: str, aggregation: str, excluded: torch.Tensor | None = None) -> torch.Tensor:
    """The advantages of a generation batch (all processes), groups of ``num_generations`` consecutive samples.

    ``rewards_per_func`` (N, F) per reward function (NaN: unscorable); ``reward_weights`` (F,); ``excluded`` (N,)
    bool: samples left out of every baseline (their rewards read as NaN) and given advantage 0.

    sum_then_normalize:  r_i = sum_f w_f r_if;  A_i = r_i - mean_g(r)  [/ (std_g(r) + 1e-4) for "group", / (std(r) +
        1e-4) over the batch for "batch", nothing for "none"]
    normalize_then_sum:  z_if = (r_if - mean_g(r_f)) / (std_g(r_f) + 1e-4);  s_i = sum_f w_f z_if;
        A_i = (s_i - mean(s)) / (std(s) + 1e-4) over the batch
    mean/std are NaN-aware (excluded and unscorable rows do not count); a NaN advantage becomes 0.   (N,)
    """
    rewards_per_func = rewards_per_func.clone()  # (N, F)
    if excluded is not None:
        rewards_per_func[excluded.bool()] = float("nan")
    unscorable = torch.isnan(rewards_per_func).all(dim=1)  # (N,)
    weights = reward_weights.to(rewards_per_func)  # (F,)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)  # (N,)
        rewards[unscorable] = float("nan")
        grouped = rewards.view(-1, num_generations)  # (N / G, G)
        mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)  # (N,)
        if scale_rewards in ("group", "none"):
            std = (nan_std(grouped, dim=1).repeat_interleave(num_generations) if num_generations > 1
                   else torch.zeros_like(rewards))  # (N,)
        elif scale_rewards == "batch":
            std = nan_std(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)  # (N,)
        else:
            raise ValueError(f"scale_rewards must be 'batch', 'group' or 'none', got {scale_rewards!r}.")
        advantages = rewards - mean  # (N,)
        if scale_rewards != "none":
            advantages = advantages / (std + 1e-4)  # (N,)
    elif aggregation == "normalize_then_sum":
        grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.size(1))  # (N / G, G, F)
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)  # (N / G, 1, F)
        std_k = nan_std(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
        z = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.size(1))  # (N, F)
        rewards = (z * weights.unsqueeze(0)).nansum(dim=1)  # (N,)
        rewards[unscorable] = float("nan")
        std = nan_std(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)  # (N,)
        advantages = (rewards - torch.nanmean(rewards)) / (std + 1e-4)  # (N,)
    else:
        raise ValueError(f"multi_objective_aggregation must be 'sum_then_normalize' or 'normalize_then_sum', got "
                         f"{aggregation!r}.")
    return torch.nan_to_num(advantages, nan=0.0)  # (N,)


def fully_rejected(keep: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Samples with trained tokens of which the correction kept none.   (B,) bool

    R_i = 1[sum_t m_it > 0] * 1[sum_t m_it k_it = 0]; a sample the correction left alone (no pi_rollout) is kept.
    """
    mask = loss_mask.bool()  # (B, T)
    return mask.any(1) & ~(mask & keep.bool()).any(1)  # (B,)


def baseline_stats(excluded: torch.Tensor) -> RolloutStats:
    """Counts of one generation batch's samples (global, ``excluded`` (N,) bool) for
    ``rollout_rs_baseline_excluded_fraction``; count them on one process only."""
    return RolloutStats(sums={BASELINE_EXCLUDED_N: count(excluded),
                              BASELINE_N: torch.tensor(float(excluded.numel()), dtype=STAT_DTYPE,
                                                         device=excluded.device)})


def finalize_baseline(floats: dict[str, float]) -> dict[str, float]:
    """``rollout_rs_baseline_excluded_fraction`` from the reduced counts (nothing when the option is off), read by
    declared name through :class:`~.criterion.StatFloats`."""
    f = StatFloats(floats)
    if not f.has(BASELINE_N):
        return {}
    return {METRIC_PREFIX + BASELINE_METRICS[0]: safe_div(f.sum(BASELINE_EXCLUDED_N), f.sum(BASELINE_N))}
