"""DPPO's trust region (arXiv:2602.04879; core/dppo.py) against a float64 re-derivation written here.

The reference is per element in Python's ``math`` from the definitions of verl's ``dppo_tv`` / ``dppo_kl`` and
prime-rl's default loss: Binary-TV masks A > 0 tokens with p - q > high and A < 0 tokens with p - q < -low; Binary-KL
masks A > 0 tokens with p > q and KL(Bern(q) || Bern(p)) > high, A < 0 tokens with p < q and the KL > low. A masked
token's advantage is 0 and it stays in the count. Then the update of real training steps through TRL's trainer
against the float64 gradient of the field's loss, -(1 - masked) min(p/q, C) A grad log p, bypass and decoupled.
The same step at every micro-batch split and over two processes as over one, in both modes:
``tests/grpo/test_invariance.py`` (cases ``dppo_tv_bypass_dapo``, ``decoupled_dppo_tv_two_steps_dapo``, whose
two-process launch the other cases share).
"""

from __future__ import annotations

import math

import pytest
import torch

from trl_rollout_corr import RolloutCorrectionConfig as Cfg
from trl_rollout_corr.core import compute_rollout_correction_stats, finalize_stats
from trl_rollout_corr.core.criterion import TOK_N, StatFloats
from trl_rollout_corr.core.dppo import (DPPO, DPPO_MASKED_NEG_TOK_N, DPPO_MASKED_POS_TOK_N, DPPO_MASKED_TOK_N,
                                        DPPO_TOK_N, DPPO_VALUE_MAX, DPPO_VALUE_SUM, dppo_divergence, dppo_mask)
from trl_rollout_corr.core.stats import MAX, SUM
from trl_rollout_corr.core.stats import METRIC_PREFIX as P

EPS = 1e-8  # verl's, inside the binary KL's second log


def ref_divergence(lp: float, lq: float, divergence: str) -> float:
    p, q = math.exp(min(lp, 0.0)), math.exp(min(lq, 0.0))
    if divergence == "binary_tv":
        return p - q
    return q * (min(lq, 0.0) - min(lp, 0.0)) + (1 - q) * math.log((1 - q + EPS) / (1 - p + EPS))


def ref_masked(lp: float, lq: float, a: float, divergence: str, low: float, high: float) -> bool:
    d = ref_divergence(lp, lq, divergence)
    if divergence == "binary_tv":
        return (a > 0 and d > high) or (a < 0 and d < -low)
    return (a > 0 and lp > lq and d > high) or (a < 0 and lp < lq and d > low)


# ---------------------------------------------------------------- hand cases, at and around the thresholds
def test_binary_tv_at_and_around_its_thresholds():
    """p = 1 (log 0), q = 0.5 (log 0.5): Delta = +0.5 exactly; and the mirror, Delta = -0.5. The bound is strict: at
    delta = 0.5 nothing is masked, just below it the side the advantage pushes is."""
    lp = torch.tensor([[0.0, math.log(0.5), 0.0, math.log(0.5)]], dtype=torch.float64)  # (1, 4)
    lq = torch.tensor([[math.log(0.5), 0.0, math.log(0.5), 0.0]], dtype=torch.float64)  # (1, 4)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)  # (1, 4)
    valid = torch.ones(1, 4, dtype=torch.bool)
    at, _, _, value = dppo_mask(lp, lq, valid, adv, "binary_tv", 0.5, 0.5)
    assert at.tolist() == [[False, False, False, False]]
    assert value.tolist() == [[0.5, 0.5, 0.5, 0.5]]
    below, pos, neg, _ = dppo_mask(lp, lq, valid, adv, "binary_tv", 0.5 - 1e-12, 0.5 - 1e-12)
    # +0.5 with A > 0: masked; -0.5 with A < 0: masked; +0.5 with A < 0 and -0.5 with A > 0: the update the
    # advantage asks for moves back into the region, kept
    assert below.tolist() == [[True, True, False, False]]
    assert pos.tolist() == [[True, False, False, True]] and neg.tolist() == [[False, True, True, False]]
    only_high, _, _, _ = dppo_mask(lp, lq, valid, adv, "binary_tv", 0.6, 0.4)  # low and high are separate
    assert only_high.tolist() == [[True, False, False, False]]


