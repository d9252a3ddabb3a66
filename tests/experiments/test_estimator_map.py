"""The estimator map (``experiments/estimator_map.py``): its smoke run, one cell's gradients against an independent
float64 computation, and the ESS formula against the small-mismatch theory on a synthetic case."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from experiments import estimator_map as em
from trl_rollout_corr import RolloutCorrectionConfig


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_smoke_run_writes_every_method_and_trls_default_equals_the_packages_spelling(tmp_path, one_thread):
    rows = em.main(["--smoke", "--out", str(tmp_path)])
    with open(tmp_path / "estimator_map.csv") as f:
        written = list(csv.DictReader(f))
    assert len(written) == len(rows)
    methods = {r["method"] for r in rows}
    assert {"none", "trl_token_truncate", "trl_token_mask", "trl_sequence_truncate", "trl_sequence_mask",
            "decoupled_token_is", "ppo_is_bypass", "pg_is", "icepop", "m2po", "decoupled_token_band_rs"} <= methods
    by = {r["method"]: r for r in rows}
    assert by["none"]["kl_k3"] > 0 and all(math.isfinite(r["mse"]) for r in rows)
    assert 0 < by["none"]["coupled_same"] < 1  # coupled: the engine's and the policy's samples mostly agree
    for key in ("bias2", "mse", "relvar", "masked_tok", "masked_seq", "ess_token"):  # TRL's code = the package's
        assert by["pkg_trl_default"][key] == pytest.approx(by["trl_sequence_mask"][key], rel=1e-5, abs=1e-9), key
        assert by["decoupled_token_is"][key] != by["trl_sequence_mask"][key] or key.startswith("masked"), key
    assert (tmp_path / "estimator_map.md").read_text().count("\n") >= 3


def test_one_cell_against_an_independent_float64_gradient(tmp_path, one_thread):
    """Coefficients by hand in float64 from the batch's rewards and log-probs (GRPO group advantages, TRL's dapo
    token normalizer, the weights' definitions), the lm_head gradient by float64 autograd through a double copy of
    the model; the map's TRL-computed coefficients and closed-form gradients must agree."""
    model = em.build_model(hidden=32, layers=1)
    em.supervised_warmup(model, 3, T=8)
    gen = torch.Generator().manual_seed(3)
    batch = next(em.sample_batches(em.Engine(model, "heavy", 0.6), model, 8, 1, gen))
    trl = em.TrlLoss(model, 8, str(tmp_path))
    coefs = em.method_coefs(trl, batch, {"decoupled_token_is": RolloutCorrectionConfig.decoupled_token_is(),
                                         "icepop": RolloutCorrectionConfig.from_preset("icepop")})
    names = ["none", "trl_token_truncate", "trl_sequence_mask", "decoupled_token_is", "icepop"]
    grads = em.lm_head_grads(batch["fwd"], torch.stack([coefs[n] for n in names]))  # (5, V, d)

    double = em.build_model(hidden=32, layers=1)
    double.load_state_dict(model.state_dict())
    double = double.double()
    ids = torch.cat([batch["prompts"], batch["completions"]], 1)  # (B, P+T)
    P, T = batch["prompts"].size(1), batch["completions"].size(1)
    r = batch["reward"].double().view(-1, em.GROUP)  # (8, 8)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1, 1)  # (B, 1)
    n_tokens = ids.size(0) * T
    with torch.no_grad():
        logp64 = double(input_ids=ids).logits[:, P - 1:-1].log_softmax(-1)  # (B, T, V)
        logp64 = logp64.gather(-1, batch["completions"].unsqueeze(-1)).squeeze(-1)  # (B, T)
    rho = (logp64 - batch["engine_logp"].double()).exp()  # (B, T)
    seq = rho.prod(1, keepdim=True)  # (B, 1)
    by_hand = {"none": -adv.expand(-1, T) / n_tokens,
               "trl_token_truncate": -adv * rho.clamp(max=3.0) / n_tokens,
               "trl_sequence_mask": -adv * (seq * (seq <= 3.0)).expand(-1, T) / n_tokens,
               "decoupled_token_is": -adv * rho.clamp(max=2.0) / n_tokens,
               "icepop": -adv * rho * ((rho >= 0.5) & (rho <= 5.0)) / n_tokens}  # IcePop: weight 0, count kept
    assert (rho > 5).any() and (rho < 0.5).any() and (seq > 3).any()  # the bounds bite on this batch
    for i, name in enumerate(names):
        torch.testing.assert_close(coefs[name].double(), by_hand[name], rtol=1e-4, atol=1e-9, msg=name)
        double.zero_grad()
        out = double(input_ids=ids).logits[:, P - 1:-1].log_softmax(-1)  # (B, T, V)
        lp = out.gather(-1, batch["completions"].unsqueeze(-1)).squeeze(-1)  # (B, T)
        (by_hand[name] * lp).sum().backward()
        expected = double.lm_head.weight.grad  # (V, d)
        torch.testing.assert_close(grads[i].double(), expected, rtol=1e-3, atol=1e-7, msg=name)


