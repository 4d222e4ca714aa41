"""Attention over the paged KV cache: a PyTorch reference that runs on any device.

One call serves a whole step's flat batch: it writes the step's new K/V into the cache, then
attends, the one-token decodes and the prefill chunks (each attending to its cached prefix
and, causally, to itself).

Three backends (chosen by engine/worker/attention_backend.py): on CPU the whole batch goes to a C++ kernel
(kernels/cpu_kernels.py, metadata `AttentionMetadata.kernel`) that reads blocks in place,
2-4x faster than the reference below; on CUDA, to the Triton kernels
(kernels/triton_attention.py, metadata `AttentionMetadata.triton`). The PyTorch reference
runs where neither can, and is the oracle of both. It puts
the decodes first, in groups of similar context length (see `group_decodes`): each group
gathers its blocks into one padded, masked batch, so a short request does not pay for the
longest one's padding. Gathers use `index_select` on whole blocks, a row memcpy on CPU,
several times faster than advanced indexing. Grouped-query attention folds the query heads
of a group into the query-length axis, so K/V are never repeated per query head.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from baton.kernels import cpu_kernels
from baton.kernels.kv_quant import from_cache, is_fp8, to_cache

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PrefillSeq:
    q_start: int  # first row of this chunk in the flat batch
    q_len: int
    ctx_len: int  # tokens of context after this chunk (cached prefix + chunk)
    block_table: torch.Tensor  # [ceil(ctx_len / block_size)] block ids
    mask: torch.Tensor | None = None  # filled on first use, see causal_mask
    windowed: dict = field(default_factory=dict)  # sliding window -> its mask, filled on first use
    # Key ranges [lo, hi) (positions counted as ctx_len's) whose queries also see the range's later
    # keys: a Gemma 3 image's tokens attend to all of that image.
    open_spans: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class DecodeGroup:
    start: int  # first row of the group in the flat batch; its rows are consecutive
    block_tables: torch.Tensor  # [n, max_blocks] block ids, padded with 0
    mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size]: additive (-inf past the end) or True = attend
    windowed: dict = field(default_factory=dict)  # sliding window -> its additive mask, filled on first use


@dataclass(slots=True)
class KernelBatch:
    """The whole batch, for the CPU kernel, which finds each row's slot and context itself."""
    block_ids: torch.Tensor  # every scheduled request's blocks, concatenated
    row_block_start: torch.Tensor  # [num_tokens] where the row's request's blocks start in block_ids
    positions: torch.Tensor  # [num_tokens]


@dataclass(slots=True)
class TritonBatch:
    """The whole batch, for the Triton kernels: B one-token decodes in the first rows, then P
    prefill chunks. Integer tensors are int32, on the cache's device."""
    slot_mapping: torch.Tensor  # [num_tokens]
    decode_tables: torch.Tensor  # [B, max blocks] block ids, padded with 0
    decode_lens: torch.Tensor  # [B] context lengths, this step's token included
    prefill_tables: torch.Tensor  # [P, max blocks]
    q_starts: torch.Tensor  # [P] first row of each chunk
    q_lens: torch.Tensor  # [P]
    ctx_lens: torch.Tensor  # [P] context after the chunk
    max_q_len: int  # known on the host: no sync to size the grid


@dataclass(slots=True)
class AttentionMetadata:
    """Either `kernel` (the CPU kernel runs every row), `triton` (the Triton kernels do), or
    the reference's decode groups and prefill chunks, with each row's cache slot. MLA's cache
    has the prefill chunks, the slots and the decode count whatever the backend (its prefill
    attends in another form, models/mla.py)."""
    decodes: list[DecodeGroup] = field(default_factory=list)  # the one-token decode rows come first
    prefills: list[PrefillSeq] = field(default_factory=list)
    slot_mapping: torch.Tensor | None = None  # [num_tokens] flat slot (block_id * block_size + offset) of each row
    kernel: KernelBatch | None = None
    triton: TritonBatch | None = None
    num_decodes: int = 0  # the one-token decode rows, first

    def decodes_only(self) -> AttentionMetadata:
        """The same step's metadata for its decode rows alone: the backend attends (and writes
        the K/V of) the first num_decodes rows only."""
        n = self.num_decodes
        if self.kernel is not None:
            kb = self.kernel
            return AttentionMetadata(kernel=KernelBatch(kb.block_ids, kb.row_block_start[:n], kb.positions[:n]))
        if self.triton is not None:
            tb = self.triton
            return AttentionMetadata(triton=TritonBatch(
                tb.slot_mapping[:n], tb.decode_tables, tb.decode_lens, tb.prefill_tables[:0], tb.q_starts[:0],
                tb.q_lens[:0], tb.ctx_lens[:0], 0))
        return AttentionMetadata(decodes=self.decodes, slot_mapping=self.slot_mapping[:n])




