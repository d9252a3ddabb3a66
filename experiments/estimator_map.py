"""Estimator map (issue 36, part 1): each correction's policy-gradient estimate against the on-policy gradient, no
training.

For completion length T x mismatch source x level, a batch of 64 engine samples (8 prompts x 8 completions, GRPO
advantages from the task reward, computed by TRL) gives each method's gradient; over ``--batches`` batches this
measures, against g* (the expectation of the uncorrected loss's gradient on on-policy samples of the trainer):

* bias: every engine batch comes with the trainer's own samples for the same prompts, drawn with the same Gumbel
  noise (each keeps its exact distribution; the two agree wherever the distributions are close), so
  E[g(engine batch) - g_none(its on-policy batch)] = E g - g* is measured with far less noise than either mean (a
  batch of 64 gives a gradient whose noise is many times its signal). g* and V_on (the per-batch noise of the
  uncorrected estimator on on-policy batches) come from every coupled on-policy batch of the T: a large on-policy
  sample, once per T. bias2 = ||E g - g*||^2 / V_on (unbiased; negative: within noise), relvar = E||g - Eg||^2 /
  V_on, mse = relvar + bias2 (1 for the uncorrected estimator on on-policy batches), bias_rel = ||E g - g*|| /
  ||g*||, breakeven_batch = 64 relvar / bias2 (the batch size above which bias outweighs variance);
* the method's effective per-token weight  w = c_method / c_none  (c = dLoss/d log pi_theta(token)): its token ESS
  (sum w)^2 / (N sum w^2), range, the fraction of tokens with w = 0 and of sequences with every w = 0;
* per cell: the measured per-token KL(pi_engine || pi_trainer) (k1 and k3 estimators on the engine's samples), T*KL,
  the raw sequence weight's ESS and the small-mismatch theory exp(-2 T KL).

The gradient is that of the output layer (``lm_head.weight``, V x d), in closed form from the coefficients:
d log pi(y_t) / dW = (e_y - p_t) h_t^T, so g = sum_t c_t (e_{y_t} - p_t) h_t^T (one trainer forward per batch
serves every method; ``tests/experiments/test_estimator_map.py`` checks it against autograd).

Methods. ``none`` and TRL's four ``vllm_importance_sampling_mode`` s (C = 3, TRL's default clip_min) are computed by
TRL's own code: TRL's ``GRPOTrainer`` (its vLLM switch on, the engine replaced by a rollout_func that returns this
batch's engine samples and log-probs, as ``tests/config/test_trl_modes.py`` does) computes rewards, advantages and its
IS ratio in ``_generate_and_score_completions``, and its ``_compute_loss`` gives the loss whose derivative in the
per-token log-probs is c. The package's presets go through the package's core (``compute_rollout_correction_stats``)
and ``losses.py`` (the inputs its trainer hands TRL's loss), then TRL's same ``_compute_loss``. The policy forward
is the fp32 trainer's, with pi_old = pi_theta (one optimizer step per generation): the gradient at the sampled
policy. TRL's private names are reached here, in a benchmark, as the tests reach them
(``tests/repo/test_trl_boundary.py`` scans the package only).

MoE routing flips (source ``moe``). A tiny Qwen2-MoE (:func:`build_moe_model`: 8 experts, top-2, a shared expert,
hidden 64, 2 layers, 280k parameters) trained as the dense model (the same 150 supervised steps, the same 64
on-policy steps) is the trainer; its engine is a copy whose routers flip a share q of the (token, layer) routings
(q = 0, the control, and 1%, 2%, 5%: the weakest chosen expert replaced by the next-ranked one, :class:`RoutingFlips`),
the routing mismatch of arXiv:2510.11370 (Routing Replay, R3) and arXiv:2510.18855 (IcePop). Each cell reports the
measured share of routings whose expert set differs between the engine's sampling and the trainer's forward on the
same tokens (``routing_flip``: the injected flips and what they change downstream) and, as every source, the
measured per-token KL. The MoE cells have their own g* and V_on (the MoE model's on-policy gradient).

Sizes (``--size``, :data:`SIZES`; ``--device cpu`` or ``cuda``). ``cpu`` (the default, the committed results): the
model above, hidden 64, 2 layers, vocabulary 256, ~0.16M parameters, fp32, T = 8 / 64 / 256 (1024 with ``--lengths``),
16 / 12 / 6 batches. ``gpu``: a Qwen2.5-0.5B-shaped Qwen2 (``Qwen2Config``: hidden 896, 24 layers, 14 attention heads,
2 KV heads, intermediate 4864, vocabulary 151,936 of which the task uses the first 256, tied embeddings, rope theta
1e6; 494,032,768 parameters), random weights built locally (nothing downloaded), trained in fp32 as the CPU model is
(150 supervised steps, at AdamW 3e-4, not tried; 64 on-policy steps; only the checkpoints of lags 1/4/16/64 kept),
then cast to bf16: the trainer is bf16, its precision engines fp16 and fp32; T = 512 / 1024 / 2048 / 4096, 4 / 3 / 2 /
2 batches per cell; the MoE source stays at the CPU size. Memory: the trainer's forward runs one sequence at a time
through the base model and lm_head (no (B, P+T, V) logits tensor), the measured gradient is that of the lm_head rows
of the task's 256 tokens (the whole lm_head at the CPU size), in chunks of 8192 tokens; sampling 64 rows at a time;
TRL's loss on the CPU. ``gpu_toy``: the same code path at toy size (hidden 32, 1 layer, vocabulary 1024, bf16), what
the CPU test runs. ``python experiments/estimator_map.py --device cuda --size gpu --out DIR`` has NOT been run on a GPU
(no GPU in the session that wrote it): its run time and memory are not measured.

Run: ``python experiments/estimator_map.py --out DIR`` (or ``python experiments/mismatch_bench.py --map --out DIR``);
``--smoke`` for one T, one source, one level, 2 batches (``--smoke --sources moe``: one MoE cell);
``--sources moe --append`` adds cells to OUT's CSV, replacing only the (T, source) pairs it measures.
"""

from __future__ import annotations

import argparse
import copy
import csv
import math
import os
import sys
import time
from collections import defaultdict
from types import SimpleNamespace

import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

DIGITS = [str(d) for d in range(10)]
SPECIAL = ["<pad>", "<eos>", "<unk>", "<bos>"]
N_TAIL = 240  # rarely used tokens: the long low-probability tail of a real vocabulary
VOCAB = SPECIAL + DIGITS + ["sum", "="] + [f"~{i:03d}" for i in range(N_TAIL)]
DIGIT0 = len(SPECIAL)
N_PROMPT_DIGITS = 4
GROUP, PROMPTS_PER_BATCH = 8, 8
BATCH = GROUP * PROMPTS_PER_BATCH
TRL_C = 3.0
M2_TAU = 0.04
TARGET_KLS = (3e-4, 3e-3, 3e-2)

#: Qwen2.5-0.5B's shape (its config.json): random weights, built locally, nothing downloaded
QWEN25_05B = dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151_936, max_len=32_768,
                  rope_theta=1e6)
#: ``--size``: the trainer model (``model``: None is :func:`build_model`'s; a dict is :func:`build_sized_model`'s), its
#: dtype, the default lengths and batches per cell, the supervised warm-up's learning rate (3e-4 for 24 layers: a
#: guess, not tried) and the memory chunks: rows per trainer forward (``fwd_rows``,
#: None: the whole batch at once, its hidden states read by a hook), tokens per gradient chunk (``grad_tokens``) and
#: rows per sampling call (``sample_rows``). ``gpu_toy`` runs ``gpu``'s code path at toy size (the CPU smoke test):
#: bf16, tied embeddings, a model vocabulary larger than the task's, chunked forward and gradient.
SIZES = {
    "cpu": dict(model=None, dtype=torch.float32, lengths="8,64,256", batches="16,12,6", fwd_rows=None,
                grad_tokens=None, sample_rows=512, warmup_lr=3e-3),
    "gpu": dict(model=QWEN25_05B, dtype=torch.bfloat16, lengths="512,1024,2048,4096", batches="4,3,2,2",
                fwd_rows=1, grad_tokens=8192, sample_rows=64, warmup_lr=3e-4),
    "gpu_toy": dict(model=dict(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, vocab=1024, max_len=1100,
                               rope_theta=1e6), dtype=torch.bfloat16, lengths="16", batches="2", fwd_rows=16,
                    grad_tokens=100, sample_rows=64, warmup_lr=3e-3),
}
CHUNKS = SimpleNamespace(fwd_rows=None, grad_tokens=None, sample_rows=512)  # set by main from --size


