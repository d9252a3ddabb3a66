"""Getting pi_rollout: generate-path capture, rollout-log-prob checks and emulated engines."""

from .capture import capture_sampling_logprobs, refuse_beam_search
from .logprobs import check_rollout_logprobs

__all__ = ["capture_sampling_logprobs", "check_rollout_logprobs", "refuse_beam_search"]
