"""experiments/mismatch_train.py: the smoke run writes its files, the pre-registered family is what the code says,
TRL's path really runs TRL's loss (checked on one batch against TRL's sequence_mask formula computed by hand), and
the psum task's reward."""

from __future__ import annotations

import csv
import json
import math
import os

import pytest
import torch

import experiments.mismatch_train as mt
from trl_rollout_corr.testing import psum_task


def test_psum_reward_is_the_correct_prefix():
    prompt = "psum 3 1 4 1 5 ="
    assert psum_task.psum_target(prompt) == ["3", "4", "8", "9", "4"]
    rewards = psum_task.psum_reward([prompt] * 4, ["3 4 8 9 4", "3 4 7 9 4", "5 4 8 9 4", "3 4"])
    assert rewards == [1.0, 2 / 5, 0.0, 2 / 5]  # the first wrong digit ends the credit


def test_the_preregistered_family_is_what_the_code_says():
    assert mt.REFERENCE == "M1"
    assert mt.FAMILY == (("S1", "M0"), ("S1", "M2"), ("S1", "M3"), ("S1", "M4"),
                         ("S2", "M0"), ("S2", "M2"), ("S2", "M3"), ("S2", "M4"))
    assert mt.TOST_MARGIN == 0.02 and mt.COST_SCENARIO == "S0" and mt.HELD_OUT_SEEDS == (10, 11, 12, 13, 14)
    # TRL's default and token_truncate run by TRL's own trainer; the others by this package's
    assert mt.METHODS["M1"] == ("trl", dict(vllm_importance_sampling_mode="sequence_mask",
                                            vllm_importance_sampling_clip_max=3.0))
    assert mt.METHODS["M2"][0] == "trl" and mt.METHODS["M2"][1]["vllm_importance_sampling_mode"] == "token_truncate"
    assert {m: k for m, (k, _) in mt.METHODS.items()} == dict(on_policy="ours", M0="ours", M1="trl", M2="trl",
                                                              M3="ours", M4="ours", M1p="ours")
    assert mt.METHODS["M1p"][1] == dict(rollout_correction_preset="trl_default")  # TRL's default, this package's code
    assert mt.STEPS_PER_GENERATION >= 2  # the PPO clip against pi_old is live
    # pre-registration 2 (experiments C, L, H), fixed before their first run
    assert mt.CONFIRM_SEEDS == tuple(range(10, 30)) and mt.CONFIRM_FAMILY == (("S2", "M3"), ("S2", "M2"))
    assert mt.LONG_FAMILY == (("S2L", "M3"), ("S2L", "M2")) and mt.LONG_SEEDS == tuple(range(30, 40))
    assert not set(mt.LONG_SEEDS) & set(mt.CONFIRM_SEEDS) and not set(mt.CONFIRM_SEEDS) & set(range(10))
    assert mt.S2L_DIGITS + 1 >= 100  # T >= 100: T*KL >= 1 is reachable at a per-token KL <= 1e-2
    # pre-registration 3 (experiment P, S3 truncated sampling), fixed before its first run (the pilot included)
    assert mt.P_FAMILY == (("S3", "M1p"), ("S3", "M3"), ("S3", "M2"), ("S3", "M0"))
    assert mt.P_SEEDS == tuple(range(40, 50)) and mt.P_HELD_OUT == tuple(range(50, 55))
    assert not set(mt.P_SEEDS + mt.P_HELD_OUT) & set(mt.LONG_SEEDS + mt.CONFIRM_SEEDS + tuple(range(10)))
    from trl_rollout_corr.config.correction import RolloutCorrectionConfig

    # M4 is IcePop as the field defines it: token weight pi_old / pi_rollout zeroed outside [0.5, 5], kept in the count
    assert RolloutCorrectionConfig.from_preset(mt.METHODS["M4"][1]["rollout_correction_preset"]) == \
        RolloutCorrectionConfig(rollout_is="token", rollout_is_bound="mask", rollout_is_threshold=5.0,
                                rollout_is_threshold_lower=0.5)


def _tiny(tmp_path, method, noise):
    from datasets import Dataset

    size = dict(mt.SMOKE)
    tok = psum_task.build_tokenizer()

    def factory():
        return psum_task.build_model(size["hidden"], size["layers"], seed=0, num_heads=size["heads"],
                                     n_digits=size["n_digits"])

    engine = mt.Engine("S1", 0, tok, factory, size["n_digits"], noise=noise)
    dataset = Dataset.from_dict({"prompt": psum_task.psum_prompts(64, size["n_digits"], seed=0)})
    fields = mt.grpo_fields(str(tmp_path), 2, size["n_digits"], 1e-3, 0)
    return mt.build_trainer(method, factory(), tok, engine, dataset, fields, []), engine


def _per_token_logps(model, batch):
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].shape[1]
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -width - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"][..., None]).squeeze(-1)


def test_trl_path_runs_trls_sequence_mask_loss(tmp_path):
    """M1's trainer is TRL's GRPOTrainer; its loss on one micro-batch equals TRL's sequence_mask formula by hand:
    w = exp(sum_t (log pi_old - log pi_engine)) per sequence, zeroed above 3; loss = sum_t -min(r A, clip(r) A) w m / N
    (dapo, N = the generation batch's token count / steps_per_generation), r = pi_theta / pi_old."""
    from trl import GRPOTrainer

    from tests.grpo.test_trl_equivalence import one_micro_batch, perturb_

    trainer, engine = _tiny(tmp_path, "M1", noise=(1.5, 0.3, 8.0, 1e-2))
    assert type(trainer) is GRPOTrainer  # TRL's class, unmodified
    rows = [{"prompt": p} for p in psum_task.psum_prompts(mt.GEN_PROMPTS, mt.SMOKE["n_digits"], seed=5)
            for _ in range(mt.NUM_GENERATIONS)]
    batch = one_micro_batch(trainer, rows)
    assert engine.log and engine.log[0]["kl_token"] > 0  # the engine sampled it
    model = trainer.model
    with torch.no_grad():
        old = _per_token_logps(model, batch)  # pi_old: the policy at generation, computed here independently
    m = batch["completion_mask"].float()
    sampling = batch["sampling_per_token_logps"]
    w = torch.exp(((old - sampling) * m).sum(-1))
    w = torch.where(w > 3.0, torch.zeros_like(w), w)  # TRL's default: masked above C=3, no lower bound
    assert (w == 0).any() and ((w > 0) & (w < 3)).any(), w  # the mask bites on this batch, and not everywhere
    torch.testing.assert_close(batch["importance_sampling_ratio"].squeeze(-1), w, rtol=1e-4, atol=1e-6)
    # an untrained tiny policy earns no reward, so every advantage is 0: give the batch varied advantages (the loss
    # reads them from the batch like any other field)
    batch["advantages"] = torch.linspace(-1.5, 1.5, len(batch["advantages"]))[torch.randperm(len(w))]
    perturb_(model)
    model.zero_grad()
    loss = trainer.compute_loss(model, batch)
    logp = _per_token_logps(model, batch)
    r = torch.exp(logp - old)
    a = batch["advantages"][:, None]
    per_token = -torch.minimum(r * a, torch.clamp(r, 1 - 0.2, 1 + 0.2) * a) * w[:, None]
    n = batch["num_items_in_batch"] / mt.STEPS_PER_GENERATION
    expected = (per_token * m).sum() / n
    assert loss.item() != 0.0
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-4, atol=1e-6)


def test_the_engine_returns_its_own_logprobs(tmp_path):
    """S1's engine samples from the perturbed logits and returns their log-probs (not the policy's): the per-token
    KL it logs is positive, and with no noise it returns the policy's log-probs (S0)."""
    trainer, engine = _tiny(tmp_path, "M0", noise=(0.0, 0.0, 0.0, 1e-2))
    prompts = psum_task.psum_prompts(2, mt.SMOKE["n_digits"], seed=3)
    out = engine(prompts, trainer)
    batch_ids = torch.tensor([p + c for p, c in zip(out["prompt_ids"], out["completion_ids"])
                              if len(c) == len(out["completion_ids"][0])])
    with torch.no_grad():
        logits = trainer.model(input_ids=batch_ids).logits.float()
    p_len = len(out["prompt_ids"][0])
    width = len(out["completion_ids"][0])
    lp = torch.log_softmax(logits[:, p_len - 1: p_len - 1 + width], -1).gather(
        -1, batch_ids[:, p_len:, None]).squeeze(-1)
    same = [lps for c, lps in zip(out["completion_ids"], out["logprobs"]) if len(c) == width]
    torch.testing.assert_close(lp, torch.tensor(same), rtol=1e-4, atol=1e-5)
    assert engine.log[-1]["kl_token"] == pytest.approx(0.0, abs=1e-5)