_MAX_CPU_SCORES = 1 << 24  # score elements (64 MiB in float32) a prefill may materialize on CPU


def causal_mask(q_len: int, ctx_len: int, group: int, dtype: torch.dtype, device,
                window: int | None = None, open_spans: list[tuple[int, int]] = ()) -> torch.Tensor:
    """Additive mask [group * q_len, ctx_len] for a chunk that ends the context: query i
    (at position ctx_len - q_len + i) sees positions up to its own (and, with a sliding
    `window`, fewer than `window` behind it), and within each of `open_spans` ([lo, hi)) the
    span's later positions too; rows repeat per query head."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)
    kv_pos = torch.arange(ctx_len, device=device)[None, :]
    hidden = kv_pos > q_pos[:, None]
    for lo, hi in open_spans:
        hidden &= ~(((q_pos >= lo) & (q_pos < hi))[:, None] & (kv_pos >= lo) & (kv_pos < hi))
    if window is not None:
        hidden |= kv_pos <= q_pos[:, None] - window
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf")).repeat(group, 1)


def _decode_window_mask(dec: DecodeGroup, window: int) -> torch.Tensor:
    """The group's mask with keys `window` or more positions behind each row's query hidden too
    (a row's query sits at its context length - 1: the count of keys its mask leaves open)."""
    mask = dec.windowed.get(window)
    if mask is None:
        lens = (dec.mask[:, 0, 0, :] == 0).sum(-1) if dec.mask.dtype != torch.bool else dec.mask[:, 0, 0, :].sum(-1)
        old = torch.arange(dec.mask.shape[-1], device=dec.mask.device)[None, :] <= (lens - 1 - window)[:, None]
        hide = False if dec.mask.dtype == torch.bool else float("-inf")
        mask = dec.windowed[window] = dec.mask.masked_fill(old[:, None, None, :], hide)
    return mask


DECODE_PADDING_ELEMS = 1 << 18  # cache elements a decode group may waste on padding (~1 MiB in float32)


def group_decodes(context_lens: list[int], kv_elems_per_token: int,
                  max_padding_elems: int = DECODE_PADDING_ELEMS) -> list[int]:
    """Split decodes, sorted by context length (longest first), into groups that each waste
    at most ~max_padding_elems cache elements (~1 MiB in float32) on padding. Small models
    get one group (a call costs more than their padding); long-tailed batches on real models
    get a few. Returns the group sizes."""
    sizes, waste, head = [], 0, 0
    for i, n in enumerate(context_lens):
        waste += (context_lens[head] - n) * kv_elems_per_token
        if waste > max_padding_elems:
            sizes.append(i - head)
            head, waste = i, 0
    if context_lens:
        sizes.append(len(context_lens) - head)
    return sizes


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, heads, D] (a strided per-layer view); block_ids of any
    shape S. Returns [*S, block_size, heads, D]."""
    return cache.index_select(0, block_ids.flatten()).view(*block_ids.shape, *cache.shape[1:])


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor | None,
             slot_mapping: torch.Tensor) -> None:
    """Scatter the step's K/V ([T, kv_heads, head_dim]) into one layer's cache views
    ([num_blocks, block_size, kv_heads, head_dim]); v_cache and v None: a cache of one part
    (MLA's latent)."""
    block_size = k_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, offsets] = k
    if v is not None:
        v_cache[blocks, offsets] = v


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    softcap: float | None = None, window: int | None = None,
                    sinks: torch.Tensor | None = None, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, q_heads, D]; k, v: this step's [T, kv_heads, D], written into the cache here.
    Rows may be strided (views into the fused QKV projection). Returns [T, q_heads, D].
    `softcap`: scores become softcap * tanh(scores / softcap) before the mask (Gemma 2);
    `window`: a query sees only keys fewer than `window` positions behind it (sliding-window
    layers); `sinks` ([q_heads] float32, gpt-oss): each head's softmax also counts one more
    score, its sink, whose value is zero, so a head may attend to nothing. Every backend does
    all three. A cache of another dtype (kernels/kv_quant.py: FP8 with `kv_scales`, [2, kv_heads]
    float32) takes the step's K/V as it holds them, written here for every backend; each reads
    its elements and attends over them (the fresh K/V of a prefill too: a chunk sees what a
    later one will read)."""
    fp8, stored = is_fp8(k_cache.dtype), k_cache.dtype != q.dtype
    if stored:
        scales = kv_scales if fp8 else (None, None)
        k, v = to_cache(k, scales[0], k_cache.dtype), None if v is None else to_cache(v, scales[1], k_cache.dtype)
    if meta.kernel is not None:
        kb = meta.kernel
        return cpu_kernels.paged_attention(q, k, v, k_cache, v_cache, kb.block_ids, kb.row_block_start, kb.positions,
                                           scale, softcap, window, sinks, kv_scales)
    if meta.triton is not None:
        from baton.kernels import triton_attention  # imported where picked only: triton is optional
        return triton_attention.paged_attention(q, k, v, k_cache, v_cache, meta.triton, scale, softcap, window,
                                                sinks, kv_scales)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)

    def read(cached: torch.Tensor, part: int) -> torch.Tensor:  # [..., kv_heads, D] as q's dtype
        return from_cache(cached, kv_scales[part] if fp8 else None, q.dtype) if stored else cached

    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for dec in meta.decodes:
        rows = slice(dec.start, dec.start + dec.block_tables.shape[0])
        # [B, kv_heads, group, D] queries against [B, kv_heads, L, D] keys.
        qd = q[rows].view(-1, num_kv_heads, group, head_dim)
        kd = read(gather_blocks(k_cache, dec.block_tables), 0).flatten(1, 2).transpose(1, 2)
        vd = read(gather_blocks(v_cache, dec.block_tables), 1).flatten(1, 2).transpose(1, 2)
        mask = dec.mask if window is None else _decode_window_mask(dec, window)
        explicit = softcap is not None or sinks is not None  # what SDPA does not do
        if explicit and mask.dtype == torch.bool:  # added to the scores: additive
            mask = torch.zeros(mask.shape, dtype=qd.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        if not explicit:
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
        else:
            scores = _capped(torch.matmul(qd, kd.transpose(-1, -2)) * scale, softcap) + mask
            sink = None if sinks is None else sinks.view(num_kv_heads, group, 1).expand(qd.shape[0], -1, -1, -1)
            od = torch.matmul(_softmax(scores, sink).to(vd.dtype), vd)
        out[rows] = od.reshape(-1, num_q_heads, head_dim)
    for seq in meta.prefills:
        rows = slice(seq.q_start, seq.q_start + seq.q_len)
        # [kv_heads, group * q_len, D]: query position varies fastest within a group.
        qp = q[rows].view(seq.q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        qp = qp.reshape(num_kv_heads, group * seq.q_len, head_dim)
        if seq.ctx_len == seq.q_len:  # no cached prefix: attend to the fresh K/V directly
            kp, vp = read(k[rows], 0).transpose(0, 1), read(v[rows], 1).transpose(0, 1)
        else:
            kp = read(gather_blocks(k_cache, seq.block_table).flatten(0, 1)[:seq.ctx_len], 0).transpose(0, 1)
            vp = read(gather_blocks(v_cache, seq.block_table).flatten(0, 1)[:seq.ctx_len], 1).transpose(0, 1)
        if seq.mask is None:  # the same for every layer: built once per step
            seq.mask = causal_mask(seq.q_len, seq.ctx_len, group, q.dtype, q.device, open_spans=seq.open_spans)
        mask = seq.mask
        if window is not None:  # per window, once per step
            mask = seq.windowed.get(window)
            if mask is None:
                mask = seq.windowed[window] = causal_mask(seq.q_len, seq.ctx_len, group, q.dtype, q.device, window,
                                                          seq.open_spans)
        if softcap is not None or sinks is not None:  # capped before the mask, as Gemma 2's eager attention does
            scores = _capped(torch.bmm(qp, kp.transpose(1, 2)) * scale, softcap) + mask
            sink = None if sinks is None else sinks.view(num_kv_heads, group, 1).repeat_interleave(seq.q_len, 1)
            op = torch.bmm(_softmax(scores, sink).to(vp.dtype), vp)
        else:
            op = dense_attention(qp, kp, vp, mask, scale)
        out[rows] = op.view(num_kv_heads, group, seq.q_len, head_dim).permute(2, 0, 1, 3).reshape(
            seq.q_len, num_q_heads, head_dim)
    return out


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
                    ) -> torch.Tensor:
    """Attention of q [H, n, E] over k [H, c, E] and v [H, c, Ev] with an additive mask [n, c] (or
    one per head, [H, n, c]): [H, n, Ev]."""
    if q.device.type == "cpu" and q.shape[0] * q.shape[1] * k.shape[1] <= _MAX_CPU_SCORES:
        # Scores materialized: on CPU 2-4x faster than SDPA's flash kernel at these sizes.
        scores = torch.baddbmm(mask, q, k.transpose(1, 2), alpha=scale)
        return torch.bmm(scores.softmax(-1, dtype=torch.float32).to(v.dtype), v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # never holds every score


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _softmax(scores: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dimension in float32; with a `sink` (a score per row, shaped like
    scores without its last dimension, plus 1) counted in the sum and dropped (gpt-oss's, as
    transformers computes it)."""
    if sink is None:
        return scores.softmax(-1, dtype=torch.float32)
    both = torch.cat((scores.float(), sink.float()), dim=-1)
    return both.softmax(-1)[..., :-1]
