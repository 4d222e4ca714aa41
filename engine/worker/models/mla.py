"""Multi-head latent attention (DeepSeek-V2, V3): keys and values come from one compressed latent
per token (kv_lora_rank values, RMS-normed) and one RoPE'd key part shared by every head
(qk_rope_head_dim), and that is all the paged cache keeps: one "head" of
kv_lora_rank + qk_rope_head_dim per token (a cache of one part: k_cache and v_cache are one view).

Attention runs in the absorbed form, as one multi-query attention over the latent: on CUDA
Triton's latent kernel (kernels/triton_mla.py) at any width; on CPU the C++ kernel where it
takes the head (up to 256: small latents; DeepSeek's real 512 + 64 runs on the reference).
Each head's query is turned into
the latent space (q_nope · W_UK, W_UK the key part of kv_b_proj), concatenated with its RoPE'd
part, and attends to [latent, k_rope] with the latent itself as the values; the output latent is
turned into each head's values by W_UV (the value part of kv_b_proj) before o_proj. That equals
up-projecting every cached token's K and V (transformers' form) and never materializes them:
what a decode, one query over a long context, wants.

Prefill chunks attend in the up-projected form instead (as vLLM's MLA does): their context's
latents, read back from the cache, turned into per-head keys (nope + rope) and values by
kv_b_proj once per chunk, and attended as ordinary multi-head attention. A chunk of q queries
over c keys then costs c · rank · heads · (nope + v) for the projection and q · c · heads ·
(nope + rope + v) for attention, against q · c · heads · (2 · rank + rope) absorbed: DeepSeek's
512-wide latent makes the absorbed form ~3.4x the attention work per query and key.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.worker.models.basic import Linear, norm
from baton.engine.worker.models.rope import rotate, rotate_interleaved, yarn_mscale
from baton.kernels.attention import (
    AttentionMetadata,
    causal_mask,
    dense_attention,
    gather_blocks,
    paged_attention,
    write_kv,
)
from baton.kernels.kv_quant import from_cache, to_cache


def yarn_softmax_mscale(scaling: dict | None) -> float:
    """DeepSeek's YaRN scales the softmax by mscale(factor, mscale_all_dim) squared."""
    if not scaling or not scaling.get("mscale_all_dim"):
        return 1.0
    mscale = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])
    return mscale * mscale


class MLAttention(nn.Module):
    """Named as DeepSeek's checkpoints name its parts."""

    def __init__(self, args):
        super().__init__()
        h, self.rank = args.hidden_size, args.kv_lora_rank
        self.num_heads, self.nope, self.rope, self.v_dim = (args.num_heads, args.qk_nope_head_dim,
                                                            args.qk_rope_head_dim, args.v_head_dim)
        q_out = self.num_heads * (self.nope + self.rope)
        if args.q_lora_rank:
            self.q_a_proj = Linear(h, args.q_lora_rank, bias=args.qkv_bias)
            self.q_a_layernorm = norm(args, args.q_lora_rank)
            self.q_b_proj = Linear(args.q_lora_rank, q_out, bias=False)
        self.q_proj = None if args.q_lora_rank else Linear(h, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, self.rank + self.rope, bias=args.qkv_bias)
        self.kv_a_layernorm = norm(args, self.rank)
        self.kv_b_proj = Linear(self.rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(self.num_heads * self.v_dim, h, bias=args.o_bias)
        self.scale = args.attn_scale
        self.turn = rotate_interleaved if args.rope_interleaved else rotate  # (halves: V3 without rope_interleave)
        self.window = None  # (CausalLM.prepare sets every layer's; DeepSeek's never slide)
        # An FP8 cache's scale of the cached row (kernels/kv_quant.py), as K's and V's: one row is both.
        self.register_buffer("kv_scales", torch.ones(2, 1, dtype=torch.float32), persistent=False)

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(-1, self.num_heads, self.nope + self.rope)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        k_rope = self.turn(k_rope[:, None], cos, sin)
        kv = torch.cat((self.kv_a_layernorm(latent)[:, None], k_rope), dim=-1)  # [T, 1, rank + rope]: what is cached
        q = torch.cat((q[..., :self.nope], self.turn(q[..., self.nope:], cos, sin)), dim=-1)
        if not meta.prefills:
            return self.o_proj(self._absorbed(q, kv, k_cache, v_cache, meta).flatten(1))
        n = meta.num_decodes
        write_kv(k_cache, None, to_cache(kv[n:], self.kv_scales[0], k_cache.dtype), None, meta.slot_mapping[n:])
        out = torch.empty(q.shape[0], self.num_heads, self.v_dim, dtype=q.dtype, device=q.device)
        if n:
            out[:n] = self._absorbed(q[:n], kv[:n], k_cache, v_cache, meta.decodes_only())
        for seq in meta.prefills:
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            out[rows] = self._up_projected(q[rows], k_cache, seq)
        return self.o_proj(out.flatten(1))

    def _absorbed(self, q, kv, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Every row of `meta` attending over the latents: [T, heads, v_head_dim]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        q = torch.cat((torch.einsum("thd,hdr->thr", q[..., :self.nope], w[:, :self.nope]), q[..., self.nope:]), -1)
        if meta.triton is not None:
            from baton.kernels import triton_mla  # imported where picked only: triton is optional
            out = triton_mla.mla_paged_attention(q, kv, k_cache, meta.triton, self.scale, self.rank, self.kv_scales)
        else:  # values: the latent (and k_rope, unused)
            out = paged_attention(q, kv, kv, k_cache, v_cache, meta, self.scale, kv_scales=self.kv_scales)
            out = out[..., :self.rank]
        return torch.einsum("thr,hvr->thv", out, w[:, self.nope:])

    def _up_projected(self, q: torch.Tensor, k_cache: torch.Tensor, seq) -> torch.Tensor:
        """One prefill chunk (its rows of q [n, heads, nope + rope], RoPE'd) over its context's
        latents from the cache, up-projected: [n, heads, v_head_dim]."""
        cached = gather_blocks(k_cache, seq.block_table).flatten(0, 1)[:seq.ctx_len]  # [ctx, 1, rank + rope]
        cached = from_cache(cached, self.kv_scales[0], q.dtype)[:, 0]
        kv = F.linear(cached[:, :self.rank], self.kv_b_proj.weight).view(seq.ctx_len, self.num_heads, -1)
        k_rope = cached[:, None, self.rank:].expand(-1, self.num_heads, -1)
        k = torch.cat((kv[..., :self.nope], k_rope), dim=-1).transpose(0, 1)
        mask = seq.mask
        if mask is None:  # the same for every layer: built once per step
            mask = seq.mask = causal_mask(seq.q_len, seq.ctx_len, 1, q.dtype, q.device)
        return dense_attention(q.transpose(0, 1), k, kv[..., self.nope:].transpose(0, 1), mask, self.scale
                               ).transpose(0, 1)