def test_s3_engine_returns_vllms_processed_logprobs_and_the_exact_kl(tmp_path):
    """S3's engine samples the policy truncated at top_p and returns log p - log M over the kept tokens: checked
    against transformers' own TopPLogitsWarper in float64 (an independent implementation of the nucleus), and its
    logged per-token KL(engine || policy) equals the mean of -log M over the completion tokens."""
    from datasets import Dataset
    from transformers.generation.logits_process import TopPLogitsWarper

    size = dict(mt.SMOKE)
    tok = psum_task.build_tokenizer()

    def factory():
        return psum_task.build_model(size["hidden"], size["layers"], seed=0, num_heads=size["heads"],
                                     n_digits=size["n_digits"])

    engine = mt.Engine("S3", 0, tok, factory, size["n_digits"])
    dataset = Dataset.from_dict({"prompt": psum_task.psum_prompts(64, size["n_digits"], seed=0)})
    fields = mt.grpo_fields(str(tmp_path), 2, size["n_digits"], 1e-3, 0, top_p=mt.S3_TOP_P)
    trainer = mt.build_trainer("M0", factory(), tok, engine, dataset, fields, [])
    assert trainer.args.top_p == mt.S3_TOP_P
    prompts = psum_task.psum_prompts(6, size["n_digits"], seed=3)
    out = engine(prompts, trainer)
    warper = TopPLogitsWarper(top_p=mt.S3_TOP_P)
    neg_log_kept, n_tokens = 0.0, 0
    for p_ids, c_ids, lps in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
        ids = torch.tensor([p_ids + c_ids])
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits[0, len(p_ids) - 1: len(p_ids) - 1 + len(c_ids)].double()
        full = torch.log_softmax(logits, -1)  # (T, V)
        kept = torch.log_softmax(warper(None, logits.clone()), -1)  # (T, V), -inf outside the nucleus
        ref = kept.gather(-1, torch.tensor(c_ids)[:, None]).squeeze(-1)  # (T,)
        torch.testing.assert_close(torch.tensor(lps, dtype=torch.float64), ref, rtol=0, atol=1e-4)
        log_m = torch.logsumexp(full.masked_fill(torch.isinf(kept), float("-inf")), -1)  # log M per position  # (T,)
        neg_log_kept += float(-log_m.sum())
        n_tokens += len(c_ids)
    assert neg_log_kept / n_tokens > 1e-3  # the truncation removes mass: the check below is not 0 == 0
    assert engine.log[-1]["kl_token"] == pytest.approx(neg_log_kept / n_tokens, rel=1e-3)


def test_smoke_run_writes_its_files(tmp_path):
    out = str(tmp_path / "smoke")
    mt.main(["--smoke", "--out", out, "--scenarios", "S1", "--methods", "M1", "--seeds", "0-1"])
    runs = sorted(os.listdir(os.path.join(out, "runs")))
    assert runs == ["S1__M1__seed0.json", "S1__M1__seed1.json", "all__on_policy__seed0.json",
                    "all__on_policy__seed1.json"]
    with open(os.path.join(out, "results.csv")) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and all(math.isfinite(float(r["score"])) for r in rows)
    assert {r["trainer"] for r in rows if r["method"] == "M1"} == {"trl"}
    assert all(float(r["kl_token"]) > 0 for r in rows if r["method"] == "M1")  # S1's engine differs from the policy
    text = open(os.path.join(out, "analysis.md")).read()
    assert "pre-registered family" in text and "| S1 | M1 |" in text
    assert os.path.exists(os.path.join(out, "mismatch_train.png"))


def _fake_runs(scores: dict) -> list[dict]:
    """Run records as run_one writes them, with only what the analysis reads."""
    runs = []
    for (scenario, method), values in scores.items():
        for seed, score in enumerate(values):
            runs.append(dict(scenario=scenario, method=method, seed=seed, score=score, kl_token=0.05, t_kl=2.0,
                             engine_reward=0.5, collapsed=False))
    return runs


def test_the_analysis_picks_only_a_holm_significant_method_where_the_mismatch_costs():
    """Ten seeds; in S1 on_policy beats M0 on every seed (the scenario counts) and M3 beats M1 on every seed: the
    exact sign-flip p of 10 positive differences is 2 / 2**10, Holm over the 8-row family multiplies the smallest by
    8 (0.015625); S2 costs nothing (on_policy = M0 + alternating +-0.01), so its rows cannot give a candidate."""
    base = [0.70, 0.72, 0.68, 0.75, 0.71, 0.69, 0.73, 0.74, 0.70, 0.72]
    wiggle = [0.01 * (-1) ** i for i in range(10)]
    shift = [0.05 + 0.001 * i for i in range(10)]
    scores = {("all", "on_policy"): [b + 0.1 for b in base]}
    for method in ("M0", "M1", "M2", "M4"):
        scores[("S1", method)] = [b + (0.002 * i if method == "M2" else 0) for i, b in enumerate(base)]
        scores[("S2", method)] = [b + 0.1 + w for b, w in zip(base, wiggle)]
    scores[("S1", "M3")] = [b + s for b, s in zip(base, shift)]
    scores[("S2", "M3")] = [b + 0.1 - w for b, w in zip(base, wiggle)]
    text, result = mt.analyse(_fake_runs(scores), list(range(10)))
    assert result["gap"]["S1"]["counts"] and not result["gap"]["S2"]["counts"]
    rows = {(r["scenario"], r["method"]): r for r in result["family"]}
    assert len(rows) == 8
    m3 = rows[("S1", "M3")]
    assert m3["p_sign_flip"] == pytest.approx(2 / 2 ** 10)
    assert m3["p_sign_flip_holm"] == pytest.approx(8 * 2 / 2 ** 10)
    assert m3["diff"] == pytest.approx(sum(shift) / 10)
    assert m3["gap_closed"] == pytest.approx(sum(shift) / 10 / 0.1)  # (M3 - M0) / (on_policy - M0), M0 = M1 here
    assert result["candidate"] == {"scenario": "S1", "method": "M3", "diff": pytest.approx(sum(shift) / 10)}
    assert "**Candidate**: M3 in S1" in text
    # the same data with S1's gap removed: nothing counts, so there is no candidate
    scores[("all", "on_policy")] = list(scores[("S1", "M0")])
    _, result = mt.analyse(_fake_runs(scores), list(range(10)))
    assert not result["gap"]["S1"]["counts"] and result["candidate"] is None


def _family_runs(scores: dict, pool: str = "all") -> list[dict]:
    runs = _fake_runs(scores)
    for r in runs:
        if r["method"] == "on_policy":
            r["pool"] = pool
    return runs


