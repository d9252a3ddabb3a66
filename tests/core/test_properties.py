"""Property-based tests of the core over random shapes, masks and log-prob values (hypothesis)."""

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trl_rollout_corr import compute_rollout_correction_and_rejection_mask
from trl_rollout_corr.core import compute_rollout_correction_weights

LOGPROB = st.one_of(st.floats(-60.0, 0.0), st.sampled_from([0.0, -1e-8, -1e4, float("nan"), float("-inf"),
                                                           float("inf")]))


@st.composite
def batches(draw):
    rows, cols = draw(st.integers(1, 5)), draw(st.integers(1, 7))
    old = torch.tensor(draw(st.lists(LOGPROB, min_size=rows * cols, max_size=rows * cols))).view(rows, cols)
    rollout = torch.tensor(draw(st.lists(LOGPROB, min_size=rows * cols, max_size=rows * cols))).view(rows, cols)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=rows * cols, max_size=rows * cols))).view(rows, cols)
    return old, rollout, mask.float()


CONFIG = st.fixed_dictionaries({
    "rollout_is": st.sampled_from([None, "token", "sequence"]),
    "rollout_is_threshold": st.floats(0.5, 10.0),
    "rollout_is_batch_normalize": st.booleans(),
    "rollout_rs": st.sampled_from([None, "token", "sequence", "geometric"]),
    "rollout_token_veto_threshold": st.sampled_from([None, 1e-4, 0.5]),
    "rollout_rs_criteria": st.sampled_from([None, "token_k2", "seq_max_k3,seq_sum_k1"]),
})

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _kwargs(cfg):
    kwargs = dict(cfg)
    kwargs["rollout_rs_threshold"] = 2.0 if cfg["rollout_rs"] else None
    kwargs["rollout_rs_criteria_threshold"] = {None: None, "token_k2": "0.5", "seq_max_k3,seq_sum_k1": "1.0,0.5_2.0"}[
        cfg["rollout_rs_criteria"]]
    return kwargs


@SETTINGS
@given(batches(), CONFIG)
def test_weights_masks_and_metrics_are_well_formed(batch, cfg):
    old, rollout, mask = batch
    weights, kept, metrics = compute_rollout_correction_and_rejection_mask(old, rollout, mask, **_kwargs(cfg))
    assert set(kept.unique().tolist()) <= {0.0, 1.0}  # binary
    assert torch.all(kept <= mask)  # never re-admits padding
    assert all(math.isfinite(v) for v in metrics.values()), {k: v for k, v in metrics.items() if not math.isfinite(v)}
    for name in ("rollout_corr/rejected_token_fraction", "rollout_corr/invalid_logprob_fraction"):
        assert 0.0 <= metrics[name] <= 1.0
    if weights is not None:
        assert torch.isfinite(weights).all()
        assert torch.all(weights[mask == 0] == 0)  # zero on padding
        assert torch.all(weights >= 0)


@SETTINGS
@given(batches(), st.sampled_from(["token", "sequence"]), st.floats(0.5, 10.0))
def test_truncated_weights_lie_in_0_C_before_normalization(batch, level, threshold):
    old, rollout, mask = batch
    finite = torch.isfinite(old) & torch.isfinite(rollout)
    old, rollout = torch.where(finite, old, -1.0), torch.where(finite, rollout, -1.0)
    weights, _, _ = compute_rollout_correction_weights(old - rollout, mask.bool(), level, threshold, False, None)
    assert torch.isfinite(weights).all()
    assert torch.all((weights >= 0) & (weights <= threshold * (1 + 1e-6)))
    assert torch.all(weights[mask == 0] == 0)