def test_binary_kl_at_and_around_its_thresholds():
    """q = 0.5, p = 0.8: D = 0.5 log(0.5/0.8) + 0.5 log((0.5 + 1e-8)/(0.2 + 1e-8)); the mask needs D > delta and p
    moving the advantage's way."""
    lq, lp = math.log(0.5), math.log(0.8)
    d = 0.5 * (lq - lp) + 0.5 * math.log((0.5 + EPS) / (0.2 + EPS))
    # by hand: 0.5 ln 0.625 + 0.5 ln 2.5 = 0.5 ln 1.5625 = 0.2231435513, and the eps's first-order shift
    # 0.5 (1e-8 / 0.5 - 1e-8 / 0.2) = -1.5e-8
    assert d == pytest.approx(0.2231435513 - 1.5e-8, abs=1e-10)
    lps = torch.tensor([[lp, lp, lq]], dtype=torch.float64)  # (1, 3) rising, rising, falling (p = 0.5 vs q = 0.8)
    lqs = torch.tensor([[lq, lq, lp]], dtype=torch.float64)  # (1, 3)
    adv = torch.tensor([1.0, -1.0, -1.0], dtype=torch.float64)[None]  # (1, 3)
    valid = torch.ones(1, 3, dtype=torch.bool)
    # the falling token: KL(Bern(0.8) || Bern(0.5)) = 0.8 ln 1.6 + 0.2 ln((0.2 + 1e-8) / (0.5 + 1e-8)), smaller
    d_fall = 0.8 * math.log(1.6) + 0.2 * math.log((0.2 + EPS) / (0.5 + EPS))
    assert d_fall == pytest.approx(0.1927448, abs=1e-7)
    above, _, _, value = dppo_mask(lps, lqs, valid, adv, "binary_kl", d_fall * (1 - 1e-9), d * (1 - 1e-9))
    assert above.tolist() == [[True, False, True]]  # rising with A > 0, falling with A < 0
    assert value[0].tolist() == pytest.approx([d, d, d_fall], rel=1e-12)
    below, _, _, _ = dppo_mask(lps, lqs, valid, adv, "binary_kl", d_fall * (1 + 1e-9), d * (1 + 1e-9))
    assert below.tolist() == [[False, False, False]]
    swapped, _, _, _ = dppo_mask(lps, lqs, valid, adv, "binary_kl", d * (1 - 1e-9), d_fall * (1 - 1e-9))
    assert swapped.tolist() == [[True, False, False]]  # low bounds the A < 0 side only, high the A > 0 side


def test_a_log_prob_above_zero_is_read_as_probability_one():
    """Float noise above log 1 (+1e-6) is p = 1 exactly. TV: 1 - 0.5 = +0.5 and 0.5 - 1 = -0.5. KL with p = 1,
    q = 0.5: 0.5 (ln 0.5 - 0) + 0.5 ln((0.5 + 1e-8) / 1e-8); with q = 1, p = 0.5: 1 (0 - ln 0.5) + 0 = ln 2. Read
    as exp(1e-6) > 1 instead, the TV moves by 1e-6 and the KL's 1 - p + 1e-8 < 0 gives NaN."""
    lp = torch.tensor([[1e-6, math.log(0.5)]], dtype=torch.float64)  # (1, 2)
    lq = torch.tensor([[math.log(0.5), 1e-6]], dtype=torch.float64)  # (1, 2)
    assert dppo_divergence(lp, lq, "binary_tv")[0].tolist() == pytest.approx([0.5, -0.5], abs=1e-15)
    kl_p1 = 0.5 * math.log(0.5) + 0.5 * math.log((0.5 + EPS) / EPS)  # = 8.5171932 by hand (0.5 ln(2.5e7 + 0.5))
    assert kl_p1 == pytest.approx(8.5171932, abs=1e-7)
    assert dppo_divergence(lp, lq, "binary_kl")[0].tolist() == pytest.approx([kl_p1, math.log(2)], rel=1e-12)


def test_an_unknown_divergence_is_refused_by_the_pure_function_too():
    lp = torch.zeros(1, 2, dtype=torch.float64)  # (1, 2)
    with pytest.raises(ValueError, match=r"rollout_dppo must be one of \('binary_tv', 'binary_kl'\) or None, got 'tv'"):
        dppo_divergence(lp, lp, "tv")