def test_the_confirmation_holm_over_two_hand_computed():
    """Experiment C's family {M3 - M1, M2 - M1}: M3 beats M1 on all 10 seeds (exact sign-flip p = 2 / 2**10; Holm
    over 2 doubles the smallest: 4 / 2**10) and is confirmed; M2's differences alternate +-0.01 around 0 (sign-flip
    p = 1: Holm keeps it at 1), not confirmed. The gap was established on earlier seeds (rule (a)) and on_policy / M0
    did not run here, so (a) holds and no gap closed is computed."""
    base = [0.70, 0.72, 0.68, 0.75, 0.71, 0.69, 0.73, 0.74, 0.70, 0.72]
    shift = [0.05, 0.01, 0.09, 0.03, 0.07, 0.02, 0.08, 0.04, 0.06, 0.05]
    scores = {("S2", "M1"): base, ("S2", "M3"): [b + s for b, s in zip(base, shift)],
              ("S2", "M2"): [b + 0.01 * (-1) ** i for i, b in enumerate(base)]}
    text, result = mt.analyse_family(_family_runs(scores), list(range(10)), "S2", mt.CONFIRM_FAMILY, "C",
                                     established=mt.C_GAP_SEEDS_0_9)
    rows = {r["method"]: r for r in result["family"]}
    assert rows["M3"]["p_sign_flip"] == pytest.approx(2 / 2 ** 10)
    assert rows["M3"]["p_sign_flip_holm"] == pytest.approx(2 * 2 / 2 ** 10)
    assert rows["M2"]["p_sign_flip"] == pytest.approx(1.0) and rows["M2"]["p_sign_flip_holm"] == pytest.approx(1.0)
    assert rows["M3"]["diff"] == pytest.approx(sum(shift) / 10)
    # paired t of M3's differences by hand: mean 0.05, sum of squared deviations 0.0060 -> sd sqrt(0.006 / 9)
    sd = math.sqrt(0.0060 / 9)
    from scipy import stats as sst

    p_t = 2 * sst.t.sf(0.05 / (sd / math.sqrt(10)), 9)
    assert 1e-5 < p_t < 1e-3
    assert rows["M3"]["p"] == pytest.approx(p_t, rel=1e-6) and rows["M3"]["p_holm"] == pytest.approx(2 * p_t, rel=1e-6)
    assert result["counts"] and result["confirmed"] == ["M3"] and result["gap_closed"] == []
    assert "M3 CONFIRMED above TRL's default in S2" in text
    # the gap re-checked on all seeds and not significant: (a) fails and nothing is confirmed
    scores[("all", "on_policy")] = base
    scores[("S2", "M0")] = [b + 0.01 * (-1) ** i for i, b in enumerate(base)]
    _, result = mt.analyse_family(_family_runs(scores), list(range(10)), "S2", mt.CONFIRM_FAMILY, "C",
                                  established=mt.C_GAP_SEEDS_0_9)
    assert not result["counts"] and result["confirmed"] == []


def test_the_long_scenario_needs_its_own_gap_and_its_own_on_policy():
    """L: on_policy runs of the 48-digit pool never stand in for S2L's (another length); without S2L's own gap nothing
    is confirmed; with it (on_policy above M0 on every seed) the same M3 rows are confirmed and the gap closed is
    (M3 - M0) / (on_policy - M0) = 0.05 / 0.1 on every seed."""
    base = [0.50, 0.52, 0.48, 0.55, 0.51, 0.49, 0.53, 0.54, 0.50, 0.52]
    scores = {("S2L", "M0"): base, ("S2L", "M1"): base, ("S2L", "M3"): [b + 0.05 for b in base],
              ("S2L", "M2"): [b + 0.01 * (-1) ** i for i, b in enumerate(base)],
              ("all", "on_policy"): [b + 0.1 for b in base]}
    table = mt.score_table(_family_runs(scores))
    assert ("S2L", "on_policy") not in table and ("S0", "on_policy") in table
    _, result = mt.analyse_family(_family_runs(scores), list(range(10)), "S2L", mt.LONG_FAMILY, "L")
    assert not result["counts"] and result["confirmed"] == []
    long_pool = _family_runs({("S2L", "on_policy"): [b + 0.1 + 0.001 * (i % 2) for i, b in enumerate(base)]},
                             pool="S2L")
    runs = _family_runs({k: v for k, v in scores.items() if k[0] != "all"}) + long_pool
    _, result = mt.analyse_family(runs, list(range(10)), "S2L", mt.LONG_FAMILY, "L")
    assert result["counts"] and result["confirmed"] == ["M3"]
    gc = {g["method"]: g for g in result["gap_closed"]}
    assert gc["M3"]["estimate"] == pytest.approx(0.05 / (0.1 + 0.0005))  # sum(M3 - M0) / sum(on_policy - M0)


def test_hurt_summary_and_the_separation_rule():
    """A run's metric mean / max over its logged steps (steps without the key skipped; none -> NaN); the separation
    rule: every costly run's mean strictly beyond every healthy run's."""
    from trl_rollout_corr.core.metric_names import metric

    logs = [{metric("grad_share_pinned"): 0.1, metric("t_kl_mean"): 2.0}, {metric("grad_share_pinned"): 0.3},
            {"loss": 1.0}]
    h = mt.hurt_summary(logs)
    assert h["grad_share_pinned_mean"] == pytest.approx(0.2) and h["grad_share_pinned_max"] == pytest.approx(0.3)
    assert h["t_kl_mean_mean"] == 2.0 and math.isnan(h["grad_share_masked_mean"])

    def run(scenario, value):
        out = dict(scenario=scenario, method="M3", seed=0, score=0.5, kl_token=0.01, t_kl=1.0, collapsed=False)
        out.update({f"{m}_{agg}": value for m in mt.HURT_METRICS for agg in ("mean", "max")})
        return out

    _, res = mt.hurt_table([run("S0", 0.0), run("S1", 0.2), run("S2", 0.3), run("S2L", 0.5)])
    assert res["separation"]["M3/grad_share_pinned"]["separates"]
    assert res["separation"]["M3/grad_share_pinned"]["healthy"] == (0.0, 0.2, 2)
    _, res = mt.hurt_table([run("S0", 0.0), run("S1", 0.4), run("S2", 0.3), run("S2L", 0.5)])
    assert not res["separation"]["M3/grad_share_pinned"]["separates"]  # 0.3 lies inside the healthy [0, 0.4]


def test_smoke_long_scenario_writes_hurt_columns(tmp_path):
    """S2L at smoke size: its own base model and length (long_digits), its own on_policy run, and the package
    trainer's "does it hurt?" metrics in the CSV."""
    out = str(tmp_path / "smoke")
    mt.main(["--smoke", "--out", out, "--scenarios", "S2L", "--methods", "M3", "--seeds", "0",
             "--experiment", "L"])
    assert sorted(os.listdir(os.path.join(out, "runs"))) == ["S2L__M3__seed0.json", "S2L__on_policy__seed0.json"]
    assert os.path.exists(os.path.join(out, "base", f"base_n{mt.SMOKE['long_digits']}.pt"))
    with open(os.path.join(out, "results.csv")) as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert {r["n_digits"] for r in rows.values()} == {str(mt.SMOKE["long_digits"])}
    assert math.isfinite(float(rows["M3"]["grad_share_pinned_mean"]))
    assert float(rows["M3"]["t_kl_mean_max"]) >= float(rows["M3"]["t_kl_mean_mean"]) >= 0
    text = open(os.path.join(out, "analysis.md")).read()
    assert "Experiment L" in text and "does it hurt?" in text


def test_package_vs_trl_is_paired_by_seed():
    """M1p - M1 per scenario on the seeds both ran: equal runs give exactly 0; one seed 0.03 below gives a mean of
    -0.01 over 3 seeds and a largest |diff| of 0.03 (a seed only one of them ran is left out)."""
    def runs(bump):
        out = [dict(scenario="S2", method=m, seed=s, score=0.5 + 0.01 * s + (bump if m == "M1p" and s == 1 else 0),
                    kl_token=0.01, t_kl=0.5, collapsed=False) for m in ("M1", "M1p") for s in range(3)]
        return out + [dict(scenario="S2", method="M1p", seed=-1, score=0.9, kl_token=0.01, t_kl=0.5, collapsed=False)]

    _, rows = mt.package_vs_trl(runs(0.0))
    assert rows[0]["n"] == 3 and rows[0]["diff"] == 0.0 and rows[0]["max_abs"] == 0.0
    _, rows = mt.package_vs_trl(runs(-0.03))
    assert rows[0]["diff"] == pytest.approx(-0.01) and rows[0]["max_abs"] == pytest.approx(0.03)


def test_the_costly_set_is_where_the_gap_counts():
    """H's costly scenarios: S2 (on_policy above M0 by 0.1 on all 10 seeds: sign-flip p 2 / 2**10) counts; S2L (its
    own on_policy pool, differences alternating +-0.01) does not."""
    base = [0.70, 0.72, 0.68, 0.75, 0.71, 0.69, 0.73, 0.74, 0.70, 0.72]
    runs = _family_runs({("all", "on_policy"): [b + 0.1 + 0.001 * i for i, b in enumerate(base)], ("S2", "M0"): base,
                         ("S2L", "M0"): base})
    runs += _family_runs({("S2L", "on_policy"): [b + 0.01 * (-1) ** i for i, b in enumerate(base)]}, pool="S2L")
    assert mt.costly_scenarios(runs) == ("S2",)


