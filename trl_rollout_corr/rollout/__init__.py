"""Getting pi_rollout: generate-path capture, rollout-log-prob validation and emulated engines."""

from .capture import capture_sampling_logprobs, refuse_beam_search, sampled_token_logprobs, validate_rollout_logprobs

__all__ = ["capture_sampling_logprobs", "refuse_beam_search", "sampled_token_logprobs", "validate_rollout_logprobs"]
