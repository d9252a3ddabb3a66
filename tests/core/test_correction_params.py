"""The core takes the correction as one frozen view of the config (``CorrectionParams``, ``config.params()``), not a
spread of 13 keyword arguments (#30); the keyword form stays for callers without a config and means the same."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from trl_rollout_corr import RolloutCorrectionConfig
from trl_rollout_corr.core import CorrectionParams, compute_rollout_correction_stats


def sample(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 7, generator=g) * 2 - 0.1  # (B, T)
    rollout = (old + 0.4 * torch.randn(6, 7, generator=g)).clamp(max=-1e-3)  # (B, T)
    mask = (torch.arange(7)[None] < torch.tensor([[7], [5], [3], [7], [1], [6]])).float()  # (B, T)
    return old, rollout, mask


@pytest.mark.parametrize("preset", [*RolloutCorrectionConfig.preset_names(), "decoupled_k3_rs_token_tis"])
def test_params_and_keywords_give_the_same_correction(preset):
    cfg = RolloutCorrectionConfig.from_preset(preset)
    old, rollout, mask = sample()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0])  # (B,) read by M2PO's trust-region scope only
    by_params = compute_rollout_correction_stats(old, rollout, mask, cfg.params(), advantages=adv)
    by_keywords = compute_rollout_correction_stats(old, rollout, mask, advantages=adv, **cfg.pipeline_kwargs())
    assert torch.equal(by_params.modified_response_mask, by_keywords.modified_response_mask)
    assert (by_params.is_weights is None) == (by_keywords.is_weights is None)
    if by_params.is_weights is not None:
        assert torch.equal(by_params.is_weights, by_keywords.is_weights)
    assert by_params.stats.to_floats() == by_keywords.stats.to_floats()


def test_params_is_a_frozen_view_of_the_config():
    cfg = RolloutCorrectionConfig.from_preset("decoupled_seq_is_rs")
    params = cfg.params()
    assert params.rollout_rs_threshold_lower == cfg.rs_threshold_lower  # resolved: 1 / rollout_rs_threshold
    assert cfg.pipeline_kwargs() == dataclasses.asdict(params)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.rollout_is = None


def test_the_correction_is_one_argument_not_a_keyword_spread():
    named = [p.name for p in inspect.signature(compute_rollout_correction_stats).parameters.values()
             if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert named == ["old_log_prob", "rollout_log_prob", "response_mask", "params", "reduce_fn", "rollout_seen",
                     "advantages"]


def test_params_and_keywords_together_or_a_wrong_type_are_clear_errors():
    old, rollout, mask = sample()
    with pytest.raises(TypeError, match=r"got params and the fields \['rollout_is'\]: pass one of the two"):
        compute_rollout_correction_stats(old, rollout, mask, CorrectionParams(), rollout_is="token")
    with pytest.raises(TypeError, match="params must be a CorrectionParams.*got str"):
        compute_rollout_correction_stats(old, rollout, mask, "token")
    with pytest.raises(TypeError, match="rollout_is_treshold"):
        compute_rollout_correction_stats(old, rollout, mask, rollout_is_treshold=2.0)
