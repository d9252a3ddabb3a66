"""Local stand-ins for the Hub artefacts TRL's own GRPO agent tests load (no download).

TRL's ``tests/test_grpo_trainer.py`` trains ``trl-internal-testing/tiny-Qwen3MoeForCausalLM`` with a reward model
``trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5`` on ``trl-internal-testing/zen``, and mocks
``model.generate`` to return *fixed Qwen3 token ids*. Those ids only mean what the tests say with Qwen3's vocabulary,
so the stand-in tokenizer here puts, at every id those tests use, the byte-level string Qwen3's tokenizer has there
(151657 = ``<tool_call>``, 4913 = ``{"``, 16370 = ``arguments``, ...), its added tokens at their Qwen3 ids with their
Qwen3 ``special`` flags (``<tool_call>`` is not special, so ``skip_special_tokens`` keeps it), and Qwen3's chat
template (TRL's ``qwen3.jinja``, the Hub tokenizer's). Every other id below 151,643 holds a unique filler that text
never encodes to. The merges are not Qwen3's: they encode each word of the chat template, tool schemas and prompts as
one token (a filler id unless it is one of the ids above), other text one token per byte, so prompt ids differ from
Qwen3's; the mocked completions are ids and are never re-encoded.

The models have the shapes of TRL's ``scripts/generate_tiny_models`` (Qwen3-30B-A3B's MoE at hidden 8, Qwen2.5-32B's
sequence classifier at hidden 16), bf16 weights with TRL's ``init_weights_tiny_model``, Qwen3's sampling
``generation_config``; they are saved to a local folder so that the trainers load them from a path string, as TRL's
tests load them from a Hub id.
"""

from __future__ import annotations

import os

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

QWEN3_BASE_VOCAB = 151_643  # ids below this are BPE tokens; the added tokens follow
# Qwen3's added tokens (tokenizer_config.json of Qwen/Qwen3-30B-A3B): (id, content, special)
QWEN3_ADDED = [(151643, "<|endoftext|>", True), (151644, "<|im_start|>", True), (151645, "<|im_end|>", True),
               (151646, "<|object_ref_start|>", True), (151647, "<|object_ref_end|>", True),
               (151648, "<|box_start|>", True), (151649, "<|box_end|>", True), (151650, "<|quad_start|>", True),
               (151651, "<|quad_end|>", True), (151652, "<|vision_start|>", True), (151653, "<|vision_end|>", True),
               (151654, "<|vision_pad|>", True), (151655, "<|image_pad|>", True), (151656, "<|video_pad|>", True),
               (151657, "<tool_call>", False), (151658, "</tool_call>", False), (151659, "<|fim_prefix|>", False),
               (151660, "<|fim_middle|>", False), (151661, "<|fim_suffix|>", False), (151662, "<|fim_pad|>", False),
               (151663, "<|repo_name|>", False), (151664, "<|file_sep|>", False),
               (151665, "<tool_response>", False), (151666, "</tool_response>", False), (151667, "<think>", False),
               (151668, "</think>", False)]
QWEN2_5_LAST_ADDED = 151664  # Qwen2.5's tokenizer stops at <|file_sep|>
# The multi-byte BPE tokens TRL's agent tests use, as Qwen3's tokenizer decodes them (read off the tests' comments,
# which give the decoded text of each row; ids 0-255 are the byte tokens in GPT-2's byte order).
QWEN3_TOKENS = {
    198: "\n", 220: " ", 293: " b", 314: " {", 330: ' "', 397: ">\n", 411: "out", 497: '",', 522: "</", 606: "name",
    788: '":', 894: " any", 927: "sh", 944: "'t", 1318: "text", 1414: " know", 1513: " don", 2765: " won",
    4913: '{"', 5212: ' {"', 5392: " tool", 6023: "hi", 6659: "call", 7692: "async", 9520: "step", 11248: "}}\n",
    14172: "tool", 16370: "arguments", 17453: "Done", 22785: "_tool", 35744: "increment", 64648: "multiply",
    93054: "_multiply", 95642: '"}}\n'}
