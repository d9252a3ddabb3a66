"""Truncated support (top-k / top-p / min-p): the kept mass against transformers' own warpers, and in training."""

import math

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from tests.support.trainer_utils import make_trainer
from trl_rollout_corr.core.metrics import finalize_floats
from trl_rollout_corr.core.truncation import (SamplingTruncation, log_kept_mass, truncated_support_logprobs,
                                              truncation_stats)

CASES = [
    SamplingTruncation(top_k=5),
    SamplingTruncation(top_p=0.8),
    SamplingTruncation(min_p=0.1),
    SamplingTruncation(temperature=0.7, top_k=20, top_p=0.9),
    SamplingTruncation(temperature=1.3, top_k=12, top_p=0.7, min_p=0.05),
    SamplingTruncation(temperature=1.3, top_k=12, top_p=0.7, min_p=0.3, min_p_first=True),  # vLLM's order
]


def hf_reference(logits, targets, truncation):
    """transformers' sampling warpers in float64 (the generate path's own processing), then the kept mass."""
    z = logits.double()
    ids = torch.zeros(z.size(0), 1, dtype=torch.long)
    z = TemperatureLogitsWarper(truncation.temperature)(ids, z)
    full = z.clone()
    if truncation.min_p and truncation.min_p_first:
        z = MinPLogitsWarper(truncation.min_p)(ids, z)
    if truncation.top_k:
        z = TopKLogitsWarper(truncation.top_k)(ids, z)
    if truncation.top_p < 1:
        z = TopPLogitsWarper(truncation.top_p)(ids, z)
    if truncation.min_p and not truncation.min_p_first:
        z = MinPLogitsWarper(truncation.min_p)(ids, z)
    kept = torch.isfinite(z)
    mass = (full.softmax(-1) * kept).sum(-1)
    return mass.log(), kept.gather(1, targets[:, None]).squeeze(1)


@pytest.mark.parametrize("truncation", CASES, ids=lambda t: (f"T{t.temperature}-k{t.top_k}-p{t.top_p}-m{t.min_p}"
                                                             f"{'-first' if t.min_p_first else ''}"))
@pytest.mark.parametrize("chunk_elements", [64 * 50, 10 ** 9])
def test_kept_mass_matches_transformers_warpers(truncation, chunk_elements):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 50, generator=g) * 2.0  # (N, V)
    targets = torch.randint(0, 50, (37,), generator=g)
    log_mass, in_support = log_kept_mass(logits, targets, truncation, chunk_elements=chunk_elements)
    want_mass, want_in = hf_reference(logits, targets, truncation)
    assert torch.allclose(log_mass.double(), want_mass, atol=1e-5)
    assert torch.equal(in_support, want_in)
    assert (log_mass < -1e-3).any() and (~in_support).any()  # the case really truncates and misses tokens


def test_min_p_order_matters_and_is_followed():
    """p = 0.4, 0.3, 0.2, 0.1 with top_p = 0.75, min_p = 0.3.

    transformers (top-p, then min-p): ascending cumsum 0.1 <= 0.25 removes 0.1; min-p keeps the rest -> M = 0.9.
    vLLM (min-p first): 0.1 < 0.12 removed; renormalized 0.2/0.9 = 0.222 <= 0.25 is removed by top-p -> M = 0.7.
    """
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    target = torch.tensor([2])
    after, in_after = log_kept_mass(logits, target, SamplingTruncation(top_p=0.75, min_p=0.3))
    first, in_first = log_kept_mass(logits, target, SamplingTruncation(top_p=0.75, min_p=0.3, min_p_first=True))
    assert after.exp().item() == pytest.approx(0.9) and in_after.item()
    assert first.exp().item() == pytest.approx(0.7) and not in_first.item()


def test_top_k_keeps_ties_and_the_mass_is_exact_by_hand():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]))
    log_mass, in_support = log_kept_mass(logits, torch.tensor([2, 3]), SamplingTruncation(top_k=2))
    assert log_mass.exp().tolist() == pytest.approx([0.7, 1.0])  # row 2: all four tie at the 2nd value
    assert in_support.tolist() == [False, True]
    log_mass, _ = log_kept_mass(logits[:1], torch.tensor([0]), SamplingTruncation(top_p=0.65))
    assert log_mass.exp().item() == pytest.approx(0.7)  # ascending cumsum 0.1, 0.3 <= 0.35 removed


def test_tokens_outside_the_training_support_keep_their_full_log_prob_and_are_counted():
    full = torch.tensor([[-1.0, -2.0, -3.0]])
    log_mass = torch.log(torch.tensor([[0.5, 0.8, 0.9]]))
    in_support = torch.tensor([[True, False, True]])
    got = truncated_support_logprobs(full, log_mass, in_support)
    assert got[0].tolist() == pytest.approx([-1.0 - math.log(0.5), -2.0, -3.0 - math.log(0.9)])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    stats = finalize_floats(truncation_stats(log_mass, in_support, mask).to_floats())
    assert stats["rollout_corr/kept_mass_mean"] == pytest.approx(0.65)
    assert stats["rollout_corr/kept_mass_min"] == pytest.approx(0.5)
    assert stats["rollout_corr/outside_support_fraction"] == pytest.approx(0.5)


@pytest.mark.parametrize("preset", ["decoupled_token_is", "ppo_is_bypass"])
def test_top_p_top_k_sampling_ratio_is_unbiased_with_the_fix_and_biased_without(tmp_path, preset):
    """On-policy sampling through transformers generate with top_p=0.8, top_k=6 (no real mismatch)."""
    results = {}
    for switch in (None, False):  # None = the default: on, because top_p/top_k are set
        trainer, logs = make_trainer(tmp_path / str(switch), preset=preset, max_steps=2, top_p=0.8, top_k=6,
                                     truncated_support_correction=switch)
        trainer.train()
        results[switch] = [log for log in logs.logs if "loss" in log]
    for log in results[None]:
        assert abs(log["rollout_corr/rollout_is_mean"] - 1.0) < 0.01
        assert abs(log["rollout_corr/kl"]) < 1e-4
        assert log["rollout_corr/kept_mass_mean"] < 0.9  # a real truncation was corrected
        assert log["rollout_corr/outside_support_fraction"] == 0.0
        assert log["clip_ratio/region_mean"] == 0.0
    for log in results[False]:
        # without the fix, the ratio is the kept mass, not a policy change
        assert log["rollout_corr/rollout_is_mean"] == pytest.approx(log["rollout_corr/kept_mass_mean"], rel=1e-3)
        assert log["rollout_corr/rollout_is_mean"] < 0.9
        assert log["rollout_corr/kl"] > 0.1


def test_no_truncation_means_no_kept_mass_metrics(tmp_path):
    trainer, logs = make_trainer(tmp_path, preset="decoupled_token_is", max_steps=1)
    trainer.train()
    log = [entry for entry in logs.logs if "loss" in entry][0]
    assert "rollout_corr/kept_mass_mean" not in log
    assert trainer._rc_truncation is None

