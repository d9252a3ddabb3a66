"""Capture the sampler's own per-token log-probs on the transformers ``generate`` path.

The processed scores that ``generate(output_scores=True)`` returns are the logits after every logits
processor and warper (repetition penalty, temperature, top-k, top-p, min-p), i.e. exactly the
distribution that was sampled, so log pi_rollout(a_t) = log_softmax(scores_t)[a_t]. No second forward.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch


def sampled_token_logprobs(scores: tuple[torch.Tensor, ...], generated_ids: torch.Tensor) -> torch.Tensor:
    """log pi_rollout(a_t | s_t) = log_softmax(scores_t)[a_t] for every generated step.   (B, S)

    ``scores``: S tensors of shape (B, V) (processed logits); ``generated_ids``: (B, S).
    Computed one step at a time so that only one (B, V) float32 buffer is alive.
    """
    steps = [
        torch.log_softmax(step_scores.float(), dim=-1).gather(-1, generated_ids[:, t : t + 1])  # (B, 1)
        for t, step_scores in enumerate(scores)
    ]
    if not steps:
        return generated_ids.new_zeros(generated_ids.shape, dtype=torch.float32)
    return torch.cat(steps, dim=1)  # (B, S)


@contextlib.contextmanager
def capture_sampling_logprobs(
    model: torch.nn.Module, sampler: Callable[..., Any] | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """Temporarily make ``model.generate`` return plain sequences while recording pi_rollout.

    ``sampler`` (optional) is the ``generate`` of another model that stands in for the rollout engine
    (an emulated stale / low-precision copy); by default the model samples itself. Yields a dict that
    holds ``"logprobs"`` (B, S) after the call.
    """
    captured: dict[str, torch.Tensor] = {}
    generate = sampler if sampler is not None else model.generate

    def generate_and_capture(*args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.update(output_scores=True, return_dict_in_generate=True)
        out = generate(*args, **kwargs)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        prompt_length = input_ids.shape[1]
        generated = out.sequences[:, prompt_length:]  # (B, S)
        captured["logprobs"] = sampled_token_logprobs(out.scores, generated)  # (B, S)
        return out.sequences

    model.generate = generate_and_capture  # instance attribute shadows the class method
    try:
        yield captured
    finally:
        del model.generate


def validate_rollout_logprobs(
    completion_ids: list[list[int]], logprobs: list[list[float | None]] | None, source: str
) -> None:
    """Refuse missing, nested or misaligned rollout log-probs with an error naming the sample and the cause."""
    if logprobs is None:
        raise ValueError(
            f"The rollout engine ({source}) returned no per-token log-probs, so pi_rollout is unknown and the rollout "
            "correction cannot run. A rollout_func must return a 'logprobs' list (one float per completion token); "
            "a vLLM server must run with --logprobs-mode processed_logprobs."
        )
    if len(logprobs) != len(completion_ids):
        raise ValueError(f"The rollout engine ({source}) returned log-probs for {len(logprobs)} completions but "
                         f"{len(completion_ids)} completions.")
    for i, (ids, lps) in enumerate(zip(completion_ids, logprobs)):
        if lps is None:
            raise ValueError(f"Sample {i}: the rollout engine ({source}) returned None instead of its log-prob list.")
        if len(lps) != len(ids):
            raise ValueError(
                f"Sample {i}: {len(lps)} rollout log-probs for {len(ids)} completion tokens ({source}); they must be "
                "aligned one per sampled token (no prompt tokens, no top-k lists).")
        for t, lp in enumerate(lps):
            if lp is not None and not isinstance(lp, (float, int)) and not (
                isinstance(lp, torch.Tensor) and lp.ndim == 0
            ):
                raise ValueError(f"Sample {i}, token {t}: rollout log-prob {lp!r} is not a float ({source}); return a "
                                 "flat list with the sampled token's log-prob, not a top-k list.")
            if isinstance(lp, (float, int)) and lp > 1e-3 and math.isfinite(lp):
                raise ValueError(f"Sample {i}, token {t}: rollout log-prob {lp} > 0 is not a log-probability ({source}); "
                                 "pass log-probs, not probabilities or logits.")
