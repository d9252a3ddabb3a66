"""M2PO's final algorithm (Zheng, Zhao & Chen, arXiv:2510.01161, ICLR 2026, Algorithm 1): ``rollout_m2_scope=
"trust_region"``, against hand-computed cases and an independent float64 re-derivation.

Only the tokens on the active side of PPO's trust region are candidates (A > 0 with rho > 1, A < 0 with rho < 1);
the largest v = (log rho)^2 among them are masked until the mean v of the remaining candidates is <= tau; a masked
token's advantage is set to 0 and the token stays in the loss's token count (the original denominator).
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from trl_rollout_corr import RolloutCorrectionConfig as Cfg
from trl_rollout_corr import compute_rollout_correction_and_rejection_mask as correct
from trl_rollout_corr.core import compute_rollout_correction_stats
from trl_rollout_corr.core.second_moment import trust_region_second_moment_mask


def reference_zeroed(log_ratio, valid, adv, tau):
    """Algorithm 1 by hand (float64 lists): the candidates, sorted; drop the largest while the mean of the rest > tau
    (the ties of the smallest dropped value go with it)."""
    rows, cols = len(valid), len(valid[0])
    cand = {(i, t): min(max(log_ratio[i][t], -20.0), 20.0) ** 2 for i in range(rows) for t in range(cols)
            if valid[i][t] and ((adv[i] > 0 and log_ratio[i][t] > 0) or (adv[i] < 0 and log_ratio[i][t] < 0))}
    ordered = sorted(cand.values())
    k = len(ordered)
    while k > 0 and sum(ordered[:k]) / k > tau:
        k -= 1
    cut = ordered[k] if k < len(ordered) else math.inf
    return [[(i, t) in cand and cand[(i, t)] >= cut for t in range(cols)] for i in range(rows)]


def batch(seed, n=6, t=7, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(n, t, generator=g, dtype=torch.float64) * spread  # (B, T)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    valid = torch.arange(t)[None, :] < lengths[:, None]  # (B, T)
    adv = torch.randn(n, generator=g, dtype=torch.float64)  # (B,)
    adv[0] = 0.0  # a zero advantage is on neither side
    return log_ratio, valid, adv


def test_hand_computed_case():
    """rho: row 0 (A = +1) 1.5, 0.5, 1; row 1 (A = -1) 1.2, 0.9, 1. Candidates: rho = 1.5 (v = ln(1.5)^2 = 0.1644)
    and rho = 0.9 (v = ln(0.9)^2 = 0.0111); their mean 0.0878 > 0.04, so 1.5 goes, leaving 0.0111 <= 0.04. rho = 0.5
    has the largest v of all (0.4805) but A > 0 with rho < 1 is not the active side: it stays, as does everything
    else. The all-token mask (AReaL's) would take 0.5 and 1.5 instead, out of the count."""
    old = torch.zeros(2, 3, dtype=torch.float64)
    rollout = -torch.log(torch.tensor([[1.5, 0.5, 1.0], [1.2, 0.9, 1.0]], dtype=torch.float64))  # log rho = -rollout
    mask = torch.ones(2, 3, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    w, m, met = correct(old, rollout, mask, advantages=adv, **Cfg.m2po().pipeline_kwargs())
    assert w.tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]]  # the advantage multiplier
    assert m.tolist() == mask.tolist()  # nothing leaves the count
    v = [math.log(x) ** 2 for x in (1.5, 0.5, 1.0, 1.2, 0.9, 1.0)]
    assert met["rollout_corr/rejected_token_fraction"] == 0.0
    assert met["rollout_corr/rollout_m2_masked_fraction"] == pytest.approx(1 / 6)
    assert met["rollout_corr/rollout_m2_trust_region_fraction"] == pytest.approx(2 / 6)
    assert met["rollout_corr/rollout_m2_trust_region"] == pytest.approx((v[0] + v[4]) / 2)
    assert met["rollout_corr/rollout_m2_trust_region_kept"] == pytest.approx(v[4])
    assert met["rollout_corr/rollout_m2"] == pytest.approx(sum(v) / 6)
    assert met["rollout_corr/rollout_m2_kept"] == pytest.approx((sum(v) - v[0]) / 5)
    _, m_all, _ = correct(old, rollout, mask, rollout_m2_threshold=0.04)  # AReaL's: any token, rejected
    assert m_all.tolist() == [[0.0, 0.0, 1.0], [1.0, 1.0, 1.0]]