def test_gpu_size_is_qwen25_05b_shape_counted_by_hand():
    """--size gpu builds Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, tied
    embeddings) over the GPU vocabulary: the parameter count equals the hand count of that architecture (built on the
    meta device: no weights allocated)."""
    size = {**mt.SMOKE, **mt.GPU_SIZE, "device": "meta"}
    with torch.device("meta"):
        model = mt.task_model(size, size["n_digits"])
    h, layers, ff, v, kv = 896, 24, 4864, mt.GPU_VOCAB, 2 * 64  # 2 KV heads of head_dim 896 / 14 = 64
    attention = (h * h + h) + 2 * (h * kv + kv) + h * h  # q (bias), k and v (bias), o (no bias)
    per_layer = attention + 3 * h * ff + 2 * h  # + gate, up, down; two RMSNorms
    assert sum(p.numel() for p in model.parameters()) == layers * per_layer + v * h + h  # tied head, final norm
    assert model.config.tie_word_embeddings and model.config.max_position_embeddings == 2 * size["n_digits"] + 8
    assert mt.GPU_SIZE["bf16"] and mt.GPU_SIZE["device"] == "cuda" and mt.GPU_SIZE["n_digits"] + 1 == 512
    assert len(mt.task_tokenizer(size)) == mt.GPU_VOCAB  # the tokenizer covers every id the model can sample


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA")
def test_device_cuda_without_cuda_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        mt.main(["--size", "gpu", "--scenarios", "S3", "--methods", "M0", "--seeds", "40", "--out", "unused"])
    assert "--device cuda" in capsys.readouterr().err


def test_bf16_sampling_is_the_autocast_forward(monkeypatch):
    """At the GPU size the engine samples under bf16 autocast, as TRL's bf16=True trains: the sampled tokens'
    log-probs equal an independent bf16-autocast forward of the same sequence (and differ from the fp32 one)."""
    model = psum_task.build_model(32, 1, seed=0, num_heads=2, n_digits=6).eval()
    ids = torch.tensor([psum_task.build_tokenizer().convert_tokens_to_ids(psum_task.psum_prompts(1, 6)[0].split())])
    monkeypatch.setattr(mt, "BF16", True)
    completions, logps, _, _ = mt.sample(model, ids, 7, torch.Generator().manual_seed(0))
    full = torch.tensor([ids[0].tolist() + completions[0]])
    width = len(completions[0])
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(input_ids=full).logits
        high = model(input_ids=full).logits
    pick = full[0, ids.shape[1]:, None]

    def lp(logits):
        return torch.log_softmax(logits[0, ids.shape[1] - 1: ids.shape[1] - 1 + width].float(), -1).gather(
            -1, pick).squeeze(-1)

    torch.testing.assert_close(torch.tensor(logps[0]), lp(low), rtol=0, atol=2e-2)
    assert (torch.tensor(logps[0]) - lp(high)).abs().max() > 1e-4  # really the bf16 forward, not the fp32 one


def test_smoke_target_regime_scenario_has_its_own_length_lr_and_lag(tmp_path, monkeypatch):
    """S2X (pre-registration 5) at smoke size: its own base model at ``xl_digits``, its own on_policy run, the lr
    tuned for its length (X_LR) unless --lr is given, and the stale engine at X_LAG."""
    monkeypatch.setattr(mt, "X_LR", 2.5e-4)  # distinct from LR whatever the pilot picked
    out = str(tmp_path / "smoke")
    mt.main(["--smoke", "--out", out, "--scenarios", "S2X", "--methods", "M0", "--seeds", "0", "--experiment", "X"])
    assert sorted(os.listdir(os.path.join(out, "runs"))) == ["S2X__M0__seed0.json", "S2X__on_policy__seed0.json"]
    # deviation 1: the base at this length trains on from the recipe's (3 steps at smoke size) to xl_base_steps
    n, steps = mt.SMOKE["xl_digits"], mt.SMOKE["xl_base_steps"]
    assert sorted(os.listdir(os.path.join(out, "base"))) == [
        f"base_n{n}.pt", f"base_n{n}_s{steps}.pt", f"warmup_n{n}_s{steps}_seed0.pt"]
    with open(os.path.join(out, "results.csv")) as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert {r["n_digits"] for r in rows.values()} == {str(mt.SMOKE["xl_digits"])}
    assert {float(r["lr"]) for r in rows.values()} == {mt.X_LR}
    assert rows["M0"]["lag"] == str(mt.X_LAG) and rows["on_policy"]["lag"] == "0"
    assert "Experiment X" in open(os.path.join(out, "analysis.md")).read()
    assert (mt.scenario_lr("S2X", None), mt.scenario_lr("S2", None), mt.scenario_lr("S2X", 3e-4)) == (
        mt.X_LR, mt.LR, 3e-4)
    assert mt.scenario_lr("S2X", None, "gpu") == mt.GPU_LR
    assert (mt.scenario_lag("S2X"), mt.scenario_lag("S2L"), mt.scenario_lag("S2")) == (mt.X_LAG, mt.S2L_LAG,
                                                                                          mt.S2_LAG)


def test_target_regime_held_out_row_survives_only_with_the_same_sign():
    """Experiment X's decision: M3 confirmed on 10 seeds (cost counts, M3 - M1 > 0 on every seed) and then judged on
    held-out seeds by the sign of M3 - M1 there (pre-registration 5, item 4)."""
    def arm(method, seeds, score):
        return [dict(scenario="S2X", method=method, seed=s, score=score(s), kl_token=8e-3, t_kl=1.5, collapsed=False,
                     pool="S2X" if method == "on_policy" else "S2X") for s in seeds]

    seeds = list(range(60, 70))
    runs = (arm("on_policy", seeds, lambda s: 0.5 + 0.003 * (s % 3)) + arm("M0", seeds, lambda s: 0.4 + 0.002 * (s % 3))
            + arm("M1", seeds, lambda s: 0.40 + 0.001 * (s % 4)) + arm("M3", seeds, lambda s: 0.45 + 0.002 * (s % 5)))
    _, result = mt.analyse_family(runs, seeds, "S2X", mt.X_FAMILY, "X")
    assert result["counts"] and result["confirmed"] == ["M3"]
    held = [70, 71, 72]
    worse = runs + arm("M1", held, lambda s: 0.45) + arm("M3", held, lambda s: 0.44 + 0.001 * (s % 2))
    assert "does NOT survive" in mt.held_out_row_text(worse, dict(result), held, "S2X")
    better = runs + arm("M1", held, lambda s: 0.40) + arm("M3", held, lambda s: 0.44 + 0.001 * (s % 2))
    res = dict(result)
    assert "SURVIVES" in mt.held_out_row_text(better, res, held, "S2X") and res["held_out"]["survives"]


def test_a_continued_base_trains_only_the_steps_after_its_start():
    """pretrain_base(init, start): from a checkpoint of ``start`` steps, only steps start..base_steps run (none when
    they are equal: the weights come back unchanged); one more step changes them."""
    import torch

    size = dict(mt.SMOKE, n_digits=mt.SMOKE["xl_digits"], base_steps=3, bf16=False)
    first = mt.pretrain_base(size)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "b.pt")
        torch.save(first.state_dict(), path)
        same = mt.pretrain_base(size, init=path, start=3)
        more = mt.pretrain_base({**size, "base_steps": 4}, init=path, start=3)
    for (name, a), b in zip(first.state_dict().items(), same.state_dict().values()):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, c) for a, c in zip(first.state_dict().values(), more.state_dict().values()))


def test_experiment_y_runs_s2x_at_its_own_lag(tmp_path, monkeypatch):
    """Pre-registration 6: --experiment Y runs S2X's stale engine at Y_LAG (twice X's), recorded in each run."""
    monkeypatch.setattr(mt, "X_LAG", mt.X_LAG)  # main() sets the module's lag: restored after the test
    out = str(tmp_path / "smoke")
    mt.main(["--smoke", "--out", out, "--scenarios", "S2X", "--methods", "M0", "--seeds", "0", "--experiment", "Y"])
    with open(os.path.join(out, "results.csv")) as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert rows["M0"]["lag"] == str(mt.Y_LAG) and mt.Y_LAG == 2 * 8
    assert "Experiment Y" in open(os.path.join(out, "analysis.md")).read()


