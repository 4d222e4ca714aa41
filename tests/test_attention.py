"""The paged attention reference: decode grouping, and groups agree with one padded batch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from baton.kernels import attention
from baton.kernels.attention import AttentionMetadata, DecodeGroup, PrefillSeq, group_decodes, paged_attention


def test_group_decodes_bounds_padding():
    lens = [100, 98, 60, 59, 10]  # sorted longest first
    assert group_decodes(lens, 1, max_padding_elems=10_000) == [5]
    assert group_decodes(lens, 1, max_padding_elems=0) == [1, 1, 1, 1, 1]
    # Waste after the head of a group: 2 (98), +40 (60) > 5 -> new group at 60; 1 (59); 50 > 5.
    assert group_decodes(lens, 1, max_padding_elems=5) == [2, 2, 1]
    assert group_decodes([], 1) == []


def test_decode_groups_equal_dense_attention():
    torch.manual_seed(0)
    bs, kv_heads, q_heads, d, num_blocks = 4, 2, 6, 8, 40
    k_cache, v_cache = torch.randn(2, num_blocks, bs, kv_heads, d).unbind(0)
    lens = [13, 9, 5, 2]
    tables = [[3, 17, 8, 30], [5, 1, 22], [39, 0], [12]]
    q = torch.randn(len(lens), q_heads, d)

    def group(start, size):
        width = len(tables[start])
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables[start:start + size]])
        mask = torch.arange(width * bs)[None, :] < torch.tensor(lens[start:start + size])[:, None]
        return DecodeGroup(start, table, mask[:, None, None, :])

    slots = torch.zeros(len(lens), dtype=torch.long)
    grouped = paged_attention(q, None, None, k_cache, v_cache,
                              AttentionMetadata([group(0, 1), group(1, 2), group(3, 1)], [], slots), 0.5)
    for i, (n, table) in enumerate(zip(lens, tables)):
        k = k_cache[table].flatten(0, 1)[:n].repeat_interleave(q_heads // kv_heads, dim=1).transpose(0, 1)
        v = v_cache[table].flatten(0, 1)[:n].repeat_interleave(q_heads // kv_heads, dim=1).transpose(0, 1)
        dense = F.scaled_dot_product_attention(q[i][:, None], k, v, scale=0.5)[:, 0]
        torch.testing.assert_close(grouped[i], dense)


def test_prefill_chunk_on_a_cached_prefix_equals_dense_attention_on_both_paths(monkeypatch):
    torch.manual_seed(1)
    bs, kv_heads, q_heads, d, num_blocks = 4, 2, 6, 8, 16
    k_cache, v_cache = torch.randn(2, num_blocks, bs, kv_heads, d).unbind(0)
    table, ctx_len, q_len = [7, 2, 11, 5], 14, 5  # the chunk is positions 9..13
    q = torch.randn(q_len, q_heads, d)
    k = k_cache[table].flatten(0, 1)[:ctx_len].repeat_interleave(q_heads // kv_heads, dim=1).transpose(0, 1)
    v = v_cache[table].flatten(0, 1)[:ctx_len].repeat_interleave(q_heads // kv_heads, dim=1).transpose(0, 1)
    future = torch.arange(ctx_len)[None, :] > torch.arange(ctx_len - q_len, ctx_len)[:, None]
    dense = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=~future, scale=0.5).transpose(0, 1)

    def paged():
        meta = AttentionMetadata([], [PrefillSeq(0, q_len, ctx_len, torch.tensor(table))], torch.zeros(q_len))
        return paged_attention(q, None, None, k_cache, v_cache, meta, 0.5)

    torch.testing.assert_close(paged(), dense)  # scores materialized
    monkeypatch.setattr(attention, "_MAX_CPU_SCORES", 0)
    torch.testing.assert_close(paged(), dense)  # SDPA
