"""A long-completion toy task: running prefix sums mod 10, where an early error ruins the rest (as in chain of
thought). Tiny, locally built model and tokenizer (no download), for the training benchmark
``experiments/mismatch_train.py`` and the main job (``trl_rollout_corr/demo/``).

Task "psum": the prompt ``psum 3 1 4 ... =`` (``n_digits`` digits, 48 by default) asks for the running sums mod 10,
``3 4 8 ... <eos>`` (y_t = (x_1 + ... + x_t) mod 10): a completion of ``n_digits + 1`` tokens. The reward is the
length of the correct prefix over ``n_digits``: the first wrong digit ends the credit, whatever follows.

The vocabulary adds ``N_RARE`` tokens that the task never uses (``r0``, ``r1``, ...): after the warm-up the policy
gives them very low probability, the long low-probability tail of a real vocabulary on which a rollout engine's
numerical error can land.
"""

from __future__ import annotations

import random

DIGITS = [str(d) for d in range(10)]
SPECIAL = ["<pad>", "<eos>", "<unk>", "<bos>"]
N_RARE = 240
RARE = [f"r{i}" for i in range(N_RARE)]
VOCAB = SPECIAL + DIGITS + ["psum", "="] + RARE
EOS_ID, PAD_ID = 1, 0
N_DIGITS = 48


def build_tokenizer(vocab_size: int | None = None):
    """A WordLevel tokenizer over the task's words, left padding, eos = <eos>; ``vocab_size`` (>= the task's) adds
    more never-used words ``r240``, ``r241``, ... (a longer low-probability tail)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = VOCAB + [f"r{i}" for i in range(N_RARE, N_RARE + max(0, (vocab_size or 0) - len(VOCAB)))]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   bos_token="<bos>", padding_side="left")


def build_model(hidden_size: int = 64, num_layers: int = 2, seed: int = 0, num_heads: int = 4,
                n_digits: int = N_DIGITS, **shape):
    """A Qwen2-style causal LM from a config (random weights, fp32, untied head), positions for prompt + completion.

    ``shape`` overrides the config's other fields (e.g. a real model's ``intermediate_size``,
    ``num_key_value_heads``, a ``vocab_size`` padded beyond the task's words: more never-used tokens)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    fields = dict(
        vocab_size=len(VOCAB), hidden_size=hidden_size, intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=2,
        max_position_embeddings=2 * n_digits + 8, tie_word_embeddings=False, pad_token_id=PAD_ID,
        eos_token_id=EOS_ID, bos_token_id=3,
    )
    config = Qwen2Config(**{**fields, **shape})
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = EOS_ID
    return model


def psum_prompts(n: int, n_digits: int = N_DIGITS, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["psum " + " ".join(rng.choice(DIGITS) for _ in range(n_digits)) + " =" for _ in range(n)]


def psum_target(prompt: str) -> list[str]:
    """The running sums mod 10 of the prompt's digits."""
    total, out = 0, []
    for word in prompt.split()[1:-1]:
        total = (total + int(word)) % 10
        out.append(str(total))
    return out


def correct_prefix(prompt: str, completion: str) -> int:
    """How many leading output words equal the target's (the special tokens end the output)."""
    target = psum_target(prompt)
    n = 0
    for word, want in zip(completion.split(), target):
        if word != want:
            break
        n += 1
    return n


def psum_reward(prompts: list[str], completions: list[str], **_) -> list[float]:
    """Length of the correct prefix / number of digits."""
    return [correct_prefix(p, c) / len(psum_target(p)) for p, c in zip(prompts, completions)]


def supervised_warmup(model, tokenizer, steps: int = 200, batch_size: int = 64, lr: float = 3e-3,
                      n_digits: int = N_DIGITS, seed: int = 0) -> None:
    """AdamW steps of teacher forcing on the task so that GRPO starts from a non-trivial policy."""
    from .toy_task import teacher_forcing

    teacher_forcing(model, tokenizer, psum_prompts, psum_target, steps, batch_size, lr, n_digits, seed)
