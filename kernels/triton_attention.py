"""Triton attention over the paged KV cache, for the GPU path: the write of a step's new K/V
into their slots, decode attention and prefill attention, each reading blocks in place
through the block table, never gathering them. The runner picks them when the cache is on a
CUDA device (engine/worker/attention_backend.py); `paged_attention` runs a whole step.

Decode (one query token per request): the query heads of a GQA group share each K/V read
(they are the rows of one tile), and long contexts are split across programs
(flash-decoding): each split writes its partial output and log-sum-exp, and a second kernel
combines them, so batch 1 of a 32k context keeps the GPU as busy as batch 256 of 1k. Prefill: a chunk of new tokens
attends to its cached prefix and, causally, to itself, so chunked prefill and prefix-cache
hits run the same kernel; a tile is BLOCK_M query tokens × the group's heads. Accumulation
is in float32. Both take a sliding window (a query sees the `window` positions ending at its
own; tiles wholly before it are skipped, and the first tile's keys before it are loaded but
masked: a hybrid KV cache's dropped entries there read block 0, finite) and a soft-cap
(scores become cap · tanh(score / cap), Gemma 2) and sinks (a score per head counted in the
softmax's sum with no value, gpt-oss: the running maximum and sum start from it, in the first
split only), each switched on by a constexpr so models without them compile the kernels as
before. An FP8 cache (FP8, kernels/kv_quant.py) is read as stored: tiles are widened to the
queries' dtype (exactly) as they are loaded, and the KV head's K scale multiplies the scores,
its V scale the output; the step's K/V arrive quantized already (attention.paged_attention).

Runs on CUDA tensors, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set
before triton is imported), which is how CI tests it. The PyTorch reference in
kernels/attention.py stays the fallback and the oracle.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.kernels.kv_quant import is_fp8


@triton.jit
def _kv_tile(K, V, TABLE, first_key, ctx_len, kv_head, d, d_ok, stride_kb, stride_kt, stride_kh, stride_vb,
             stride_vt, stride_vh, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr):
    """TILE keys from first_key, read in place: a tile spans TILE / BLOCK_SIZE cache blocks (or
    part of one), each key's block looked up in the sequence's table row, so the tile does not
    depend on the block size. Keys past ctx_len read as zeros."""
    key = first_key + tl.arange(0, TILE)
    in_ctx = key < ctx_len
    block_id = tl.load(TABLE + key // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
    kv_mask = in_ctx[:, None] & d_ok[None, :]
    k = tl.load(K + (block_id * stride_kb + (key % BLOCK_SIZE) * stride_kt)[:, None] + kv_head * stride_kh
                + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + (block_id * stride_vb + (key % BLOCK_SIZE) * stride_vt)[:, None] + kv_head * stride_vh
                + d[None, :], mask=kv_mask, other=0.0)
    return key, in_ctx, k, v


@triton.jit
def _split_tiles(first_tile, end_tile, split, num_splits):
    """This split's key tiles [first, end) of a sequence's [first_tile, end_tile): each
    sequence shares its own tiles evenly over the grid's splits, so the grid (a CUDA graph's,
    captured once for every context length) need not follow the longest context."""
    per = tl.cdiv(end_tile - first_tile, num_splits)
    first = first_tile + split * per
    return first, tl.minimum(first + per, end_tile)


@triton.jit
def _capped(scores, softcap, CAPPED: tl.constexpr):
    """cap · tanh(scores / cap) where CAPPED (tanh from the sigmoid: tl has no tanh of its own)."""
    if CAPPED:
        scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
    return scores


@triton.jit
def _start(SINKS, heads, sunk, ROWS: tl.constexpr, SUNK: tl.constexpr):
    """The online softmax's running maximum and sum before any key: -inf and 0, or where SUNK
    the `sunk` rows' sink score and its exp(0) = 1, so each sink is counted once."""
    m = tl.full([ROWS], float("-inf"), tl.float32)
    s = tl.zeros([ROWS], tl.float32)
    if SUNK:
        sink = tl.load(SINKS + heads, mask=sunk, other=0.0).to(tl.float32)
        m = tl.where(sunk, sink, m)
        s = tl.where(sunk, 1.0, s)
    return m, s


