"""The Triton paged kernels equal attention computed directly in PyTorch, over a grid of
shapes: batch sizes, contexts crossing block boundaries, GQA groups 1 and 4-12, block sizes
16-128, head sizes 64-256 (80 and 96 included), split-K on and off, offsets past 2^31
elements. Without CUDA they run under Triton's interpreter on CPU tensors (small shapes);
with CUDA, on the GPU. bfloat16 is checked on a GPU only: the interpreter's tl.dot multiplies
bf16 bit patterns as if they were other numbers."""
from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

from baton.testing.attention import paged_reference

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
triton = pytest.importorskip("triton")
triton_attention = pytest.importorskip("baton.kernels.triton_attention")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32 accumulates the same way in both (tolerance for the order of the sums); half types
# round their inputs to the kernel's dot products.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def reference(q, k_cache, v_cache, block_tables, seq_lens, scale, softcap=None, window=None, sinks=None):
    """Each sequence's one query row against its whole context: paged_reference with chunks
    of one token."""
    n = len(seq_lens)
    return paged_reference(q, k_cache, v_cache, block_tables, torch.arange(n), torch.ones(n, dtype=torch.int32),
                           seq_lens, scale, softcap, window, sinks)


def case(batch, lens, group, head_dim, block_size, dtype, num_kv_heads=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(math.ceil(n / block_size) for n in lens)
    num_blocks = batch * max_blocks + 3
    # The blocks of the cache in a shuffled order, as a pool hands them out.
    perm = torch.randperm(num_blocks, generator=gen)[:batch * max_blocks].view(batch, max_blocks).to(torch.int32)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(batch, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return (q.to(DEVICE), cache[0].to(DEVICE), cache[1].to(DEVICE), perm.to(DEVICE),
            torch.tensor(lens, dtype=torch.int32, device=DEVICE))


GRID = [  # batch and context lengths (crossing block boundaries), GQA group, head size, block size
    (1, [1], 1, 64, 16), (3, [15, 16, 17], 4, 64, 16), (2, [33, 70], 8, 64, 32), (2, [50, 5], 4, 128, 16),
    # Head sizes that are no power of two (padded, masked) and 256; groups of 5-7 and 12
    # (Qwen2.5); blocks larger than the 64-key tile.
    (2, [70, 130], 5, 80, 64), (1, [200], 6, 96, 128), (2, [40, 9], 12, 256, 16), (1, [130], 7, 64, 128),
]


@pytest.mark.parametrize("shape,split,dtype", [
    (shape, split, dtype) for shape, split, dtype in itertools.product(
        GRID, [None, 6], [torch.float32, torch.float16])])
def test_decode_kernel_equals_the_reference(shape, split, dtype):
    """split 6: six programs share each sequence's 16-key tiles (tiles smaller than a block of
    32, too; a short context leaves some with none), then the combine pass; None: the default
    64-key tiles, one split at these sizes (written directly)."""
    batch, lens, group, head_dim, block_size = shape
    q, k_cache, v_cache, tables, seq_lens = case(batch, lens, group, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    got = triton_attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, split,
                                                  kv_tile=16 if split else None)
    want = reference(q, k_cache, v_cache, tables, seq_lens, scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_strided_cache_views_of_one_layer_are_read_in_place():
    """The engine's cache is [blocks, layers, 2, block, kv heads, D]: a layer's K and V are
    strided views, read without a copy."""
    q, k_cache, v_cache, tables, seq_lens = case(2, [20, 45], 4, 64, 16, torch.float32, seed=3)
    full = torch.zeros(k_cache.shape[0], 3, 2, *k_cache.shape[1:], device=DEVICE)
    full[:, 1, 0], full[:, 1, 1] = k_cache, v_cache
    got = triton_attention.paged_decode_attention(q, full[:, 1, 0], full[:, 1, 1], tables, seq_lens, 0.125, 2,
                                                  kv_tile=16)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, tables, seq_lens, 0.125), atol=2e-5, rtol=2e-5)


def test_offsets_past_2_to_the_31_elements_are_read_right():
    """A cache of more than 2^31 elements (a GPU's whole memory in bf16): block offsets need
    64 bits. The pages are only touched where the test writes, so it costs no real memory."""
    block_size, kv_heads, head_dim = 16, 2, 64
    num_blocks = (1 << 31) // (block_size * kv_heads * head_dim) + 8
    k_cache = torch.empty(num_blocks, block_size, kv_heads, head_dim, dtype=torch.float16, device=DEVICE)
    v_cache = torch.empty_like(k_cache)
    tables = torch.tensor([[num_blocks - 1, num_blocks - 5, num_blocks - 3]], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(5)
    for b in tables[0].tolist():
        k_cache[b] = torch.randn(block_size, kv_heads, head_dim, generator=gen).half()
        v_cache[b] = torch.randn(block_size, kv_heads, head_dim, generator=gen).half()
    q = torch.randn(1, kv_heads * 4, head_dim, generator=gen).half().to(DEVICE)
    seq_lens = torch.tensor([40], dtype=torch.int32, device=DEVICE)
    got = triton_attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125)
    want = reference(q, k_cache, v_cache, tables, seq_lens, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)


def test_uneven_heads_are_refused_naming_the_shapes():
    q, k_cache, v_cache, tables, seq_lens = case(1, [4], 1, 64, 16, torch.float32, num_kv_heads=2)
    with pytest.raises(ValueError, match="heads must group evenly"):
        triton_attention.paged_decode_attention(q[:, :1].repeat(1, 3, 1), k_cache, v_cache, tables, seq_lens, 1.0)


@pytest.mark.parametrize("chunks,group,head_dim,block_size,block_m,dtype,kv_tile", [
    ([(5, 5)], 1, 64, 16, 16, torch.float32, None),  # a whole short prompt
    ([(17, 40), (16, 16), (3, 70)], 4, 64, 16, 16, torch.float32, None),  # chunks after cached prefixes
    ([(17, 40), (16, 16), (3, 70)], 4, 64, 16, 16, torch.float32, 16),  # a key tile per block
    ([(33, 33), (20, 52)], 8, 64, 32, 8, torch.float32, 16),  # half a block per key tile
    ([(12, 30), (40, 40)], 4, 128, 16, 16, torch.float16, None),
    # The default rows per program (tokens × heads capped at 64) for groups of 7, 12 and 5.
    ([(20, 90)], 7, 96, 64, None, torch.float32, None),
    ([(9, 140), (30, 30)], 12, 80, 128, None, torch.float32, None),
    ([(6, 20)], 5, 256, 16, None, torch.float32, None),
])
def test_prefill_kernel_equals_the_reference(chunks, group, head_dim, block_size, block_m, dtype, kv_tile):
    """(chunk length, context length after it): the chunk attends to its prefix and causally to itself."""
    gen = torch.Generator().manual_seed(len(chunks) + head_dim)
    lens = [ctx for _, ctx in chunks]
    _, k_cache, v_cache, tables, _ = case(len(chunks), lens, group, head_dim, block_size, dtype, seed=7)
    q_lens = torch.tensor([n for n, _ in chunks], dtype=torch.int32)
    q_starts = torch.cumsum(q_lens, 0, dtype=torch.int32) - q_lens
    q = torch.randn(int(q_lens.sum()), 2 * group, head_dim, generator=gen).to(dtype).to(DEVICE)
    args = (q, k_cache, v_cache, tables, q_starts.to(DEVICE), q_lens.to(DEVICE),
            torch.tensor(lens, dtype=torch.int32, device=DEVICE), head_dim ** -0.5)
    got = triton_attention.paged_prefill_attention(*args, block_m=block_m, kv_tile=kv_tile)
    torch.testing.assert_close(got.float(), paged_reference(*args).float(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_puts_each_row_in_its_slot_and_nothing_else(dtype):
    gen = torch.Generator().manual_seed(11)
    k_cache = torch.zeros(6, 16, 2, 64, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    kv = torch.randn(2, 21, 2, 64, generator=gen).to(dtype).to(DEVICE)  # two programs' worth of tokens
    slots = torch.randperm(96, generator=gen)[:21].to(torch.int32).to(DEVICE)
    triton_attention.write_kv(k_cache, v_cache, kv[0], kv[1], slots)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    want_k.view(-1, 2, 64)[slots.long()] = kv[0]
    want_v.view(-1, 2, 64)[slots.long()] = kv[1]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)  # a copy, no arithmetic: exact


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="real shapes need CUDA")
@pytest.mark.parametrize("batch,context", [(1, 32768), (64, 4096), (256, 1024)])
def test_decode_kernel_on_real_shapes(batch, context):
    """Llama-3-8B's heads (32 query, 8 KV, 128), bfloat16, contexts from 1k to 32k."""
    q, k_cache, v_cache, tables, seq_lens = case(batch, [context - i for i in range(batch)], 4, 128, 16,
                                                 torch.bfloat16, num_kv_heads=8)
    got = triton_attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 128 ** -0.5)
    want = reference(q, k_cache, v_cache, tables, seq_lens, 128 ** -0.5)
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_the_attention_bench_runs_and_checks_its_kernels():
    """bench/attention.py on tiny shapes under the interpreter: the GPU figures come from this
    script, so it must run; it checks each kernel against SDPA before timing it."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "bench" / "attention.py"
    out = subprocess.run([sys.executable, str(bench), "--smoke"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "baton (paged)" in out.stdout and "vs gather" in out.stdout


def chunks_ending(k_cache, v_cache, tables, seq_lens, scale, seed):
    """The prefill kernel's arguments for chunks of 40, 21 and 7 tokens ending the three
    sequences' contexts (8 query heads of 64), random queries from `seed`."""
    q_lens = torch.tensor([40, 21, 7], dtype=torch.int32)
    q_starts = torch.cumsum(q_lens, 0, dtype=torch.int32) - q_lens
    qp = torch.randn(int(q_lens.sum()), 8, 64, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    return qp, k_cache, v_cache, tables, q_starts.to(DEVICE), q_lens.to(DEVICE), seq_lens, scale


@pytest.mark.parametrize("softcap,window,block_size", [(None, 20, 16), (4.0, None, 16), (4.0, 33, 8),
                                                       (None, 100, 32)])
def test_sliding_windows_and_soft_caps_equal_the_reference(softcap, window, block_size):
    """Decodes and prefill chunks, contexts past the window by more than a key tile (whose tiles
    are skipped: the blocks wholly before a window hold garbage here, as a hybrid KV cache's
    dropped blocks may) and within it."""
    lens = [150, 21, 97]
    q, k_cache, v_cache, tables, seq_lens = case(3, lens, 4, 64, block_size, torch.float32, seed=11)
    if window is not None:
        for row, n in enumerate(lens):  # garbage where no query of this test looks
            for blk in range(max(0, n - 40 - window) // block_size):  # (the chunk below starts 40 back)
                k_cache[tables[row, blk].long()] = 1e4
                v_cache[tables[row, blk].long()] = -1e4
    scale = 64 ** -0.5
    got = triton_attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, num_splits=5,
                                                  softcap=softcap, window=window)
    want = reference(q, k_cache, v_cache, tables, seq_lens, scale, softcap, window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    args = chunks_ending(k_cache, v_cache, tables, seq_lens, scale, seed=3)
    got = triton_attention.paged_prefill_attention(*args, block_m=16, softcap=softcap, window=window)
    torch.testing.assert_close(got, paged_reference(*args, softcap, window), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("split,window", [(None, None), (5, None), (5, 20)])
def test_sinks_equal_the_reference(split, window):
    """gpt-oss's sinks: counted once whatever the splits (the first only), also when the first
    split has no key in a window; heads whose sink outweighs their keys."""
    lens = [150, 21, 97]
    q, k_cache, v_cache, tables, seq_lens = case(3, lens, 4, 64, 16, torch.float32, seed=12)
    sinks = torch.tensor([4.0, -2.0, 0.0, 9.0, -30.0, 1.0, 2.5, 6.0], device=DEVICE)
    scale = 64 ** -0.5
    got = triton_attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, num_splits=split,
                                                  window=window, sinks=sinks)
    want = reference(q, k_cache, v_cache, tables, seq_lens, scale, None, window, sinks)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    args = chunks_ending(k_cache, v_cache, tables, seq_lens, scale, seed=4)
    got = triton_attention.paged_prefill_attention(*args, block_m=16, window=window, sinks=sinks)
    torch.testing.assert_close(got, paged_reference(*args, None, window, sinks), atol=2e-5, rtol=2e-5)