# ---------------------------------------------------------------- the pipeline against the reference
def batch(seed: int, scale: float):
    g = torch.Generator().manual_seed(seed)
    lq = torch.log(torch.rand(6, 9, generator=g, dtype=torch.float64) * 0.95 + 0.02)  # (B, T) log q in (log .02, 0)
    lp = (lq + scale * torch.randn(6, 9, generator=g, dtype=torch.float64)).clamp(max=0.0)  # (B, T)
    mask = (torch.arange(9)[None] < torch.tensor([[9], [6], [3], [9], [0], [5]])).float()  # (B, T); row 4 all padding
    adv_seq = torch.tensor([1.0, -1.0, 0.0, -0.5, 1.0, 2.0], dtype=torch.float64)  # (B,) both signs and 0
    adv_tok = torch.randn(6, 9, generator=g, dtype=torch.float64)  # (B, T)
    return lp, lq, mask, adv_seq, adv_tok


@pytest.mark.parametrize("divergence,low,high", [("binary_tv", 0.15, 0.15), ("binary_tv", 0.05, 0.3),
                                                 ("binary_kl", 0.05, 0.05), ("binary_kl", 0.2, 0.01)])
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_advantage_mask_and_metrics_are_the_reference_s(divergence, low, high, per_token, seed):
    lp, lq, mask, adv_seq, adv_tok = batch(seed, scale=0.6)
    lp[5, 2] = float("nan")  # a non-finite log-prob: its whole row leaves the batch (nothing masked there)
    adv = adv_tok if per_token else adv_seq
    result = compute_rollout_correction_stats(lp, lq, mask, rollout_is=None, rollout_dppo=divergence,
                                              rollout_dppo_mask_low=low, rollout_dppo_mask_high=high,
                                              advantages=adv)
    lp32, lq32 = lp.float().double().tolist(), lq.float().double().tolist()  # the pipeline reads float32
    valid = [[bool(mask[i, t] > 0) and i != 5 for t in range(9)] for i in range(6)]
    a = [[float(adv[i, t] if per_token else adv[i]) for t in range(9)] for i in range(6)]
    masked = [[valid[i][t] and ref_masked(lp32[i][t], lq32[i][t], a[i][t], divergence, low, high)
               for t in range(9)] for i in range(6)]
    assert result.advantage_mask.tolist() == [[0.0 if m else 1.0 for m in row] for row in masked]
    assert torch.equal(result.modified_response_mask, mask * torch.tensor([[float(i != 5)] for i in range(6)]))
    n = sum(map(sum, valid))
    size = [abs(ref_divergence(lp32[i][t], lq32[i][t], divergence)) for i in range(6) for t in range(9) if valid[i][t]]
    metrics = finalize_stats(result.stats)
    pos = sum(masked[i][t] and a[i][t] > 0 for i in range(6) for t in range(9))
    neg = sum(masked[i][t] and a[i][t] < 0 for i in range(6) for t in range(9))
    assert 0 < pos + neg < n  # the mask bites, and not everywhere
    assert metrics[P + "rollout_dppo_masked_fraction"] == pytest.approx((pos + neg) / n, abs=1e-12)
    assert metrics[P + "rollout_dppo_masked_fraction_pos"] == pytest.approx(pos / n, abs=1e-12)
    assert metrics[P + "rollout_dppo_masked_fraction_neg"] == pytest.approx(neg / n, abs=1e-12)
    assert metrics[P + "rollout_dppo_divergence_mean"] == pytest.approx(sum(size) / n, rel=1e-9)
    assert metrics[P + "rollout_dppo_divergence_max"] == pytest.approx(max(size), rel=1e-9)


def test_an_all_padding_batch_masks_nothing_and_reports_zeros():
    z = torch.zeros(2, 4)
    result = compute_rollout_correction_stats(z, z, z, rollout_is=None, rollout_dppo="binary_tv",
                                              advantages=torch.tensor([1.0, -1.0]))
    assert result.advantage_mask.tolist() == [[1.0] * 4] * 2
    metrics = finalize_stats(result.stats)
    assert [metrics[P + f"rollout_dppo_{m}"] for m in ("masked_fraction", "divergence_mean", "divergence_max")] == [
        0.0, 0.0, 0.0]