# ---------------------------------------------------------------- task and model
def build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   bos_token="<bos>", padding_side="left")


def build_model(hidden: int = 64, layers: int = 2, seed: int = 0, max_len: int = 1100):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(VOCAB), hidden_size=hidden, intermediate_size=4 * hidden,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=max_len, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
                      bos_token_id=3)
    model = Qwen2ForCausalLM(cfg).eval()
    return model


def build_sized_model(spec: dict, seed: int = 0):
    """A Qwen2 model of ``spec``'s shape (:data:`SIZES`; tied input and output embeddings, as Qwen2.5-0.5B), random
    weights; the task's tokens are its first ``len(VOCAB)`` ids, the rest a never-trained tail."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
                      num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                      num_key_value_heads=spec["kv_heads"], max_position_embeddings=spec["max_len"],
                      rope_parameters={"rope_type": "default", "rope_theta": spec["rope_theta"]},
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=3)
    return Qwen2ForCausalLM(cfg).eval()


def device_of(model) -> torch.device:
    return next(model.parameters()).device


def resolve_device(name: str) -> torch.device:
    """``--device``: ``cpu`` or ``cuda`` (``cuda:N``); a CUDA device without CUDA fails here, naming the flag."""
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available here (torch.cuda.is_available() is False; torch "
                         f"{torch.__version__}); run with --device cpu, or on a machine with a GPU and a CUDA build "
                         "of torch")
    if not (name == "cpu" or name.startswith("cuda")):
        raise ValueError(f"--device {name}: expected cpu or cuda[:N]")
    return torch.device(name)


def prompt_digits(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 10, (n, N_PROMPT_DIGITS), generator=gen, device=gen.device)  # (N, 4)


def prompt_ids(digits: torch.Tensor) -> torch.Tensor:
    n = digits.size(0)
    head = torch.full((n, 1), VOCAB.index("sum"), device=digits.device)  # (N, 1)
    tail = torch.full((n, 1), VOCAB.index("="), device=digits.device)  # (N, 1)
    return torch.cat([head, digits + DIGIT0, tail], dim=1)  # (N, P)


def targets(digits: torch.Tensor, T: int) -> torch.Tensor:
    """Running sums: y_t = (y_{t-1} + x_{t mod 4}) mod 10, y_{-1} = 0 (an early error ruins the rest, as in CoT)."""
    x = digits.repeat(1, T // N_PROMPT_DIGITS + 1)[:, :T]  # (N, T)
    return torch.cumsum(x, dim=1) % 10  # (N, T)


def reward_from_ids(digits: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
    """Fraction of steps consistent with the rule given the previous token: 1[y_t = (y_{t-1} + x_{t mod 4}) mod 10]
    (a non-digit token counts as wrong and as 0 for the next step)."""
    T = completion.size(1)
    y = completion - DIGIT0  # (N, T)
    is_digit = (y >= 0) & (y < 10)  # (N, T)
    y = torch.where(is_digit, y, torch.zeros_like(y))  # (N, T)
    prev = torch.cat([torch.zeros_like(y[:, :1]), y[:, :-1]], dim=1)  # (N, T)
    x = digits.repeat(1, T // N_PROMPT_DIGITS + 1)[:, :T]  # (N, T)
    ok = is_digit & (y == (prev + x) % 10)  # (N, T)
    return ok.float().mean(1)  # (N,)


def supervised_warmup(model, steps: int, T: int, lr: float = 3e-3, seed: int = 0) -> None:
    gen = torch.Generator(device=device_of(model)).manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        d = prompt_digits(64, gen)  # (64, 4)
        ids = torch.cat([prompt_ids(d), targets(d, T) + DIGIT0], dim=1)  # (64, P+T)
        labels = ids.clone()
        labels[:, : N_PROMPT_DIGITS + 2] = -100
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


# ---------------------------------------------------------------- engines (mismatch sources)
def fp8_like(model):
    """Every Linear weight cast to float8_e4m3fn with a per-tensor scale (amax / 448) and back (FlashRL-like)."""
    eng = copy.deepcopy(model)
    with torch.no_grad():
        for mod in eng.modules():
            if isinstance(mod, torch.nn.Linear):
                w = mod.weight
                scale = w.abs().max().clamp(min=1e-12) / 448.0
                mod.weight.copy_((w / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale)
    return eng


class Engine:
    """A sampler: a model (another dtype, quantized weights or an older checkpoint) and a logits transform (noise,
    truncation). Samples T tokens from its own distribution and reports its log-prob of each (the renormalized one
    for truncation, as vLLM's processed log-probs)."""

    def __init__(self, model, kind: str = "exact", knob: float = 0.0):
        self.model, self.kind, self.knob = model, kind, knob

    def log_probs(self, logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        z = logits.float().log_softmax(-1)  # (N, V)
        if self.kind == "heavy":  # dense noise + sparse spikes on low-probability tokens (Liu et al.'s mechanism)
            noise = torch.randn(z.shape, generator=gen, device=z.device)  # (N, V)
            spike = (torch.rand(z.shape, generator=gen, device=z.device) < 0.01) & (z < math.log(1e-3))  # (N, V)
            z = (z + self.knob * (noise + 10.0 * spike)).log_softmax(-1)  # (N, V)
        elif self.kind == "top_p":
            p = z.exp()  # (N, V)
            sp, idx = p.sort(-1, descending=True)  # (N, V)
            drop_sorted = (sp.cumsum(-1) - sp) >= self.knob  # (N, V) mass before the token already >= top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)  # (N, V)
            z = z.masked_fill(drop, -math.inf).log_softmax(-1)  # (N, V)
        elif self.kind == "top_k":
            kth = z.topk(int(self.knob), dim=-1).values[:, -1:]  # (N, 1)
            z = z.masked_fill(z < kth, -math.inf).log_softmax(-1)  # (N, V)
        return z  # (N, V)

    @torch.no_grad()
    def sample(self, prompts: torch.Tensor, T: int, gen: torch.Generator, partner: Engine | None = None):
        """(completions (N, T), engine log-probs (N, T), the partner's completions (N, T) or None).

        Gumbel-max sampling, y = argmax(log p + G). With a ``partner`` (the trainer's own policy) both sample in
        lockstep with the same Gumbel noise G at every step: each keeps its exact distribution, and the two agree
        wherever their distributions are close (a coupling: E[g(engine) - g(policy)] = E g - g*, the bias, is
        measured with far less noise than either mean)."""
        N = prompts.size(0)
        shared = partner is not None and partner.model is self.model
        models = [self.model] if partner is None or shared else [self.model, partner.model]
        start = torch.cat([prompts, prompts]) if shared else prompts  # (N or 2N, P)
        state = []
        for m in models:
            out = m(input_ids=start, use_cache=True)
            state.append([out.past_key_values, out.logits[:, -1]])  # (rows, V)
        ys, lps, pys = [], [], []
        for _ in range(T):
            if shared:
                logits_e, logits_p = state[0][1][:N], state[0][1][N:]  # (N, V) each
            else:
                logits_e, logits_p = state[0][1], (state[1][1] if partner is not None else None)
            z = self.log_probs(logits_e, gen)  # (N, V)
            u = torch.rand(z.shape, generator=gen, device=z.device).clamp_(min=1e-20)  # (N, V)
            gumbel = -torch.log(-torch.log(u))  # (N, V)
            y = (z + gumbel).argmax(-1, keepdim=True)  # (N, 1)
            ys.append(y)
            lps.append(z.gather(1, y))  # (N, 1)
            if partner is not None:
                zp = partner.log_probs(logits_p, gen)  # (N, V)
                pys.append((zp + gumbel).argmax(-1, keepdim=True))  # (N, 1)
            if shared:
                nxt = [torch.cat([y, pys[-1]])]  # (2N, 1)
            else:
                nxt = [y] + ([pys[-1]] if partner is not None else [])
            for st, m, tok in zip(state, models, nxt):
                out = m(input_ids=tok, past_key_values=st[0], use_cache=True)
                st[0], st[1] = out.past_key_values, out.logits[:, -1]  # (rows, V)
        partner_ys = torch.cat(pys, 1) if partner is not None else None  # (N, T)
        return torch.cat(ys, 1), torch.cat(lps, 1), partner_ys  # (N, T), (N, T), (N, T)


# ---------------------------------------------------------------- MoE routing flips
MOE_EXPERTS, MOE_TOP_K = 8, 2
MOE_FLIP_RATES = (0.01, 0.02, 0.05)  # the share of (token, layer) routings the engine changes


def build_moe_model(hidden: int = 64, layers: int = 2, seed: int = 0, max_len: int = 1100):
    """A tiny Qwen2-MoE (``Qwen2MoeForCausalLM``, built locally): ``MOE_EXPERTS`` routed experts of width ``hidden``
    (top-``MOE_TOP_K``, routing weights the chosen experts' softmax probabilities, Qwen2-MoE's default
    ``norm_topk_prob=False``) plus a gated shared expert of width ``hidden`` in every layer; the same vocabulary,
    attention and task as :func:`build_model`."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2MoeConfig(vocab_size=len(VOCAB), hidden_size=hidden, intermediate_size=4 * hidden,
                         moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden,
                         num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K, decoder_sparse_step=1,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=max_len, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
                         bos_token_id=3)
    return Qwen2MoeForCausalLM(cfg).eval()


def routers(model) -> list[torch.nn.Module]:
    """The model's top-k routers (modules returning (router logits, routing weights, expert indices))."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


class RoutingFlips:
    """The engine's routing differs from the trainer's: at each (token, layer) routing, with probability ``rate``
    (its own generator), the k-th chosen expert (the weakest of the top-k) is replaced by the (k+1)-th ranked one
    and the routing weights are re-read from the router's probabilities: the near-tie flip that a different kernel,
    precision or batch composition produces in an inference engine (Routing Replay / R3, arXiv:2510.11370; IcePop,
    arXiv:2510.18855). Forward hooks on every router of ``model`` (the engine's own copy)."""

    def __init__(self, model, rate: float, seed: int = 0):
        self.rate, self.flipped, self.routed = rate, 0, 0
        self.gen = torch.Generator().manual_seed(seed)
        self.handles = [r.register_forward_hook(self.hook) for r in routers(model)]

    def hook(self, module, args, out):
        logits, _, idx = out  # (n, E), (n, k), (n, k)
        probs = logits.float().softmax(-1)  # (n, E)
        k = idx.size(1)
        ranked = probs.topk(k + 1, dim=-1).indices  # (n, k+1)
        flip = torch.rand(idx.size(0), generator=self.gen).to(idx.device) < self.rate  # (n,)
        idx = idx.clone()  # (n, k)
        idx[:, k - 1] = torch.where(flip, ranked[:, k], idx[:, k - 1])  # (n, k)
        weights = probs.gather(1, idx)  # (n, k)
        if module.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)  # (n, k)
        self.flipped += int(flip.sum())
        self.routed += idx.size(0)
        return logits, weights.to(logits.dtype), idx


class RouteRecorder:
    """Records every router call's chosen experts, per layer: ``calls[layer]`` = list of (rows, positions, k)."""

    def __init__(self, model):
        self.calls: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.handles = []
        for i, r in enumerate(routers(model)):
            self.handles.append(r.register_forward_hook(
                lambda mod, args, out, i=i: self.calls[i].append((args[0].shape[:-1], out[2]))))

    def sets(self, rows: int) -> torch.Tensor:
        """The chosen expert sets, (layers, rows, positions, k) sorted, positions concatenated over the calls."""
        per_layer = []
        for i in sorted(self.calls):
            parts = [idx.view(rows, -1, idx.size(-1)) for _, idx in self.calls[i]]  # (rows, S, k) each
            per_layer.append(torch.cat(parts, 1).sort(-1).values)  # (rows, positions, k)
        return torch.stack(per_layer)  # (L, rows, positions, k)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def moe_flip_engine(model, rate: float, seed: int = 0) -> Engine:
    eng = copy.deepcopy(model).eval()
    engine = Engine(eng)
    engine.flips = RoutingFlips(eng, rate, seed)
    return engine


@torch.no_grad()
def measure_routing_flips(engine: Engine, model, T: int, n: int, seed: int) -> float:
    """The share of (token, layer) routings where the engine's chosen expert set differs from the trainer's on the
    same tokens (the engine's samples, re-read by the trainer's full forward): the injected flips plus what they
    change downstream."""
    gen = torch.Generator(device=device_of(model)).manual_seed(seed)
    prompts = prompt_ids(prompt_digits(n, gen))  # (n, P)
    rec_e = RouteRecorder(engine.model)
    try:
        comp, _, _ = engine.sample(prompts, T, gen)  # (n, T)
    finally:
        rec_e.remove()
    rec_t = RouteRecorder(model)
    try:
        model(input_ids=torch.cat([prompts, comp], 1))
    finally:
        rec_t.remove()
    e, t = rec_e.sets(n), rec_t.sets(n)  # (L, n, P+T, k) each
    return (e != t).any(-1).float().mean().item()


# ---------------------------------------------------------------- the trainer's forward and the lm_head gradient
class Forward(SimpleNamespace):
    logp: torch.Tensor  # (B, T) log pi_theta of the sampled tokens
    probs: torch.Tensor  # (B*T, V) pi_theta
    hidden: torch.Tensor  # (B*T, d) lm_head input
    tokens: torch.Tensor  # (B*T,)


@torch.no_grad()
def trainer_forward(model, prompts: torch.Tensor, completions: torch.Tensor, rows: int | None = None) -> Forward:
    """The trainer's log-probs of the completions, its lm_head inputs h_t and pi_theta over the task's vocabulary
    (the first ``len(VOCAB)`` ids: the rows of lm_head whose gradient the map measures; all of them at the CPU size).
    ``rows`` (default ``CHUNKS.fwd_rows``): the GPU sizes' path, ``rows`` sequences per forward of the base model and
    its lm_head, so that no (B, P+T, V) logits tensor is ever built (64 x 4k x 152k)."""
    rows = CHUNKS.fwd_rows if rows is None else rows
    if rows:
        return _chunked_forward(model, prompts, completions, rows)
    captured = {}
    handle = model.lm_head.register_forward_pre_hook(lambda mod, args: captured.__setitem__("h", args[0]))
    try:
        ids = torch.cat([prompts, completions], 1)  # (B, P+T)
        logits = model(input_ids=ids).logits  # (B, P+T, V)
    finally:
        handle.remove()
    P, T = prompts.size(1), completions.size(1)
    logits = logits[:, P - 1:P - 1 + T].float()  # (B, T, V)
    logprobs = logits.log_softmax(-1)  # (B, T, V)
    logp = logprobs.gather(-1, completions.unsqueeze(-1)).squeeze(-1)  # (B, T)
    hidden = captured["h"][:, P - 1:P - 1 + T].float()  # (B, T, d)
    return Forward(logp=logp, probs=logprobs.exp().reshape(-1, logits.size(-1)),
                   hidden=hidden.reshape(-1, hidden.size(-1)), tokens=completions.reshape(-1))


def _chunked_forward(model, prompts: torch.Tensor, completions: torch.Tensor, rows: int) -> Forward:
    P, T = prompts.size(1), completions.size(1)
    G = len(VOCAB)
    logp, probs, hidden = [], [], []
    for i in range(0, prompts.size(0), rows):
        ids = torch.cat([prompts[i:i + rows], completions[i:i + rows]], 1)  # (r, P+T)
        h = model.model(input_ids=ids).last_hidden_state[:, P - 1:P - 1 + T]  # (r, T, d)
        logprobs = model.lm_head(h).float().log_softmax(-1)  # (r, T, V)
        logp.append(logprobs.gather(-1, completions[i:i + rows].unsqueeze(-1)).squeeze(-1))  # (r, T)
        probs.append(logprobs[..., :G].exp().reshape(-1, G))  # (r*T, G)
        hidden.append(h.float().reshape(-1, h.size(-1)))  # (r*T, d)
        del logprobs
    return Forward(logp=torch.cat(logp), probs=torch.cat(probs), hidden=torch.cat(hidden),
                   tokens=completions.reshape(-1))


def lm_head_grads(fwd: Forward, coefs: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """g_m = sum_t c_m,t (e_{y_t} - p_t) h_t^T for M coefficient sets (M, B, T) at once, over the V rows of
    ``fwd.probs`` (a sampled token outside them adds only its -p_t part).   (M, V, d)

    ``chunk`` (default ``CHUNKS.grad_tokens``; None: all at once) tokens at a time bounds the (M, chunk, d) product."""
    chunk = CHUNKS.grad_tokens if chunk is None else chunk
    M = coefs.size(0)
    c = coefs.reshape(M, -1).to(device=fwd.hidden.device, dtype=fwd.hidden.dtype)  # (M, N)
    N, V, d = c.size(1), fwd.probs.size(1), fwd.hidden.size(1)
    g = torch.zeros(M, V, d, dtype=c.dtype, device=c.device)  # (M, V, d)
    step = chunk or N
    for i in range(0, N, step):
        ch = c[:, i:i + step].unsqueeze(-1) * fwd.hidden[i:i + step].unsqueeze(0)  # (M, n, d)
        tokens = fwd.tokens[i:i + step]  # (n,)
        inside = tokens < V  # (n,)
        if inside.all():
            g.index_add_(1, tokens, ch)  # (M, V, d)  sum_t c_t e_{y_t} h_t^T
        else:
            g.index_add_(1, tokens[inside], ch[:, inside])  # (M, V, d)
        g -= torch.einsum("nv,mnd->mvd", fwd.probs[i:i + step], ch)  # (M, V, d)  - sum_t c_t p_t h_t^T
    return g  # (M, V, d)


# ---------------------------------------------------------------- methods
def package_methods():
    """Name -> RolloutCorrectionConfig: the package's presets that apply (IcePop and M2PO as the field defines them
    among them: ``icepop``, weight 0 outside [0.5, 5] with the token kept in the count, verl's
    ``decoupled_token_icepop``; ``m2po``, M2PO's final Algorithm 1), the all-token second-moment mask (AReaL's
    ``m2_threshold``), and TRL's default spelled with the package's fields (a check: equal to TRL's own)."""
    from trl_rollout_corr import RolloutCorrectionConfig as R

    names = ["decoupled_token_is", "decoupled_seq_is", "decoupled_seq_is_rs", "decoupled_geo_rs", "ppo_is_bypass",
             "pg_is", "pg_rs", "icepop", "decoupled_token_band_rs", "m2po", "trl_default"]
    methods = {n: R.from_preset(n) for n in names if n in R.preset_names()}
    methods["m2_all_tokens_0.04"] = R(rollout_is=None, rollout_m2_threshold=M2_TAU)
    if "decoupled_token_band_rs" not in methods:  # before branch methods: icepop was the [0.5, 2] token rejection
        methods["decoupled_token_band_rs"] = methods.pop("icepop")
        methods["icepop"] = R(rollout_is="token", rollout_is_bound="mask", rollout_is_threshold=5.0,
                              rollout_is_threshold_lower=0.5)
    methods["pkg_trl_default"] = methods.pop("trl_default")
    return methods


TRL_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


class TrlLoss:
    """TRL's GRPOTrainer with its vLLM switch on; the engine is this batch's samples (rollout_func), the policy
    forward returns the batch's precomputed fp32 log-probs (as a leaf, so dLoss/dlogp is the coefficient c)."""

    def __init__(self, model, T: int, out_dir: str):
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        self.GRPOTrainer = GRPOTrainer
        self.tok = build_tokenizer()
        self.batch = None
        args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
                          num_generations=GROUP, max_completion_length=T, max_steps=1, learning_rate=1e-3,
                          logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=0,
                          dataloader_num_workers=0, vllm_importance_sampling_correction=False)
        rows = [{"prompt": "sum 0 0 0 0 ="}] * BATCH

        def reward(prompts, completions, completion_ids=None, **_):
            return self.batch["reward"].tolist()

        def rollout_func(prompts, trainer):
            b = self.batch
            tail = b["completions"] >= len(VOCAB)  # (B, T) GPU sizes: a model vocabulary beyond the tokenizer's
            completions = b["completions"].masked_fill(tail, VOCAB.index("<unk>"))  # (B, T) TRL only decodes them
            return {"prompt_ids": b["prompts"].tolist(), "completion_ids": completions.tolist(),
                    "logprobs": b["engine_logp"].double().tolist()}

        # TRL gets its own copy: its setup wraps the model's forward (a deepcopy of the wrapped model would still run
        # the original's weights); the policy forward it asks for is stubbed below anyway
        self.trainer = GRPOTrainer(model=copy.deepcopy(model), reward_funcs=reward, args=args,
                                   train_dataset=Dataset.from_list(rows), processing_class=self.tok,
                                   rollout_func=rollout_func)
        t = self.trainer
        t.use_vllm, t._last_loaded_step = True, -1
        t.vllm_generation = SimpleNamespace(sync_weights=lambda: None)
        t.vllm_importance_sampling_clip_max, t.vllm_importance_sampling_clip_min = TRL_C, None
        t.model.train()
        t.current_gradient_accumulation_steps = 1
        self.logp = None

        def forward(*args, **kwargs):  # TRL's policy (and pi_old) forward: the batch's fp32 log-probs
            return self.logp, torch.zeros_like(self.logp), None

        t._get_per_token_logps_and_entropies = forward

    def generate(self, batch: dict, mode: str | None) -> dict:
        """TRL's generation batch (rewards, advantages, its IS ratio for ``mode``; None: TRL's correction off)."""
        t = self.trainer
        self.batch, self.logp = batch, batch["train_logp"]
        t.vllm_importance_sampling_correction = mode is not None
        t.vllm_importance_sampling_mode = mode or "sequence_mask"
        prompts = [{"prompt": " ".join(VOCAB[i] for i in row)} for row in batch["prompts"].tolist()]
        out = t._generate_and_score_completions(prompts)
        clear_metrics(t)
        return out

    def coef(self, inputs: dict) -> torch.Tensor:
        """c = dLoss/d log pi_theta (B, T) of TRL's ``_compute_loss`` on ``inputs``."""
        leaf = self.batch["train_logp"].clone().requires_grad_(True)  # (B, T)
        self.logp = leaf
        inputs = dict(inputs)
        inputs.setdefault("num_items_in_batch", (inputs["completion_mask"]).sum().float())
        self.trainer.vllm_importance_sampling_correction = "importance_sampling_ratio" in inputs
        loss = self.GRPOTrainer._compute_loss(self.trainer, self.trainer.model, inputs)
        clear_metrics(self.trainer)
        (c,) = torch.autograd.grad(loss, leaf)
        self.logp = self.batch["train_logp"]
        return c.detach()  # (B, T)


def clear_metrics(trainer) -> None:
    for logged in trainer._metrics.values():  # TRL's per-mode metric lists: kept from growing over many calls
        logged.clear()


def package_inputs(cfg, base: dict, train_logp: torch.Tensor, engine_logp: torch.Tensor) -> dict:
    """The micro-batch this package's trainer hands TRL's loss (``trainer._correction`` / ``_corrected_inputs``, one
    generation batch = one micro-batch, pi_old = pi_theta), from the core's weights and mask."""
    from trl_rollout_corr.core import compute_rollout_correction_stats
    from trl_rollout_corr.core.losses import PI_ROLLOUT, corrected_loss_mask, safe_anchor, weighted_advantages

    mask = base["completion_mask"]  # (B, T)
    m2po = getattr(cfg, "zeroes_advantages", False)  # M2PO's trust region reads the advantages' signs
    extra = {"advantages": base["advantages"]} if m2po else {}
    result = compute_rollout_correction_stats(train_logp, engine_logp, mask, cfg.params(), **extra)
    keep = result.modified_response_mask.to(mask.dtype)  # (B, T)
    is_weights, anchor = result.is_weights, None
    if cfg.loss_anchor == PI_ROLLOUT:  # bypass PPO: TRL's ratio pi_theta / pi_rollout is rho; w feeds metrics only
        anchor = engine_logp
    if not cfg.applies_is_weights:
        is_weights = None
    patched = dict(base)
    patched["tool_mask"] = corrected_loss_mask(mask, base.get("tool_mask"), keep)  # (B, T)
    patched["advantages"] = weighted_advantages(base["advantages"], is_weights, cfg.rollout_is == "sequence")
    if m2po and result.advantage_mask is not None:  # losses.zeroed_advantages: A = 0, token kept in the count
        from trl_rollout_corr.core.losses import zeroed_advantages

        patched["advantages"] = zeroed_advantages(patched["advantages"], result.advantage_mask)  # (B, T)
    kept = mask * keep  # (B, T)
    if anchor is not None:
        patched["old_per_token_logps"] = safe_anchor(anchor, train_logp, kept)  # (B, T)
    else:
        patched.pop("old_per_token_logps", None)
    patched.pop("importance_sampling_ratio", None)
    patched["sampling_per_token_logps"] = engine_logp
    patched["num_items_in_batch"] = (kept if cfg.masks_tokens else mask).sum().float()
    return patched


def method_coefs(trl: TrlLoss, batch: dict, pkg: dict) -> dict[str, torch.Tensor]:
    """Every method's coefficient c (B, T) on one batch."""
    base = trl.generate(batch, None)
    coefs = {"none": trl.coef(base)}
    for mode in TRL_MODES:
        coefs[f"trl_{mode}"] = trl.coef(trl.generate(batch, mode))
    for name, cfg in pkg.items():
        coefs[name] = trl.coef(package_inputs(cfg, base, batch["train_logp"], batch["engine_logp"]))
    return coefs


# ---------------------------------------------------------------- the map
def sample_batches(engine: Engine, trainer_model, T: int, n_batches: int, gen: torch.Generator,
                   chunk: int | None = None, coupled: bool = False):
    """``n_batches`` batches of 8 prompts x 8 completions from ``engine``, sampled together (up to ``chunk`` rows at a
    time: one step of a small model costs about the same for 64 rows as for 512), each with the trainer's forward.
    ``coupled``: each batch also carries ``"policy"``, the trainer's own samples for the same prompts, coupled to the
    engine's (:meth:`Engine.sample`). The batch's (B, T) tensors are on the CPU (TRL's loss runs there), its
    forward (``"fwd"``) on the model's device."""
    chunk = chunk or CHUNKS.sample_rows
    digits = prompt_digits(n_batches * PROMPTS_PER_BATCH, gen).repeat_interleave(GROUP, 0)  # (n*B, 4)
    prompts = prompt_ids(digits)  # (n*B, P)
    partner = Engine(trainer_model) if coupled else None
    parts = [engine.sample(prompts[i:i + chunk], T, gen, partner) for i in range(0, prompts.size(0), chunk)]
    completions = torch.cat([c for c, _, _ in parts])  # (n*B, T)
    engine_logp = torch.cat([lp for _, lp, _ in parts])  # (n*B, T)
    policy = torch.cat([p for _, _, p in parts]) if coupled else None  # (n*B, T)
    for b in range(n_batches):
        rows = slice(b * BATCH, (b + 1) * BATCH)
        fwd = trainer_forward(trainer_model, prompts[rows], completions[rows])
        batch = {"prompts": prompts[rows].cpu(), "completions": completions[rows].cpu(),
                 "engine_logp": engine_logp[rows].cpu(), "train_logp": fwd.logp.cpu(),
                 "reward": reward_from_ids(digits[rows], completions[rows]).cpu(), "fwd": fwd}
        if coupled:
            pf = trainer_forward(trainer_model, prompts[rows], policy[rows])
            batch["policy"] = {"prompts": prompts[rows].cpu(), "completions": policy[rows].cpu(),
                               "engine_logp": pf.logp.cpu(), "train_logp": pf.logp.cpu(),
                               "reward": reward_from_ids(digits[rows], policy[rows]).cpu(), "fwd": pf}
        yield batch


def ess(w: torch.Tensor) -> float:
    """Normalized effective sample size (sum w)^2 / (n sum w^2) in (0, 1] of non-negative weights (any shape)."""
    w = w.double().flatten()  # (n,)
    return (w.sum() ** 2 / (w.numel() * w.pow(2).sum())).item()


def sequence_ess(log_rho: torch.Tensor) -> float:
    """The ESS of the raw sequence weights prod_t rho_t from the per-token log rho (n, T), computed from
    exp(sum_t log rho_t - max): ESS is scale-free, and the weights themselves overflow where T*KL is in the hundreds."""
    log_w = log_rho.double().sum(1)  # (n,)
    return ess((log_w - log_w.max()).exp())


def effective_weights(coefs: dict, name: str) -> torch.Tensor:
    c0 = coefs["none"]  # (B, T)
    ok = c0.abs() > 1e-12  # (B, T)
    return torch.where(ok, coefs[name] / torch.where(ok, c0, 1.0), torch.nan)  # (B, T)


class OnPolicy:
    """The on-policy gradient g* of one T, pooled over every cell's coupled policy batches (a large on-policy sample),
    and V_on = E||g_on - g*||^2, the per-batch noise of the uncorrected estimator on on-policy batches of 64: the unit
    of the map's variances, biases and MSEs."""

    def __init__(self):
        self.sum, self.sq, self.n = None, 0.0, 0

    def add(self, g: torch.Tensor) -> None:
        self.sum = g.clone() if self.sum is None else self.sum + g
        self.sq += g.pow(2).sum().item()
        self.n += 1

    def finish(self) -> dict:
        mean = self.sum / self.n  # (V, d)
        var = (self.sq / self.n - mean.pow(2).sum().item()) * self.n / (self.n - 1)  # V_on
        g2 = mean.pow(2).sum().item() - var / self.n  # ||g*||^2, unbiased
        return {"v_on": var, "g_star_sq": g2, "n_on": self.n}


def run_cell(trl: TrlLoss, model, engine: Engine, T: int, n_batches: int, pkg: dict, seed: int,
             on_policy: OnPolicy) -> list[dict]:
    """Every method's raw measures on one (T, source, level) cell (:func:`finish_rows` scales them by V_on)."""
    gen = torch.Generator(device=device_of(model)).manual_seed(seed)
    acc = defaultdict(lambda: defaultdict(float))
    names, w_all, lr_all, same = None, defaultdict(list), [], []
    for batch in sample_batches(engine, model, T, n_batches, gen, coupled=True):
        coefs = method_coefs(trl, batch, pkg)
        names = list(coefs)
        grads = lm_head_grads(batch["fwd"], torch.stack([coefs[n] for n in names]))  # (M, V, d)
        pol = batch["policy"]
        g_on = lm_head_grads(pol["fwd"], trl.coef(trl.generate(pol, None)).unsqueeze(0))[0]  # (V, d)
        on_policy.add(g_on)
        same.append((pol["completions"] == batch["completions"]).float().mean().item())
        for i, n in enumerate(names):
            g = grads[i]  # (V, d)
            d = g - g_on  # (V, d) this batch's error against its coupled on-policy batch
            a = acc[n]
            a["sum"] = g.clone() if isinstance(a["sum"], float) else a["sum"] + g
            a["dsum"] = d.clone() if isinstance(a["dsum"], float) else a["dsum"] + d
            a["sq"] += g.pow(2).sum().item()
            a["dsq"] += d.pow(2).sum().item()
            w_all[n].append(effective_weights(coefs, n))
        lr_all.append(batch["train_logp"] - batch["engine_logp"])  # (B, T) log rho
    log_rho = torch.cat(lr_all)  # (n*B, T)
    k1 = (-log_rho).mean().item()
    k3 = (log_rho.exp() - 1 - log_rho).mean().item()
    ess_seq = sequence_ess(log_rho)
    rows = []
    unbias = n_batches / max(n_batches - 1, 1)
    for n in names:
        a = acc[n]
        mean = a["sum"] / n_batches  # (V, d)
        dmean = a["dsum"] / n_batches  # (V, d)
        var = (a["sq"] / n_batches - mean.pow(2).sum().item()) * unbias  # E||g - Eg||^2
        dvar = (a["dsq"] / n_batches - dmean.pow(2).sum().item()) * unbias
        d2 = dmean.pow(2).sum().item()
        w = torch.cat(w_all[n])  # (n*B, T)
        valid = ~torch.isnan(w)  # (n*B, T)
        wv = w[valid]
        zero = (w == 0) & valid  # (n*B, T)
        rows.append(dict(
            method=n, kl_k1=k1, kl_k3=k3, t_kl=T * k3,
            var=var, bias2=d2 - dvar / n_batches,  # ||E g - g*||^2, unbiased (coupled differences)
            bias2_se=math.sqrt(max(4 * d2 * dvar / n_batches + 2 * (dvar / n_batches) ** 2, 0.0)),
            mean_sq=mean.pow(2).sum().item() - var / n_batches,  # ||E g||^2, unbiased
            ess_token=ess(wv) if wv.numel() else float("nan"),
            masked_tok=zero.sum().item() / max(valid.sum().item(), 1),
            masked_seq=(zero | ~valid).all(1).float().mean().item(),
            w_min=wv.min().item() if wv.numel() else float("nan"),
            w_max=wv.max().item() if wv.numel() else float("nan"),
            ess_seq_raw=ess_seq, ess_seq_theory=math.exp(-2 * T * k3), max_abs_log_rho=log_rho.abs().max().item(),
            coupled_same=sum(same) / len(same), n_batches=n_batches))
    return rows


def finish_rows(rows: list[dict], on: dict) -> None:
    """Scale one T's rows by the on-policy per-batch noise V_on (in place): relvar = V / V_on, bias2 = B^2 / V_on,
    mse = relvar + bias2 (the uncorrected estimator on on-policy batches has mse 1); bias_rel = B / ||g*|| and
    norm_ratio = ||E g|| / ||g*|| where g* is resolved (snr_on = ||g*||^2 / V_on > 0); breakeven_batch = 64 V / B^2,
    the batch size above which the method's bias outweighs its variance (inf: bias within 2 standard errors of 0)."""
    v_on, g2 = on["v_on"], on["g_star_sq"]
    for r in rows:
        r["relvar"] = r.pop("var") / v_on
        b2, se = r.pop("bias2"), r.pop("bias2_se")
        r["bias2"], r["bias2_se"] = b2 / v_on, se / v_on
        r["mse"] = r["relvar"] + r["bias2"]
        r["bias_rel"] = math.sqrt(max(b2, 0.0) / g2) if g2 > 0 else float("nan")
        mean_sq = r.pop("mean_sq")
        r["norm_ratio"] = math.sqrt(max(mean_sq, 0.0) / g2) if g2 > 0 else float("nan")
        r["breakeven_batch"] = BATCH * r["relvar"] / r["bias2"] if r["bias2"] > 2 * r["bias2_se"] else math.inf
        r["snr_on"], r["n_on"] = g2 / v_on, on["n_on"]


def measure_kl(engine: Engine, model, T: int, n: int, seed: int) -> float:
    gen = torch.Generator(device=device_of(model)).manual_seed(seed)
    d = prompt_digits(n, gen)
    prompts = prompt_ids(d)
    comp, elp, _ = engine.sample(prompts, T, gen)
    lr = trainer_forward(model, prompts, comp).logp - elp  # (n, T)
    return (lr.exp() - 1 - lr).mean().item()


def calibrate_heavy(model, targets_kl, T: int = 32, n: int = 64, rounds: int = 2) -> dict[float, float]:
    """The noise scale s per target per-token KL (k3): KL ~ s^2 at small s, two rounds of s *= sqrt(target/KL)."""
    out = {}
    for target in targets_kl:
        s = 0.1
        for r in range(rounds):
            kl = measure_kl(Engine(model, "heavy", s), model, T, n, seed=11 + r)
            s *= math.sqrt(target / max(kl, 1e-12))
        out[target] = s
    return out


def stale_checkpoints(model, steps: int, T: int, target_step_kl: float = 1e-3, seed: int = 5,
                      lags: tuple | None = None):
    """A short on-policy training (REINFORCE with GRPO group advantages, Adam), its learning rate chosen by a pilot
    step so that the per-step policy movement is ~``target_step_kl`` per token; every step's weights are kept (with
    ``lags``: only the last and those ``lags`` steps before it, None in the other places; the GPU size's memory)."""
    wanted = None if lags is None else {steps} | {steps - lag for lag in lags}

    def train(lr, n_steps, keep):
        m = copy.deepcopy(model)
        opt = torch.optim.Adam(m.parameters(), lr=lr)
        gen = torch.Generator(device=device_of(model)).manual_seed(seed)
        ckpts = [copy.deepcopy(m.state_dict()) if wanted is None or 0 in wanted else None] if keep else []
        for _ in range(n_steps):
            digits = prompt_digits(PROMPTS_PER_BATCH, gen).repeat_interleave(GROUP, 0)  # (B, 4)
            prompts = prompt_ids(digits)
            comp, _, _ = Engine(m).sample(prompts, T, gen)  # (B, T)
            r = reward_from_ids(digits, comp).view(-1, GROUP)  # (8, 8)
            adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1, 1)  # (B, 1)
            m.train()
            logits = m(input_ids=torch.cat([prompts, comp], 1)).logits[:, prompts.size(1) - 1:-1]  # (B, T, V)
            logp = logits.log_softmax(-1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)  # (B, T)
            loss = -(adv * logp).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            m.eval()
            if keep:
                kept = wanted is None or len(ckpts) in wanted
                ckpts.append(copy.deepcopy(m.state_dict()) if kept else None)
        return m, ckpts

    def step_kl(a, b):
        return measure_kl(Engine(a), b, T, 64, seed=17)

    lr = 1e-4
    moved, _ = train(lr, 1, keep=False)
    kl = step_kl(moved, model)
    lr *= math.sqrt(target_step_kl / max(kl, 1e-12))
    _, ckpts = train(lr, steps, keep=True)
    return lr, ckpts


