"""Attention over a paged cache computed directly in PyTorch, the kernels' oracle in the Triton
tests and in bench/gpu_check.py: each sequence's chunk of queries (the last of its context)
against its blocks gathered densely, causal, with an optional sliding window, soft-cap and sinks
(gpt-oss's: one more score per head in the softmax, dropped after it, as transformers does)."""
from __future__ import annotations

import math

import torch


def paged_reference(q, k_cache, v_cache, block_tables, q_starts, q_lens, ctx_lens, scale, softcap=None, window=None,
                    sinks=None):
    """q [T, Hq, D]; k_cache/v_cache [blocks, block_size, Hkv, D]; per sequence its table row,
    first query row, query count and context length (the chunk's own tokens included)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    block_size = k_cache.shape[1]
    for s, (start, n, ctx) in enumerate(zip(q_starts.tolist(), q_lens.tolist(), ctx_lens.tolist())):
        blocks = block_tables[s, :math.ceil(ctx / block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx].float().repeat_interleave(group, dim=1)
        v = v_cache[blocks].flatten(0, 1)[:ctx].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,thd->hqt", q[start:start + n].float(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        pos = (ctx - n + torch.arange(n, device=q.device))[:, None]
        keys = torch.arange(ctx, device=q.device)[None, :]
        visible = keys <= pos  # [n, ctx]
        if window is not None:
            visible &= keys > pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:  # [h, q, t + 1], the sink's column dropped after the softmax
            sink = sinks.float()[:, None, None].expand(-1, n, 1)
            p = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(scores, dim=-1)
        out[start:start + n] = torch.einsum("hqt,thd->qhd", p, v).to(q.dtype)
    return out
