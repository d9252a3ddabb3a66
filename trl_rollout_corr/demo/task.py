"""The main job's task, model and evaluation: the running-prefix-sum task at T = 49 on a 465k-parameter model.

These are the pieces of S3V (the truncated-sampling experiment on the real vLLM engine, pre-registrations 20-24 of
``experiments/vllm_truncation.py``, whose runs back the ``truncating-sampler`` row of
:data:`trl_rollout_corr.monitor.verdict.VERDICTS`) that the demo needs, kept in the package so that the shipped CLI
imports nothing from ``experiments/``. Same recipe, same numbers: on one machine a demo run and the S3V run of the same
arm and seed give the same score, bit for bit (checked on S3V's ``on_policy``, seed 230: 0.7900390625).

* Task (:mod:`trl_rollout_corr.testing.psum_task`): ``psum d_1 ... d_48 =`` asks for the 48 running sums mod 10 and
  ``<eos>``: a completion of T = 49 tokens; reward = the correct prefix's length / 48.
* Model: Qwen2-style, hidden 96, 3 layers, 4 heads (2 KV heads), MLP 384, untied head over a 256-word vocabulary:
  465k parameters, built from the weights of seed ``BASE_SEED`` (no download).
* Base model (:func:`build_base`): ``BASE_STEPS`` supervised steps, built once per output directory (~1 min on one
  quiet core); then each seed's warm-up (:func:`warm_model`): ``WARMUP_STEPS`` more, from torch seed ``seed``.
* Served model (:func:`served_model`): the same function as a Llama model whose heads are zero-padded from 24 to
  vLLM's CPU head size 32: the trainer trains it, vLLM serves it.
* Score (:func:`eval_recorder`, :func:`policy_reward`): the policy's OWN held-out reward (64 fixed prompts, sampled
  at temperature 1 on the full distribution, no engine), averaged over the evaluations of the last 30% of the steps.
"""

from __future__ import annotations

import os
import statistics

HIDDEN, LAYERS, HEADS, N_DIGITS = 96, 3, 4, 48
BASE_STEPS, BASE_LR, BASE_SEED, BASE_BATCH = 200, 2e-3, 12345, 64
WARMUP_STEPS, WARMUP_LR = 10, 5e-4
GEN_PROMPTS, NUM_GENERATIONS, STEPS_PER_GENERATION = 4, 8, 2  # 32 completions per generation, 2 optimizer steps
LR = 1e-4
STEPS = 30
N_EVAL, EVAL_EVERY, TAIL, TAIL_EVAL_EVERY = 64, 10, 0.3, 3  # evaluations every 10 steps, every 3 in the last 30%
EVAL_PROMPT_SEED, EVAL_SAMPLE_SEED = 777_777, 1234
SERVED_HEAD_DIM = 32  # vLLM's CPU attention supports head sizes 32, 64, 80, ... (not the task model's 24)

FULL = dict(hidden=HIDDEN, layers=LAYERS, heads=HEADS, n_digits=N_DIGITS, base_steps=BASE_STEPS,
            warmup_steps=WARMUP_STEPS, n_eval=N_EVAL, eval_every=EVAL_EVERY, steps=STEPS)
# the suite's size: a model vLLM's CPU attention serves as is (hidden 64, 2 heads of 32), T = 7, 2 steps
TINY = dict(hidden=64, layers=2, heads=2, n_digits=6, base_steps=2, warmup_steps=1, n_eval=4, eval_every=1, steps=2)


def task_tokenizer():
    from ..testing.psum_task import build_tokenizer

    return build_tokenizer()


def task_model(size: dict):
    """A fresh task model of ``size`` (the weights of seed ``BASE_SEED``), fp32 on the CPU."""
    from ..testing.psum_task import build_model

    return build_model(size["hidden"], size["layers"], seed=BASE_SEED, num_heads=size["heads"],
                       n_digits=size["n_digits"])


