"""A PyTorch stand-in for the FlashAttention-3 kernel TRL's async GRPO trainer packs its rows with, for CPUs.

TRL 1.16's ``AsyncGRPOTrainer`` folds a rank's samples into a prefix trie (``packing.TreeRow``) and runs attention
with ``kernels-community/flash-attn3``'s ``flash_attn_varlen_func``: a CUDA kernel fetched from the Hub. Each
segment s of the trie (queries ``q[cu_q[s]:cu_q[s+1]]``) attends to the keys of its root-to-segment path
(``k[cu_k[s]:cu_k[s+1]]``), causally with the bottom-right alignment FlashAttention uses for ``Lq <= Lk``: query i of
a segment of Lq queries over Lk keys sees key j iff ``j <= i + Lk - Lq`` (and, with a sliding window of w keys to the
left, ``j >= i + Lk - Lq - w``).

This computes the same thing with ``torch.nn.functional.scaled_dot_product_attention``, one segment at a time
(exact, no padding across segments; the cost is a Python loop over segments, fine for the small models a CPU
trains).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           softmax_scale: float | None = None, causal: bool = True,
                           window_size: tuple[int, int] = (-1, -1), softcap: float | None = None,
                           **unsupported) -> torch.Tensor:
    """Variable-length attention over packed segments, FlashAttention's signature and semantics.

    q: (Nq, H, D), k / v: (Nk, Hk, D) with H a multiple of Hk (grouped-query attention), cu_seqlens_*: (S + 1,)
    segment boundaries. Returns (Nq, H, D).
    """
    if unsupported:
        raise NotImplementedError(f"flash_attn_varlen_func stand-in: unsupported arguments {sorted(unsupported)}")
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} key/value heads")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    left = window_size[0] if window_size and window_size[0] >= 0 else None
    out = torch.empty_like(q)  # (Nq, H, D)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[s], bounds_q[s + 1], bounds_k[s], bounds_k[s + 1]
        if q1 == q0:
            continue
        q_s = q[q0:q1].transpose(0, 1)  # (H, Lq, D)
        k_s = k[k0:k1].transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, dim=0)  # (H, Lk, D)
        v_s = v[k0:k1].transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, dim=0)  # (H, Lk, D)
        len_q, len_k = q1 - q0, k1 - k0
        i = torch.arange(len_q, device=q.device).unsqueeze(1)  # (Lq, 1)
        j = torch.arange(len_k, device=q.device).unsqueeze(0)  # (1, Lk)
        allowed = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device)  # (Lq, Lk)
        if causal:
            allowed &= j <= i + (len_k - len_q)
        if left is not None:
            allowed &= j >= i + (len_k - len_q) - left
        if softcap:
            scores = torch.einsum("hqd,hkd->hqk", q_s.float(), k_s.float()) * scale  # (H, Lq, Lk)
            scores = softcap * torch.tanh(scores / softcap)
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[q0:q1] = torch.einsum("hqk,hkd->hqd", scores.softmax(-1), v_s.float()).transpose(0, 1).to(q.dtype)
        else:
            out[q0:q1] = F.scaled_dot_product_attention(q_s, k_s, v_s, attn_mask=allowed, scale=scale).transpose(0, 1)
    return out


KERNEL = SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)