def test_experiment_z_runs_y_setting_with_the_cost_established_by_y(tmp_path, monkeypatch):
    """Pre-registration 7: --experiment Z runs S2X at Y's lag with no on_policy/M0 runs of its own (rule (a) is Y's
    established cost), tests Z_FAMILY and prints the collapse-free pairs."""
    monkeypatch.setattr(mt, "X_LAG", mt.X_LAG)  # main() sets the module's lag: restored after the test
    out = str(tmp_path / "smoke")
    mt.main(["--smoke", "--out", out, "--scenarios", "S2X", "--methods", "M1,M3", "--seeds", "0-1", "--experiment",
             "Z", "--without_on_policy"])
    with open(os.path.join(out, "results.csv")) as f:
        rows = list(csv.DictReader(f))
    assert {r["method"] for r in rows} == {"M1", "M3"} and {r["lag"] for r in rows} == {str(mt.Y_LAG)}
    text = open(os.path.join(out, "analysis.md")).read()
    assert "Experiment Z" in text and "gap was established on earlier seeds" in text
    assert "| M1 − M3 |" in text  # the descriptive pairs (pre-registration 7)
    result = json.load(open(os.path.join(out, "analysis.json")))
    assert result["counts"] is True and [r["method"] for r in result["family"]] == ["M3"]


def test_collapse_free_pairs_leave_out_a_seed_where_either_arm_collapsed():
    """Pre-registration 7's descriptive line, by hand: M1 collapses on seed 2, so a - b over seeds 0 and 1 only."""
    runs = [dict(scenario="S2X", method=m, seed=s, score=sc, collapsed=c, kl_token=0.0, t_kl=0.0, engine_reward=0.0)
            for m, s, sc, c in (("M1", 0, 0.9, False), ("M1", 1, 0.8, False), ("M1", 2, 0.1, True),
                                ("M3", 0, 0.85, False), ("M3", 1, 0.8, False), ("M3", 2, 0.8, False))]
    text = mt.collapse_free_text(runs, [0, 1, 2], "S2X", ("M1", "M3"))
    row = [line for line in text.splitlines() if line.startswith("| M1 − M3")][0].split("|")
    assert row[2].strip() == "2" and float(row[3]) == pytest.approx(0.025)  # (0.05 + 0) / 2
    assert row[4].strip() == "3" and float(row[5].split()[0]) == pytest.approx((0.05 + 0 - 0.7) / 3, abs=5e-5)


def copy_committed_results(folder) -> None:
    """Every committed ``*_results.csv`` into ``folder`` (where a test then replaces one with a synthetic CSV)."""
    import shutil

    for name in os.listdir(mt.RESULTS):
        if name.endswith("_results.csv"):
            shutil.copy(os.path.join(mt.RESULTS, name), os.path.join(folder, name))


def synthetic_arm(scenario: str, method: str, seeds, score) -> list[dict]:
    """One arm's runs as runs_from_csv reads them, the score ``score(seed)`` (the regime fields are placeholders)."""
    return [dict(scenario=scenario, method=method, seed=s, score=score(s), kl_token=5e-3, t_kl=1.4, engine_reward=0.5,
                 collapsed=False) for s in seeds]


def test_confirmed_methods_counts_a_target_regime_row_only_after_its_held_out_seeds(tmp_path):
    """confirmed_methods()'s S2X entry (experiments X and Y): a row confirmed on X_SEEDS counts only if M3 - M1 keeps
    its sign on X_HELD_OUT (pre-registration 5, item 4); the committed results confirm nothing there."""
    assert mt.confirmed_methods()["S2X"] == []
    copy_committed_results(tmp_path)

    def arm(method, seeds, score):
        return synthetic_arm("S2X", method, seeds, score)

    seeds, held = list(mt.X_SEEDS), list(mt.X_HELD_OUT)
    base = (arm("on_policy", seeds, lambda s: 0.9 + 0.001 * (s % 3)) + arm("M0", seeds, lambda s: 0.7 + 0.002 * (s % 3))
            + arm("M1", seeds, lambda s: 0.80 + 0.001 * (s % 4)) + arm("M3", seeds, lambda s: 0.85 + 0.002 * (s % 5)))
    for held_m3, expected in ((0.79, []), (0.86, ["M3"])):
        runs = base + arm("M1", held, lambda s: 0.80) + arm("M3", held, lambda s, v=held_m3: v + 0.001 * (s % 2))
        mt.write_csv(runs, str(tmp_path / mt.TARGET_CSV))
        assert mt.confirmed_methods(str(tmp_path))["S2X"] == expected


def test_the_sequence_weight_alarm_fires_on_two_consecutive_low_generations_only():
    """Pre-registration 8's rule by hand: rows without TRL's key are skipped; one low value (Y seed 77's shape) does
    not fire; two low values in a row fire at the second one's step."""
    key = mt.ALARM_KEY
    one_dip = [{"step": 1, key: 1.0}, {"step": 2}, {"step": 3, key: 0.1}, {"step": 5, key: 0.6}, {"step": 7, key: 0.4}]
    assert mt.alarm_step(one_dip) is None
    two = [{"step": 1, key: 1.0}, {"step": 3, key: 0.29}, {"step": 4}, {"step": 5, key: 0.05}, {"step": 7, key: 0.01}]
    assert mt.alarm_step(two) == 5
    assert mt.alarm_step([{"step": 1, key: 0.3}, {"step": 3, key: 0.3}]) is None  # strictly below the threshold
    assert mt.first_low_eval([(0, 0.8), (10, 0.41), (20, 0.39)]) == 20  # below 0.5 x 0.8 = 0.4
    assert mt.first_low_eval([(0, 0.8), (10, 0.8)]) is None


def test_the_alarm_analysis_counts_hits_and_false_alarms_and_applies_the_rule():
    """Pre-registration 8's table and decision on made-up runs: 2 of 2 collapses alarmed, 1 of 8 others alarmed:
    false-alarm rate 0.125 > 0.10, so not adopted; without that false alarm it is adopted."""
    key = mt.ALARM_KEY
    low = [{"step": 1, key: 1.0}, {"step": 3, key: 0.1}, {"step": 5, key: 0.1}]
    high = [{"step": 1, key: 1.0}, {"step": 3, key: 0.9}, {"step": 5, key: 0.8}]

    def run(seed, collapsed, logs):
        return dict(scenario="S2X", method="M1", seed=seed, score=0.5, collapsed=collapsed, kl_token=0.0, t_kl=0.0,
                    engine_reward=0.0, logs=logs, curve=[(0, 0.8), (10, 0.3 if collapsed else 0.8)])

    runs = [run(0, True, low), run(1, True, low)] + [run(s, False, low if s == 2 else high) for s in range(2, 10)]
    _, result = mt.alarm_analysis(runs, list(range(10)))
    assert (result["collapsed"], result["alarmed_collapsed"], result["alarmed_healthy"]) == (2, 2, 1)
    assert result["false_alarm_rate"] == pytest.approx(1 / 8) and result["adopt"] is False
    assert result["sensitivity_ci"][0] == pytest.approx(0.025 ** 0.5)
    runs[2] = run(2, False, high)
    text, result = mt.alarm_analysis(runs, list(range(10)))
    assert result["adopt"] is True and "ADOPTED" in text and "| 0 | yes | 5 | 10 |" in text


