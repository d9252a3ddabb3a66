"""How the correction enters TRL's loss (trl_rollout_corr.core.losses): hand-computed cases, shapes and dtypes."""

from __future__ import annotations

import math

import torch

import pytest

from trl_rollout_corr import RolloutCorrectionConfig
from trl_rollout_corr.core.pipeline import finite_rows_mask, rollout_usable_mask
from trl_rollout_corr.core.losses import (PI_OLD, PI_ROLLOUT, PI_THETA, batch_correction, corrected_loss_mask,
                                          loss_anchor, loss_patch, mode_correction, safe_anchor,
                                          vespo_sampler_ratio, weighted_advantages, weights_advantage,
                                          zeroed_advantages)

MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])  # (2, 4) completion mask
KEEP = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0]])  # (2, 4) token 1 rejected, row 1 rejected entirely


def test_corrected_loss_mask_folds_keep_into_the_tool_mask():
    tool = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]])  # a tool token at (0, 2)
    assert corrected_loss_mask(MASK, tool, KEEP).tolist() == [[1, 0, 0, 0], [0, 0, 0, 0]]
    assert corrected_loss_mask(MASK, None, KEEP).tolist() == KEEP.tolist()  # no tool mask: the kept mask itself


def test_weighted_advantages_token_level():
    adv = torch.tensor([2.0, -1.0])  # (B,)
    w = torch.tensor([[0.5, 1.5, 2.0, 0.0], [1.0, 0.25, 0.0, 0.0]])  # (B, T)
    out = weighted_advantages(adv, w, sequence_level=False)
    assert out.shape == (2, 4)
    assert out.tolist() == [[1.0, 3.0, 4.0, 0.0], [-1.0, -0.25, 0.0, 0.0]]
    adv_bt = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0]])  # (B, T) advantages pass through as (B, T)
    assert weighted_advantages(adv_bt, w, sequence_level=False).tolist() == [[0.5, 3.0, 6.0, 0.0],
                                                                             [1.0, 0.25, 0.0, 0.0]]
    assert weighted_advantages(adv_bt, w, sequence_level=True).shape == (2, 4)  # a (B, T) advantage stays token-wise
    assert weighted_advantages(adv, None, sequence_level=False) is adv  # no weights: untouched


def test_weighted_advantages_sequence_level_keeps_one_value_per_sequence():
    adv = torch.tensor([2.0, -1.0])  # (B,)
    w = torch.tensor([[1.5, 1.5, 1.5, 0.0], [0.5, 0.5, 0.0, 0.0]])  # one weight per row, 0 on padding
    out = weighted_advantages(adv, w, sequence_level=True)
    assert out.shape == (2, 1) and out.tolist() == [[3.0], [-0.5]]
    bf16 = weighted_advantages(adv.bfloat16(), w, sequence_level=True)
    assert bf16.dtype == torch.bfloat16  # the advantage's dtype is kept


def test_zeroed_advantages_by_hand():
    """M2PO's trust-region mask: A * z per token, (B,) and (B, T) advantages alike; no mask leaves A untouched."""
    z = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])  # (B, T)
    assert zeroed_advantages(torch.tensor([2.0, -1.0]), z).tolist() == [[2.0, 0.0, 2.0], [-0.0, -1.0, -1.0]]
    adv_bt = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # (B, T)
    assert zeroed_advantages(adv_bt, z).tolist() == [[1.0, 0.0, 3.0], [0.0, 5.0, 6.0]]
    adv = torch.tensor([2.0, -1.0])
    assert zeroed_advantages(adv, None) is adv


def test_vespo_sampler_ratio_is_one_outside_the_kept_tokens():
    w = torch.tensor([[0.5, 1.5, 2.0, 0.0], [1.0, 0.25, 0.0, 0.0]], dtype=torch.bfloat16)
    out = vespo_sampler_ratio(w, KEEP)
    assert out.dtype == torch.float32
    assert out.tolist() == [[0.5, 1.0, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0]]


def test_safe_anchor_replaces_non_finite_and_masked_entries_only():
    anchor = torch.tensor([[-1.0, math.nan, -math.inf, -2.0]])
    fallback = torch.tensor([[-5.0, -6.0, -7.0, -8.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0]])
    out = safe_anchor(anchor, fallback, mask)
    # kept finite: itself; NaN/-inf on kept: fallback; masked: fallback
    assert out.tolist() == [[-1.0, -6.0, -7.0, -8.0]]
    assert not out.requires_grad


