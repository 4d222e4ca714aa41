"""Triton attention for multi-head latent attention (DeepSeek-V2, V3) in its absorbed form
(engine/worker/models/mla.py): every query head attends to one shared cached row per token,
[latent (rank), k_rope (rope)], and the values are that row's latent. The generic kernels
(kernels/triton_attention.py) read it as one head of rank + rope and pad it to a power of two:
DeepSeek's 512 + 64 became 1024 columns, K and V tiles of 64 keys each, and overflowed an
H100's shared memory. Here, instead:

- the row is read as two tiles, latent [TILE, rank] and rope [TILE, rope], each padded on its
  own (512 and 64: no padding at the real sizes), and the latent tile is read once and serves
  as both the keys (scores = q_latent · c + q_rope · k_rope) and the values (p · c), so a
  pipeline stage holds one [TILE, rank + rope] tile, not a K and a V;
- a program takes BLOCK_H query heads (16; DeepSeek has up to 128), not a whole GQA group,
  which bounds its float32 output accumulator [BLOCK_H, rank] (32 KiB at 512: registers);
- the key tile is sized to the row: TILE keys × (rank + rope) elements stay within
  _STAGE_BYTES (32 keys at 576 bfloat16, 16 in float32, 64 for small latents).

The latent is not cut into chunks along its width: all of a loop body's loads share a pipeline
stage, so chunks would not shrink it, and an output in chunks would compute the scores again
per chunk. One [32, 576] bfloat16 tile per stage, read for both uses, took 55 KiB of shared
memory on an H100 in decode (74 KiB in prefill), of its 227.

Decode and prefill are one kernel (decode: one query per sequence, its row the sequence's
index; prefill: BLOCK_M tokens × BLOCK_H heads per program, causal over a cached prefix and
the chunk). Decode splits long contexts across programs (flash-decoding), as
triton_attention does, with a combine pass over the splits' log-sum-exps. Accumulation is in
float32. The output is [T, heads, rank]: only the latent is attended (the rope columns of the
values would be discarded by the caller anyway). Runs on CUDA, or on CPU under Triton's
interpreter (TRITON_INTERPRET=1, set before triton is imported), which is how CI tests it;
baton.testing.attention.paged_reference over the full row is the oracle. An FP8 cache's rows
are widened as they are read; its one scale multiplies the scores and the output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.kernels import triton_attention
from baton.kernels.kv_quant import is_fp8, to_cache
from baton.kernels.triton_attention import _split_tiles  # (a jit function: called from _mla by name)


@triton.jit
def _row_tile(CACHE, TABLE, first_key, ctx_len, r, p, stride_cb, stride_ct, RANK: tl.constexpr,
              ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr):
    """TILE cached rows from first_key, read in place through the sequence's table row: the
    latent [TILE, R_PAD] and the rope part [TILE, P_PAD]. Keys past ctx_len read as zeros."""
    key = first_key + tl.arange(0, TILE)
    in_ctx = key < ctx_len
    block_id = tl.load(TABLE + key // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
    row = CACHE + (block_id * stride_cb + (key % BLOCK_SIZE) * stride_ct)[:, None]
    c = tl.load(row + r[None, :], mask=in_ctx[:, None] & (r < RANK)[None, :], other=0.0)
    k_rope = tl.load(row + RANK + p[None, :], mask=in_ctx[:, None] & (p < ROPE)[None, :], other=0.0)
    return key, c, k_rope


# Integers that change from step to step are not specialized on (see triton_attention): the
# table's width, the split count's strides, tiles per split.
@triton.jit(do_not_specialize=["stride_tb", "stride_ot", "stride_oh", "stride_os", "stride_lt", "stride_lh"])
def _mla(Q, CACHE, OUT, LSE, BLOCK_TABLES, Q_STARTS, Q_LENS, CTX_LENS, SCALES,
         stride_qt, stride_qh, stride_cb, stride_ct, stride_tb, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
         scale,
         NUM_HEADS: tl.constexpr, RANK: tl.constexpr, R_PAD: tl.constexpr, ROPE: tl.constexpr, P_PAD: tl.constexpr,
         BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
         TILE: tl.constexpr, DECODE: tl.constexpr, DIRECT: tl.constexpr, FP8: tl.constexpr):
    # Axis 0 (no 65535 limit): decode's split, or prefill's tile of BLOCK_M query tokens.
    third, seq, head_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx_len = tl.load(CTX_LENS + seq)
    if DECODE:  # the query is row `seq`, at position ctx_len - 1; this split's key tiles
        q_start, q_len, m_tile, split = seq, 1, 0, third
        first, end = _split_tiles(0, tl.cdiv(ctx_len, TILE), split, tl.num_programs(0))
    else:  # the tile's last row sees keys up to ctx_len - q_len + (m_tile + 1) * BLOCK_M - 1
        q_start, q_len, m_tile, split = tl.load(Q_STARTS + seq), tl.load(Q_LENS + seq), third, 0
        if m_tile * BLOCK_M >= q_len:
            return
        first = 0
        end = tl.cdiv(tl.minimum(ctx_len, ctx_len - q_len + (m_tile + 1) * BLOCK_M), TILE)
    # Rows: BLOCK_M query tokens, each with BLOCK_H heads (heads vary fastest).
    i, r, p = tl.arange(0, ROWS), tl.arange(0, R_PAD), tl.arange(0, P_PAD)
    head = head_block * BLOCK_H + i % BLOCK_H
    i = m_tile * BLOCK_M + i // BLOCK_H  # the query token, within the chunk
    row_ok = (tl.arange(0, ROWS) < BLOCK_M * BLOCK_H) & (i < q_len) & (head < NUM_HEADS)
    pos = ctx_len - q_len + i  # its position in the context: it sees keys 0..pos
    q_row = Q + (q_start + i).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q_latent = tl.load(q_row + r[None, :], mask=row_ok[:, None] & (r < RANK)[None, :], other=0.0)
    q_rope = tl.load(q_row + RANK + p[None, :], mask=row_ok[:, None] & (p < ROPE)[None, :], other=0.0)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    s = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, R_PAD], tl.float32)
    row_scale = 1.0  # an FP8 cache's one scale: the row's keys' and, the latent, its values'
    if FP8:
        row_scale = tl.load(SCALES)
    for tile in range(first, end):
        key, c, k_rope = _row_tile(CACHE, BLOCK_TABLES + seq * stride_tb, tile * TILE, ctx_len, r, p, stride_cb,
                                   stride_ct, RANK, ROPE, BLOCK_SIZE, TILE)
        c, k_rope = c.to(q_latent.dtype), k_rope.to(q_latent.dtype)  # (FP8 elements: exact in q's dtype)
        scores = tl.dot(q_latent, tl.trans(c), input_precision="ieee")
        scores = (scores + tl.dot(q_rope, tl.trans(k_rope), input_precision="ieee")) * (scale * row_scale)
        scores = tl.where((key[None, :] <= pos[:, None]) & row_ok[:, None], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a padding row sees no key
        prob = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        s = s * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(c.dtype), c, input_precision="ieee")  # the latent: the values
        m = m_new
    has = s > 0  # a split past the end of its sequence holds nothing
    out = tl.where(has[:, None], acc * (row_scale / tl.where(has, s, 1.0))[:, None], 0.0)
    tok = (q_start + i).to(tl.int64)
    ok = row_ok[:, None] & (r < RANK)[None, :]
    out_ptrs = OUT + tok[:, None] * stride_ot + head[:, None] * stride_oh + split * stride_os + r[None, :]
    tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=ok)
    if not DIRECT:
        lse = tl.where(has, m + tl.log(tl.where(has, s, 1.0)), float("-inf"))
        tl.store(LSE + tok * stride_lt + head * stride_lh + split, lse, mask=row_ok)


BLOCK_H = 16  # query heads per program: DeepSeek's 16-128 heads (per GPU) in 1-8 programs per sequence
_PREFILL_ROWS = 32  # tokens × heads per prefill program (the rows of its float32 accumulator)
_STAGE_BYTES = 40 << 10  # one key tile's rows: two pipeline stages and q stay well inside an H100's 227 KiB


def kv_tile(width: int, dtype: torch.dtype) -> int:
    """Keys per loop iteration for rows of `width` elements: a power of two, 16-64, whose tile
    fits _STAGE_BYTES (32 at DeepSeek's 576 in bfloat16, 16 in float32)."""
    keys = _STAGE_BYTES // (width * dtype.itemsize)
    return max(16, min(64, 1 << max(0, keys.bit_length() - 1)))


def _check(name: str, q: torch.Tensor, cache: torch.Tensor, rank: int) -> tuple[int, int]:
    """(heads, rope) after checking the shapes the kernel assumes."""
    if (q.dim() != 3 or cache.dim() != 4 or cache.shape[2] != 1 or q.shape[2] != cache.shape[3]
            or not 0 < rank < q.shape[2] or q.stride(-1) != 1 or cache.stride(-1) != 1):
        raise ValueError(f"{name}: q {tuple(q.shape)} over cache {tuple(cache.shape)} with rank {rank} (q must be "
                         f"[T, heads, rank + rope], the cache [blocks, block_size, 1, rank + rope], rows contiguous)")
    return q.shape[1], q.shape[2] - rank


# Two pipeline stages of one key tile each; 4 warps: on an H100 (bfloat16, 512 + 64) 1.2-1.3x
# faster than 8 in decode and 1.5-1.6x in prefill, though prefill's [32, 512] accumulator spills
# a few registers there. Shared memory measured: 55 KiB decode, 74 KiB prefill.
_LAUNCH = {"num_warps": 4, "num_stages": 2}


_pad = triton_attention._pad  # a tile dimension: a power of two, at least 16 (tl.dot's smallest)


def _out(q: torch.Tensor, rank: int, out: torch.Tensor | None, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty(*q.shape[:2], rank, dtype=q.dtype, device=q.device)
    if out.shape[0] < q.shape[0] or out.shape[1] != q.shape[1] or out.shape[2] < rank or out.stride(-1) != 1:
        raise ValueError(f"{name}: out {tuple(out.shape)} cannot hold [{q.shape[0]}, {q.shape[1]}, {rank}]")
    return out


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         scale: float, rank: int, num_splits: int | None = None,
                         out: torch.Tensor | None = None, tile: int | None = None,
                         kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence over its cached context. q [B, heads, rank + rope]; cache
    [num_blocks, block_size, 1, rank + rope] (a strided per-layer view, rows contiguous);
    block_tables [B, max_blocks] int32; seq_lens [B] int32 (this step's token included).
    Returns the attended latent [B, heads, rank] (`out`: written into its first B rows and
    rank columns instead). `num_splits`: programs sharing each sequence's key tiles (default:
    enough to fill the device, triton_attention.default_num_splits); `tile`: keys per
    tile (default kv_tile); `kv_scales`: an FP8 cache's ([2, 1] float32, one scale)."""
    num_heads, rope = _check("mla_decode_attention", q, cache, rank)
    out = _out(q, rank, out, "mla_decode_attention")
    batch, block_size = q.shape[0], cache.shape[1]
    if not batch:
        return out
    tile = tile or kv_tile(q.shape[2], cache.dtype)
    head_blocks = -(-num_heads // BLOCK_H)
    max_tiles = max(1, -(-block_tables.shape[1] * block_size // tile))
    num_splits = num_splits or triton_attention.default_num_splits(q.device, batch, head_blocks, max_tiles)
    if num_splits == 1:  # written directly: no combine pass (lse unused)
        part, lse, part_strides, lse_strides = out, out, (out.stride(0), out.stride(1), 0), (0, 0)
    else:
        part = torch.empty(batch, num_heads, num_splits, rank, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_strides, lse_strides = part.stride()[:3], lse.stride()[:2]
    block_h = min(BLOCK_H, triton.next_power_of_2(num_heads))
    _mla[(num_splits, batch, head_blocks)](
        q, cache, part, lse, block_tables, seq_lens, seq_lens, seq_lens, triton_attention._scales(kv_scales, q),
        q.stride(0), q.stride(1), cache.stride(0),
        cache.stride(1), block_tables.stride(0), *part_strides, *lse_strides, scale,
        NUM_HEADS=num_heads, RANK=rank, R_PAD=_pad(rank), ROPE=rope, P_PAD=_pad(rope), BLOCK_SIZE=block_size,
        BLOCK_M=1, BLOCK_H=block_h, ROWS=_pad(block_h), TILE=tile, DECODE=True, DIRECT=num_splits == 1,
        FP8=is_fp8(cache.dtype), **_LAUNCH)
    if num_splits > 1:
        triton_attention.combine_splits[(batch, num_heads)](  # the latents' splits, as any head's
            part, lse, out, num_splits, *part_strides, *lse_strides, out.stride(0), out.stride(1), HEAD_DIM=rank,
            D_PAD=_pad(rank), num_warps=2 if rank > 128 else 1)
    return out


def mla_prefill_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, q_starts: torch.Tensor,
                          q_lens: torch.Tensor, ctx_lens: torch.Tensor, scale: float, rank: int,
                          max_q_len: int | None = None, out: torch.Tensor | None = None,
                          tile: int | None = None, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill chunks: sequence i's q_lens[i] rows of q [T, heads, rank + rope], from row
    q_starts[i], are the last tokens of its ctx_lens[i]-token context (their rows already in
    the cache), each seeing the keys up to its own. Returns [T, heads, rank] (`out`: its rows
    written there instead, other rows untouched). `max_q_len`: the longest chunk, when the
    caller knows it (else read from the device, a sync); `tile`: keys per tile; `kv_scales`: an
    FP8 cache's."""
    num_heads, rope = _check("mla_prefill_attention", q, cache, rank)
    out = _out(q, rank, out, "mla_prefill_attention")
    num_seqs = q_lens.shape[0]
    if not num_seqs:
        return out
    max_q = int(q_lens.max()) if max_q_len is None else max_q_len
    block_h = min(BLOCK_H, triton.next_power_of_2(num_heads))
    block_m = max(1, _PREFILL_ROWS // block_h)
    rows = _pad(block_m * block_h)
    _mla[(-(-max_q // block_m), num_seqs, -(-num_heads // block_h))](
        q, cache, out, out, block_tables, q_starts, q_lens, ctx_lens, triton_attention._scales(kv_scales, q),
        q.stride(0), q.stride(1), cache.stride(0),
        cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1), 0, 0, 0, scale,
        NUM_HEADS=num_heads, RANK=rank, R_PAD=_pad(rank), ROPE=rope, P_PAD=_pad(rope), BLOCK_SIZE=cache.shape[1],
        BLOCK_M=block_m, BLOCK_H=block_h, ROWS=rows, TILE=tile or kv_tile(q.shape[2], cache.dtype), DECODE=False,
        DIRECT=True, FP8=is_fp8(cache.dtype), **_LAUNCH)
    return out


def mla_paged_attention(q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor, batch, scale: float,
                        rank: int, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """One MLA layer of a whole step (a kernels.attention.TritonBatch: decodes first, then
    prefill chunks): this step's rows kv [T, 1, rank + rope] written to their slots of the
    cache (one part per token: the latent is the values too), then each kind's kernel into one
    output, the attended latent [T, heads, rank]. (The engine hands it decodes only: its MLA
    prefill attends up-projected, models/mla.py.) An FP8 cache's rows are written quantized with
    `kv_scales` ([2, 1] float32: the latent's one scale, twice)."""
    if cache.dtype != kv.dtype:
        kv = to_cache(kv, kv_scales[0] if is_fp8(cache.dtype) else None, cache.dtype)
    triton_attention.write_kv(cache, None, kv, None, batch.slot_mapping)
    out = _out(q, rank, None, "mla_paged_attention")
    num_decodes = batch.decode_lens.shape[0]
    if num_decodes:
        mla_decode_attention(q[:num_decodes], cache, batch.decode_tables, batch.decode_lens, scale, rank, out=out,
                             kv_scales=kv_scales)
    if batch.q_lens.shape[0]:
        mla_prefill_attention(q, cache, batch.prefill_tables, batch.q_starts, batch.q_lens, batch.ctx_lens, scale,
                              rank, max_q_len=batch.max_q_len, out=out, kv_scales=kv_scales)
    return out