# Qwen2's pre-tokenizer split (Qwen2TokenizerFast's PRETOKENIZE_REGEX)
PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                     r"\s*[\r\n]+|\s+(?!\S)|\s+")

# trl-internal-testing/zen: the Zen of Python, each aphorism cut into prompt and completion; train = 17 prompts
ZEN_PROMPTS = ["Beautiful is better than", "Explicit is", "Simple is better than", "Complex", "Flat is better than",
               "Sparse is better", "Readability", "Special cases aren't special", "Although practicality",
               "Errors should never", "Unless explicitly", "In the face of ambiguity, refuse",
               "There should be one-- and preferably", "Although that way may not be obvious at first",
               "Now is better", "Although never is", "If the implementation is hard to explain, it's"]


# words of the tool schemas and system prompts, merged into one token each to keep prompts short
MERGED_WORDS = ['"type": "function"', '"function": {"name": "multiply_tool"',
                '"description": "Multiplies two integers."',
                '"parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first"',
                'integer."}', '"required": ["a", "b"]}', "increment", "Increment the internal counter.", "shout",
                "Shout the given text.", "Value to add to the counter.", "Text to shout.", "Count.", "Echo."]


def _byte_codes() -> list[int]:
    """The bytes in the order of GPT-2's byte-to-unicode table: Qwen's id i (i < 256) is the byte _byte_codes()[i]."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    return printable + [b for b in range(256) if b not in printable]


def _byte_chars() -> dict[int, str]:
    """byte -> its byte-level character (itself when printable, else chr(256 + k) for the k-th other byte)."""
    codes = _byte_codes()
    return {b: chr(b) if i < 188 else chr(256 + i - 188) for i, b in enumerate(codes)}


def _byte_level(text: str) -> str:
    chars = _byte_chars()
    return "".join(chars[b] for b in text.encode())


def _chain_merges(vocab: dict[str, int], corpus: str) -> list[tuple[str, str]]:
    """Merges that encode each pre-tokenized chunk of ``corpus`` as one token (left to right: ``ab``, ``abc``, ...);
    a prefix that is one of :data:`QWEN3_TOKENS` keeps its Qwen3 id, the others take free ids from the top of the
    base vocabulary down. Only to keep prompts short (not Qwen3's merges: prompt ids are not Qwen3's)."""
    splitter = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    chunks = sorted({chunk for chunk, _ in splitter.pre_tokenize_str(corpus)})
    merges, seen, used, free = [], set(), set(vocab.values()), QWEN3_BASE_VOCAB - 1
    for length in range(2, max(len(c) for c in chunks) + 1):  # shorter prefixes first: every merge's parts exist
        for prefix in sorted({c[:length] for c in chunks if len(c) >= length}):
            if prefix not in vocab:
                while free in used:
                    free -= 1
                vocab[prefix], free = free, free - 1
            pair = (prefix[:-1], prefix[-1])
            if pair not in seen:
                seen.add(pair)
                merges.append(pair)
    return merges


def build_qwen_tokenizer(last_added: int = 151668, chat_template: str = "qwen3"):
    """A ``PreTrainedTokenizerFast`` whose ids decode as Qwen3's (Qwen2.5's with ``last_added=151664``) wherever
    TRL's agent tests look, with TRL's copy of the Hub chat template ``chat_template`` (``qwen3``, ``qwen2_5``)."""
    from importlib.resources import files

    from transformers import PreTrainedTokenizerFast

    chars = _byte_chars()
    vocab = {chars[b]: i for i, b in enumerate(_byte_codes())}  # ids 0-255: one byte each
    for token_id, text in QWEN3_TOKENS.items():
        if token_id >= 256:
            vocab[_byte_level(text)] = token_id
    template = (files("trl") / "chat_templates" / f"{chat_template}.jinja").read_text()
    merges = _chain_merges(vocab, template + " " + " ".join(ZEN_PROMPTS + MERGED_WORDS))
    taken = set(vocab.values())
    for token_id in range(256, QWEN3_BASE_VOCAB):
        if token_id not in taken:
            vocab[f"<filler{token_id}>"] = token_id  # never produced by encoding (no merge makes it), unique
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    added = [(i, c, s) for i, c, s in QWEN3_ADDED if i <= last_added]
    tok.add_special_tokens([AddedToken(c, special=True, normalized=False) for _, c, s in added if s])
    tok.add_tokens([AddedToken(c, special=False, normalized=False) for _, c, s in added if not s])
    for token_id, content, _ in added:
        if tok.token_to_id(content) != token_id:
            raise AssertionError(f"{content} landed at {tok.token_to_id(content)}, not at Qwen's {token_id}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=131072, clean_up_tokenization_spaces=False, errors="replace",
                                   split_special_tokens=False)
    fast.chat_template = template
    return fast


def _save_tokenizer(tokenizer, path: str) -> None:
    """Saved with the Hub tokenizer's class and settings (``Qwen2Tokenizer``, no BOS/UNK, no prefix space)."""
    import json

    tokenizer.save_pretrained(path)
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(tokenizer_class="Qwen2Tokenizer", add_bos_token=False, add_prefix_space=False, bos_token=None,
                  unk_token=None)
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def init_weights_tiny_model(model: torch.nn.Module) -> None:
    """TRL's ``scripts/generate_tiny_models/_common.init_weights_tiny_model``."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
            torch.nn.init.xavier_uniform_(module.weight)
        elif isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, torch.nn.LayerNorm):
            torch.nn.init.ones_(module.weight)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)


def save_tiny_qwen3_moe(path: str, seed: int = 0) -> str:
    """tiny-Qwen3MoeForCausalLM: TRL's config (vocabulary 151,936, hidden 8, 2 layers, 4 experts, top-2, head_dim
    128), bf16, Qwen3's tokenizer and generation config (eos 151645/151643, pad 151643, T=0.6, top-k 20, top-p 0.95)."""
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=151936, hidden_size=8, num_attention_heads=4, num_key_value_heads=2,
                            num_hidden_layers=2, intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                            max_position_embeddings=40960, rope_theta=1000000.0, norm_topk_prob=True,
                            bos_token_id=151643, eos_token_id=151645, head_dim=128, max_window_layers=48)
    model = Qwen3MoeForCausalLM(config).to(dtype=torch.bfloat16)
    init_weights_tiny_model(model)
    model.save_pretrained(path)
    _save_tokenizer(build_qwen_tokenizer(), path)
    GenerationConfig(bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643, do_sample=True,
                     temperature=0.6, top_k=20, top_p=0.95).save_pretrained(path)
    return path


def save_tiny_qwen2_reward_model(path: str, seed: int = 1) -> str:
    """tiny-Qwen2ForSequenceClassification-2.5: Qwen2.5-32B-Instruct's config at hidden 16, 2 layers, 1 label,
    bf16, with Qwen2.5's tokenizer and chat template."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=152064, hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, intermediate_size=32, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, num_labels=1,
                         bos_token_id=151643, eos_token_id=151645)
    model = Qwen2ForSequenceClassification(config).to(dtype=torch.bfloat16)
    init_weights_tiny_model(model)
    model.save_pretrained(path)
    _save_tokenizer(build_qwen_tokenizer(QWEN2_5_LAST_ADDED, "qwen2_5"), path)
    return path


def zen_conversational_prompts():
    """trl-internal-testing/zen, ``conversational_prompt_only``, train split (17 prompts)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in ZEN_PROMPTS]})


def saved_standins(root: str) -> tuple[str, str]:
    """Both models saved under ``root``: (policy path, reward model path)."""
    return (save_tiny_qwen3_moe(os.path.join(root, "tiny-Qwen3MoeForCausalLM")),
            save_tiny_qwen2_reward_model(os.path.join(root, "tiny-Qwen2ForSequenceClassification-2.5")))