def test_dppo_combines_with_a_rejection_and_the_is_weights():
    """With token RS on too, the kept mask is RS's alone and the advantage mask DPPO's alone (neither overwrites
    the other); the IS weights are min(rho, C) on every valid token."""
    lp, lq, mask, adv, _ = batch(0, scale=0.6)
    both = compute_rollout_correction_stats(lp, lq, mask, rollout_is="token", rollout_is_threshold=1.5,
                                            rollout_rs="token", rollout_rs_threshold=2.0, rollout_dppo="binary_tv",
                                            advantages=adv)
    rs_only = compute_rollout_correction_stats(lp, lq, mask, rollout_is="token", rollout_is_threshold=1.5,
                                               rollout_rs="token", rollout_rs_threshold=2.0, advantages=adv)
    dppo_only = compute_rollout_correction_stats(lp, lq, mask, rollout_dppo="binary_tv", advantages=adv)
    assert torch.equal(both.modified_response_mask, rs_only.modified_response_mask)
    assert torch.equal(both.advantage_mask, dppo_only.advantage_mask)
    assert torch.equal(both.is_weights, rs_only.is_weights)
    assert not torch.equal(both.modified_response_mask, mask) and both.advantage_mask.min() == 0


def test_a_call_without_advantages_is_refused():
    lp, lq, mask, _, _ = batch(0, scale=0.2)
    with pytest.raises(ValueError, match="rollout_dppo='binary_kl' needs the advantages"):
        compute_rollout_correction_stats(lp, lq, mask, rollout_dppo="binary_kl")
    # the fix: which sign goes with which direction, and the shapes to pass
    with pytest.raises(ValueError, match=r"the advantage pushes: A > 0 with .*: pass advantages=\(B,\) or \(B, T\)"):
        compute_rollout_correction_stats(lp, lq, mask, rollout_dppo="binary_tv")
    with pytest.raises(ValueError, match="rollout_dppo must be one of"):
        compute_rollout_correction_stats(lp, lq, mask, rollout_dppo="tv", advantages=torch.ones(6))


# ---------------------------------------------------------------- config: checks in the criterion's file
@pytest.mark.parametrize("fields,match", [
    (dict(rollout_dppo="tv"), "rollout_dppo must be 'binary_tv'"),
    (dict(rollout_dppo="binary_tv", rollout_dppo_mask_high=1.5),
     r"rollout_dppo_mask_high must be in \(0, 1\] \(a probability difference; e\.g\. 0\.15, verl's DPPO example"),
    (dict(rollout_dppo="binary_tv", rollout_dppo_mask_low=0.0), r"rollout_dppo_mask_low must be in \(0, 1\]"),
    (dict(rollout_dppo="binary_tv", rollout_dppo_mask_low=float("nan")), "rollout_dppo_mask_low must be"),
    (dict(rollout_dppo="binary_kl", rollout_dppo_mask_high=float("inf")),
     r"rollout_dppo_mask_high must be a finite number > 0 \(a KL in nats; e\.g\. 0\.05, verl's DPPO example"),
    (dict(rollout_dppo="binary_kl", rollout_dppo_mask_low=-0.1), "rollout_dppo_mask_low must be a finite number"),
    (dict(rollout_dppo="binary_kl", rollout_dppo_mask_low="0.1"), "rollout_dppo_mask_low must be"),
    (dict(rollout_dppo_mask_low=0.1), "rollout_dppo_mask_high / rollout_dppo_clip_ratio_c are set but"),
    (dict(rollout_dppo_mask_high=0.1), r"set rollout_dppo \('binary_tv' or 'binary_kl'\) or unset them\."),
])
def test_bad_fields_are_refused_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        Cfg(rollout_is=None, bypass_mode=True, **fields)