# Integers that change from step to step are not specialized on: Triton would compile a new
# variant whenever one's value class changes (equal to 1, divisible by 16), stalling the step.
@triton.jit
def _kv_scales(KV_SCALES, kv_head, stride_sv, FP8: tl.constexpr):
    """An FP8 cache's K and V scale for this KV head ([2, kv_heads] float32); 1.0 otherwise."""
    if FP8:
        return tl.load(KV_SCALES + kv_head), tl.load(KV_SCALES + stride_sv + kv_head)
    return 1.0, 1.0


@triton.jit(do_not_specialize=["stride_tb", "stride_ob", "stride_oh", "stride_os", "stride_lb", "stride_lh",
                               "window"])
def _decode_split(Q, K, V, BLOCK_TABLES, SEQ_LENS, OUT, LSE, SINKS, KV_SCALES,
                  stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                  stride_tb, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, scale,
                  window, softcap, stride_sv,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, DIRECT: tl.constexpr, SLIDING: tl.constexpr,
                  CAPPED: tl.constexpr, SUNK: tl.constexpr, FP8: tl.constexpr):
    b, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k_scale, v_scale = _kv_scales(KV_SCALES, kv_head, stride_sv, FP8)
    seq_len = tl.load(SEQ_LENS + b)
    first_key = 0  # the first key the query (at seq_len - 1) sees
    if SLIDING:
        first_key = tl.maximum(seq_len - window, 0)
    first, end = _split_tiles(first_key // TILE, tl.cdiv(seq_len, TILE), split, tl.num_programs(2))
    g, d = tl.arange(0, GROUP_PAD), tl.arange(0, D_PAD)
    heads = kv_head * GROUP + g
    d_ok = d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=(g[:, None] < GROUP) & d_ok[None, :], other=0.0)
    m, s = _start(SINKS, heads, (g < GROUP) & (g * 0 + split == 0), GROUP_PAD, SUNK)  # (a tensor mask)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for tile in range(first, end):
        key, in_ctx, k, v = _kv_tile(K, V, BLOCK_TABLES + b * stride_tb, tile * TILE, seq_len, kv_head, d, d_ok,
                                     stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, BLOCK_SIZE,
                                     TILE)
        k, v = k.to(q.dtype), v.to(q.dtype)  # (an FP8 cache's elements: exact in q's dtype)
        scores = _capped(tl.dot(q, tl.trans(k), input_precision="ieee") * (scale * k_scale), softcap, CAPPED)
        scores = tl.where((in_ctx & (key >= first_key))[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        s = s * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
    has = s > 0  # a split past the end of this sequence holds nothing (nor the sinks)
    out = tl.where(has[:, None], acc * (v_scale / tl.where(has, s, 1.0))[:, None], 0.0)
    row_ok = g < GROUP
    out_ptrs = OUT + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    if DIRECT:  # one split: the final output, no combine pass
        tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        tl.store(out_ptrs, out, mask=row_ok[:, None] & d_ok[None, :])
        lse = tl.where(has, m + tl.log(tl.where(has, s, 1.0)), float("-inf"))
        tl.store(LSE + b * stride_lb + heads * stride_lh + split, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_splits", "stride_pb", "stride_ph", "stride_ps", "stride_lb", "stride_lh"])
def combine_splits(PART, LSE, OUT, num_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                    stride_ob, stride_oh, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """One (sequence, head): the splits' partial outputs weighted by their log-sum-exps, a
    split at a time with a running maximum (a [splits, head_dim] tile would not fit in
    registers at batch 1 of a long context), so the split count is a runtime value."""
    b, h = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    m = tl.full([], float("-inf"), tl.float32)
    w_sum = tl.zeros([], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    for sp in range(0, num_splits):
        lse = tl.load(LSE + b * stride_lb + h * stride_lh + sp)
        part = tl.load(PART + b * stride_pb + h * stride_ph + sp * stride_ps + d, mask=d_ok, other=0.0)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # every split so far empty
        alpha, w = tl.exp(m - m_safe), tl.exp(lse - m_safe)
        acc = acc * alpha + part * w
        w_sum = w_sum * alpha + w
        m = m_new
    tl.store(OUT + b * stride_ob + h * stride_oh + d, (acc / w_sum).to(OUT.dtype.element_ty), mask=d_ok)


@triton.jit(do_not_specialize=["num_tokens"])
def _write_kv(K, V, K_CACHE, V_CACHE, SLOTS, num_tokens, stride_kt, stride_kh, stride_vt, stride_vh,
              stride_cb, stride_ct, stride_ch, stride_db, stride_dt, stride_dh, NUM_HEADS: tl.constexpr,
              HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, COLS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
              BLOCK_T: tl.constexpr, WRITE_V: tl.constexpr):
    # BLOCK_T tokens × all their KV heads: column c is head c // D_PAD, element c % D_PAD.
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.arange(0, COLS)
    h, d = c // D_PAD, c % D_PAD
    slot = tl.load(SLOTS + t, mask=t < num_tokens, other=-1).to(tl.int64)
    # A negative slot is a padding row's (a CUDA graph's batch padded to its captured size): not written.
    ok = (slot >= 0)[:, None] & ((h < NUM_HEADS) & (d < HEAD_DIM))[None, :]
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    k = tl.load(K + t[:, None] * stride_kt + (h * stride_kh + d)[None, :], mask=ok)
    tl.store(K_CACHE + (block * stride_cb + offset * stride_ct)[:, None] + (h * stride_ch + d)[None, :], k, mask=ok)
    if WRITE_V:
        v = tl.load(V + t[:, None] * stride_vt + (h * stride_vh + d)[None, :], mask=ok)
        tl.store(V_CACHE + (block * stride_db + offset * stride_dt)[:, None] + (h * stride_dh + d)[None, :], v,
                 mask=ok)


# Keys per loop iteration, whatever the block size (a tile reads several blocks, or part of one,
# through the table): a larger tile puts [TILE, head_dim] K and V in every pipeline stage.
KV_TILE = 64
# Rows of a prefill program (query tokens × the GQA group's heads): Qwen2.5's groups of 7 at 16
# tokens would give 128, which spills registers.
_MAX_ROWS = 64


def _launch(head_dim: int) -> dict:
    """Warps and pipeline stages for a head size: wider heads get more warps for their tile;
    two stages keep each stage's K and V tiles (64 × head_dim) in shared memory at 256."""
    return {"num_warps": 4 if head_dim <= 64 else 8, "num_stages": 2}


def _pad(n: int) -> int:
    """A tile dimension for n: a power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(n))


def _sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The sink scores as the kernels read them (float32, one per query head), or q as a
    placeholder pointer where there are none (never read: SUNK is off)."""
    if sinks is None:
        return q
    if sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks: expected one per query head ({q.shape[1]}), got shape {tuple(sinks.shape)}")
    return sinks.to(torch.float32).contiguous()


def _scales(kv_scales: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """An FP8 cache's scales as the kernels read them ([2, kv_heads] float32, contiguous), or q as
    a placeholder pointer (never read: FP8 is off)."""
    return q if kv_scales is None else kv_scales.to(torch.float32).contiguous()


def _groups(name: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Query heads per KV head, after checking the shapes the kernels assume."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads or q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"{name}: q {tuple(q.shape)} over cache {tuple(k_cache.shape)} "
                         f"(heads must group evenly; the head dimension must be contiguous)")
    return num_heads // num_kv_heads


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor | None,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] into the cache at flat slots (block id × block size + offset) [T]; the
    arguments in the order of the reference's kernels.attention.write_kv (v_cache and v None:
    a cache of one part, MLA's)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if not num_tokens:
        return
    d_pad = triton.next_power_of_2(head_dim)
    cols = triton.next_power_of_2(num_kv_heads) * d_pad
    block_t = max(1, min(64, 4096 // cols))  # tokens per program: a tile of at most 4096 elements
    write_v = v is not None
    v, v_cache = (v, v_cache) if write_v else (k, k_cache)  # (placeholders, never read)
    _write_kv[(-(-num_tokens // block_t),)](
        k, v, k_cache, v_cache, slot_mapping, num_tokens, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), NUM_HEADS=num_kv_heads, HEAD_DIM=head_dim, D_PAD=d_pad,
        COLS=cols, BLOCK_SIZE=k_cache.shape[1], BLOCK_T=block_t, WRITE_V=write_v)


@triton.jit(do_not_specialize=["stride_tb", "window"])
def _prefill(Q, K, V, OUT, BLOCK_TABLES, Q_STARTS, Q_LENS, CTX_LENS, SINKS, KV_SCALES,
             stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
             stride_ot, stride_oh, stride_tb, scale, window, softcap, stride_sv,
             GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
             BLOCK_M: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr, SLIDING: tl.constexpr,
             CAPPED: tl.constexpr, SUNK: tl.constexpr, FP8: tl.constexpr):
    seq, m_tile, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k_scale, v_scale = _kv_scales(KV_SCALES, kv_head, stride_sv, FP8)
    q_len = tl.load(Q_LENS + seq)
    if m_tile * BLOCK_M >= q_len:
        return
    q_start, ctx_len = tl.load(Q_STARTS + seq), tl.load(CTX_LENS + seq)
    # A tile's rows: BLOCK_M query tokens, each with the GROUP heads that share a K/V head.
    r, d = tl.arange(0, ROWS), tl.arange(0, D_PAD)
    i = m_tile * BLOCK_M + r // GROUP  # the query token, within the chunk
    head = kv_head * GROUP + r % GROUP
    row_ok = (r < BLOCK_M * GROUP) & (i < q_len)
    pos = ctx_len - q_len + i  # its position in the context: it sees keys 0..pos
    d_ok = d < HEAD_DIM
    q = tl.load(Q + (q_start + i)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m, s = _start(SINKS, head, row_ok, ROWS, SUNK)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    last = tl.minimum(ctx_len, ctx_len - q_len + (m_tile + 1) * BLOCK_M)  # keys the tile's last row sees
    start = 0  # the first tile any row sees
    if SLIDING:
        start = tl.maximum(ctx_len - q_len + m_tile * BLOCK_M - window + 1, 0) // TILE
    for tile in range(start, tl.cdiv(last, TILE)):
        key, _, k, v = _kv_tile(K, V, BLOCK_TABLES + seq * stride_tb, tile * TILE, ctx_len, kv_head, d, d_ok,
                                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, BLOCK_SIZE, TILE)
        k, v = k.to(q.dtype), v.to(q.dtype)
        scores = _capped(tl.dot(q, tl.trans(k), input_precision="ieee") * (scale * k_scale), softcap, CAPPED)
        seen = key[None, :] <= pos[:, None]
        if SLIDING:
            seen = seen & (key[None, :] > pos[:, None] - window)
        scores = tl.where(seen & row_ok[:, None], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a padding row sees no key
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        s = s * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
    out = acc * (v_scale / tl.where(s > 0, s, 1.0))[:, None]
    tl.store(OUT + (q_start + i)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
                            ctx_lens: torch.Tensor, scale: float, block_m: int | None = None,
                            max_q_len: int | None = None, out: torch.Tensor | None = None,
                            kv_tile: int | None = None, softcap: float | None = None,
                            window: int | None = None, sinks: torch.Tensor | None = None,
                            kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of prefill chunks: sequence i's q_lens[i] rows of q [T, Hq, D], from row
    q_starts[i], are the last tokens of its ctx_lens[i]-token context (the cached prefix and
    the chunk, whose K/V are in the cache already), each seeing the keys up to its own.
    `max_q_len`: the longest chunk, when the caller knows it (else read from the device, a
    sync); `out`: where the rows go (default: a new tensor like q; other rows untouched);
    `block_m`: query tokens per program (default: as many as fill _MAX_ROWS rows with their
    heads); `kv_tile`: keys per loop iteration (default KV_TILE); `softcap`, `window`, `sinks`
    ([Hq] float32): see the module's docstring."""
    group = _groups("paged_prefill_attention", q, k_cache, v_cache)
    head_dim, num_kv_heads = q.shape[2], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    num_seqs = q_lens.shape[0]
    if not num_seqs:
        return out
    max_q = int(q_lens.max()) if max_q_len is None else max_q_len
    block_m = block_m or max(1, _MAX_ROWS // group)
    _prefill[(num_seqs, -(-max_q // block_m), num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, q_starts, q_lens, ctx_lens, _sinks(sinks, q), _scales(kv_scales, q),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        block_tables.stride(0), scale, window or 0, softcap or 0.0, num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
        D_PAD=_pad(head_dim), BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, ROWS=_pad(block_m * group),
        TILE=kv_tile or KV_TILE, SLIDING=window is not None, CAPPED=softcap is not None, SUNK=sinks is not None,
        FP8=is_fp8(k_cache.dtype), **_launch(head_dim))
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, out: torch.Tensor | None = None,
                           kv_tile: int | None = None, softcap: float | None = None,
                           window: int | None = None, sinks: torch.Tensor | None = None,
                           kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its cached context.

    q [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] (one layer's views, any
    strides but a contiguous last dim); block_tables [B, max_blocks] int32; seq_lens [B] int32
    (the context, this step's token included). `kv_tile`: keys per loop iteration (default
    KV_TILE); `num_splits`: programs that share each sequence's key tiles (default
    `default_num_splits`; one split needs no combine pass); `out`: where the B rows go (its
    first B rows; default: a new tensor like q); `softcap`, `window`, `sinks` ([Hq] float32): see
    the module's docstring.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = _groups("paged_decode_attention", q, k_cache, v_cache)
    kv_tile = kv_tile or KV_TILE
    max_tiles = max(1, -(-block_tables.shape[1] * block_size // kv_tile))
    num_splits = num_splits or default_num_splits(q.device, batch, num_kv_heads, max_tiles)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if num_splits == 1:
        part, lse = out, out  # written directly (lse unused)
        part_strides, lse_strides = (out.stride(0), out.stride(1), 0), (0, 0)
    else:
        part = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_strides, lse_strides = part.stride()[:3], lse.stride()[:2]
    d_pad = _pad(head_dim)
    _decode_split[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part, lse, _sinks(sinks, q), _scales(kv_scales, q),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        *part_strides, *lse_strides, scale, window or 0, softcap or 0.0, num_kv_heads,
        GROUP=group, GROUP_PAD=_pad(group), HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size, TILE=kv_tile,
        DIRECT=num_splits == 1, SLIDING=window is not None, CAPPED=softcap is not None, SUNK=sinks is not None,
        FP8=is_fp8(k_cache.dtype), **_launch(head_dim))
    if num_splits > 1:
        combine_splits[(batch, num_heads)](
            part, lse, out, num_splits, *part_strides, *lse_strides, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, D_PAD=d_pad, num_warps=1 if head_dim <= 64 else 2)
    return out


def default_num_splits(device: torch.device, batch: int, num_kv_heads: int, max_tiles: int) -> int:
    """Decode programs per sequence and KV head: enough that batch × KV heads × splits fills
    the device's SMs twice over, at most the tiles of the widest table; a large batch, or a
    short context, gets one."""
    target = 2 * (_sm_count(device) if device.type == "cuda" else 4)
    return max(1, min(max_tiles, -(-target // (batch * num_kv_heads))))


_SM_COUNTS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch, scale: float, softcap: float | None = None,
                    window: int | None = None, sinks: torch.Tensor | None = None,
                    kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """One layer of a whole step (a kernels.attention.TritonBatch: decodes first, then prefill
    chunks): the step's K/V written to their slots, then each kind's kernel into one output."""
    write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_decodes = batch.decode_lens.shape[0]
    if num_decodes:
        paged_decode_attention(q[:num_decodes], k_cache, v_cache, batch.decode_tables, batch.decode_lens, scale,
                               out=out, softcap=softcap, window=window, sinks=sinks, kv_scales=kv_scales)
    if batch.q_lens.shape[0]:
        paged_prefill_attention(q, k_cache, v_cache, batch.prefill_tables, batch.q_starts, batch.q_lens,
                                batch.ctx_lens, scale, max_q_len=batch.max_q_len, out=out, softcap=softcap,
                                window=window, sinks=sinks, kv_scales=kv_scales)
    return out