def sample(model, prompt_ids, max_new: int, generator, perturb=None):
    """Autoregressive sampling with a KV cache at temperature 1, a row stopping at EOS; ``perturb(logits)``
    processes the logits first (e.g. :func:`top_p_truncation`).

    Returns ``(completions, kl)``: the token ids per row (EOS included) and the exact per-position
    KL(perturbed || unperturbed) over the vocabulary, (B, T) (zeros without ``perturb``)."""
    import torch

    from ..testing.psum_task import EOS_ID, PAD_ID

    batch = prompt_ids.shape[0]
    with torch.no_grad():
        out = model(input_ids=prompt_ids, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1].float()  # (B, V)
        done = torch.zeros(batch, dtype=torch.bool)
        tokens, kls = [], []
        for _ in range(max_new):
            logq = torch.log_softmax(perturb(logits) if perturb is not None else logits, -1)  # (B, V)
            if perturb is not None:  # q log(q / p) with 0 log 0 = 0 (a truncation zeroes tokens)
                q = logq.exp()  # (B, V)
                kls.append(torch.where(q > 0, q * (logq - torch.log_softmax(logits, -1)), 0.0).sum(-1))  # (B,)
            y = torch.multinomial(logq.exp(), 1, generator=generator).squeeze(-1)  # (B,)
            y = torch.where(done, torch.full_like(y, PAD_ID), y)
            tokens.append(y)
            done = done | (y == EOS_ID)
            if bool(done.all()):
                break
            out = model(input_ids=y[:, None], past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1].float()
    tok = torch.stack(tokens, 1)  # (B, T)
    completions = []
    for row in range(batch):
        ids = tok[row].tolist()
        completions.append(ids[: ids.index(EOS_ID) + 1] if EOS_ID in ids else ids)
    kl = torch.stack(kls, 1) if kls else torch.zeros(batch, len(tokens))  # (B, T)
    return completions, kl


def top_p_truncation(top_p: float):
    """Top-p (nucleus) truncation of logits (B, V) as vLLM's sampler does it: sort ascending, remove the tokens whose
    cumulative probability is <= 1 - top_p, always keep the most likely one. The kept set's log-softmax is
    log p - log M (M: the kept mass), so the exact KL(top-p(pi) || pi) per position is -log M."""
    import torch

    def perturb(logits):
        ordered, order = torch.sort(logits, dim=-1)  # ascending  # (B, V)
        cumulative = torch.softmax(ordered, -1).cumsum(-1)  # (B, V)
        remove_sorted = cumulative <= 1 - top_p
        remove_sorted[:, -1] = False  # the most likely token is always kept
        remove = remove_sorted.scatter(-1, order, remove_sorted)  # back to vocabulary order  # (B, V)
        return logits.masked_fill(remove, float("-inf"))

    return perturb


def _prompt_ids(tok, prompts):
    import torch

    return torch.tensor([tok.convert_tokens_to_ids(p.split()) for p in prompts])  # (B, P)


def policy_reward(model, tok, prompts, n_digits: int, seed: int = EVAL_SAMPLE_SEED) -> float:
    """The policy's own mean reward on ``prompts``: sampled at temperature 1 on the full distribution, fixed seed."""
    import torch

    from ..testing.psum_task import psum_reward

    was_training = model.training
    model.eval()
    completions, _ = sample(model, _prompt_ids(tok, prompts), n_digits + 1, torch.Generator().manual_seed(seed))
    model.train(was_training)
    return statistics.fmean(psum_reward(prompts, [" ".join(tok.convert_ids_to_tokens(c)) for c in completions]))


def truncation_kl(model, tok, prompts, n_digits: int, top_p: float, seed: int = 4321) -> tuple[float, float]:
    """The exact per-token KL(top-p(pi) || pi) (= mean over positions of -log M, M the kept mass) of ``model`` on
    ``prompts`` sampled at ``top_p``, and the mean T·KL per sequence (its own generator: the run is untouched)."""
    import torch

    was_training = model.training
    model.eval()
    completions, kl = sample(model, _prompt_ids(tok, prompts), n_digits + 1, torch.Generator().manual_seed(seed),
                             top_p_truncation(top_p))  # kl: (B, T)
    model.train(was_training)
    mask = torch.zeros_like(kl)  # (B, T)
    for row, c in enumerate(completions):
        mask[row, : len(c)] = 1
    return float((kl * mask).sum() / mask.sum()), float((kl * mask).sum(-1).mean())


def base_path(out: str) -> str:
    return os.path.join(out, "base", "base.pt")


