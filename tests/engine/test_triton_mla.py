"""The MLA latent kernels (kernels/triton_mla.py) equal attention computed directly in PyTorch
over the whole cached row [latent, k_rope] (its output's first `rank` columns: the values are
the latent): decode with and without splits, prefill chunks with and without a cached prefix,
and a whole mixed step. Latents of 24-32 with rope parts of 8 and 5-16 heads (powers of two and
not), and DeepSeek's real 512 + 64 at 16 heads over a short context. Without CUDA they run
under Triton's interpreter on CPU tensors, float32 only (see test_triton_attention.py)."""
from __future__ import annotations

import math
import os

import pytest
import torch

from baton.testing.attention import paged_reference

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
triton = pytest.importorskip("triton")
triton_mla = pytest.importorskip("baton.kernels.triton_mla")

from baton.kernels.attention import TritonBatch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 2e-5  # float32: the same sums in another order


def cache_case(lens, rank, rope, block_size, seed=0, layers=1):
    """A shuffled block table per sequence and a cache that is a strided view of a larger
    [blocks, layers, 2, block_size, 1, rank + rope] tensor (read in place, strides not assumed)."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(math.ceil(n / block_size) for n in lens)
    num_blocks = len(lens) * max_blocks + 3
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * max_blocks].view(len(lens), max_blocks)
    full = torch.randn(num_blocks, layers, 2, block_size, 1, rank + rope, generator=gen)
    return full.to(DEVICE)[:, layers - 1, 0], tables.to(torch.int32).to(DEVICE), gen


def ints(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def want(q, cache, tables, q_starts, q_lens, ctx_lens, scale, rank):
    return paged_reference(q, cache, cache, tables, q_starts, q_lens, ctx_lens, scale)[..., :rank]


@pytest.mark.parametrize("lens,heads,rank,rope,block_size,split", [
    ([1], 4, 32, 8, 16, None),
    ([15, 16, 17], 4, 32, 8, 16, None),  # around a block boundary
    ([33, 70], 5, 24, 8, 32, None),  # a latent and a head count that are no powers of two
    ([33, 70], 5, 24, 8, 32, 9),  # more programs than key tiles, then the combine pass
    ([50, 5, 18], 16, 32, 8, 16, 2),
    ([70, 130], 128, 32, 8, 16, 1),  # 8 head blocks; one split of several key tiles (the online softmax)
    ([40], 16, 512, 64, 16, None),  # DeepSeek's real row, 576 wide
    ([20, 45], 16, 512, 64, 32, 3),
])
def test_decode_equals_the_reference(lens, heads, rank, rope, block_size, split):
    """split: programs sharing each sequence's key tiles (None: the default, several at these sizes on CPU)."""
    cache, tables, gen = cache_case(lens, rank, rope, block_size, seed=len(lens) + rank)
    q = torch.randn(len(lens), heads, rank + rope, generator=gen).to(DEVICE)
    scale = 0.1
    got = triton_mla.mla_decode_attention(q, cache, tables, ints(lens), scale, rank, num_splits=split)
    n = len(lens)
    expected = want(q, cache, tables, torch.arange(n), torch.ones(n, dtype=torch.int32), ints(lens), scale, rank)
    assert got.shape == (n, heads, rank)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("chunks,heads,rank,rope,block_size", [
    ([(5, 5)], 4, 32, 8, 16),  # a whole short prompt
    ([(17, 40), (16, 16), (3, 70)], 4, 32, 8, 16),  # chunks after cached prefixes, one without
    ([(33, 33), (20, 52)], 5, 24, 8, 32),
    ([(9, 20)], 16, 512, 64, 16),  # DeepSeek's real row
    ([(3, 35)], 20, 32, 8, 32),  # two head blocks, the second partly empty
])
def test_prefill_equals_the_reference(chunks, heads, rank, rope, block_size):
    """(chunk length, context length after it): the chunk attends to its prefix and causally to itself."""
    lens = [ctx for _, ctx in chunks]
    cache, tables, gen = cache_case(lens, rank, rope, block_size, seed=7 + heads)
    q_lens = torch.tensor([n for n, _ in chunks], dtype=torch.int32)
    q_starts = torch.cumsum(q_lens, 0, dtype=torch.int32) - q_lens
    q = torch.randn(int(q_lens.sum()), heads, rank + rope, generator=gen).to(DEVICE)
    args = (q, cache, tables, q_starts.to(DEVICE), q_lens.to(DEVICE), ints(lens), 0.1)
    got = triton_mla.mla_prefill_attention(*args, rank)
    torch.testing.assert_close(got, want(*args, rank), atol=TOL, rtol=TOL)