def write_csv(rows: list[dict], path: str) -> None:
    """Every key of any row is a column (a row without it: empty), floats to 6 significant digits."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, restval="")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def read_csv(path: str) -> list[dict]:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    for i, r in enumerate(rows):
        r = rows[i] = {k: v for k, v in r.items() if v != ""}  # an empty cell: the row has no such column
        for k, v in r.items():
            if k not in ("source", "level", "method"):
                r[k] = float(v)
    return rows


def _table(rows: list[dict], cells: list, methods: list[str], value) -> list[str]:
    by = {(r["T"], r["source"], r["level"], r["method"]): r for r in rows}
    lines = ["| T | source | level | T*KL " + "".join(f"| {m} " for m in methods) + "|",
             "|---" * (4 + len(methods)) + "|"]
    for key in cells:
        first = next(by[(*key, m)] for m in methods if (*key, m) in by)
        vals = [value(by[(*key, m)]) if (*key, m) in by else "" for m in methods]
        lines.append(f"| {key[0]:g} | {key[1]} | {key[2]} | {first['t_kl']:.3g} | " + " | ".join(vals) + " |")
    return lines


def flips(row: dict) -> str:
    value = row.get("routing_flip", math.nan)
    return "" if value == "" or value is None or math.isnan(value) else f"{value:.3g}"


def markdown(rows: list[dict]) -> str:
    """The cells (KL, T*KL, ESS against theory, the best methods), then one table per measure, method by method."""
    cells = list(dict.fromkeys((r["T"], r["source"], r["level"]) for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["T"], r["source"], r["level"], r["method"]): r for r in rows}
    out = ["### Cells", "",
           "| T | source | level | KL k3 | KL k1 | T*KL | max abs log rho | raw seq-weight ESS | exp(-2 T KL) | "
           "coupled tokens equal | on-policy SNR | routings flipped | lowest MSE | highest bias^2 |",
           "|---" * 14 + "|"]
    for key in cells:
        rs = [by[(*key, m)] for m in methods if (*key, m) in by]
        r0 = rs[0]
        best = min(rs, key=lambda r: r["mse"])
        worst = max(rs, key=lambda r: r["bias2"])
        out.append(f"| {key[0]:g} | {key[1]} | {key[2]} | {r0['kl_k3']:.2g} | {r0['kl_k1']:.2g} | {r0['t_kl']:.3g} | "
                   f"{r0['max_abs_log_rho']:.2g} | {r0['ess_seq_raw']:.3g} | {r0['ess_seq_theory']:.3g} | "
                   f"{r0['coupled_same']:.3g} | {r0['snr_on']:.2g} | {flips(r0)} | "
                   f"{best['method']} ({best['mse']:.3g}) | {worst['method']} ({worst['bias2']:.2g}) |")
    measures = [
        ("MSE E||g - g*||^2 / V_on (= relvar + bias^2; the uncorrected estimator on on-policy batches: 1)",
         lambda r: f"{r['mse']:.3g}"),
        ("Squared bias ||E g - g*||^2 / V_on (coupled batches; one standard error in brackets)",
         lambda r: f"{r['bias2']:.2g} ({r['bias2_se']:.1g})"),
        ("Variance E||g - E g||^2 / V_on", lambda r: f"{r['relvar']:.3g}"),
        ("Relative bias ||E g - g*|| / ||g*|| and norm ratio ||E g|| / ||g*||",
         lambda r: f"{r['bias_rel']:.2g} / {r['norm_ratio']:.2g}"),
        ("Masked tokens / masked sequences (effective weight 0)",
         lambda r: f"{r['masked_tok']:.2g} / {r['masked_seq']:.2g}"),
        ("Token ESS of the effective weight c / c_none [its range]",
         lambda r: f"{r['ess_token']:.2g} [{r['w_min']:.2g}, {r['w_max']:.2g}]"),
        ("Batch size above which bias^2 exceeds the variance (64 V / B^2; inf: bias not resolved)",
         lambda r: f"{r['breakeven_batch']:.3g}"),
    ]
    for title, value in measures:
        out += ["", f"### {title}", ""] + _table(rows, cells, methods, value)
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    markers = "os^vD<>ph*xP+1234"
    for i, m in enumerate(methods):
        controls = (r["source"] == "exact" or r["level"] == "flip0" for r in rows)  # no mismatch: T*KL ~0
        rs = sorted((r for r, c in zip(rows, controls) if r["method"] == m and not c), key=lambda r: r["t_kl"])
        x = [r["t_kl"] for r in rs]
        axes[0].plot(x, [r["bias2"] for r in rs], markers[i % len(markers)], ms=4, label=m, alpha=0.7)
        axes[1].plot(x, [r["mse"] for r in rs], markers[i % len(markers)], ms=4, label=m, alpha=0.7)
    for ax, name in zip(axes, ("squared bias ||E g - g*||^2 / V_on", "MSE E||g - g*||^2 / V_on")):
        ax.set_xscale("log")
        ax.set_yscale("symlog", linthresh=1e-2)
        ax.set_xlabel("T x per-token KL (k3)")
        ax.set_title(name)
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarize(rows: list[dict], out: str, plot_too: bool) -> None:
    with open(os.path.join(out, "estimator_map.md"), "w") as f:
        f.write(markdown(rows))
    if plot_too:
        plot(rows, os.path.join(out, "estimator_map.png"))


def build_trainer_model(warmup_steps: int, seed: int = 0, small: bool = False, moe: bool = False, size: str = "cpu",
                        device: str | torch.device = "cpu"):
    """The trainer before its on-policy steps: built (``size``'s model, or the MoE one), moved to ``device`` in fp32,
    ``warmup_steps`` supervised steps at T = 32. The caller casts it to ``size``'s dtype after its training."""
    spec = SIZES[size]["model"]
    if spec is not None:
        model = build_sized_model(spec, seed=seed)
    else:
        build = build_moe_model if moe else build_model
        model = build(hidden=32, layers=1, seed=seed) if small else build(seed=seed)
    model.to(device)
    supervised_warmup(model, warmup_steps, T=32, lr=SIZES[size]["warmup_lr"], seed=seed)
    return model


PRECISIONS = (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32))