def test_rollout_usable_mask_drops_samples_with_a_non_finite_rollout_logprob():
    rollout = torch.tensor([[-1.0, math.nan, -1.0, 0.0], [-1.0, -2.0, math.inf, 0.0], [math.nan] * 4])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0]])  # row 1's inf sits on padding: harmless
    assert rollout_usable_mask(rollout, mask).tolist() == [[False] * 4, [True, True, False, False], [False] * 4]
    seen = torch.tensor([True, True, False])  # row 2 has no pi_rollout: it stays (trained uncorrected)
    assert rollout_usable_mask(rollout, mask, seen).tolist() == [[False] * 4, [True, True, False, False],
                                                                 [True, True, False, False]]


@pytest.mark.parametrize("bypass, policy_gradient, anchor, weighted", [
    (False, False, PI_OLD, True),       # decoupled: r = pi_theta / pi_old, A' = w A
    (True, False, PI_ROLLOUT, False),   # bypass PPO: r = pi_theta / pi_rollout already is rho
    (True, True, PI_THETA, True),       # bypass policy gradient: r = 1, -w A grad log pi_theta
])
def test_loss_anchor_by_mode(bypass, policy_gradient, anchor, weighted):
    assert loss_anchor(bypass, policy_gradient) == anchor
    assert weights_advantage(anchor) is weighted
    if not policy_gradient or bypass:  # the config's own view (policy gradient without bypass is refused there)
        cfg = RolloutCorrectionConfig(rollout_is="token", bypass_mode=bypass, use_policy_gradient=policy_gradient)
        assert cfg.loss_anchor == anchor and cfg.applies_is_weights is weighted


def test_finite_rows_mask_drops_a_row_with_any_non_finite_masked_value():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]])  # (4, 3)
    a = torch.tensor([[0.0, -1.0, float("nan")], [0.0, float("-inf"), 0.0], [0.0, 0.0, 0.0], [float("nan")] * 3])
    b = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [float("inf"), 0.0, 0.0], [0.0, 0.0, 0.0]])
    # row 0: NaN on padding only (kept); row 1: -inf in a; row 2: +inf in b; row 3: nothing masked
    assert finite_rows_mask(mask, a, b).int().tolist() == [[1, 1, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert finite_rows_mask(mask, b).int().tolist() == [[1, 1, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0]]


# ------------------------------------------------------------------ the one loss patch both trainers apply
W = torch.tensor([[0.5, 1.5, 2.0, 1.0], [1.0, 0.25, 1.0, 1.0]])  # (2, 4) IS weights
Z = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]])  # (2, 4) M2PO's trust-region mask: token (0, 2) zeroed
ROLL = torch.tensor([[-1.0, -2.0, float("nan"), -1.0], [-0.5, -0.5, -0.5, -0.5]])  # (2, 4) log pi_rollout
THETA = torch.tensor([[-1.1, -1.9, -3.0, -1.2], [-0.4, -0.6, -0.7, -0.8]])  # (2, 4) log pi_theta