def test_the_baseline_exclusion_and_a_bypass_clip_ratio_c_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="rollout_rs_exclude_from_baseline=True with rollout_dppo='binary_kl'"):
        Cfg.dppo_kl_bypass(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_exclude_from_baseline=True)
    # the reason's start and the fix (either field's setting)
    with pytest.raises(ValueError, match=r"DPPO's mask is decided on the sign of the advantages, .* Use one of them "
                                         r"\(rollout_rs_exclude_from_baseline=False, or rollout_dppo=None\)\."):
        Cfg.dppo_tv_bypass(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_exclude_from_baseline=True)
    with pytest.raises(ValueError, match="rollout_dppo_clip_ratio_c=2.0 with bypass_mode=True"):
        Cfg.dppo_tv_bypass(rollout_dppo_clip_ratio_c=2.0)
    with pytest.raises(ValueError, match=r"weight min\(pi_theta/pi_rollout, C\) with rollout_is_threshold\. Unset "
                                         r"rollout_dppo_clip_ratio_c, or set bypass_mode=False \(decoupled DPPO\)\."):
        Cfg.dppo_kl_bypass(rollout_dppo_clip_ratio_c=2.0)
    with pytest.raises(ValueError, match="rollout_dppo_clip_ratio_c are set but rollout_dppo is None"):
        Cfg(rollout_dppo_clip_ratio_c=2.0)


@pytest.mark.parametrize("c", [0.0, -1.0, float("nan"), float("inf"), "2", True])
def test_decoupled_clip_ratio_c_must_be_finite_positive(c):
    with pytest.raises(ValueError, match="rollout_dppo_clip_ratio_c must be a finite number > 0"):
        Cfg(rollout_dppo="binary_tv", rollout_dppo_clip_ratio_c=c)


def test_decoupled_mode_is_the_policy_loss_not_a_pipeline_criterion():
    cfg = Cfg(rollout_dppo="binary_kl")  # decoupled: C defaults to verl's DPPO example's clip_ratio_c
    assert cfg.policy_loss == ("dppo_kl", 0.05, 0.05, 1e4)
    assert cfg.params().rollout_dppo is None and cfg.params().rollout_dppo_mask_low is None
    assert Cfg.dppo_kl_bypass().policy_loss is None and Cfg.dppo_kl_bypass().params().rollout_dppo == "binary_kl"
    tv, kl = Cfg.decoupled_dppo_tv(), Cfg.decoupled_dppo_kl()
    for cfg in (tv, kl):  # decoupled PPO's token TIS (pi_old vs pi_rollout) under the DPPO policy loss
        assert (cfg.bypass_mode, cfg.use_policy_gradient, cfg.rollout_is, cfg.rollout_is_threshold) == (
            False, False, "token", 2.0)
    assert tv.policy_loss == ("dppo_tv", 0.15, 0.15, 1e4) and kl.policy_loss == ("dppo_kl", 0.05, 0.05, 1e4)
    assert Cfg.from_json_string(tv.to_json_string()) == tv


def test_decoupled_stats_match_a_hand_count():
    from trl_rollout_corr.core.dppo import decoupled_dppo_stats
    from trl_rollout_corr.core.stats import RolloutStats  # noqa: F401
    p = torch.tensor([[0.8, 0.6, 0.3, 0.45], [0.2, 0.9, 0.5, 0.5]], dtype=torch.float64)
    q = torch.full_like(p, 0.5)
    valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
    st = decoupled_dppo_stats(p.log(), q.log(), valid, torch.tensor([1.0, -1.0]), "binary_tv", 0.15, 0.15)
    # row 0 (A > 0): +0.3 masked; row 1 (A < 0): -0.3 masked, +0.4 not (rises are kept for A < 0)
    assert {k.split(".")[-1]: float(v) for k, v in st.sums.items()} == pytest.approx(dict(
        tok_n=6.0, dppo_masked_tok_n=2.0, masked_pos_tok_n=1.0, masked_neg_tok_n=1.0,
        value_sum=0.3 + 0.1 + 0.2 + 0.05 + 0.3 + 0.4))
    assert float(next(iter(st.maxes.values()))) == pytest.approx(0.4)


def finalize(sums: dict, value_max: float) -> dict[str, float]:
    """The criterion's metrics of hand-built reduced statistics (``sums``: declared name -> value)."""
    floats = {SUM + name: float(v) for name, v in sums.items()}
    return DPPO.finalize(StatFloats({**floats, MAX + DPPO_VALUE_MAX: value_max}))


