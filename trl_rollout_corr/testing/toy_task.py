"""The toy task: tiny, locally built models, tokenizers and a verifiable task (no download), for tests, benchmarks,
examples and the CPU demo.

Task "reverse": the prompt ``rev 3 1 4 =`` asks for the digits reversed, ``4 1 3 <eos>``; the reward is
the fraction of positions right, over max(len(output), n_digits).
"""

from __future__ import annotations

import random

DIGITS = [str(d) for d in range(10)]
SPECIAL = ["<pad>", "<eos>", "<unk>", "<bos>"]
VOCAB = SPECIAL + DIGITS + ["rev", "="]


def build_tokenizer():
    """A WordLevel tokenizer over the task's words, left padding, eos = <eos>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   bos_token="<bos>", padding_side="left")
    return fast


def build_model(hidden_size: int = 64, num_layers: int = 2, seed: int = 0, num_heads: int = 4):
    """A Qwen2-style causal LM from a config (random weights, fp32, untied head).

    vLLM's CPU attention needs a head size (hidden_size / num_heads) of at least 32.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(VOCAB), hidden_size=hidden_size, intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=3,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    return model


def reverse_prompts(n: int, n_digits: int = 6, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["rev " + " ".join(rng.choice(DIGITS) for _ in range(n_digits)) + " =" for _ in range(n)]


def reverse_target(prompt: str) -> list[str]:
    return prompt.split()[1:-1][::-1]


def reverse_reward(prompts: list[str], completions: list[str], **_) -> list[float]:
    """Fraction of positions right: matches / max(len(output), len(target))."""
    rewards = []
    for prompt, completion in zip(prompts, completions):
        target = reverse_target(prompt)
        out = [w for w in completion.replace("<eos>", " ").split() if w not in SPECIAL]
        hits = sum(a == b for a, b in zip(out, target))
        rewards.append(hits / max(len(out), len(target)))
    return rewards


def supervised_warmup(model, tokenizer, steps: int = 90, batch_size: int = 64, lr: float = 1e-3,
                      n_digits: int = 6, seed: int = 0) -> None:
    """A few AdamW steps of teacher forcing on the task so that GRPO starts from a non-trivial policy."""
    teacher_forcing(model, tokenizer, reverse_prompts, reverse_target, steps, batch_size, lr, n_digits, seed)


def teacher_forcing(model, tokenizer, make_prompts, target, steps: int, batch_size: int, lr: float, n_digits: int,
                    seed: int) -> None:
    """AdamW steps on ``prompt answer <eos>`` with the loss on the answer only (a task's supervised warm-up):
    ``make_prompts(n, n_digits, seed=...)`` draws the prompts, ``target(prompt)`` gives the answer's tokens."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        prompts = make_prompts(batch_size, n_digits, seed=seed * 100003 + step)
        texts = [p + " " + " ".join(target(p)) + " <eos>" for p in prompts]
        ids = torch.tensor([tokenizer.convert_tokens_to_ids(t.split()) for t in texts], device=model.device)  # (B, L)
        labels = ids.clone()
        labels[:, : n_digits + 2] = -100  # learn the answer only
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