@pytest.mark.parametrize("mode, vespo, weights, anchor, ratio", [
    (PI_ROLLOUT, False, None, "rollout", None),  # bypass PPO: r = pi_theta / pi_rollout already is rho
    (PI_THETA, False, "w", None, None),  # bypass PG: r = 1, w on A
    (PI_OLD, False, "w", "old", None),  # decoupled: pi_old anchors, w on A
    (PI_OLD, True, None, "old", "w"),  # VESPO: w as phi's sampler ratio, A unweighted
])
def test_mode_correction_by_mode(mode, vespo, weights, anchor, ratio):
    c = mode_correction(mode, KEEP, W, Z, rollout_anchor=ROLL, old_anchor=THETA, vespo=vespo)
    assert c.keep is KEEP and c.advantage_mask is Z  # in every mode
    assert c.is_weights is (W if weights else None)
    assert c.anchor is {"rollout": ROLL, "old": THETA, None: None}[anchor]
    if ratio:  # w on kept tokens, exactly 1 elsewhere
        assert c.sampler_ratio.tolist() == [[0.5, 1.0, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    else:
        assert c.sampler_ratio is None


def test_loss_patch_by_hand_on_rows_and_on_flat_terms():
    """A' = A * w * z and the anchor made safe on the kept tokens, for the synchronous trainer's (B,) advantages and
    the asynchronous trainer's (1, M) terms (the same values, laid out flat)."""
    adv = torch.tensor([2.0, -1.0])  # (B,)
    c = mode_correction(PI_ROLLOUT, KEEP, W, Z, rollout_anchor=ROLL, old_anchor=None)  # no w on A
    patch = loss_patch(adv, c, THETA, MASK * KEEP, sequence_level=False)
    assert patch.advantages.tolist() == [[2.0, 2.0, 0.0, 2.0], [-1.0, -1.0, -1.0, -1.0]]  # z only
    # kept (0, 0), (0, 2): rollout where finite; (0, 2) is NaN -> pi_theta; every other token -> pi_theta
    assert torch.equal(patch.anchor, torch.tensor([[-1.0, -1.9, -3.0, -1.2], [-0.4, -0.6, -0.7, -0.8]]))
    c = mode_correction(PI_THETA, KEEP, W, Z, rollout_anchor=ROLL, old_anchor=None)
    patch = loss_patch(adv, c, THETA, MASK * KEEP, sequence_level=False)
    assert patch.advantages.tolist() == [[1.0, 3.0, 0.0, 2.0], [-1.0, -0.25, -1.0, -1.0]]  # A * w * z
    assert patch.anchor is None  # TRL uses pi_theta detached
    flat = lambda t: t.reshape(1, -1)  # noqa: E731  (1, M): the asynchronous trainer's terms
    terms = mode_correction(PI_THETA, flat(KEEP), flat(W), flat(Z), rollout_anchor=flat(ROLL), old_anchor=None)
    adv_terms = adv.repeat_interleave(4).reshape(1, -1)  # (1, M) one advantage per term
    flat_patch = loss_patch(adv_terms, terms, flat(THETA), flat(KEEP), sequence_level=False)
    assert flat_patch.advantages.tolist() == [sum(patch.advantages.tolist(), [])]


def test_batch_correction_is_the_pipeline_then_the_mode_rule():
    """A bypass-PPO token-RS batch: keep from the pipeline's rejection (|log rho| > log 1.5 rejected), no weight on A,
    and the anchor pi_rollout; decoupled with a forward: pi_old anchors, w = min(rho, 2) on A."""
    train = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])  # (2, 3) log pi_train
    rollout = torch.tensor([[-1.0, -2.0, -1.1], [-2.0, -2.0, -1.0]])  # (2, 3) log rho = 0, 1, 0.1 / 0, 0, -1
    mask = torch.ones(2, 3)
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token",
                                  rollout_rs_threshold=1.5, rollout_rs_threshold_lower=1 / 1.5)
    c, stats = batch_correction(train, rollout, mask, cfg.params(), anchor_mode=PI_ROLLOUT, forward_anchor=False,
                                vespo=False, advantages=torch.tensor([1.0, -1.0]))
    assert c.keep.tolist() == [[1, 0, 1], [1, 1, 0]] and c.keep.dtype == mask.dtype
    assert c.is_weights is None and torch.equal(c.anchor, rollout)
    assert "mask.kept_tok_n" in stats.sums and float(stats.sums["mask.kept_tok_n"]) == 4.0
    c, _ = batch_correction(train, rollout, mask, cfg.params(), anchor_mode=PI_OLD, forward_anchor=True,
                            vespo=False, advantages=torch.tensor([1.0, -1.0]))
    assert c.anchor is train
    assert torch.allclose(c.is_weights, torch.tensor([[1.0, 2.0, math.exp(0.1)], [1.0, 1.0, math.exp(-1.0)]]))


# ------------------------------------------------------------------------------ policy losses: decoupled DPPO
from trl_rollout_corr.core.losses import (POLICY_LOSSES, PolicyLossTerms, policy_loss_advantages,  # noqa: E402
                                          policy_loss_terms, register_policy_loss)