@pytest.mark.parametrize("tau", [1e-4, 0.01, 0.04, 0.2, 10.0])
def test_matches_algorithm_1_re_derived(tau):
    zeroed_total = 0
    for seed in range(5):
        log_ratio, valid, adv = batch(seed)
        zeroed, region, _ = trust_region_second_moment_mask(log_ratio, valid, adv, tau)
        assert zeroed.tolist() == reference_zeroed(log_ratio.tolist(), valid.tolist(), adv.tolist(), tau)
        assert not (zeroed & ~region).any() and not region[0].any()  # only candidates; A = 0 is no candidate
        rest = log_ratio[region & ~zeroed] ** 2
        assert rest.numel() == 0 or rest.mean() <= tau + 1e-12
        zeroed_total += int(zeroed.sum())
    assert (zeroed_total == 0) == (tau == 10.0)


def test_token_advantages_and_global_across_processes():
    """(B, T) advantages work as (B,) broadcast; two halves with a summing reduce give the whole batch's mask."""
    log_ratio, valid, adv = batch(11, n=8)
    whole, _, _ = trust_region_second_moment_mask(log_ratio, valid, adv, 0.03)
    per_token, _, _ = trust_region_second_moment_mask(log_ratio, valid, adv[:, None].expand(8, 7), 0.03)
    assert torch.equal(whole, per_token) and whole.any()
    halves = [(log_ratio[:4], valid[:4], adv[:4]), (log_ratio[4:], valid[4:], adv[4:])]
    results, barrier, box = {}, threading.Barrier(2), {}

    def rank(r):
        def reduce_fn(stat, op):
            box[r] = stat
            barrier.wait()
            out = stat + box[1 - r] if op == "sum" else torch.maximum(stat, box[1 - r])
            barrier.wait()
            return out
        results[r] = trust_region_second_moment_mask(*halves[r], 0.03, reduce_fn)[0]

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert torch.cat([results[0], results[1]]).tolist() == whole.tolist()


def test_in_the_pipeline_with_token_is_and_samples_without_pi_rollout():
    log_ratio, valid, adv = batch(5)
    old = -torch.rand(6, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64) - 0.1
    rollout = old - log_ratio
    seen = torch.tensor([True, True, False, True, True, True])
    cfg = Cfg.m2po(rollout_is="token", tau=0.02)
    result = compute_rollout_correction_stats(old, rollout, valid.double(), cfg.params(), advantages=adv,
                                              rollout_seen=seen)
    corrected = valid & seen[:, None]
    want = reference_zeroed(log_ratio.tolist(), corrected.tolist(), adv.tolist(), 0.02)
    assert (result.advantage_mask == 0).tolist() == want and any(map(any, want))
    assert torch.equal(result.modified_response_mask, valid.double())  # no token leaves the count
    assert result.is_weights is not None  # the token IS weight is computed as without the mask
    assert (result.advantage_mask[2] == 1).all()  # a sample without pi_rollout is left alone