def build_base(out: str, size: dict) -> str:
    """The shared base model (``base_steps`` AdamW steps, lr ``BASE_LR``, gradient norm clipped at 1, of teacher
    forcing on fresh batches of 64, data seed 10**6 + step, one thread: deterministic), built once per ``out``."""
    import torch

    from ..testing.psum_task import psum_prompts, psum_target

    path = base_path(out)
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.set_num_threads(1)
    n = size["n_digits"]
    tok = task_tokenizer()
    model = task_model(size)
    opt = torch.optim.AdamW(model.parameters(), lr=BASE_LR)
    model.train()
    for step in range(size["base_steps"]):
        prompts = psum_prompts(BASE_BATCH, n, seed=10**6 + step)
        ids = torch.tensor([tok.convert_tokens_to_ids((p + " " + " ".join(psum_target(p)) + " <eos>").split())
                            for p in prompts])  # (64, 2n + 3)
        labels = ids.clone()
        labels[:, : n + 2] = -100  # learn the answer only
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    torch.save(model.state_dict(), f"{path}.{os.getpid()}.tmp")
    os.replace(f"{path}.{os.getpid()}.tmp", path)
    return path


def warm_model(model, tok, base: str, size: dict, seed: int):
    """``model`` with seed ``seed``'s warm-up of ``base``: ``warmup_steps`` supervised steps (torch seed ``seed``),
    computed once per seed and saved beside the base (shared by the seed's runs)."""
    import torch

    from ..testing.psum_task import supervised_warmup

    warm = os.path.join(os.path.dirname(base), f"warmup_seed{seed}.pt")
    if os.path.exists(warm):
        model.load_state_dict(torch.load(warm, map_location="cpu"))
        return model
    model.load_state_dict(torch.load(base, map_location="cpu"))
    torch.manual_seed(seed)
    supervised_warmup(model, tok, steps=size["warmup_steps"], lr=WARMUP_LR, n_digits=size["n_digits"], seed=seed + 1)
    torch.save(model.state_dict(), f"{warm}.{os.getpid()}.tmp")
    os.replace(f"{warm}.{os.getpid()}.tmp", warm)
    return model