def test_finalize_on_hand_built_statistics():
    """Shares over the token count: decoupled mode's own (DPPO_TOK_N, the loss's tokens) wherever present, even beside
    the pipeline's TOK_N; bypass mode's TOK_N otherwise. Nothing where DPPO did not run."""
    counts = {DPPO_MASKED_TOK_N: 3, DPPO_MASKED_POS_TOK_N: 2, DPPO_MASKED_NEG_TOK_N: 1, DPPO_VALUE_SUM: 1.2}
    names = [P + f"rollout_dppo_{m}" for m in ("masked_fraction", "masked_fraction_pos", "masked_fraction_neg",
                                               "divergence_mean", "divergence_max")]
    expected = [3 / 8, 2 / 8, 1 / 8, 1.2 / 8, 0.5]  # by hand, over 8 tokens
    decoupled = finalize({DPPO_TOK_N: 8, **counts}, 0.5)
    assert [decoupled[n] for n in names] == pytest.approx(expected, rel=1e-15)
    both = finalize({TOK_N: 5, DPPO_TOK_N: 8, **counts}, 0.5)  # the pipeline's count of another batch beside it
    assert [both[n] for n in names] == pytest.approx(expected, rel=1e-15)
    bypass = finalize({TOK_N: 6, **counts}, 0.5)
    assert [bypass[n] for n in names] == pytest.approx([3 / 6, 2 / 6, 1 / 6, 1.2 / 6, 0.5], rel=1e-15)
    empty = finalize({DPPO_TOK_N: 0, **{k: 0 for k in counts}}, -math.inf)  # no token: zeros, not -inf
    assert [empty[n] for n in names] == [0.0] * 5
    assert DPPO.finalize(StatFloats({SUM + TOK_N: 6.0})) == {}  # DPPO off: the pipeline ran, DPPO's counts absent
    assert DPPO.finalize(StatFloats({})) == {}


def test_the_bounds_edges_are_accepted():
    """delta = 1 is the top of binary_tv's (0, 1]; C only needs to be finite > 0 (0.5 truncates every ratio above
    it, an unusual but valid setting)."""
    tv = Cfg(rollout_dppo="binary_tv", bypass_mode=True, rollout_is=None, rollout_dppo_mask_high=1.0,
             rollout_dppo_mask_low=1.0)
    assert (tv.rollout_dppo_mask_low, tv.rollout_dppo_mask_high) == (1.0, 1.0)
    assert Cfg(rollout_dppo="binary_tv", rollout_dppo_clip_ratio_c=0.5).policy_loss == ("dppo_tv", 0.15, 0.15, 0.5)
    assert Cfg(rollout_dppo="binary_kl", rollout_dppo_mask_high=3.0, rollout_dppo_clip_ratio_c=1).policy_loss == (
        "dppo_kl", 0.05, 3.0, 1.0)  # a KL bound above 1 is fine


def test_unset_thresholds_are_the_divergence_s_defaults_written_back():
    tv = Cfg(rollout_dppo="binary_tv", bypass_mode=True, rollout_dppo_mask_high=0.3)
    kl = Cfg(rollout_dppo="binary_kl", bypass_mode=True)
    assert (tv.rollout_dppo_mask_low, tv.rollout_dppo_mask_high) == (0.15, 0.3)  # verl's DPPO example: 0.15 TV
    assert (kl.rollout_dppo_mask_low, kl.rollout_dppo_mask_high) == (0.05, 0.05)  # and 0.05 KL
    assert tv.zeroes_advantages and not tv.masks_tokens
    assert Cfg.from_json_string(tv.to_json_string()) == tv


