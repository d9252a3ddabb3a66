"""A tiny tool-calling task for TRL's ``environment_factory`` on CPU (no download).

A byte-level tokenizer (every text encodes exactly) with a compact chat template that renders tool calls as
``<tool_call>{json}</tool_call>``, TRL's Qwen3 response template to parse them, a counter environment whose
``increment`` tool is the reward, and a tiny Qwen2 model taught by teacher forcing to call it and then say "Done".
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
CHAT_TEMPLATE = (
    "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' -%}{{ m.content or '' }}{%- for tc in m.tool_calls or [] -%}"
    "{{ '<tool_call>' + (tc.function | tojson) + '</tool_call>' }}{%- endfor -%}"
    "{%- else -%}{{ m.content }}{%- endif -%}{{ '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")
TOOL_CALL = {"type": "function", "function": {"name": "increment", "arguments": {"step": 1}}}
PROMPTS = ["add one", "go", "count"]


class Counter:
    """The environment: one counter per rollout; the reward is its final value."""

    def reset(self, **kwargs):
        self._counter = 0

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self._counter += step
        return self._counter

    def get_reward(self):
        return float(self._counter)


def build_tool_tokenizer() -> PreTrainedTokenizerFast:
    from trl.chat_template_utils import qwen3_template

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # one token per byte
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   additional_special_tokens=SPECIALS[1:], padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    fast.response_template = qwen3_template
    return fast


def conversation(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
            {"role": "tool", "name": "increment", "content": "1"}, {"role": "assistant", "content": "Done"}]


def build_tool_model(tokenizer, steps: int = 150) -> Qwen2ForCausalLM:
    """A tiny Qwen2 taught (teacher forcing, AdamW) to call ``increment`` once and then answer "Done"."""
    torch.manual_seed(0)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=eos)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, eos
    rows = [tokenizer.apply_chat_template(conversation(p), tokenize=True, return_dict=False) for p in PROMPTS]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])  # (N, L)
    labels = torch.tensor([r + [-100] * (width - len(r)) for r in rows])  # (N, L)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()
