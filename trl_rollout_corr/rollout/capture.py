"""Capture the sampler's own per-token log-probs on the transformers ``generate`` path.

The scores a sampler draws from are the logits after every logits processor and warper (repetition penalty,
temperature, top-k, top-p, min-p): at step t, with processed scores z_t (B, V) and sampled token a_t,

    log pi_rollout(a_t | s_t) = log_softmax(z_t)[a_t] = z_t[a_t] - log sum_v exp(z_t[v]).

No second forward. The capture is lean: instead of asking ``generate`` for ``output_scores=True`` (which keeps S
tensors of (B, V) alive until generation ends: 20 GB at V = 151,936, B = 64, S = 512), two hooks ride along:

* a logits processor appended at the very *end* of the chain ``generate`` builds (after its warpers, which
  transformers appends after any user-supplied processor) keeps a reference to z_t, the tensor that is sampled;
* a stopping criterion, which ``generate`` calls right after a_t has been appended to ``input_ids``, gathers
  log_softmax(z_t)[a_t] (B, 1) and drops the reference.

So the capture holds at most one (B, V) buffer at a time, and keeps the (B, S) result. The hooks are attached where
``generate`` builds its chains (``GenerationMixin._get_logits_processor`` / ``_get_stopping_criteria``), only for
the ``generate`` calls made through the wrapped ``model.generate`` (a context variable names the active capture), so
they reach whichever transformers model actually generates: the policy, a PEFT/DDP-wrapped policy's inner model, or
an emulated rollout engine. ``output_scores`` / ``return_dict_in_generate`` are left alone: ``generate`` returns what
it returns (a plain tensor, or a ``GenerateOutput`` when the caller asked for one).

Beam search (``num_beams > 1``) is refused: it keeps the most probable beams instead of drawing each token from one
per-token distribution, so there is no pi_rollout(a_t | s_t) for the correction to divide by.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import GenerationMixin, LogitsProcessor, StoppingCriteria


def refuse_beam_search(num_beams: Any) -> None:
    """Beam search has no per-token sampling distribution, hence no pi_rollout: refuse it, naming the fix."""
    if num_beams is not None and int(num_beams) > 1:
        raise ValueError(
            f"num_beams={num_beams}: beam search keeps the most probable of num_beams hypotheses instead of drawing "
            "each token from one per-token distribution, so there is no pi_rollout(a_t | s_t) for the rollout "
            "correction to divide by (its per-step scores are (B*num_beams, V) beam log-probs). Generate by "
            "sampling: remove num_beams from generation_kwargs (or set it to 1), and from the model's "
            "generation_config.")


# ---------------------------------------------------------------------------------------------- the two hooks
class _StepwiseLogprobRecorder:
    """The state the two hooks share: the pending processed scores z_t and the finished steps."""

    def __init__(self) -> None:
        self.pending: torch.Tensor | None = None  # z_t (B, V): held from the end of processing to token selection
        self.steps: list[torch.Tensor] = []  # log pi_rollout(a_t | s_t), each (B, 1)
        self.sampled: list[torch.Tensor] = []  # a_t, each (B, 1)
        self.processor = _KeepProcessedScores(self)
        self.criterion = _GatherSampledToken(self)
        self.attached = False  # the hooks go into the first chains built (the outer generate call's)

    def logprobs(self) -> torch.Tensor | None:
        return torch.cat(self.steps, dim=1) if self.steps else None  # (B, S)

    def tokens(self) -> torch.Tensor:
        return torch.cat(self.sampled, dim=1)  # (B, S)


class _KeepProcessedScores(LogitsProcessor):
    """Last logits processor of the chain: remembers z_t (no copy) and returns it unchanged."""

    def __init__(self, recorder: _StepwiseLogprobRecorder) -> None:
        self.recorder = recorder

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.recorder.pending is not None:
            raise RuntimeError(
                "capture_sampling_logprobs: generate ran its logits processors twice without the capture's stopping "
                "criterion in between (assisted / speculative decoding, or a model whose _get_stopping_criteria "
                "drops added criteria), so pi_rollout cannot be aligned with the sampled tokens. Generate by plain "
                "sampling (no assistant_model / prompt_lookup_num_tokens), or supply log-probs via rollout_func.")
        self.recorder.pending = scores  # z_t (B, V)
        return scores


class _GatherSampledToken(StoppingCriteria):
    """Called by ``generate`` right after a_t is appended: records log_softmax(z_t)[a_t]; never stops anything."""

    def __init__(self, recorder: _StepwiseLogprobRecorder) -> None:
        self.recorder = recorder

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        pending, self.recorder.pending = self.recorder.pending, None  # release z_t before the next step
        if pending is not None:
            sampled = input_ids[:, -1:]  # a_t (B, 1)
            self.recorder.steps.append(torch.log_softmax(pending.float(), dim=-1).gather(-1, sampled))  # (B, 1)
            self.recorder.sampled.append(sampled)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # (B,)


# ---------------------------------------------------------------------------------------------- attaching them
_ACTIVE: contextvars.ContextVar[_StepwiseLogprobRecorder | None] = contextvars.ContextVar(
    "trl_rollout_corr_capture", default=None)
_PATCH_LOCK = threading.Lock()
_PATCH_USERS = 0
_ORIGINALS: dict[str, Any] = {}


def _get_logits_processor_and_capture(self: Any, generation_config: Any, *args: Any, **kwargs: Any) -> Any:
    """``GenerationMixin._get_logits_processor``, with the active capture's processor appended last."""
    processors = _ORIGINALS["_get_logits_processor"](self, generation_config, *args, **kwargs)
    recorder = _ACTIVE.get()
    if recorder is None or recorder.attached:
        return processors
    refuse_beam_search(getattr(generation_config, "num_beams", None))  # the config generate resolved
    if type(self)._get_logits_processor is not _get_logits_processor_and_capture:
        raise RuntimeError(
            f"capture_sampling_logprobs: {type(self).__name__} overrides _get_logits_processor, so the capture "
            "cannot know that its processor is the last one of the chain (pi_rollout would be wrong). Use a "
            "rollout_func or vLLM to supply the rollout log-probs for this model.")
    processors.append(recorder.processor)
    return processors