def test_the_presets_are_the_field_s_settings():
    tv, kl, prime = Cfg.dppo_tv_bypass(), Cfg.dppo_kl_bypass(), Cfg.dppo_tv_prime_rl()
    for cfg in (tv, kl, prime):  # the policy-gradient loss with token IS: -stopgrad(min(p/q, C)) A log p
        assert (cfg.bypass_mode, cfg.use_policy_gradient, cfg.rollout_is) == (True, True, "token")
    assert (tv.rollout_dppo, tv.rollout_dppo_mask_low, tv.rollout_dppo_mask_high, tv.rollout_is_threshold) == (
        "binary_tv", 0.15, 0.15, 1e4)
    assert (kl.rollout_dppo, kl.rollout_dppo_mask_low, kl.rollout_dppo_mask_high, kl.rollout_is_threshold) == (
        "binary_kl", 0.05, 0.05, 1e4)
    assert (prime.rollout_dppo, prime.rollout_dppo_mask_low, prime.rollout_dppo_mask_high) == ("binary_tv", 0.2, 0.2)
    assert prime.rollout_is_threshold == math.inf
    assert Cfg.from_yaml(prime.to_yaml()) == prime and Cfg.from_json_string(prime.to_json_string()) == prime


def test_none_on_the_flat_field_switches_dppo_off_over_a_preset(tmp_path):
    from trl_rollout_corr import RolloutCorrGRPOConfig

    args = RolloutCorrGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                 per_device_train_batch_size=4, num_generations=4,
                                 rollout_correction_preset="dppo_kl_bypass", rollout_dppo="none")
    rc = args.rollout_correction
    assert (rc.rollout_dppo, rc.rollout_dppo_mask_low, rc.rollout_dppo_mask_high) == (None, None, None)
    args = RolloutCorrGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                 per_device_train_batch_size=4, num_generations=4,
                                 rollout_correction_preset="dppo_tv_bypass", rollout_dppo_mask_high="0.25")
    assert (args.rollout_correction.rollout_dppo_mask_low, args.rollout_correction.rollout_dppo_mask_high) == (
        0.15, 0.25)


# ---------------------------------------------------------------- the update through TRL's trainer
# (mode, divergence, delta, shape): each shape once per mode, each divergence in each mode once where the batch lands in
# one optimizer step and once where pi_theta moves within it (the mask re-derived at the later step). The divergence is
# core code (the reference cases above), the shape the trainer's plumbing: their cross product adds runs, no path.
TRAINER_CASES = [
    ("bypass", "binary_tv", 0.01, "one_micro_batch"),
    ("bypass", "binary_kl", 0.002, "accumulation_4"),
    ("bypass", "binary_tv", 0.01, "steps_per_generation_2"),
    ("bypass", "binary_kl", 0.002, "num_iterations_2"),
    ("decoupled", "binary_kl", 0.0002, "one_micro_batch"),
    ("decoupled", "binary_tv", 0.01, "accumulation_4"),
    ("decoupled", "binary_kl", 0.0002, "steps_per_generation_2"),
    ("decoupled", "binary_tv", 0.01, "num_iterations_2"),
]
POLICY_NAMES = {"binary_tv": "dppo_tv", "binary_kl": "dppo_kl"}


