"""Paged attention against dense attention on the same keys and values: the PyTorch
reference (decode groups, prefill chunks on a cached prefix) and the CPU kernel, on a batch
that mixes decodes, a chunk on a cached prefix and a fresh prompt. Both paths also write the
step's K/V into the cache."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import require_cpu_kernel

from baton.kernels import attention, cpu_kernels
from baton.kernels.attention import (
    AttentionMetadata,
    DecodeGroup,
    KernelBatch,
    PrefillSeq,
    group_decodes,
    paged_attention,
)


def test_group_decodes_bounds_padding():
    lens = [100, 98, 60, 59, 10]  # sorted longest first
    assert group_decodes(lens, 1, max_padding_elems=10_000) == [5]
    assert group_decodes(lens, 1, max_padding_elems=0) == [1, 1, 1, 1, 1]
    # Waste after the head of a group: 2 (98), +40 (60) > 5 -> new group at 60; 1 (59); 50 > 5.
    assert group_decodes(lens, 1, max_padding_elems=5) == [2, 2, 1]
    assert group_decodes([], 1) == []


@dataclass
class Batch:
    """One step: sequences as (context after the step, rows this step), decodes first."""
    seqs: list[tuple[int, int]]
    tables: list[list[int]]
    q: torch.Tensor  # [rows, q_heads, D]
    k: torch.Tensor  # this step's [rows, kv_heads, D]
    v: torch.Tensor
    cache: torch.Tensor  # [blocks, layers, 2, block_size, kv_heads, D], the engine's layout
    expected_out: torch.Tensor
    expected_cache: torch.Tensor
    block_size: int

    def caches(self, cache=None):
        """Layer 1's K and V views: strided, as the engine passes them."""
        cache = self.cache if cache is None else cache
        return cache[:, 1, 0], cache[:, 1, 1]

    def positions(self) -> list[int]:
        return [p for ctx, n in self.seqs for p in range(ctx - n, ctx)]

    def slots(self) -> torch.Tensor:
        bs = self.block_size
        return torch.tensor([t[p // bs] * bs + p % bs for (ctx, n), t in zip(self.seqs, self.tables)
                             for p in range(ctx - n, ctx)])


def make_batch(seqs, kv_heads=2, group=3, head_dim=8, block_size=4, dtype=torch.float32, seed=0,
               fused_qkv=False) -> Batch:
    torch.manual_seed(seed)
    num_blocks = sum(-(-ctx // block_size) for ctx, _ in seqs) + 7
    cache = torch.randn(num_blocks, 3, 2, block_size, kv_heads, head_dim).to(dtype)
    free = torch.randperm(num_blocks).tolist()
    tables = [[free.pop() for _ in range(-(-ctx // block_size))] for ctx, _ in seqs]
    rows, q_heads = sum(n for _, n in seqs), kv_heads * group
    if fused_qkv:  # q, k, v as views into one projection output, as the model passes them
        qkv = torch.randn(rows, q_heads + 2 * kv_heads, head_dim).to(dtype)
        q, k, v = qkv[:, :q_heads], qkv[:, q_heads:q_heads + kv_heads], qkv[:, q_heads + kv_heads:]
    else:
        q, k, v = (torch.randn(rows, h, head_dim).to(dtype) for h in (q_heads, kv_heads, kv_heads))
    expected_cache = cache.clone()
    outs, row = [], 0
    for (ctx, n), table in zip(seqs, tables):
        k_seq = expected_cache[table, 1, 0].flatten(0, 1)  # copies, written back below
        v_seq = expected_cache[table, 1, 1].flatten(0, 1)
        k_seq[ctx - n:ctx], v_seq[ctx - n:ctx] = k[row:row + n], v[row:row + n]
        expected_cache[table, 1, 0] = k_seq.view(len(table), block_size, kv_heads, head_dim)
        expected_cache[table, 1, 1] = v_seq.view(len(table), block_size, kv_heads, head_dim)
        keys = k_seq[:ctx].float().repeat_interleave(group, dim=1).transpose(0, 1)
        values = v_seq[:ctx].float().repeat_interleave(group, dim=1).transpose(0, 1)
        future = torch.arange(ctx)[None, :] > torch.arange(ctx - n, ctx)[:, None]
        outs.append(F.scaled_dot_product_attention(q[row:row + n].float().transpose(0, 1), keys, values,
                                                   attn_mask=~future, scale=head_dim ** -0.5).transpose(0, 1))
        row += n
    return Batch(seqs, tables, q, k, v, cache, torch.cat(outs).to(dtype), expected_cache, block_size)


MIXED = [(13, 1), (9, 1), (9, 1), (2, 1), (14, 5), (7, 7)]  # decodes, a chunk on a cached prefix, a fresh prompt


def reference_meta(b: Batch, decode_groups: list[int]) -> AttentionMetadata:
    meta, start = AttentionMetadata(slot_mapping=b.slots()), 0
    for size in decode_groups:
        width = len(b.tables[start])
        table = torch.tensor([t + [0] * (width - len(t)) for t in b.tables[start:start + size]])
        lens = torch.tensor([ctx for ctx, _ in b.seqs[start:start + size]])
        mask = torch.arange(width * b.block_size)[None, :] < lens[:, None]
        meta.decodes.append(DecodeGroup(start, table, mask[:, None, None, :]))
        start += size
    row = start
    for (ctx, n), table in zip(b.seqs[start:], b.tables[start:]):
        meta.prefills.append(PrefillSeq(row, n, ctx, torch.tensor(table)))
        row += n
    return meta


def kernel_meta(b: Batch) -> AttentionMetadata:
    block_ids, row_block_start = [], []
    for (_, n), table in zip(b.seqs, b.tables):
        row_block_start += [len(block_ids)] * n
        block_ids += table
    return AttentionMetadata(kernel=KernelBatch(torch.tensor(block_ids), torch.tensor(row_block_start),
                                                torch.tensor(b.positions())))


def run(b: Batch, meta: AttentionMetadata) -> torch.Tensor:
    k_cache, v_cache = b.caches()
    return paged_attention(b.q, b.k, b.v, k_cache, v_cache, meta, b.q.shape[-1] ** -0.5)


@pytest.mark.parametrize("decode_groups", [[4], [1, 2, 1], [1, 1, 1, 1]])
def test_reference_equals_dense_attention_and_writes_the_step(decode_groups):
    b = make_batch(MIXED, fused_qkv=True)
    torch.testing.assert_close(run(b, reference_meta(b, decode_groups)), b.expected_out)
    torch.testing.assert_close(b.cache, b.expected_cache, rtol=0, atol=0)  # writing K/V is a copy: exact


def test_reference_prefill_through_sdpa(monkeypatch):
    monkeypatch.setattr(attention, "_MAX_CPU_SCORES", 0)  # no materialized scores
    b = make_batch(MIXED)
    torch.testing.assert_close(run(b, reference_meta(b, [4])), b.expected_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,group,head_dim,block_size", [
    (2, 2, 16, 16),  # the tiny test models
    (3, 3, 64, 16),  # SmolLM2
    (1, 7, 24, 16),  # no fixed-size instance for head_dim 24
    (4, 1, 128, 8),  # and none for block size 8
])
def test_cpu_kernel_equals_dense_attention_and_writes_the_step(dtype, kv_heads, group, head_dim, block_size):
    require_cpu_kernel()
    # Longer than a block and than a tile of 8 query rows; a single token; a block boundary.
    seqs = [(200, 1), (97, 1), (16, 1), (1, 1), (64, 21), (37, 37), (1, 1)]
    b = make_batch(seqs, kv_heads, group, head_dim, block_size, dtype, seed=head_dim, fused_qkv=True)
    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(run(b, kernel_meta(b)), b.expected_out, **tol)
    torch.testing.assert_close(b.cache, b.expected_cache, rtol=0, atol=0)  # writing K/V is a copy: exact


def test_cpu_kernel_rejects_what_it_cannot_read():
    require_cpu_kernel()
    b = make_batch(MIXED)
    k_cache, v_cache = b.caches()
    meta = kernel_meta(b).kernel

    def call(q=b.q, k=b.k, k_cache=k_cache, positions=meta.positions):
        cpu_kernels.paged_attention(q, k, b.v, k_cache, v_cache, meta.block_ids, meta.row_block_start, positions, 1.0)

    with pytest.raises(ValueError, match="q: expected rows of"):
        call(q=b.q.transpose(1, 2))  # D not contiguous
    with pytest.raises(ValueError, match="k_cache: expected rows of"):
        call(k_cache=k_cache.transpose(2, 3).contiguous().transpose(2, 3))  # heads not head_dim apart
    with pytest.raises(ValueError, match="dtype"):
        call(k=b.k.double())
    with pytest.raises(ValueError, match="int64"):
        call(positions=meta.positions.int())


def test_without_a_compiler_the_reference_runs(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv("BATON_CPU_KERNELS", raising=False)
    monkeypatch.setenv("BATON_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None
        assert not cpu_kernels.supports(torch.float32, torch.device("cpu"), 4, 2, 16)
        assert "PyTorch reference" in caplog.text
    finally:
        cpu_kernels.load.cache_clear()


def test_cpu_kernel_refuses_a_row_past_its_blocks_and_writes_nothing():
    require_cpu_kernel()
    b = make_batch(MIXED)
    k_cache, v_cache = b.caches()
    meta = kernel_meta(b).kernel
    before = b.cache.clone()
    for block_ids in (meta.block_ids[:-1], torch.cat([meta.block_ids[:-1], torch.tensor([10_000])])):
        with pytest.raises(ValueError, match="past its blocks"):
            cpu_kernels.paged_attention(b.q, b.k, b.v, k_cache, v_cache, block_ids, meta.row_block_start,
                                        meta.positions, 1.0)
    assert torch.equal(b.cache, before)


def test_cpu_kernel_rows_need_not_come_in_position_order():
    require_cpu_kernel()
    seqs = [(20, 4)]  # one chunk whose rows arrive last position first; head_dim 16 sums 4 queries at once
    b = make_batch(seqs, kv_heads=1, group=1, head_dim=16, block_size=16, seed=5)
    k_cache, v_cache = b.caches()
    flip = torch.arange(3, -1, -1)
    meta = kernel_meta(b).kernel
    out = cpu_kernels.paged_attention(b.q[flip], b.k[flip], b.v[flip], k_cache, v_cache, meta.block_ids,
                                      meta.row_block_start, meta.positions[flip], b.q.shape[-1] ** -0.5)
    torch.testing.assert_close(out, b.expected_out[flip])


@pytest.mark.parametrize("softcap,window,sunk", [(None, 6, False), (3.0, None, False), (3.0, 9, False),
                                                (None, None, True), (3.0, 9, True)])
def test_cpu_kernel_windows_soft_caps_and_sinks_equal_the_reference(softcap, window, sunk):
    """Against the reference (their oracle) on one batch; the blocks wholly before every window
    of a sequence are NaN for the kernel, which must never read them (a hybrid KV cache lets
    them go). Sinks large enough to take most of some heads' weight."""
    require_cpu_kernel()
    seqs = [(200, 1), (97, 1), (16, 1), (1, 1), (64, 21), (37, 37), (1, 1)]
    b = make_batch(seqs, 2, 3, 16, 16, seed=5, fused_qkv=True)
    scale = b.q.shape[-1] ** -0.5
    sinks = torch.tensor([3.0, -1.0, 0.5, 8.0, -20.0, 1.5]) if sunk else None
    ref_cache = b.cache.clone()
    want = paged_attention(b.q, b.k, b.v, ref_cache[:, 1, 0], ref_cache[:, 1, 1], reference_meta(b, [4]), scale,
                           softcap, window, sinks)
    if sunk:  # they count: the same batch without them differs
        without = paged_attention(b.q, b.k, b.v, ref_cache[:, 1, 0].clone(), ref_cache[:, 1, 1].clone(),
                                  reference_meta(b, [4]), scale, softcap, window)
        assert not torch.allclose(want, without, atol=1e-3)
    if window is not None:
        for (ctx, n), table in zip(b.seqs, b.tables):
            for blk in range(max(0, ctx - n - window + 1) // b.block_size):  # before the first row's window
                b.cache[table[blk], 1] = float("nan")
    k_cache, v_cache = b.caches()
    got = paged_attention(b.q, b.k, b.v, k_cache, v_cache, kernel_meta(b), scale, softcap, window, sinks)
    torch.testing.assert_close(got, want)