def test_experiment_q_is_s1_noise_at_the_target_length_without_a_stale_copy(tmp_path, monkeypatch):
    """Pre-registration 10: S1X = S1's heavy-tailed noise at Q_NOISE (the pilot level whose per-token KL is closest
    to 8e-3), at S2X's length, base model and lr, with no stale copy (lag 0) and its own on_policy run; the smoke run
    writes Q's analysis with rule (c)."""
    assert mt.Q_NOISE == (0.1, 0.08, 10.0, 1e-2) and mt.Q_PILOT[mt.Q_NOISE][0] == pytest.approx(7.91e-3)
    assert mt.Q_FAMILY == (("S1X", "M3"), ("S1X", "M2"), ("S1X", "M0"))
    assert mt.Q_SEEDS == tuple(range(125, 135)) and mt.Q_HELD_OUT == tuple(range(135, 140))
    assert (mt.scenario_lr("S1X", None), mt.scenario_lr("S1", None)) == (mt.X_LR, mt.LR)
    assert mt.cell_base("o", "S1X", mt.SMOKE) == mt.cell_base("o", "S2X", mt.SMOKE)  # the same base model as S2X
    engine = mt.Engine("S1X", 0, None, lambda: pytest.fail("S1X keeps no stale copy"), 4)
    assert engine.stale is None and engine.perturb is not None
    # pre-registration 11: S1D, the same with dense noise only, at D_PILOT's level closest to 8e-3
    assert mt.D_NOISE == (1.2, 0.0, 0.0, 1e-2) and mt.D_PILOT[mt.D_NOISE][0] == pytest.approx(8.85e-3)
    assert mt.D_FAMILY == (("S1D", "M3"), ("S1D", "M2"), ("S1D", "M0")) and mt.D_SEEDS == tuple(range(140, 150))
    assert mt.cell_base("o", "S1D", mt.SMOKE) == mt.cell_base("o", "S2X", mt.SMOKE)
    assert mt.scenario_lr("S1D", None) == mt.X_LR
    dense = mt.Engine("S1D", 0, None, lambda: pytest.fail("S1D keeps no stale copy"), 4)
    logits = torch.zeros(3, 50)
    logits[:, 7] = 30.0  # every other token has p ~ 1e-13 < below: a spike would land on one of them
    noisy = dense.perturb(logits, torch.Generator().manual_seed(0))
    assert (noisy - logits).abs().max() < 6 * 1.2 and 0.9 < (noisy - logits).std() < 1.5  # N(0, 1.2^2), no +spike
    out = str(tmp_path / "smoke")
    mt.main(["--smoke", "--out", out, "--scenarios", "S1X", "--methods", "M0,M1", "--seeds", "0-1", "--experiment",
             "Q"])
    with open(os.path.join(out, "results.csv")) as f:
        rows = list(csv.DictReader(f))
    assert {r["n_digits"] for r in rows} == {str(mt.SMOKE["xl_digits"])} and {r["lag"] for r in rows} == {"0"}
    kl = {r["method"]: float(r["kl_token"]) for r in rows if r["seed"] == "0"}
    assert kl["on_policy"] == 0 and kl["M0"] > 0
    text = open(os.path.join(out, "analysis.md")).read()
    assert "Experiment Q" in text and "**Rule (c)**" in text


def test_q_rule_c_and_its_held_out_rows_by_hand():
    """Rule (c): M0 above M1 on every seed (Holm over 3 still < 0.05 with 10 seeds: sign-flip p 2/1024 x 3) means
    TRL's default costs, whatever rule (a) says (here the mismatch itself costs nothing: on_policy == M0); the
    held-out row survives only with the same sign."""
    def arm(method, seeds, score):
        return [dict(scenario="S1X", method=method, seed=s, score=score(s), kl_token=8e-3, t_kl=2.0, collapsed=False,
                     pool="S1X") for s in seeds]

    seeds = list(mt.Q_SEEDS)
    runs = (arm("on_policy", seeds, lambda s: 0.80 + 0.002 * (s % 3))
            + arm("M0", seeds, lambda s: 0.80 + 0.002 * (s % 3))
            + arm("M1", seeds, lambda s: 0.70 + 0.003 * (s % 4)) + arm("M3", seeds, lambda s: 0.70 + 0.003 * (s % 4))
            + arm("M2", seeds, lambda s: 0.70 + 0.001 * (s % 2)))
    _, result = mt.analyse_family(runs, seeds, "S1X", mt.Q_FAMILY, "Q")
    assert not result["counts"] and result["confirmed"] == []  # rule (b) needs (a)
    text = mt.q_rule_c_text(result)
    m0 = next(r for r in result["family"] if r["method"] == "M0")
    assert m0["p_sign_flip_holm"] == pytest.approx(3 * 2 / 1024) and "COSTS" in text and result["trl_default_costs"]
    assert mt.q_held_out_methods(result) == ["M0"]
    tost = mt.q_tost_text(runs, seeds, result)  # cost 0, M3 - M1 0, M2 - M1 -0.004: ties; M0 - M1 ~ +0.1: not one
    assert "| on_policy − M0 | 10 | +0.0000 |" in tost and tost.count("| yes |") == 3
    assert tost.splitlines()[-1].startswith("| M0 − M1 | 10 | +0.0977") and tost.endswith("| no |")
    held = list(mt.Q_HELD_OUT)
    flipped = runs + arm("M1", held, lambda s: 0.80) + arm("M0", held, lambda s: 0.79 + 0.001 * (s % 2))
    assert "does NOT survive" in mt.q_held_out_text(flipped, result, held)
    assert result["held_out"]["M0"]["survives"] is False
    same = runs + arm("M1", held, lambda s: 0.70) + arm("M0", held, lambda s: 0.79 + 0.001 * (s % 2))
    assert "SURVIVES" in mt.q_held_out_text(same, result, held) and result["held_out"]["M0"]["survives"]
    quiet = runs[: 2 * len(seeds)] + arm("M1", seeds, lambda s: 0.80 + 0.002 * (s % 3)) + runs[3 * len(seeds):]
    _, tie = mt.analyse_family(quiet, seeds, "S1X", mt.Q_FAMILY, "Q")
    assert "no significant cost" in mt.q_rule_c_text(tie) and mt.q_held_out_methods(tie) == []


def test_confirmed_methods_counts_a_precision_row_only_after_its_held_out_seeds(tmp_path):
    """confirmed_methods()'s S1X entry (experiment Q): a row rule (b) confirms on Q_SEEDS counts only if it keeps its
    sign on Q_HELD_OUT; M0 (no correction) never counts, even when rule (c) finds it above TRL's default; with the
    held-out seeds not run it refuses rather than guess."""
    copy_committed_results(tmp_path)

    def arm(method, seeds, score):
        return synthetic_arm("S1X", method, seeds, score)

    seeds, held = list(mt.Q_SEEDS), list(mt.Q_HELD_OUT)
    base = (arm("on_policy", seeds, lambda s: 0.9 + 0.001 * (s % 3))
            + arm("M0", seeds, lambda s: 0.84 + 0.002 * (s % 3)) + arm("M1", seeds, lambda s: 0.80 + 0.001 * (s % 4))
            + arm("M3", seeds, lambda s: 0.85 + 0.002 * (s % 5)) + arm("M2", seeds, lambda s: 0.80 + 0.001 * (s % 4)))
    mt.write_csv(base, str(tmp_path / mt.TARGET_Q_CSV))
    with pytest.raises(NotImplementedError, match="Q_HELD_OUT"):
        mt.confirmed_methods(str(tmp_path))
    for held_score, expected in ((0.79, []), (0.86, ["M3"])):
        runs = (base + arm("M1", held, lambda s: 0.80) + arm("M3", held, lambda s, v=held_score: v + 0.001 * (s % 2))
                + arm("M0", held, lambda s: 0.85 + 0.001 * (s % 2)))
        mt.write_csv(runs, str(tmp_path / mt.TARGET_Q_CSV))
        assert mt.confirmed_methods(str(tmp_path))["S1X"] == expected


def test_experiment_a_is_ds_noise_on_a_stale_engine(tmp_path):
    """Pre-registration 13: S2D = the policy of A_LAG = 4 optimizer steps ago (TRL's asynchronous default bound)
    sampled with D's dense noise, at S2X's length, base model and lr; its smoke run records lag 4 and a non-zero KL
    to the policy, and writes A's analysis."""
    assert (mt.A_LAG, mt.scenario_lag("S2D"), mt.scenario_lag("S2X")) == (4, 4, mt.X_LAG)
    assert mt.A_FAMILY == (("S2D", "M3"), ("S2D", "M2"), ("S2D", "M0")) and mt.A_SEEDS == tuple(range(155, 165))
    assert mt.A_HELD_OUT == tuple(range(165, 170)) and not set(mt.A_SEEDS) & set(mt.D_HELD_OUT + mt.Q_HELD_OUT)
    assert mt.cell_base("o", "S2D", mt.SMOKE) == mt.cell_base("o", "S2X", mt.SMOKE)
    assert mt.scenario_lr("S2D", None) == mt.X_LR
    engine = mt.Engine("S2D", 0, None, lambda: "stale copy", 4, lag=mt.scenario_lag("S2D"))
    assert engine.stale == "stale copy" and engine.lag == 4
    logits = torch.zeros(3, 50)
    logits[:, 7] = 30.0
    noisy = engine.perturb(logits, torch.Generator().manual_seed(0))
    assert 0.9 < (noisy - logits).std() < 1.5 and (noisy - logits).abs().max() < 6 * 1.2  # D's N(0, 1.2^2)
    out = str(tmp_path / "smoke")
    mt.main(["--smoke", "--out", out, "--scenarios", "S2D", "--methods", "M0,M1", "--seeds", "0-1", "--experiment",
             "A"])
    with open(os.path.join(out, "results.csv")) as f:
        rows = list(csv.DictReader(f))
    assert {r["n_digits"] for r in rows} == {str(mt.SMOKE["xl_digits"])}
    assert {r["method"]: r["lag"] for r in rows if r["seed"] == "0"} == {"on_policy": "0", "M0": "4", "M1": "4"}
    assert all(float(r["kl_token"]) > 0 for r in rows if r["method"] != "on_policy")
    assert "Experiment A: a stale engine (lag 4)" in open(os.path.join(out, "analysis.md")).read()