def _ref_dppo_grad(theta, old, mask, adv, w, divergence, low, high, c):
    """Independent float64 reference (plain Python): verl's decoupled DPPO loss, token-mean over the mask,
    L = -sum_t A_t (1 - masked_t) sg(min(r_t, C)) w_t log pi_theta(a_t) / n, and its gradient in log pi_theta."""
    n = sum(int(m) for row in mask for m in row)
    grad, coef = [], []
    for b, row in enumerate(mask):
        grad.append([]), coef.append([])
        for t, m in enumerate(row):
            if not m:
                grad[b].append(0.0), coef[b].append(0.0)
                continue
            lt, lo, a = float(theta[b][t]), float(old[b][t]), float(adv[b])
            p, q = math.exp(min(lt, 0.0)), math.exp(min(lo, 0.0))
            if divergence == "binary_tv":
                cut = (a > 0 and p - q > high) or (a < 0 and p - q < -low)
            else:
                d = q * (math.log(q) - math.log(p)) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
                cut = (a > 0 and lt > lo and d > high) or (a < 0 and lt < lo and d > low)
            k = 0.0 if cut else min(math.exp(max(-20.0, min(20.0, lt - lo))), c)
            coef[b].append(k)
            grad[b].append(-a * k * float(w[b][t]) / n)
    return grad, coef


def _package_grad(theta, old, mask, adv, w, name, low, high, c, clip_eps=0.2):
    """The package's path: the policy loss's A'' into a TRL-style PPO-clip loss with anchor pi_theta detached."""
    theta = theta.clone().requires_grad_(True)  # (B, T)
    terms = policy_loss_terms(name, theta.detach(), old, mask.bool(), adv, low=low, high=high, clip_ratio_c=c)
    a2 = policy_loss_advantages(adv, terms, w)  # (B, T)
    r = torch.exp(theta - theta.detach())  # (B, T) = 1: TRL's ratio against its pi_theta-detached anchor
    per_token = -torch.min(r * a2, r.clamp(1 - clip_eps, 1 + clip_eps) * a2)  # (B, T) TRL's clip form
    per_token = torch.where(mask.bool(), per_token, 0.0)  # (B, T) TRL multiplies by the mask
    (per_token.sum() / mask.sum()).backward()
    return theta.grad, terms


def test_policy_loss_registry_has_dppo_and_refuses_unknown_and_duplicate_names():
    assert {"dppo_tv", "dppo_kl"} <= set(POLICY_LOSSES)
    with pytest.raises(ValueError, match="policy loss must be one of"):
        policy_loss_terms("ppo", torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool),
                          torch.ones(1), low=0.1, high=0.1, clip_ratio_c=2.0)
    with pytest.raises(ValueError, match="registered twice"):
        register_policy_loss("dppo_tv")(lambda *a, **k: None)


def test_decoupled_dppo_tv_hand_computed():
    # q = pi_old = 0.5 everywhere; p = pi_theta: 0.8 (+0.3), 0.6 (+0.1), 0.3 (-0.2), 0.45 (-0.05); delta = 0.15, C = 1.5
    p = torch.tensor([[0.8, 0.6, 0.3, 0.45]], dtype=torch.float64)
    theta, old = p.log(), torch.full_like(p, 0.5).log()
    valid = torch.ones_like(p, dtype=torch.bool)
    pos = policy_loss_terms("dppo_tv", theta, old, valid, torch.tensor([1.0]), low=0.15, high=0.15, clip_ratio_c=1.5)
    # A > 0: +0.3 leaves the region (masked); +0.1 stays (r = 1.2); falls are never masked (r = 0.6, 0.9)
    assert pos.masked.tolist() == [[True, False, False, False]]
    assert pos.coefficient[0].tolist() == pytest.approx([0.0, 1.2, 0.6, 0.9], abs=1e-12)
    neg = policy_loss_terms("dppo_tv", theta, old, valid, torch.tensor([-1.0]), low=0.15, high=0.15, clip_ratio_c=1.5)
    # A < 0: -0.2 leaves the region (masked); rises are never masked: r = 1.6 truncated to C = 1.5
    assert neg.masked.tolist() == [[False, False, True, False]]
    assert neg.coefficient[0].tolist() == pytest.approx([1.5, 1.2, 0.0, 0.9], abs=1e-12)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_decoupled_dppo_threshold_is_strict(name):
    """A token exactly at delta stays; one ulp below delta and it is masked (both signs)."""
    theta = torch.tensor([[math.log(0.7)], [math.log(0.2)]], dtype=torch.float64)  # (2, 1) rising, falling
    old = torch.tensor([[math.log(0.5)], [math.log(0.4)]], dtype=torch.float64)
    valid, adv = torch.ones(2, 1, dtype=torch.bool), torch.tensor([1.0, -1.0])
    from trl_rollout_corr.core.dppo import dppo_divergence
    d = dppo_divergence(theta, old, "binary_" + name[5:])  # (2, 1)
    at_high, at_low = float(d[0, 0].abs()), float(d[1, 0].abs())
    at = policy_loss_terms(name, theta, old, valid, adv, low=at_low, high=at_high, clip_ratio_c=10.0)
    assert at.masked.tolist() == [[False], [False]]
    below = policy_loss_terms(name, theta, old, valid, adv, low=math.nextafter(at_low, 0.0),
                              high=math.nextafter(at_high, 0.0), clip_ratio_c=10.0)
    assert below.masked.tolist() == [[True], [True]]
    assert below.coefficient.tolist() == [[0.0], [0.0]]


