"""Checking the per-token rollout log-probs an engine handed over, before they become a padded tensor.

Three cases per sample:

* aligned log-probs (one float per completion token; ``None``/NaN for a token the engine could not score, which
  rejects the sample later and is counted in ``invalid_logprob_fraction``);
* **missing**: no pi_rollout for the sample at all (a ``rollout_func`` that returns none, or a ``generate`` whose
  sampling distribution cannot be seen: mocked, wrapped, remote). Unless log-probs are required, the sample is
  trained uncorrected (weight 1, nothing rejected) and counted in ``missing_rollout_logprobs_fraction``;
* **misaligned** or malformed (a count that differs from the completion's, a top-k list, a probability): always an
  error naming the sample, never a silent wrong ratio.
"""

from __future__ import annotations

import array
import math
from typing import Any

import numpy as np
import torch


def _missing_cause(source: str) -> str:
    if source == "transformers generate":
        return ("the model's generate returned tokens without running its sampling distribution through transformers' "
                "logits processors (a mocked, wrapped or remote generate)")
    return f"the rollout engine ({source}) returned no per-token log-probs"


def check_rollout_logprobs(
    completion_ids: list[list[int]],
    logprobs: list[Any] | None,
    source: str,
    require: bool,
    nan_marks_missing: bool = False,
) -> tuple[list[list[float | None]], list[bool]]:
    """Validate ``logprobs`` against ``completion_ids``; return ``(logprobs with missing rows as NaN, seen per row)``.

    ``nan_marks_missing``: a NaN in a row means the row was not seen (the transformers capture writes NaN there;
    engines use None/NaN for single unscored tokens instead). ``require``: a missing row raises ``ValueError``.
    """
    if logprobs is None:
        logprobs = [None] * len(completion_ids)
    if len(logprobs) != len(completion_ids):
        raise ValueError(f"The rollout engine ({source}) returned log-probs for {len(logprobs)} completions but "
                         f"{len(completion_ids)} completions.")
    checked, seen = [], []
    for i, (ids, lps) in enumerate(zip(completion_ids, logprobs)):
        missing = lps is None or (nan_marks_missing and any(isinstance(lp, float) and math.isnan(lp) for lp in lps))
        if missing:
            if require:
                raise ValueError(
                    f"Sample {i}: {_missing_cause(source)}, so pi_rollout is unknown and the rollout correction cannot "
                    "run (require_rollout_logprobs=True). A rollout_func must return a 'logprobs' list (one float per "
                    "completion token); a vLLM server must run with --logprobs-mode processed_logprobs; a "
                    "transformers generate must sample through GenerationMixin.generate.")
            checked.append([float("nan")] * len(ids))
            seen.append(False)
            continue
        _check_row(i, ids, lps, source)
        checked.append(lps)
        seen.append(True)
    return checked, seen


def _check_row(i: int, ids: list[int], lps: list[Any], source: str) -> None:
    if len(lps) != len(ids):
        raise ValueError(
            f"Sample {i}: {len(lps)} rollout log-probs for {len(ids)} completion tokens ({source}); they must be "
            "aligned one per sampled token (no prompt tokens, no top-k lists).")
    start = 0
    try:  # a flat list of numbers: checked at once, without a Python loop over the tokens
        values = np.frombuffer(array.array("d", lps), dtype=np.float64)  # (T,)
    except TypeError:  # None (an unscored token), a list, a string, ...: the loop below names what is wrong
        values = None
    if values is not None:
        positive = np.flatnonzero((values > 1e-3) & np.isfinite(values))
        if positive.size == 0:
            return
        start = int(positive[0])
        lps = lps[start:]  # the loop below names the first offending token
    for t, lp in enumerate(lps, start):
        if lp is not None and not isinstance(lp, (float, int)) and not (isinstance(lp, torch.Tensor) and lp.ndim == 0):
            raise ValueError(f"Sample {i}, token {t}: rollout log-prob {lp!r} is not a float ({source}); return a flat "
                             "list with the sampled token's log-prob, not a top-k list.")
        if isinstance(lp, (float, int)) and lp > 1e-3 and math.isfinite(lp):
            raise ValueError(f"Sample {i}, token {t}: rollout log-prob {lp} > 0 is not a log-probability ({source}); "
                             "pass log-probs, not probabilities or logits.")