def test_a_mixed_step_writes_its_rows_then_attends():
    """Two decodes then a chunk of 6 after a prefix of 12, as the runner's TritonBatch has them:
    the step's rows go to their slots first, so each query sees its own token."""
    rank, rope, block_size, heads = 24, 8, 16, 5
    lens, decodes, chunk = [20, 33, 18], 2, 6
    cache, tables, gen = cache_case(lens, rank, rope, block_size, seed=3)
    positions = [[19], [32], list(range(12, 18))]  # this step's tokens of each sequence
    slots = [int(tables[s, p // block_size]) * block_size + p % block_size for s, ps in enumerate(positions)
             for p in ps]
    kv = torch.randn(len(slots), 1, rank + rope, generator=gen).to(DEVICE)
    q = torch.randn(len(slots), heads, rank + rope, generator=gen).to(DEVICE)
    batch = TritonBatch(slot_mapping=ints(slots), decode_tables=tables[:decodes], decode_lens=ints(lens[:decodes]),
                        prefill_tables=tables[decodes:], q_starts=ints([decodes]), q_lens=ints([chunk]),
                        ctx_lens=ints(lens[decodes:]), max_q_len=chunk)
    expected_cache = cache.clone()
    expected_cache.view(-1, 1, rank + rope)[torch.tensor(slots)] = kv
    got = triton_mla.mla_paged_attention(q, kv, cache, batch, 0.1, rank)
    assert torch.equal(cache, expected_cache)
    expected = want(q, cache, tables, torch.tensor([0, 1, 2]), torch.tensor([1, 1, chunk]), ints(lens), 0.1, rank)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=TOL)


def test_out_may_be_the_full_row_width():
    """An `out` of [T, heads, rank + rope] (the generic kernels' shape) gets the latent in its
    first rank columns; the rest are left as they were."""
    cache, tables, gen = cache_case([30], 32, 8, 16, seed=5)
    q = torch.randn(1, 4, 40, generator=gen).to(DEVICE)
    out = torch.full((1, 4, 40), 7.0, device=DEVICE)
    triton_mla.mla_decode_attention(q, cache, tables, ints([30]), 0.1, 32, out=out)
    expected = want(q, cache, tables, torch.tensor([0]), torch.tensor([1]), ints([30]), 0.1, 32)
    torch.testing.assert_close(out[..., :32], expected, atol=TOL, rtol=TOL)
    assert torch.equal(out[..., 32:], torch.full((1, 4, 8), 7.0, device=DEVICE))


def test_bad_shapes_are_refused_naming_them():
    cache, tables, gen = cache_case([4], 32, 8, 16)
    with pytest.raises(ValueError, match=r"mla_decode_attention: q \(1, 4, 36\)"):
        triton_mla.mla_decode_attention(torch.zeros(1, 4, 36, device=DEVICE), cache, tables, ints([4]), 1.0, 32)
    with pytest.raises(ValueError, match="rank 40"):
        triton_mla.mla_prefill_attention(torch.zeros(1, 4, 40, device=DEVICE), cache, tables, ints([0]), ints([1]),
                                         ints([4]), 1.0, 40)
    with pytest.raises(ValueError, match=r"out \(1, 4, 16\)"):
        triton_mla.mla_decode_attention(torch.zeros(1, 4, 40, device=DEVICE), cache, tables, ints([4]), 1.0, 32,
                                        out=torch.zeros(1, 4, 16, device=DEVICE))


def test_key_tiles_fit_a_stage_of_shared_memory():
    """32 keys of DeepSeek's 576-wide bfloat16 rows per tile, 16 in float32, 64 for small rows."""
    assert triton_mla.kv_tile(576, torch.bfloat16) == 32
    assert triton_mla.kv_tile(576, torch.float32) == 16
    assert triton_mla.kv_tile(40, torch.float32) == 64