def test_signed_held_out_rows_test_a_negative_row_by_its_own_sign():
    """Pre-registration 13's held-out rule by hand: M3 below M1 on all 10 seeds (sign-flip p 2/1024, Holm x 3) is
    held out although rules (b) and (c) find nothing; it survives iff M3 - M1 stays negative on the held-out seeds."""
    seeds, held = list(mt.A_SEEDS), list(mt.A_HELD_OUT)

    def arm(method, seeds, score):
        return synthetic_arm("S2D", method, seeds, score)

    runs = (arm("on_policy", seeds, lambda s: 0.80 + 0.002 * (s % 3))
            + arm("M0", seeds, lambda s: 0.80 + 0.002 * (s % 3))
            + arm("M1", seeds, lambda s: 0.80 + 0.003 * (s % 4)) + arm("M3", seeds, lambda s: 0.60 + 0.003 * (s % 4))
            + arm("M2", seeds, lambda s: 0.80 + 0.003 * (s % 4) + 0.001 * (-1) ** s))  # M2 - M1 = +-0.001: a tie
    _, result = mt.analyse_family(runs, seeds, "S2D", mt.A_FAMILY, "A")
    m3 = next(r for r in result["family"] if r["method"] == "M3")
    assert m3["p_sign_flip_holm"] == pytest.approx(3 * 2 / 1024) and m3["diff"] == pytest.approx(-0.2)
    assert mt.q_held_out_methods(result) == [] and mt.q_held_out_methods(result, signed=True) == ["M3"]
    worse = runs + arm("M1", held, lambda s: 0.80) + arm("M3", held, lambda s: 0.70 + 0.001 * (s % 2))
    assert "SURVIVES" in mt.q_held_out_text(worse, result, held, "S2D", signed=True)
    assert result["held_out"]["M3"]["survives"] is True
    better = runs + arm("M1", held, lambda s: 0.70) + arm("M3", held, lambda s: 0.75 + 0.001 * (s % 2))
    assert "does NOT survive" in mt.q_held_out_text(better, result, held, "S2D", signed=True)
    assert "no family row was significant" in mt.q_held_out_text(runs, {"family": []}, held, "S2D", signed=True)


def test_the_pooled_alarm_counts_each_experiments_m1_runs_and_decides_on_the_pool(tmp_path):
    """Pre-registration 14 on made-up CSVs: Z 3 healthy M1 runs (no alarm), D 2 healthy (one false alarm), A 2
    collapsed (both alarmed) and an M3 run that is not counted; the other experiments' CSVs absent (not run).
    Pooled: sensitivity 2/2, false alarms 1/5 = 0.2 > 0.10: not adopted; without D's false alarm, adopted."""
    def m1(scenario, seed, collapsed, alarm, method="M1"):
        return dict(scenario=scenario, method=method, seed=seed, score=0.5, kl_token=5e-3, t_kl=1.0,
                    engine_reward=0.5, collapsed=collapsed, alarm_step=alarm)

    def write(name, runs):
        mt.write_csv(runs, str(tmp_path / mt.ALARM_POOL_CSV[name]))

    write("Z", [m1("S2X", s, False, None) for s in mt.Z_SEEDS[:3]])
    write("D", [m1("S1D", mt.D_SEEDS[0], False, 7), m1("S1D", mt.D_SEEDS[1], False, None)])
    write("A", [m1("S2D", s, True, 9) for s in mt.A_SEEDS[:2]] + [m1("S2D", mt.A_SEEDS[2], True, None, "M3")])
    text, result = mt.alarm_pool(str(tmp_path))
    pooled = result["groups"]["pooled"]
    assert (pooled["n"], pooled["collapsed"], pooled["alarmed_collapsed"], pooled["alarmed_healthy"]) == (7, 2, 2, 1)
    assert pooled["false_alarm_rate"] == pytest.approx(0.2) and result["adopt"] is False and "NOT adopted" in text
    assert result["groups"]["all persistent"]["n"] == 2 and "Q" not in result["groups"]
    assert "| A | 2 | 2 | 2/2 = 1.00 [0.16, 1.00] | — |" in text  # Clopper-Pearson lower bound sqrt(0.025) ~ 0.158
    write("D", [m1("S1D", mt.D_SEEDS[0], False, None), m1("S1D", mt.D_SEEDS[1], False, None)])
    text, result = mt.alarm_pool(str(tmp_path))
    assert result["adopt"] is True and "ADOPTED" in text


def test_experiment_b_is_a_with_the_smaller_noise_and_only_bypass_against_trls_default(tmp_path):
    """Pre-registration 15: S2B = S2D's 4-step-stale engine with sigma 1.0 noise (D_PILOT: 4.41e-3 at step 0), arms
    M1 and M3 only, the family {M3 - M1}; its smoke run (no on_policy, no M0) writes B's analysis without rule (c)."""
    assert mt.B_NOISE == (1.0, 0.0, 0.0, 1e-2) and mt.D_PILOT[mt.B_NOISE][0] == pytest.approx(4.41e-3)
    assert (mt.scenario_lag("S2B"), mt.B_FAMILY, mt.B_SEEDS) == (4, (("S2B", "M3"),), tuple(range(170, 180)))
    assert mt.HELD_OUT_EXPERIMENTS["B"] == ("S2B", mt.B_FAMILY, mt.B_SEEDS, tuple(range(180, 185)))
    assert "B" not in mt.FAMILY_EXPERIMENTS  # no on_policy / M0 arms: nothing can be confirmed (recommended) from B
    engine = mt.Engine("S2B", 0, None, lambda: "stale copy", 4, lag=mt.scenario_lag("S2B"))
    noise = engine.perturb(torch.zeros(4, 500), torch.Generator().manual_seed(0))
    assert engine.stale == "stale copy" and 0.9 < noise.std() < 1.1  # N(0, 1.0^2), not A's 1.2
    out = str(tmp_path / "smoke")
    mt.main(["--smoke", "--out", out, "--scenarios", "S2B", "--methods", "M1,M3", "--seeds", "0-1", "--experiment",
             "B", "--without_on_policy"])
    with open(os.path.join(out, "results.csv")) as f:
        assert {(r["method"], r["lag"]) for r in csv.DictReader(f)} == {("M1", "4"), ("M3", "4")}
    text = open(os.path.join(out, "analysis.md")).read()
    assert "Experiment B: a stale engine (lag 4) with a smaller dense gap" in text and "Rule (c)" not in text


@pytest.mark.parametrize("name, sigma, kl, seeds", [("E", 0.8, 2.05e-3, range(185, 195)),
                                                    ("F", 0.6, 8.69e-4, range(200, 210))])
