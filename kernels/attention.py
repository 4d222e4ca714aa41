"""Attention over the paged KV cache: a PyTorch reference that runs on any device.

One call serves a whole step's flat batch: first the one-token decodes (batched, their block
tables padded and masked), then prefill chunks (each attending to its cached prefix and,
causally, to itself). The step's new K/V must already be written into the cache.
Grouped-query attention folds the query heads of a group into the query-length axis, so K/V
are never repeated per query head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSeq:
    q_start: int  # first row of this chunk in the flat batch
    q_len: int
    ctx_len: int  # tokens of context after this chunk (cached prefix + chunk)
    block_table: torch.Tensor  # [ceil(ctx_len / block_size)] block ids


@dataclass(slots=True)
class AttentionMetadata:
    num_decodes: int  # the first num_decodes rows are one-token decodes
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks], padded with 0
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size], True = attend
    prefills: list[PrefillSeq]
    slot_mapping: torch.Tensor  # [num_tokens] flat slot (block_id * block_size + offset) of each row


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter the step's K/V ([T, kv_heads, head_dim]) into one layer's cache views
    ([num_blocks, block_size, kv_heads, head_dim])."""
    block_size = k_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, q_heads, D]; k, v: this step's [T, kv_heads, D] (already in the cache).
    Returns [T, q_heads, D]."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        # [B, kv_heads, group, D] queries against [B, kv_heads, L, D] keys.
        qd = q[:nd].view(nd, num_kv_heads, group, head_dim)
        kd = k_cache[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)
        vd = v_cache[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[:nd] = od.reshape(nd, num_q_heads, head_dim)
    for seq in meta.prefills:
        rows = slice(seq.q_start, seq.q_start + seq.q_len)
        # [kv_heads, group * q_len, D]: query position varies fastest within a group.
        qp = q[rows].view(seq.q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        qp = qp.reshape(num_kv_heads, group * seq.q_len, head_dim)
        if seq.ctx_len == seq.q_len:  # no cached prefix: attend to the fresh K/V directly
            kp, vp = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
        else:
            kp = k_cache[seq.block_table].flatten(0, 1)[:seq.ctx_len].transpose(0, 1)
            vp = v_cache[seq.block_table].flatten(0, 1)[:seq.ctx_len].transpose(0, 1)
        q_pos = torch.arange(seq.ctx_len - seq.q_len, seq.ctx_len, device=q.device)
        mask = torch.arange(seq.ctx_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, ctx]
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask.repeat(group, 1), scale=scale)
        out[rows] = op.view(num_kv_heads, group, seq.q_len, head_dim).permute(2, 0, 1, 3).reshape(
            seq.q_len, num_q_heads, head_dim)
    return out
