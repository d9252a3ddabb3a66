"""The CPU stand-in for TRL's tree attention kernel (trl_rollout_corr.trl_hooks.tree_attention) against plain
attention: TRL's own packing (a prefix trie of samples sharing a prompt), TRL's fused log-prob head, and a per-sample
eager forward of the same model as the reference."""

from __future__ import annotations

import trl_rollout_corr  # noqa: F401  (first: its CPU-torch guard)

import pytest
import torch
import torch.nn.functional as F

from trl_rollout_corr.trl_hooks.tree_attention import flash_attn_varlen_func
from trl_rollout_corr.testing.toy_task import build_model


def test_one_segment_is_causal_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)  # GQA: 2 query heads per kv head
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), is_causal=True)
    assert torch.allclose(out, ref.transpose(0, 1), atol=1e-6)


def test_bottom_right_alignment_and_window_by_hand():
    """2 queries over 4 keys: query 0 sees keys 0..2, query 1 sees 0..3; with a window of 1: keys 1..2 and 2..3."""
    d = 4
    q = torch.zeros(2, 1, d)  # equal scores: the output is the mean of the values each query sees
    k = torch.zeros(4, 1, d)
    v = torch.arange(4.0).reshape(4, 1, 1).expand(4, 1, d).contiguous()
    cu_q, cu_k = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2, 4)
    assert out[:, 0, 0].tolist() == pytest.approx([1.0, 1.5])
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2, 4, window_size=(1, 0))
    assert out[:, 0, 0].tolist() == pytest.approx([1.5, 2.5])
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2, 4, alibi_slopes=torch.ones(1))


def test_packed_trie_log_probs_equal_a_plain_forward_per_sample(monkeypatch):
    from trl.experimental.async_grpo import packing
    from trl.trainer.utils import add_fused_lm_head

    from trl_rollout_corr.trl_hooks.tree_attention import KERNEL

    monkeypatch.setattr(packing, "_flash_attn", lambda: KERNEL)
    packing.register_tree_attention()
    model = build_model(hidden_size=64, num_heads=2).eval()  # GQA: 2 query heads, 2 kv heads
    reference = build_model(hidden_size=64, num_heads=2).eval()
    model.config._attn_implementation = packing.TREE_ATTENTION
    reference.config._attn_implementation = "eager"
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))

    prompt = [3, 12, 14, 9, 7, 5]  # vocabulary of 16
    completions = [[10, 11, 12, 1], [10, 11, 15, 6, 1], [13, 4, 1], [10, 11, 12, 1, 0]]  # shared prefixes
    row = packing.TreeRow()
    samples = []
    for n, completion in enumerate(completions):
        ids = torch.tensor(prompt + completion)
        mask = torch.tensor([0] * len(prompt) + [1] * len(completion))
        sample = {"input_ids": ids, "completion_mask": mask, "old_log_probs": torch.zeros(len(ids)),
                  "advantage": float(n), "group_id": 0}
        row.add(sample)
        samples.append(sample)
    packed = row.pack()
    assert packed["input_ids"].numel() < sum(len(s["input_ids"]) for s in samples)  # the prompt is shared
    with torch.no_grad():
        out = model(input_ids=packed["input_ids"][None], position_ids=packed["position_ids"][None],
                    shift_labels=packed["shift_labels"][None], fused_lm_head=True,
                    tree_kv_index=packed["tree_kv_index"], tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
                    tree_cu_seqlens_k=packed["tree_cu_seqlens_k"],
                    tree_max_seqlen_q=int(packed["tree_max_seqlens"][0]),
                    tree_max_seqlen_k=int(packed["tree_max_seqlens"][1]))
        packed_logps = out.log_probs.flatten()[packed["token_index"]]  # (M,)
        want = []
        for sample in samples:
            ids = sample["input_ids"][None]
            logits = reference(input_ids=ids).logits[0, :-1].double() / 0.7  # (T-1, V)
            logps = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]  # (T-1,)
            want.append(logps[sample["completion_mask"][1:].bool()])
    want = torch.cat(want)  # (M,), in TreeRow's sample order
    assert packed_logps.shape == want.shape
    assert torch.allclose(packed_logps.double(), want, atol=2e-5), (packed_logps.double() - want).abs().max()
