"""Pure tensor math of rollout correction. No TRL import lives below this package."""

from .metrics import compute_offpolicy_metrics, finalize_stats
from .params import CorrectionParams
from .pipeline import compute_rollout_correction_and_rejection_mask, compute_rollout_correction_stats
from .rejection import compute_rollout_rejection_mask, compute_veto_mask
from .stats import RolloutStats
from .weights import SAFETY_BOUND, compute_rollout_correction_weights

__all__ = [
    "SAFETY_BOUND",
    "CorrectionParams",
    "compute_offpolicy_metrics",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_stats",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "compute_veto_mask",
    "finalize_stats",
    "RolloutStats",
]