def precision_engines(dtype: torch.dtype) -> list[tuple[str, torch.dtype]]:
    """The precision source's engine dtypes: every one of bf16, fp16, fp32 but the trainer's (the CPU size's fp32
    trainer: bf16 and fp16 engines; the GPU sizes' bf16 trainer: fp16 and fp32 engines)."""
    return [(label, d) for label, d in PRECISIONS if d != dtype]


def sources(model, ckpts, heavy_scales, smoke: bool):
    """(source, level label, engine) triples, in the issue's priority order."""
    if smoke:
        yield "heavy", f"s={heavy_scales[TARGET_KLS[-1]]:.3g}", Engine(model, "heavy", heavy_scales[TARGET_KLS[-1]])
        return
    yield "exact", "-", Engine(model)
    for label, dtype in precision_engines(next(model.parameters()).dtype):
        yield "precision", label, Engine(copy.deepcopy(model).to(dtype))
    for target, s in heavy_scales.items():
        yield "heavy", f"~{target:g}", Engine(model, "heavy", s)
    yield "fp8", "e4m3", Engine(fp8_like(model))
    last = len(ckpts) - 1
    for lag in (1, 4, 16, 64):
        if lag <= last:
            stale = copy.deepcopy(model)
            stale.load_state_dict(ckpts[last - lag])
            yield "stale", f"lag{lag}", Engine(stale.eval())
    yield "truncation", "top_p0.95", Engine(model, "top_p", 0.95)
    yield "truncation", "top_p0.9", Engine(model, "top_p", 0.9)
    yield "truncation", "top_k8", Engine(model, "top_k", 8)