def test_ess_formula_and_the_small_mismatch_theory():
    assert em.ess(torch.tensor([1.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)
    assert em.ess(torch.full((7,), 3.0)) == pytest.approx(1.0)
    assert em.ess(torch.tensor([1.0, 3.0])) == pytest.approx(16 / 20)
    # sequence weights e^800 (overflows even float64) and e^799.3 (= e^800 / 2): ESS (1 + 1/2)^2 / (2 (1 + 1/4))
    log_rho = torch.tensor([[400.0, 400.0], [400.0, 400.0 - math.log(2.0)]])  # (2, T=2)
    assert em.sequence_ess(log_rho) == pytest.approx(2.25 / 2.5)
    # per-token log rho ~ N(-kl, 2 kl) (E rho = 1, KL(pi_e || pi) = kl): the sequence weight's ESS -> exp(-2 T kl)
    gen = torch.Generator().manual_seed(0)
    T, kl = 64, 0.004
    log_rho = -kl + math.sqrt(2 * kl) * torch.randn(80_000, T, generator=gen, dtype=torch.float64)  # (n, T)
    assert (-log_rho).mean().item() == pytest.approx(kl, rel=0.03)
    assert em.ess(log_rho.sum(1).exp()) == pytest.approx(math.exp(-2 * T * kl), rel=0.06)


def test_mismatch_bench_map_dispatches_to_the_estimator_map(monkeypatch):
    from experiments import mismatch_bench

    seen = []
    monkeypatch.setattr(em, "main", seen.append)
    mismatch_bench.main(["--map", "--smoke", "--out", "DIR"])
    assert seen == [["--smoke", "--out", "DIR"]]


def test_coupled_sampling_keeps_each_distribution_and_the_bias_units():
    """The coupling leaves each sampler's distribution exact (token frequencies of a coupled engine = its own
    distribution, on a 3-token case) while agreeing more often than independent draws, and finish_rows scales by
    V_on as documented."""
    gen = torch.Generator().manual_seed(0)

    class Fixed:  # a "model" whose next-token logits are fixed: p = (0.7, 0.2, 0.1), q = (0.2, 0.3, 0.5)
        def __init__(self, p):
            self.logits = torch.tensor(p).log()

        def __call__(self, input_ids, past_key_values=None, use_cache=True):
            n = input_ids.size(0)
            return type("Out", (), {"past_key_values": None, "logits": self.logits.expand(n, 1, 3)})()

    engine, policy = em.Engine(Fixed([0.2, 0.3, 0.5])), em.Engine(Fixed([0.7, 0.2, 0.1]))
    ys, lps, pys = engine.sample(torch.zeros(20000, 1, dtype=torch.long), 1, gen, partner=policy)
    freq_e = torch.bincount(ys.flatten(), minlength=3) / ys.numel()  # (3,)
    freq_p = torch.bincount(pys.flatten(), minlength=3) / pys.numel()  # (3,)
    torch.testing.assert_close(freq_e, torch.tensor([0.2, 0.3, 0.5]), atol=0.015, rtol=0)
    torch.testing.assert_close(freq_p, torch.tensor([0.7, 0.2, 0.1]), atol=0.015, rtol=0)
    torch.testing.assert_close(lps.flatten(), torch.tensor([0.2, 0.3, 0.5]).log()[ys.flatten()])
    assert 0.3 < (ys == pys).float().mean().item() < 1.0  # coupled: independent draws agree 25% of the time
    row = dict(var=4.0, bias2=1.0, bias2_se=0.1, mean_sq=9.0)
    em.finish_rows([row], {"v_on": 2.0, "g_star_sq": 4.0, "n_on": 10})
    assert (row["relvar"], row["bias2"], row["mse"], row["bias_rel"], row["norm_ratio"]) == (2.0, 0.5, 2.5, 0.5, 1.5)
    assert row["breakeven_batch"] == em.BATCH * 2.0 / 0.5 and row["snr_on"] == 2.0


def test_moe_routing_flips_at_the_requested_rate(one_thread):
    """The MoE engine's routings differ from the trainer's at the requested rate, measured independently: every
    router's chosen expert set recorded in the engine's KV-cache sampling and in the trainer's full forward over the
    same tokens, compared (L x rows x positions routings). Rate 0: the engine is the trainer (no routing differs,
    log-probs equal); rate 0.1: 10% +- 3 s.e. differ, and the engine's log-probs move."""
    moe = em.build_moe_model(hidden=32, layers=2)
    em.supervised_warmup(moe, 5, T=8)
    assert len(em.routers(moe)) == 2
    n, T = 64, 8
    routings = 2 * n * (T + em.N_PROMPT_DIGITS + 2)  # layers x rows x (prompt + completion) positions
    exact = em.moe_flip_engine(moe, 0.0)
    assert em.measure_routing_flips(exact, moe, T, n, seed=1) == 0.0
    flip = em.moe_flip_engine(moe, 0.1, seed=2)
    measured = em.measure_routing_flips(flip, moe, T, n, seed=1)
    se = math.sqrt(0.1 * 0.9 / routings)
    assert abs(measured - 0.1) < 3 * se, (measured, se)
    gen = torch.Generator().manual_seed(4)
    prompts = em.prompt_ids(em.prompt_digits(n, gen))  # (n, P)
    comp, elp, _ = exact.sample(prompts, T, gen)  # (n, T)
    torch.testing.assert_close(elp, em.trainer_forward(moe, prompts, comp).logp, atol=1e-5, rtol=0)
    comp, elp, _ = flip.sample(prompts, T, gen)  # (n, T)
    assert (elp - em.trainer_forward(moe, prompts, comp).logp).abs().max() > 1e-4


def test_smoke_run_of_the_moe_source(tmp_path, one_thread):
    rows = em.main(["--smoke", "--sources", "moe", "--out", str(tmp_path)])
    assert {r["source"] for r in rows} == {"moe"} and {r["level"] for r in rows} == {"flip0.05"}
    assert all(0 < r["routing_flip"] < 0.15 and r["routing_flip_asked"] == 0.05 for r in rows)
    assert all(math.isfinite(r["mse"]) for r in rows)
    again = em.merge_rows(em.read_csv(str(tmp_path / "estimator_map.csv")), [dict(rows[0], level="x")])
    assert [r["level"] for r in again] == ["x"]  # --append replaces the (T, source) rows it measures


def test_gpu_size_is_qwen25_05b_shaped_and_cuda_without_cuda_fails_naming_the_flag(tmp_path, capsys):
    """--size gpu's model has Qwen2.5-0.5B's parameter count (494,032,768 with tied embeddings; the model card's
    0.49B total, 0.36B without embeddings), built on the meta device (no memory, no download); --device cuda on a
    machine without CUDA stops before any work, naming the flag."""
    with torch.device("meta"):
        model = em.build_sized_model(em.QWEN25_05B)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    total = sum(p.numel() for p in model.parameters())
    assert total == 494_032_768 and total - 151_936 * 896 == 357_898_112
    assert em.SIZES["gpu"]["dtype"] == torch.bfloat16 and em.SIZES["gpu"]["lengths"] == "512,1024,2048,4096"
    assert [d for _, d in em.precision_engines(torch.bfloat16)] == [torch.float16, torch.float32]
    assert [d for _, d in em.precision_engines(torch.float32)] == [torch.bfloat16, torch.float16]
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(SystemExit):
        em.main(["--device", "cuda", "--size", "gpu_toy", "--smoke", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "--device cuda" in err and "CUDA is not available" in err and "--device cpu" in err
    assert not (tmp_path / "estimator_map.csv").exists()


def test_gpu_code_path_chunks_equal_the_whole_batch(one_thread):
    """The GPU sizes' forward (rows at a time through the base model and lm_head, pi_theta kept over the task's 256
    ids of a 1024-id vocabulary) and chunked gradient equal the CPU size's whole-batch forward and gradient restricted
    to the same lm_head rows, on a batch whose samples include tail ids (>= 256)."""
    spec = dict(em.SIZES["gpu_toy"]["model"])
    model = em.build_sized_model(spec)  # fp32 here: the comparison is of the code paths, not of bf16 rounding
    gen = torch.Generator().manual_seed(0)
    prompts = em.prompt_ids(em.prompt_digits(16, gen))  # (16, P)
    comp, _, _ = em.Engine(model).sample(prompts, 8, gen)  # (16, 8) an untrained model: many tail ids
    assert (comp >= len(em.VOCAB)).any()
    whole = em.trainer_forward(model, prompts, comp, rows=0)
    chunked = em.trainer_forward(model, prompts, comp, rows=3)
    G = len(em.VOCAB)
    torch.testing.assert_close(chunked.logp, whole.logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked.hidden, whole.hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked.probs, whole.probs[:, :G], atol=1e-6, rtol=1e-5)
    coefs = torch.randn(3, 16, 8, generator=gen)  # (3, B, T)
    expected = em.lm_head_grads(whole, coefs, chunk=0)[:, :G]  # (3, G, d)
    torch.testing.assert_close(em.lm_head_grads(chunked, coefs, chunk=7), expected, atol=1e-5, rtol=1e-4)


def test_smoke_run_of_the_gpu_code_path_at_toy_size(tmp_path, one_thread):
    rows = em.main(["--smoke", "--size", "gpu_toy", "--out", str(tmp_path)])
    by = {r["method"]: r for r in rows}
    assert all(math.isfinite(r["mse"]) for r in rows) and by["none"]["kl_k3"] > 0
    for key in ("bias2", "mse", "relvar", "masked_tok", "masked_seq", "ess_token"):  # TRL's code = the package's
        assert by["pkg_trl_default"][key] == pytest.approx(by["trl_sequence_mask"][key], rel=1e-5, abs=1e-9), key
    assert em.CHUNKS.fwd_rows is None and em.CHUNKS.grad_tokens is None  # main restores the CPU size's chunks