@pytest.mark.parametrize("name,low,high", [("dppo_tv", 0.1, 0.05), ("dppo_kl", 0.02, 0.01)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decoupled_dppo_gradient_matches_float64_reference(name, low, high, seed):
    """Random (B, T) = (6, 7) float32 log-probs, both advantage signs and A = 0, padding holding inf/NaN, one row
    whose every token is masked, IS weights on pi_old vs pi_rollout: the gradient through TRL's clip form with anchor
    pi_theta detached equals verl's loss's gradient, re-derived in float64 plain Python."""
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 7
    old = torch.rand(B, T, generator=g).clamp(0.02, 0.98).log().float()  # (B, T)
    theta = (old + 0.8 * torch.randn(B, T, generator=g)).clamp(max=0.0).float()  # (B, T)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    old[1, 5], old[1, 4], old[3, 6] = float("nan"), float("-inf"), float("inf")  # padding garbage (pi_old)
    adv = torch.tensor([1.3, -0.7, 0.0, 2.0, -1.1, 0.9], dtype=torch.float32)
    # row 5: every token rises far above pi_old with A > 0: all masked
    old[5] = math.log(0.05)
    theta[5] = math.log(0.9)
    w = (0.5 + torch.rand(B, T, generator=g)) * mask  # (B, T) IS weights, 0 on padding
    grad, terms = _package_grad(theta, old, mask, adv, w, name, low, high, c=2.0)
    ref_grad, ref_coef = _ref_dppo_grad(theta.tolist(), old.tolist(), mask.tolist(), adv.tolist(), w.tolist(),
                                        "binary_" + name[5:], low, high, 2.0)
    assert torch.isfinite(grad).all()
    assert terms.coefficient.flatten().tolist() == pytest.approx(sum(ref_coef, []), rel=1e-12, abs=1e-12)
    assert grad.double().flatten().tolist() == pytest.approx(sum(ref_grad, []), rel=1e-5, abs=1e-7)
    assert terms.masked[5].all() and grad[5].abs().sum() == 0  # the all-masked row has no gradient
    assert not terms.masked[mask == 0].any() and (grad[mask == 0] == 0).all()  # padding neither masked nor moved
    assert terms.masked.any() and (~terms.masked & (mask == 1)).any()  # the case exercises both outcomes


def test_policy_loss_advantages_shapes_and_detach():
    terms = PolicyLossTerms(torch.tensor([[0.5, 0.0], [2.0, 1.0]], dtype=torch.float64),
                            torch.tensor([[False, True], [False, False]]))
    adv = torch.tensor([2.0, -1.0], requires_grad=True)  # (B,)
    w = torch.tensor([[1.0, 1.0], [0.5, 3.0]], requires_grad=True)
    out = policy_loss_advantages(adv, terms, w)
    assert out.dtype == torch.float32 and out.shape == (2, 2)
    assert out.tolist() == [[1.0, 0.0], [-1.0, -3.0]]
    out.sum().backward()
    assert w.grad is None  # the weight is detached; A keeps its own graph as TRL's does