def moe_sources(model, smoke: bool, seed: int):
    """(level label, flip rate, engine): the MoE trainer's own engine (no flip, the control) and one engine per flip
    rate (its own flip generator, seeded per T and level)."""
    rates = MOE_FLIP_RATES[-1:] if smoke else (0.0, *MOE_FLIP_RATES)
    for j, rate in enumerate(rates):
        yield f"flip{rate:g}", rate, (moe_flip_engine(model, rate, seed + j) if rate else Engine(model))


def run_moe(trl: TrlLoss, moe, T: int, n_batches: int, pkg: dict, smoke: bool) -> list[dict]:
    """The MoE source's cells at one T, with their own on-policy gradient (the MoE model's; its V_on is the unit)."""
    on_policy, rows = OnPolicy(), []
    for j, (level, rate, engine) in enumerate(moe_sources(moe, smoke, seed=T * 100 + 50)):
        t1 = time.time()
        measured = measure_routing_flips(engine, moe, T, n=16 if smoke else 64, seed=T * 100 + 70 + j)
        cell = run_cell(trl, moe, engine, T, n_batches, pkg, T * 100 + 50 + j, on_policy)
        rows += [dict(T=T, source="moe", level=level, **r, routing_flip=measured, routing_flip_asked=rate)
                 for r in cell]
        print(f"T={T} moe {level}: routings flipped {measured:.3g} (asked {rate:g}); KL k3 {cell[0]['kl_k3']:.3g} "
              f"T*KL {cell[0]['t_kl']:.3g} ({time.time() - t1:.0f} s)", flush=True)
    on = on_policy.finish()
    finish_rows(rows, on)
    print(f"T={T} moe: on-policy ||g*||^2 / V_on = {on['g_star_sq'] / on['v_on']:.3g} from {on['n_on']} batches",
          flush=True)
    return rows


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``--append``: the new rows replace the old ones of the same (T, source); the rest of ``old`` is kept."""
    replaced = {(float(r["T"]), r["source"]) for r in new}
    return [r for r in old if (float(r["T"]), r["source"]) not in replaced] + new


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/estimator_map")
    p.add_argument("--lengths", default=None, help="completion lengths T (default: the size's)")
    p.add_argument("--batches", default=None, help="batches of 64 per cell, per T (one value: every T; default: the "
                   "size's)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]: the models, sampling and gradients (TRL's loss "
                   "on the CPU)")
    p.add_argument("--size", default="cpu", choices=sorted(SIZES), help="cpu: the ~0.16M model in fp32, T 8/64/256; "
                   "gpu: Qwen2.5-0.5B's shape in bf16, T 512-4096; gpu_toy: gpu's code path at toy size")
    p.add_argument("--sources", default=None, help="comma-separated subset of the sources (default: all; the MoE "
                   "routing flips are 'moe')")
    p.add_argument("--warmup_steps", type=int, default=150)
    p.add_argument("--stale_steps", type=int, default=64)
    p.add_argument("--smoke", action="store_true", help="one T (8), one source, one level, 2 batches")
    p.add_argument("--append", action="store_true", help="merge into OUT's CSV: rows of the (T, source) pairs this "
                   "run measures are replaced, the others kept")
    p.add_argument("--summarize", action="store_true", help="only rewrite the tables and the plot from OUT's CSV")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core machine)")
    a = p.parse_args(argv)
    try:
        device = resolve_device(a.device)
    except ValueError as err:
        p.error(str(err))
    size = SIZES[a.size]
    a.lengths, a.batches = a.lengths or size["lengths"], a.batches or size["batches"]
    torch.set_num_threads(a.threads)
    saved = dict(vars(CHUNKS))
    CHUNKS.__dict__.update(fwd_rows=size["fwd_rows"], grad_tokens=size["grad_tokens"], sample_rows=size["sample_rows"])
    try:
        return run_map(a, device)
    finally:
        CHUNKS.__dict__.update(saved)


def run_map(a, device: torch.device) -> list[dict]:
    csv_path = os.path.join(a.out, "estimator_map.csv")
    if a.summarize:
        rows = read_csv(csv_path)
        summarize(rows, a.out, plot_too=True)
        return rows
    if a.smoke:
        a.lengths, a.batches, a.warmup_steps, a.stale_steps = "8", "2", 5, 0
    os.makedirs(a.out, exist_ok=True)
    wanted = a.sources.split(",") if a.sources else None
    dense = wanted is None or any(s != "moe" for s in wanted)
    t0 = time.time()
    model = build_trainer_model(a.warmup_steps, small=a.smoke, size=a.size, device=device)
    ckpts, stale_lr = [], float("nan")
    if a.stale_steps and dense:
        lags = None if a.size == "cpu" else (1, 4, 16, 64)
        stale_lr, ckpts = stale_checkpoints(model, a.stale_steps, T=32, lags=lags)
        model.load_state_dict(ckpts[-1])  # the trainer is the end of the short on-policy training
    model.to(SIZES[a.size]["dtype"])  # trained in fp32; the trainer in its size's dtype (the GPU sizes: bf16)
    heavy = (calibrate_heavy(model, TARGET_KLS[-1:], T=8, n=16, rounds=1) if a.smoke
             else calibrate_heavy(model, TARGET_KLS)) if dense else {}
    moe, moe_lr = None, float("nan")
    if a.size != "cpu" and wanted and "moe" in wanted:
        print("moe: the MoE source runs at --size cpu only (a tiny Qwen2-MoE)", flush=True)
    if a.size == "cpu" and ((wanted is None and not a.smoke) or (wanted and "moe" in wanted)):
        # trained as the dense model: the same supervised warm-up, the same on-policy steps
        moe = build_trainer_model(a.warmup_steps, small=a.smoke, moe=True)
        if a.stale_steps:
            moe_lr, moe_ckpts = stale_checkpoints(moe, a.stale_steps, T=32)
            moe.load_state_dict(moe_ckpts[-1])
            del moe_ckpts
    print(f"setup {time.time() - t0:.0f} s; stale lr {stale_lr:.3g}; heavy scales {heavy}; MoE on-policy lr "
          f"{moe_lr:.3g}", flush=True)
    pkg = package_methods()
    old = read_csv(csv_path) if a.append and os.path.isfile(csv_path) else []
    rows = []
    lengths = [int(x) for x in a.lengths.split(",")]
    counts = [int(x) for x in a.batches.split(",")]
    batches = dict(zip(lengths, counts if len(counts) == len(lengths) else counts[:1] * len(lengths)))
    for T in lengths:
        # TRL's trainer needs a model only to be built (its policy forward is stubbed): a small CPU one at GPU sizes
        trl = TrlLoss(model if a.size == "cpu" else build_model(hidden=32, layers=1), T, os.path.join(a.out, "trl"))
        on_policy, t_rows, t_start = OnPolicy(), [], time.time()
        for i, (source, level, engine) in enumerate(sources(model, ckpts, heavy, a.smoke) if dense else ()):
            if wanted and source not in wanted:
                continue
            t1 = time.time()
            cell = run_cell(trl, model, engine, T, batches[T], pkg, T * 100 + i, on_policy)
            t_rows += [dict(T=T, source=source, level=level, **r) for r in cell]
            print(f"T={T} {source} {level}: KL k3 {cell[0]['kl_k3']:.3g} T*KL {cell[0]['t_kl']:.3g} "
                  f"({time.time() - t1:.0f} s)", flush=True)
        if t_rows:
            on = on_policy.finish()
            finish_rows(t_rows, on)
            print(f"T={T}: {time.time() - t_start:.0f} s; on-policy ||g*||^2 / V_on = "
                  f"{on['g_star_sq'] / on['v_on']:.3g} from {on['n_on']} batches", flush=True)
        if moe is not None:
            t_rows += run_moe(trl, moe, T, batches[T], pkg, a.smoke)
        rows += t_rows
        write_csv(merge_rows(old, rows), csv_path)
    rows = merge_rows(old, rows)
    summarize(rows, a.out, plot_too=not a.smoke)
    print(f"total {time.time() - t0:.0f} s")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