@pytest.mark.parametrize("mode,divergence,delta,shape", TRAINER_CASES)
def test_each_step_matches_the_float64_gradient_of_the_field_s_loss(tmp_path, mode, divergence, delta, shape):
    """Two SGD steps of the real trainer (dapo's normalizer), C = 1.5 so the truncation bites too: the update is -lr
    times the float64 gradient of

        bypass (prime-rl):  (1 / N_gen) sum_t -(1 - masked_t) min(p_t / q_t, 1.5) A_t log p_t
        decoupled (verl):   (1 / N_gen) sum_t -(1 - masked_t) min(p_t / o_t, 1.5) min(o_t / q_t, 2) A_t log p_t

    (all but log p_t detached) with p = pi_theta at the micro-batch's optimizer step, o = pi_old (the policy that
    generated the batch), q = pi_rollout (decoupled: under token TIS, C = 2), and the mask re-derived here on p vs q
    (bypass) or p vs o (decoupled) at each micro-batch's step: the policy moves between steps. The logged masked
    shares (all, by sign) are the re-derived counts over each step's tokens. Decoupled with the batch in one optimizer
    step, pi_old = pi_theta at every loss: nothing to mask, r = 1."""
    from tests.grpo.test_gradients import LR, SHAPES, forward64, load, train
    from trl_rollout_corr.testing.toy_task import build_model

    decoupled = mode == "decoupled"
    fields = dict(rollout_dppo=divergence, rollout_dppo_mask_low=delta, rollout_dppo_mask_high=delta)
    case = (dict(preset="decoupled_dppo_tv", rollout_dppo_clip_ratio_c=1.5, **fields) if decoupled
            else dict(preset="dppo_tv_bypass", rollout_is_threshold=1.5, **fields))
    trainer, recorder, _, final = train(tmp_path, build_model(hidden_size=32), case, SHAPES[shape])
    cfg = trainer.rollout_correction
    assert cfg.bypass_mode is not decoupled
    assert cfg.policy_loss[0] == POLICY_NAMES[divergence] if decoupled else cfg.rollout_dppo == divergence
    model = build_model(hidden_size=32).double()
    ga, spg = trainer.args.gradient_accumulation_steps, trainer.args.steps_per_generation
    after = recorder.params_at_step[1:] + [final]
    counts = []  # per step: (masked, masked with A > 0, masked with A < 0, valid)
    for step in range(2):
        theta = recorder.params_at_step[step]
        grads, count = None, torch.zeros(4, dtype=torch.long)
        for mb_step, gen_index, mb in recorder.micro_batches:
            if mb_step != step:
                continue
            generation = recorder.generations[gen_index]
            n_gen = generation["completion_mask"].sum()  # nothing rejected: every token of the generation batch
            mask = mb["completion_mask"].bool()  # (B, T)
            sampling = mb["sampling_per_token_logps"].double()  # (B, T) log q
            if decoupled:
                load(model, generation["params"])  # the policy that generated the batch
                with torch.no_grad():
                    old = forward64(model, mb)  # (B, T) log pi_old
            load(model, theta)
            for p in model.parameters():
                p.grad = None
            logps = forward64(model, mb)  # (B, T) with grad
            adv = mb["advantages"].double()  # (B,)
            anchor = old if decoupled else sampling  # (B, T) what the mask and the ratio compare pi_theta with
            lp32, la32 = logps.detach().float().double(), anchor.float().double()  # what the trainer's pipeline reads
            masked = torch.tensor([[bool(mask[i, t]) and ref_masked(
                float(lp32[i, t]), float(la32[i, t]), float(adv[i]), divergence, delta, delta)
                for t in range(mask.shape[1])] for i in range(mask.shape[0])])  # (B, T)
            count += torch.tensor([int(masked.sum()), int((masked & (adv[:, None] > 0)).sum()),
                                   int((masked & (adv[:, None] < 0)).sum()), int(mask.sum())])
            w = torch.exp((logps.detach() - anchor).clamp(-20, 20)).clamp(max=1.5)  # (B, T) min(p/q or p/o, 1.5)
            if decoupled:
                w = w * torch.exp((old - sampling).clamp(-20, 20)).clamp(max=2.0)  # (B, T) times min(o/q, 2)
            per_token = -(~masked).double() * w * adv[:, None] * logps  # (B, T)
            loss = (per_token * mask.double()).sum() / (n_gen * ga / spg)
            loss.backward()
            step_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            grads = step_grads if grads is None else {n: grads[n] + g for n, g in step_grads.items()}
        update = torch.cat([(after[step][n] - theta[n]).flatten().double() for n in grads])
        expected = torch.cat([(-LR * g).flatten() for g in grads.values()])
        assert update.abs().max() > 1e-6
        assert ((update - expected).norm() / expected.norm()).item() <= 1e-4, (mode, divergence, shape, step)
        counts.append(count.tolist())
    logged = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logged) == 2
    for log, (n_masked, n_pos, n_neg, n_valid) in zip(logged, counts):
        assert [log[P + f"rollout_dppo_masked_fraction{s}"] for s in ("", "_pos", "_neg")] == pytest.approx(
            [n_masked / n_valid, n_pos / n_valid, n_neg / n_valid], abs=1e-9), (mode, shape)
        assert all(math.isfinite(log[P + f"rollout_dppo_divergence_{m}"]) for m in ("mean", "max"))
    n_masked, n_valid = sum(c[0] for c in counts), sum(c[3] for c in counts)
    if decoupled and shape in ("one_micro_batch", "accumulation_4"):  # pi_old = pi_theta at every loss
        assert n_masked == 0
    else:  # the mask bites on this data, and not everywhere
        assert 0 < n_masked < n_valid