def _get_stopping_criteria_and_capture(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``GenerationMixin._get_stopping_criteria``, with the active capture's criterion appended."""
    criteria = _ORIGINALS["_get_stopping_criteria"](self, *args, **kwargs)
    recorder = _ACTIVE.get()
    if recorder is not None and not recorder.attached:
        criteria.append(recorder.criterion)
        recorder.attached = True  # _get_logits_processor has run just before, for the same call
    return criteria


@contextlib.contextmanager
def _hooks_in_generate(recorder: _StepwiseLogprobRecorder) -> Iterator[None]:
    """While open (in this thread / context only), ``generate`` puts ``recorder``'s hooks into its chains."""
    global _PATCH_USERS
    with _PATCH_LOCK:
        if _PATCH_USERS == 0:
            _ORIGINALS["_get_logits_processor"] = GenerationMixin._get_logits_processor
            _ORIGINALS["_get_stopping_criteria"] = GenerationMixin._get_stopping_criteria
            GenerationMixin._get_logits_processor = _get_logits_processor_and_capture
            GenerationMixin._get_stopping_criteria = _get_stopping_criteria_and_capture
        _PATCH_USERS += 1
    token = _ACTIVE.set(recorder)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        with _PATCH_LOCK:
            _PATCH_USERS -= 1
            if _PATCH_USERS == 0:  # _ORIGINALS stay set: a call already inside a patched method still finds them
                GenerationMixin._get_logits_processor = _ORIGINALS["_get_logits_processor"]
                GenerationMixin._get_stopping_criteria = _ORIGINALS["_get_stopping_criteria"]


# ---------------------------------------------------------------------------------------------- the capture
def _prompt_length(args: tuple, kwargs: dict[str, Any]) -> int | None:
    prompt = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    return prompt.shape[-1] if isinstance(prompt, torch.Tensor) else None


def _returned_sequences(out: Any) -> torch.Tensor | None:
    """(B, P + S) from a plain tensor or a ``GenerateOutput``; None when ``generate`` returned something else."""
    if isinstance(out, torch.Tensor):
        return out
    sequences = getattr(out, "sequences", None)
    return sequences if isinstance(sequences, torch.Tensor) else None


def _aligned_logprobs(recorder: _StepwiseLogprobRecorder, out: Any, prompt_length: int | None) -> torch.Tensor | None:
    """The recorded (B, S') cut to the S tokens ``generate`` returned: NaN rows where the returned tokens are not the
    ones the capture saw being sampled (a generate that did not sample through transformers' chains, or changed the
    tokens afterwards). None when neither the steps nor the returned sequences are known."""
    logprobs = recorder.logprobs()  # (B, S') or None
    sequences = _returned_sequences(out)  # (B, P + S) or None
    generated = None if sequences is None or prompt_length is None else sequences.shape[1] - prompt_length  # S
    if generated is None:  # generate returned something without sequences: trust the recorded steps
        return logprobs
    rows = sequences.shape[0]
    if generated == 0:
        return torch.zeros(rows, 0, dtype=torch.float32, device=sequences.device)  # (B, 0)
    if logprobs is None or logprobs.shape[0] != rows or logprobs.shape[1] < generated:
        return torch.full((rows, generated), float("nan"), device=sequences.device)  # (B, S) nothing seen
    # drops a step that generate undid (deferred stop check), if any
    logprobs, sampled = logprobs[:, :generated], recorder.tokens()[:, :generated]  # (B, S), (B, S)
    same_tokens = (sampled.to(sequences.device) == sequences[:, prompt_length:]).all(-1, keepdim=True)  # (B, 1)
    return torch.where(same_tokens, logprobs, torch.full_like(logprobs, float("nan")))  # (B, S)


@contextlib.contextmanager
def capture_sampling_logprobs(
    model: torch.nn.Module, sampler: Callable[..., Any] | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """Temporarily wrap ``model.generate`` so that every call also records log pi_rollout(a_t | s_t).   (B, S)

    ``sampler`` (optional) is the ``generate`` of another model that stands in for the rollout engine (an emulated
    stale / low-precision copy, :mod:`trl_rollout_corr.rollout.emulated`); by default the model samples itself.
    Yields a dict that holds ``"logprobs"`` (B, S) after each call, S = number of new tokens in the returned
    sequences (positions after EOS hold the log-prob of the pad token; callers cut at the completion length). A row
    is NaN where ``generate`` returned tokens the capture did not see being sampled (a mocked or wrapped generate):
    its pi_rollout is unknown.

    ``generate``'s return value is passed through unchanged (a plain tensor stays a tensor). Whatever ``generate``
    attribute the model instance had before (a user's or another library's wrapper) is what the wrapper calls, and
    it is put back on exit; a model without one gets its class method back. Beam search raises ``ValueError``.
    """
    captured: dict[str, torch.Tensor] = {}
    generate = sampler if sampler is not None else model.generate
    missing = object()
    previous = vars(model).get("generate", missing)  # an instance attribute shadowing the class method, if any

    def generate_and_capture(*args: Any, **kwargs: Any) -> Any:
        recorder = _StepwiseLogprobRecorder()
        with _hooks_in_generate(recorder):
            out = generate(*args, **kwargs)
        captured["logprobs"] = _aligned_logprobs(recorder, out, _prompt_length(args, kwargs))  # (B, S)
        return out

    model.generate = generate_and_capture  # instance attribute shadows the class method
    try:
        yield captured
    finally:
        if previous is missing:
            vars(model).pop("generate", None)
        else:
            model.generate = previous