def served_model(qwen2, head_dim: int = SERVED_HEAD_DIM):
    """The same function as the task's Qwen2 model as a Llama model whose attention heads are zero-padded from
    d = hidden / heads to ``head_dim`` (vLLM's Qwen2 fixes d = hidden / heads; its Llama reads ``head_dim``).

    Per head, dims [0, d/2) and [d/2, d) of q, k, v go to [0, d/2) and [D/2, D/2 + d/2) (D = ``head_dim``), so
    rotate_half pairs (j, j + D/2) are the original pairs (j, j + d/2); RoPE's frequencies theta'^(-2j/D) equal
    theta^(-2j/d) with theta' = theta^(D/d); q is scaled by sqrt(D/d), which turns the attention scale D^-1/2 back
    into d^-1/2; o_proj reads the same dims (its added bias is 0 and frozen: :func:`freeze_added_bias`). The padded
    dims have zero gradient (q_pad . k_pad = 0 and o_proj's padded columns are 0), so training moves exactly the
    original parameters: the trainer trains the task model, vLLM serves it. The experiments
    (``experiments/async_mismatch.py``, ``experiments/vllm_truncation.py``) import it from here."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    c = qwen2.config
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    d = c.hidden_size // heads
    theta = c.rope_parameters["rope_theta"]
    rope = {"rope_type": "default", "rope_theta": theta ** (head_dim / d)}
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_hidden_layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                         rope_parameters=rope,
                         attention_bias=True, mlp_bias=False, tie_word_embeddings=False, pad_token_id=c.pad_token_id,
                         eos_token_id=c.eos_token_id, bos_token_id=c.bos_token_id, hidden_act=c.hidden_act)
    llama = LlamaForCausalLM(config)
    half = d // 2
    dim_map = torch.cat([torch.arange(half), head_dim // 2 + torch.arange(half)])  # (d,) original dim -> padded dim

    def pad_rows(weight, n_heads, scale=1.0):  # (n_heads * d, ...) -> (n_heads * D, ...)
        out = weight.new_zeros((n_heads, head_dim) + weight.shape[1:])
        out[:, dim_map] = weight.reshape((n_heads, d) + weight.shape[1:]) * scale
        return out.reshape((n_heads * head_dim,) + weight.shape[1:])

    source = qwen2.state_dict()
    state = {k: v.clone() for k, v in source.items() if ".self_attn." not in k}
    for i in range(c.num_hidden_layers):
        a = f"model.layers.{i}.self_attn."
        scale = (head_dim / d) ** 0.5
        state[a + "q_proj.weight"] = pad_rows(source[a + "q_proj.weight"], heads, scale)
        state[a + "q_proj.bias"] = pad_rows(source[a + "q_proj.bias"], heads, scale)
        for name in ("k_proj", "v_proj"):
            state[a + name + ".weight"] = pad_rows(source[a + name + ".weight"], kv_heads)
            state[a + name + ".bias"] = pad_rows(source[a + name + ".bias"], kv_heads)
        state[a + "o_proj.weight"] = pad_rows(source[a + "o_proj.weight"].T, heads).T.contiguous()
        state[a + "o_proj.bias"] = torch.zeros_like(llama.state_dict()[a + "o_proj.bias"])
    llama.load_state_dict(state)
    llama.generation_config.pad_token_id = c.pad_token_id
    llama.generation_config.eos_token_id = c.eos_token_id
    return llama


def freeze_added_bias(llama) -> None:
    """Freeze the o_proj biases :func:`served_model` adds (at 0, out of the optimizer; TRL's weight sync skips frozen
    parameters). Raises if one is not 0."""
    for layer in llama.model.layers:
        bias = layer.self_attn.o_proj.bias
        if bias.detach().abs().max() != 0:
            raise ValueError(f"{bias.shape} o_proj bias is not 0: not a served_model() of a Qwen2 model")
        bias.requires_grad_(False)


def grpo_fields(output_dir: str, size: dict, seed: int) -> dict:
    """The GRPO settings every arm shares (``RolloutCorrGRPOConfig`` fields): 32 completions per generation, two
    optimizer steps per generation (the PPO clip against pi_old is live), DAPO loss, no KL penalty, lr ``LR``."""
    per_step = GEN_PROMPTS * NUM_GENERATIONS // STEPS_PER_GENERATION
    return dict(output_dir=output_dir, per_device_train_batch_size=per_step, gradient_accumulation_steps=1,
                steps_per_generation=STEPS_PER_GENERATION, num_generations=NUM_GENERATIONS,
                max_completion_length=size["n_digits"] + 1, max_steps=size["steps"], learning_rate=LR,
                lr_scheduler_type="constant", warmup_steps=0, adam_beta2=0.99, max_grad_norm=1.0, loss_type="dapo",
                beta=0.0, epsilon=0.2, temperature=1.0, logging_steps=1, save_strategy="no", report_to="none",
                use_cpu=True, bf16=False, gradient_checkpointing=False, seed=seed, disable_tqdm=True,
                dataloader_num_workers=0)


def eval_recorder(evaluator, steps: int, eval_every: int, on_eval, rows: list[dict]):
    """A ``TrainerCallback``: at every ``eval_every``-th step, every ``TAIL_EVAL_EVERY``-th step of the last ``TAIL``
    of ``steps`` and at the last, ``evaluator`` gets the trained weights and ``on_eval(step, evaluator)`` runs;
    every training log's numbers are appended to ``rows``."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            step = state.global_step
            tail_step = step >= (1 - TAIL) * steps and step % TAIL_EVAL_EVERY == 0
            if step % eval_every == 0 or tail_step or step == steps:
                evaluator.load_state_dict(model.state_dict())
                on_eval(step, evaluator)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                numbers = {k: v for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
                rows.append({"step": state.global_step, **numbers})

    return Recorder()


def tail_score(curve: list[tuple[int, float]], steps: int) -> float:
    """The score: the mean held-out reward of the evaluations at steps >= (1 - TAIL) * steps (step 0 excluded)."""
    return statistics.fmean(r for s, r in curve if s >= (1 - TAIL) * steps and s > 0)


def psum_reward_from_ids(prompts, completions, completion_ids=None, **_) -> list[float]:
    """The task's reward read from the completion's token ids (TRL decodes with ``skip_special_tokens``: no EOS)."""
    from ..testing.psum_task import VOCAB, psum_reward

    return psum_reward(prompts, [" ".join(VOCAB[i] for i in ids) for ids in completion_ids])