def test_experiments_e_and_f_are_b_at_the_pre_registered_smaller_gaps(tmp_path, name, sigma, kl, seeds):
    """Pre-registration 16: S2E / S2F = B's 4-step-stale engine with sigma 0.8 / 0.6 noise (E_PILOT: 2.05e-3 /
    8.7e-4 per token at step 0), arms M1 and M3, the family {M3 - M1}, fresh seeds; the smoke run writes the
    analysis under the experiment's own title."""
    scenario, noise, analysis_seeds, held_out = mt.GAP_LADDER[name]
    assert noise == (sigma, 0.0, 0.0, 1e-2) and mt.E_PILOT[noise][0] == pytest.approx(kl)
    assert (mt.scenario_lag(scenario), tuple(analysis_seeds)) == (4, tuple(seeds))
    assert mt.HELD_OUT_EXPERIMENTS[name] == (scenario, ((scenario, "M3"),), tuple(seeds),
                                             tuple(range(seeds[-1] + 1, seeds[-1] + 6)))
    assert name in mt.SIGNED_HELD_OUT and name not in mt.FAMILY_EXPERIMENTS
    engine = mt.Engine(scenario, 0, None, lambda: "stale copy", 4, lag=mt.scenario_lag(scenario))
    drawn = engine.perturb(torch.zeros(4, 2000), torch.Generator().manual_seed(0))
    assert engine.stale == "stale copy" and abs(float(drawn.std()) - sigma) < 0.03
    out = str(tmp_path / "smoke")
    mt.main(["--smoke", "--out", out, "--scenarios", scenario, "--methods", "M1,M3", "--seeds", "0-1",
             "--experiment", name, "--without_on_policy"])
    text = open(os.path.join(out, "analysis.md")).read()
    assert f"Experiment {name}: a stale engine (lag 4) with a smaller dense gap" in text and "Rule (c)" not in text


def _write_ladder_csv(path, scenario: str, seeds, diffs, methods=("M1", "M3")) -> None:
    """A committed-style results CSV: M3 - M1 = ``diffs`` per seed; any other arm M1's score + a small spread."""
    fields = ("scenario", "method", "seed", "collapsed", "score", "kl_token", "t_kl", "engine_reward", "alarm_step",
              "first_low_eval")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fields)
        w.writeheader()
        for i, (seed, d) in enumerate(zip(seeds, diffs)):
            for j, method in enumerate(methods):
                score = 0.8 + (d if method == "M3" else 0.0 if method == "M1" else 0.003 * ((i + j) % 3 - 1))
                w.writerow(dict(scenario=scenario, method=method, seed=seed, collapsed=False, score=score,
                                kl_token=3e-3, t_kl=0.8, engine_reward=0.6, alarm_step="", first_low_eval=""))


def test_lag0_caution_kl_is_the_smallest_gap_whose_negative_row_survived(tmp_path):
    """Pre-registration 16, decision (2), on hand-made results: an experiment counts iff M3 - M1 is negative on all of
    its 10 seeds (sign-flip p 2/1024, before Holm) AND negative again on its held-out seeds; a positive row, a row
    whose held-out sign flips, held-out seeds not run, or an experiment not run does not count; the smallest such
    step-0 KL (A 8.85e-3, B 4.41e-3, E 2.05e-3, F 8.7e-4) is returned."""
    down = [-0.05 - 0.001 * i for i in range(10)]
    for name, sign, held_sign in (("A", 1, 1), ("B", 1, 1), ("E", 1, -1), ("F", -1, -1)):
        scenario, _, seeds, held_out = mt.HELD_OUT_EXPERIMENTS[name]
        arms = mt.A_ARMS if name == "A" else ("M1", "M3")
        csv_name, held_csv = mt.LADDER_CSV[name]
        _write_ladder_csv(tmp_path / csv_name, scenario, seeds, [sign * d for d in down], arms)
        _write_ladder_csv(tmp_path / held_csv, scenario, held_out, [held_sign * -0.04] * 5)
    assert mt.lag0_caution_kl(str(tmp_path)) == pytest.approx(4.41e-3)  # A and B count; E's sign flips; F is positive
    _write_ladder_csv(tmp_path / mt.LADDER_CSV["E"][1], "S2E", mt.E_HELD_OUT, [-0.04] * 5)
    assert mt.lag0_caution_kl(str(tmp_path)) == pytest.approx(2.05e-3)  # E's held-out seeds now hold the sign
    os.remove(tmp_path / mt.LADDER_CSV["E"][1])
    assert mt.lag0_caution_kl(str(tmp_path)) == pytest.approx(4.41e-3)  # E's held-out seeds not run: E does not count
    os.remove(tmp_path / mt.LADDER_CSV["B"][0])
    assert mt.lag0_caution_kl(str(tmp_path)) == pytest.approx(8.85e-3)  # A alone (Holm over its family of 3)
    os.remove(tmp_path / mt.LADDER_CSV["A"][0])
    assert mt.lag0_caution_kl(str(tmp_path)) is None


def test_lag0_caution_kl_on_the_committed_results():
    """Pre-registration 16 on the committed CSVs: A (8.85e-3), B (4.41e-3) and E (2.05e-3) survived; F (8.7e-4) runs
    only after E survived; the monitor's bound is exactly the smallest."""
    from trl_rollout_corr.monitor import advice

    assert mt.lag0_caution_kl() == pytest.approx(2.05e-3) and advice.LAG0_CAUTION_KL == mt.lag0_caution_kl()


def test_a_child_that_fails_prints_its_traceback_before_it_exits(capfd):
    """``in_child`` ends the child with ``os._exit``, which would swallow the exception: the child must print it (on an
    H200 a base-model build failed with nothing above the parent's "see its traceback above")."""
    def boom():
        raise ValueError("the child's own error")

    with pytest.raises(RuntimeError, match="boom failed in its child process"):
        mt.in_child(boom)
    err = capfd.readouterr().err
    assert "Traceback" in err and "ValueError: the child's own error" in err

    def clean_exit():
        raise SystemExit(0)

    mt.in_child(clean_exit)  # a clean SystemExit is a success, not a failure


def test_the_cuda_check_runs_in_a_child_so_forked_runs_can_use_cuda(monkeypatch, tmp_path):
    """``torch.cuda.is_available()`` initializes the CUDA driver (torch's "poison fork"): asked by the driver
    process, every forked child (base build, runs) fails at its first CUDA call. The check must run in a child."""
    seen = tmp_path / "pid"

    def is_available():
        seen.write_text(str(os.getpid()))
        return True

    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    assert mt.cuda_available_in_child()
    assert int(seen.read_text()) != os.getpid()  # asked in the child
    nvml = tmp_path / "nvml"
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # the driver's setting ...
    monkeypatch.setattr(torch.cuda, "is_available",
                        lambda: nvml.write_text(os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK", "unset")) or True)
    assert mt.cuda_available_in_child() and nvml.read_text() == "unset"  # ... not the child's: the real check
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not mt.cuda_available_in_child()
    seen.unlink()
    monkeypatch.setattr(torch.cuda, "is_available", is_available)

    def stop(fn, *args, **kwargs):
        raise SystemExit("stop: past the check")

    monkeypatch.setattr(mt, "in_child", stop)  # the base model's build: the first forked child
    with pytest.raises(SystemExit, match="stop: past the check"):
        mt.main(["--size", "gpu", "--scenarios", "S0", "--methods", "M0", "--seeds", "99", "--out", str(tmp_path),
                 "--without_on_policy"])
    assert int(seen.read_text()) != os.getpid()  # main asked a child, never torch.cuda in this process


def test_the_base_build_checkpoints_on_a_gpu_and_gives_the_same_model():
    """Off the CPU the base build and the warm-up check-point their activations (the GPU size's base build held ~114
    GB on an H200 without it): the same update, so the same base model (here on CPU, checkpointing forced on); the
    model comes back without checkpointing."""
    size = {**mt.full_size(), **{k: v for k, v in mt.SMOKE.items() if k != "steps"}, "base_steps": 3}
    plain = mt.pretrain_base({**size, "checkpointing": False})
    checkpointed = mt.pretrain_base({**size, "checkpointing": True})
    assert not checkpointed.is_gradient_checkpointing
    for (name, a), (_, b) in zip(plain.state_dict().items(), checkpointed.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    moved = mt.pretrain_base({**size, "checkpointing": False, "base_steps": 0})
    assert any(not torch.equal(a, b) for a, b in zip(plain.state_dict().values(), moved.state_dict().values()))
    for device, on in (("cuda", True), ("cpu", False)):  # the default: on off the CPU (no CUDA call is made)
        with mt.checkpointed(moved, {"device": device}) as model:
            assert model.is_gradient_checkpointing == on
        assert not moved.is_gradient_checkpointing
