"""A vLLM logits processor that adds dense Gaussian noise to every logit: a precision-like gap between the engine
and the trainer, inside the real engine (experiments/async_mismatch.py: TRL's asynchronous trainer, issue 36's S4).

The engine samples from, and returns the log-probs of, q = softmax(z + sigma * eps), eps ~ N(0, I) drawn afresh at
every position of every request, while the trainer scores p = softmax(z): the per-token KL(q || p) grows like
sigma^2 / 2 times the variance of the log-probs under p (the same perturbation as ``heavy_tailed(sigma, 0, 0, .)`` of
experiments/mismatch_train.py, the synchronous experiments D, B, E, F). vLLM's ``processed_logprobs`` (the log-probs
``trl-rollout-corr vllm-serve-async`` asks for) are computed after the logits processors, so the trainer receives
log q, as from an engine whose numerics differ.

Use: ``TRL_ROLLOUT_CORR_LOGIT_NOISE=0.8 trl-rollout-corr vllm-serve-async MODEL --logits-processors
experiments.logit_noise:GaussianLogitNoise``; the noise's generator is seeded by
``TRL_ROLLOUT_CORR_LOGIT_NOISE_SEED`` (default 0) once per engine. A test and benchmark tool, not a correction.
"""

from __future__ import annotations

import os

import torch

SIGMA_ENV = "TRL_ROLLOUT_CORR_LOGIT_NOISE"
SEED_ENV = "TRL_ROLLOUT_CORR_LOGIT_NOISE_SEED"


def noise_sigma() -> float:
    """sigma from ``TRL_ROLLOUT_CORR_LOGIT_NOISE``: a finite number >= 0, else a ValueError naming the variable."""
    raw = os.environ.get(SIGMA_ENV, "0")
    try:
        sigma = float(raw)
    except ValueError:
        sigma = float("nan")
    if not sigma >= 0 or sigma == float("inf"):
        raise ValueError(f"{SIGMA_ENV}={raw!r}: the logit noise's standard deviation must be a finite number >= 0")
    return sigma


def add_logit_noise(logits: torch.Tensor, sigma: float, generator: torch.Generator | None) -> torch.Tensor:
    """z + sigma * eps with eps ~ N(0, I) of the logits' shape (B, V); -inf stays -inf (a masked token stays
    masked); sigma 0 returns ``logits`` unchanged."""
    if sigma == 0:
        return logits
    eps = torch.randn(logits.shape, generator=generator, device=logits.device, dtype=torch.float32)  # (B, V)
    return logits + sigma * eps.to(logits.dtype)


try:  # vLLM's v1 interface; without vLLM the pure function above still imports (the suite's CPU tests)
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
except ImportError:  # pragma: no cover - vLLM not installed
    LogitsProcessor, BatchUpdate = object, None


class GaussianLogitNoise(LogitsProcessor):
    """vLLM v1 logits processor: every request's logits z -> z + sigma * eps (sigma: ``TRL_ROLLOUT_CORR_LOGIT_NOISE``).

    Not argmax-invariant, so vLLM applies it before sampling for greedy and random requests alike, and
    ``processed_logprobs`` are the noisy distribution's."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.sigma = noise_sigma()
        self.generator = torch.Generator(device=device).manual_seed(int(os.environ.get(SEED_ENV, "0")))

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:  # the same noise law for every request: no per-request state
        return None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return add_logit_noise(logits, self.sigma, self.generator)