def test_config_validation_and_preset():
    c = Cfg.from_preset("m2po")
    assert (c.rollout_is, c.rollout_m2_threshold, c.rollout_m2_scope, c.bypass_mode) == (None, 0.04, "trust_region",
                                                                                         False)
    assert c.zeroes_advantages and c.is_enabled and not c.masks_tokens  # a weight: the kept-token count is unchanged
    assert Cfg(rollout_m2_threshold=0.04).masks_tokens and not Cfg(rollout_m2_threshold=0.04).zeroes_advantages
    assert Cfg.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="rollout_m2_scope must be 'all'.*or 'trust_region'"):
        Cfg(rollout_m2_threshold=0.04, rollout_m2_scope="quadrants")
    with pytest.raises(ValueError, match="rollout_m2_scope='trust_region' is set but rollout_m2_threshold is None"):
        Cfg(rollout_m2_scope="trust_region")
    old = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="rollout_m2_scope='trust_region' needs the advantages"):
        compute_rollout_correction_stats(old, old, torch.ones(1, 2), c.params())


def test_the_trainer_config_carries_the_scope(tmp_path):
    from trl_rollout_corr import RolloutCorrGRPOConfig

    args = RolloutCorrGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                 rollout_correction_preset="m2po", rollout_m2_threshold=0.1)
    assert args.rollout_correction == Cfg.m2po(tau=0.1) and args.rollout_m2_scope == "trust_region"
    args.rollout_m2_threshold = "none"  # switching the mask off drops the preset's scope with it
    assert args.rollout_correction.rollout_m2_threshold is None and args.rollout_correction.rollout_m2_scope == "all"


@pytest.mark.parametrize("bypass", [False, True])
def test_the_trainer_hands_trl_the_zeroed_advantages(tmp_path, bypass):
    """Our loss and gradients == TRL's own ``_compute_loss`` (dapo) fed A_t * z_t, z = 0 on the tokens Algorithm 1
    takes (re-derived here from the batch's pi_train, pi_rollout and A) and the FULL token count as normalizer."""
    from trl import GRPOTrainer

    from tests.support.trainer_utils import make_trainer
    from trl_rollout_corr.rollout.emulated import EmulatedRolloutEngine

    extra = dict(bypass_mode=True) if bypass else dict(pi_old_source="forward")
    trainer, _ = make_trainer(tmp_path, preset="m2po", rollout_m2_threshold=1e-4, max_steps=1, loss_type="dapo",
                              rollout_sampler=EmulatedRolloutEngine("wq3"), **extra)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer inside train()
    batch = trainer._generate_and_score_completions(trainer.train_dataset.select(range(8)).to_list())
    mask = batch["completion_mask"]  # (B, T)
    sampling = batch["sampling_per_token_logps"]  # (B, T)
    with torch.no_grad():
        train = trainer._get_per_token_logps_and_entropies(  # pi_old (decoupled) = pi_theta (bypass) here
            trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], mask], 1), mask.size(1))[0] if bypass else batch["old_per_token_logps"]
    want = reference_zeroed((train - sampling).double().tolist(), mask.bool().tolist(),
                            batch["advantages"].double().tolist(), 1e-4)
    assert any(map(any, want)), "the mask must take some token for this test to mean anything"
    if not bypass:
        assert (batch["rc_advantage_mask"] == 0).tolist() == want

    def loss_and_grad(fn, inputs):
        trainer.model.zero_grad()
        loss = fn(inputs)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]

    ours = loss_and_grad(lambda b: trainer.compute_loss(trainer.model, b), batch)
    trl_batch = {k: v for k, v in batch.items() if not k.startswith("rc_")}
    trl_batch["advantages"] = batch["advantages"][:, None] * (1.0 - torch.tensor(want, dtype=torch.float32))
    trl_batch["num_items_in_batch"] = mask.sum()  # the original denominator: every valid token
    if bypass:
        trl_batch["old_per_token_logps"] = sampling  # bypass PPO: TRL's ratio is pi_theta / pi_rollout
    theirs = loss_and_grad(lambda b: GRPOTrainer._compute_loss(trainer, trainer.model, b), trl_batch)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-7)
    for a, b in zip(ours[1], theirs[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
