"""An FP8 KV cache (kv_cache_dtype fp8 / fp8_e5m2): every attention backend reads FP8 blocks
itself and equals the reference on the same blocks; each writes the same bytes (one writer,
kernels/kv_quant.py); an FP8 engine batched, chunked, preempted, prefix-cached, swapped to the
host tier, over tensor-parallel ranks and through the router equals a plain FP8 engine; FP8
blocks move between a prefill and a decode as stored (a quarter of float32's bytes), and a pair
of two KV dtypes converts on landing, the decode's blocks holding what its own writer makes of
the prefill's K and V. The checkpoint's k_scale/v_scale are read; bad values are refused
naming the field.

FP8 rounds every cached element (3 mantissa bits in e4m3): output is not transformers'. The
oracle of an engine is a plain FP8 engine (one prompt at a time, unchunked, a pool that never
preempts), of a kernel the reference over the same FP8 blocks."""
from __future__ import annotations

import json
import os
import shutil

import grpc
import pytest
import torch
from conftest import require_cpu_kernel
from helpers import greedy_through, pools_full, random_prompts, stats, wait_serving
from nixl_engines import assert_pools_full, connect, disaggregated, nixl_engine
from safetensors.torch import save_file
from servers import pd_stack
from test_attention import kernel_meta, make_batch, reference_meta
from test_families import FAMILIES, pool, write_family

from baton import LLM, SamplingParams
from baton.engine.common.errors import InvalidArgument
from baton.kernels.attention import paged_attention
from baton.kernels.kv_quant import dequantize_kv, quantize_kv
from baton.kv_transfer.base import KVFormat, KVFormatMismatch
from baton.testing.attention import paged_reference
from baton.v1 import generate_pb2 as pb
from baton.v1 import generate_pb2_grpc

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SCALES = torch.tensor([[0.02, 0.05], [0.03, 0.011]])  # [K, V] × 2 KV heads: per-head, and unlike 1.0


def fp8_batch(dtype, seed=5):
    """test_attention's mixed step (decodes past a block, a chunk on a cached prefix, a fresh
    prompt) with its cache quantized to `dtype` under SCALES."""
    b = make_batch([(200, 1), (97, 1), (16, 1), (1, 1), (64, 21), (37, 37), (1, 1)], 2, 3, 16, 16, seed=seed,
                   fused_qkv=True)
    cache = torch.empty(b.cache.shape, dtype=dtype)
    for part in (0, 1):
        cache[:, :, part] = quantize_kv(b.cache[:, :, part], SCALES[part], dtype)
    return b, cache


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("softcap,window,sunk", [(None, None, False), (3.0, 9, True)])
def test_the_cpu_kernel_reads_fp8_blocks_as_the_reference_and_writes_the_same_bytes(dtype, softcap, window, sunk):
    require_cpu_kernel()
    b, cache = fp8_batch(dtype)
    scale = b.q.shape[-1] ** -0.5
    sinks = torch.tensor([3.0, -1.0, 0.5, 8.0, -20.0, 1.5]) if sunk else None
    ref_cache, kernel_cache = cache.clone(), cache.clone()
    want = paged_attention(b.q, b.k, b.v, ref_cache[:, 1, 0], ref_cache[:, 1, 1], reference_meta(b, [4]), scale,
                           softcap, window, sinks, SCALES)
    got = paged_attention(b.q, b.k, b.v, kernel_cache[:, 1, 0], kernel_cache[:, 1, 1], kernel_meta(b), scale,
                          softcap, window, sinks, SCALES)
    torch.testing.assert_close(got, want)
    assert torch.equal(kernel_cache.view(torch.uint8), ref_cache.view(torch.uint8))  # one writer: the same bytes
    # The reference over FP8 blocks is attention over their values: the float path on a dequantized cache.
    values = torch.stack([dequantize_kv(cache[:, :, p], SCALES[p], torch.float32) for p in (0, 1)], dim=2)
    k, v = (dequantize_kv(quantize_kv(x, SCALES[p], dtype), SCALES[p], torch.float32) for p, x in enumerate((b.k, b.v)))
    plain = paged_attention(b.q, k, v, values[:, 1, 0], values[:, 1, 1], reference_meta(b, [4]), scale, softcap,
                            window, sinks)
    torch.testing.assert_close(want, plain)


def test_a_wrong_scale_shape_is_refused_by_the_cpu_kernel():
    require_cpu_kernel()
    b, cache = fp8_batch(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_scales"):
        paged_attention(b.q, b.k, b.v, cache[:, 1, 0], cache[:, 1, 1], kernel_meta(b), 0.25,
                        kv_scales=SCALES[:, :1])


@pytest.fixture
def triton_kernels(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # (read when a kernel runs)
    pytest.importorskip("triton")
    from baton.kernels import triton_attention, triton_mla

    return triton_attention, triton_mla


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
def test_triton_reads_fp8_blocks_in_decode_and_prefill(triton_kernels, dtype):
    triton_attention, _ = triton_kernels
    gen = torch.Generator().manual_seed(3)
    blocks, block_size, heads, group, head_dim = 12, 16, 2, 3, 32
    values = torch.randn(2, blocks, block_size, heads, head_dim, generator=gen) * 0.05
    cache = torch.stack([quantize_kv(values[p], SCALES[p], dtype) for p in (0, 1)])
    wide = torch.stack([dequantize_kv(cache[p], SCALES[p], torch.float32) for p in (0, 1)])
    tables = torch.randperm(blocks, generator=gen)[:10].view(2, 5).to(torch.int32)
    q = torch.randn(2, heads * group, head_dim, generator=gen)
    lens = torch.tensor([70, 33], dtype=torch.int32)
    got = triton_attention.paged_decode_attention(q, cache[0], cache[1], tables, lens, 0.2, num_splits=2,
                                                  kv_scales=SCALES)
    want = paged_reference(q, wide[0], wide[1], tables, torch.arange(2), torch.ones(2, dtype=torch.int32), lens, 0.2)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    qp = torch.randn(20, heads * group, head_dim, generator=gen)  # chunks of 12 and 8 ending contexts of 60 and 8
    starts, q_lens, ctx = (torch.tensor(x, dtype=torch.int32) for x in ([0, 12], [12, 8], [60, 8]))
    got = triton_attention.paged_prefill_attention(qp, cache[0], cache[1], tables, starts, q_lens, ctx, 0.2,
                                                   softcap=2.0, window=24, kv_scales=SCALES)
    want = paged_reference(qp, wide[0], wide[1], tables, starts, q_lens, ctx, 0.2, softcap=2.0, window=24)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_triton_mla_reads_an_fp8_latent(triton_kernels):
    _, triton_mla = triton_kernels
    gen = torch.Generator().manual_seed(4)
    rank, rope, heads, blocks, block_size = 24, 8, 4, 6, 16
    scales = torch.tensor([[0.04], [0.04]])  # one row, one scale (K's and V's alike)
    cache = quantize_kv(torch.randn(blocks, block_size, 1, rank + rope, generator=gen), scales[0],
                        torch.float8_e4m3fn)
    wide = dequantize_kv(cache, scales[0], torch.float32)
    tables = torch.randperm(blocks, generator=gen)[:6].view(2, 3).to(torch.int32)
    q = torch.randn(2, heads, rank + rope, generator=gen)
    lens = torch.tensor([40, 17], dtype=torch.int32)
    got = triton_mla.mla_decode_attention(q, cache, tables, lens, 0.3, rank, num_splits=2, kv_scales=scales)
    want = paged_reference(q, wide, wide, tables, torch.arange(2), torch.ones(2, dtype=torch.int32), lens, 0.3)
    torch.testing.assert_close(got, want[..., :rank], atol=2e-5, rtol=2e-5)


# GQA and a window (mistral), soft-caps and alternating windows in hybrid groups (gemma2), sinks
# (gpt-oss), MLA's latent (deepseek-v2), one KV head (qwen3).
SPINE = ["mistral", "gemma2", "gpt-oss", "deepseek-v2", "qwen3"]


@pytest.fixture(scope="module", params=SPINE)
def family(request, tmp_path_factory) -> str:
    config_class, shape = FAMILIES[request.param]
    return write_family(str(tmp_path_factory.mktemp(request.param) / request.param), config_class, **shape)


def prompts() -> list[list[int]]:
    out = random_prompts([3, 17, 40, 75, 130], seed=45)
    return out + [out[3][:48] + out[0]]  # shares three blocks with the fourth


def plain_fp8(model_dir: str, ps, dtype: str = "fp8", **kwargs) -> list[list[int]]:
    """The oracle: a plain FP8 engine, one prompt at a time, unchunked, in a pool that never preempts."""
    with LLM(model_dir, dtype="float32", device="cpu", kv_cache_dtype=dtype, max_num_batched_tokens=256,
             max_model_len=192, **kwargs) as llm:
        return [llm.generate([p], GREEDY)[0].token_ids for p in ps]


# (bfloat16 under float32 compute: a cache of another dtype without scales, as the FP8 one's path)
@pytest.mark.parametrize("kv", ["fp8", "bfloat16"])
def test_an_fp8_engine_batched_chunked_preempted_and_prefix_cached_equals_a_plain_one(family, kv):
    require_cpu_kernel()
    ps = prompts()
    want = plain_fp8(family, ps, kv)
    for backend in ("cpu", "torch"):
        with LLM(family, dtype="float32", device="cpu", kv_cache_dtype=kv, max_num_batched_tokens=32,
                 num_kv_blocks=pool(family), max_model_len=192, attention_backend=backend) as llm:
            assert llm.engine.runner.kv_cache.dtype == {"fp8": torch.float8_e4m3fn, "bfloat16": torch.bfloat16}[kv]
            assert [o.token_ids for o in llm.generate(ps, GREEDY)] == want, backend
            assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.prefix_hits > 0
            assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_fp8_blocks_move_between_prefill_and_decode_as_stored(family):
    ps = prompts()
    want = plain_fp8(family, ps)
    pairs = {}
    for kv in ("auto", "fp8"):
        prefill, decode = (nixl_engine(family, role, kv_cache_dtype=kv) for role in ("prefill", "decode"))
        connect(prefill, decode)
        pairs[kv] = disaggregated(prefill, decode, ps, [GREEDY] * len(ps)), decode.runner.connector.num_bytes_pulled
        assert_pools_full(prefill, decode)
        for engine in (prefill, decode):
            engine.close()
    assert pairs["fp8"][0] == want
    assert pairs["fp8"][1] * 4 == pairs["auto"][1]  # a quarter of float32's bytes, block for block


def on_step_first(decode, seen) -> None:
    """Keep a copy of the first request's blocks as they are in the decode's cache at its first step."""
    if "cache" in seen or not decode.runner.states:
        return
    state = next(iter(decode.runner.states.values()))
    ids = torch.tensor(state.block_ids[0], dtype=torch.long)
    seen["cache"] = decode.runner.kv_cache[ids].clone()


def test_a_float_prefill_feeds_an_fp8_decode_through_its_own_writer(tmp_path):
    """The decode READs the float32 blocks into a buffer and writes them through quantize_kv, as
    its attention writes: its cache holds exactly its own writer's bytes for the prefill's K/V.
    (Not a colocated FP8 engine's tokens: the prefill's later layers attended to unrounded K/V.)"""
    config_class, shape = FAMILIES["mistral"]
    model_dir = write_family(str(tmp_path / "m"), config_class, **shape)
    prompt = random_prompts([70], seed=9)[0]
    prefill, decode = nixl_engine(model_dir, "prefill"), nixl_engine(model_dir, "decode", kv_cache_dtype="fp8")
    wide = nixl_engine(model_dir, "decode")  # a float32 decode: what the prefill's blocks hold, read as they are
    try:
        connect(prefill, decode)
        connect(prefill, wide)
        first, float_first = {}, {}
        disaggregated(prefill, decode, [prompt], [GREEDY], on_step=lambda: on_step_first(decode, first))
        disaggregated(prefill, wide, [prompt], [GREEDY], on_step=lambda: on_step_first(wide, float_first))
        blocks = float_first["cache"]  # [n, layers, 2, block_size, heads, D] float32
        scales = decode.runner.model.layers[0].self_attn.kv_scales
        expect = torch.stack([quantize_kv(blocks[:, :, p], scales[p], torch.float8_e4m3fn) for p in (0, 1)], dim=2)
        landed = first["cache"]
        # The blocks the prompt filled (the last token's block is the decode's to write next).
        full = len(prompt) // 16
        assert landed.dtype == torch.float8_e4m3fn
        assert torch.equal(landed[:full].view(torch.uint8), expect[:full].view(torch.uint8))
        assert decode.runner.connector.num_bytes_pulled == wide.runner.connector.num_bytes_pulled
        assert_pools_full(prefill, decode, wide)
    finally:
        for engine in (prefill, decode, wide):
            engine.close()


# gemma2: hybrid groups, each group's blocks converted as its own; deepseek-v2: MLA's one cached row.
@pytest.mark.parametrize("name", ["gemma2", "deepseek-v2"])
def test_an_fp8_prefill_feeds_a_float_decode_and_e5m2_an_e4m3_one(tmp_path, name):
    """The other ways: FP8 blocks widened into a float32 cache (exactly: every FP8 value is a
    float32 one), and e5m2 blocks requantized into e4m3. Both run to the end with nothing leaked."""
    config_class, shape = FAMILIES[name]
    model_dir = write_family(str(tmp_path / name), config_class, **shape)
    ps = prompts()
    for prefill_kv, decode_kv in (("fp8", "auto"), ("fp8_e5m2", "fp8")):
        prefill = nixl_engine(model_dir, "prefill", kv_cache_dtype=prefill_kv, max_model_len=192)
        decode = nixl_engine(model_dir, "decode", kv_cache_dtype=decode_kv, max_model_len=192)
        try:
            connect(prefill, decode)
            outs = disaggregated(prefill, decode, ps, [GREEDY] * len(ps))
            assert [len(o) for o in outs] == [GREEDY.max_tokens] * len(ps)
            reader = decode.runner.connector  # the prefill's bytes moved, whatever the decode's
            assert reader.num_bytes_pulled == reader.num_blocks_pulled * prefill.runner.connector.layout.block_bytes
            assert_pools_full(prefill, decode)
        finally:
            for engine in (prefill, decode):
                engine.close()


def test_fp8_blocks_swap_to_the_host_tier_and_back_as_stored(tmp_path):
    require_cpu_kernel()
    config_class, shape = FAMILIES["mistral"]
    model_dir = write_family(str(tmp_path / "m"), config_class, **shape)
    ps = prompts()
    want = plain_fp8(model_dir, ps)
    with LLM(model_dir, dtype="float32", device="cpu", kv_cache_dtype="fp8", max_num_batched_tokens=32,
             num_kv_blocks=16, max_model_len=192, kv_offloading_size=0.01, preemption_mode="swap") as llm:
        assert llm.engine.runner.host_kv.host_cache.dtype == torch.float8_e4m3fn
        assert [o.token_ids for o in llm.generate(ps, GREEDY)] == want
        assert llm.engine.core.host.num_swapped_out > 0
        assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_fp8_blocks_hold_four_times_float32s_tokens(tiny_llama):
    sizes = {}
    for kv in ("auto", "bfloat16", "fp8", "fp8_e5m2"):
        with LLM(tiny_llama, dtype="float32", device="cpu", kv_cache_dtype=kv, kv_cache_memory_bytes=1 << 20,
                 max_num_seqs=256) as llm:
            sizes[kv] = llm.engine.num_kv_blocks
    assert sizes["fp8"] == sizes["fp8_e5m2"] == 2 * sizes["bfloat16"] == 4 * sizes["auto"]


def with_scales(src: str, dst, per_tensor: float, per_head: list[float]) -> str:
    """A copy of checkpoint `src` (sharded) with an FP8 KV cache's scales in a shard of their own:
    layer 0 in compressed-tensors' names (one per tensor), layer 1 in ModelOpt's (one per KV head)."""
    shutil.copytree(src, dst)
    scales = {"model.layers.0.self_attn.k_scale": torch.tensor(per_tensor),
              "model.layers.0.self_attn.v_scale": torch.tensor(per_tensor * 2),
              "model.layers.1.self_attn.k_proj.k_scale": torch.tensor(per_head),
              "model.layers.1.self_attn.v_proj.v_scale": torch.tensor(per_head[::-1])}
    save_file(scales, os.path.join(dst, "kv-scales.safetensors"))
    index_path = os.path.join(dst, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["weight_map"].update(dict.fromkeys(scales, "kv-scales.safetensors"))
    with open(index_path, "w") as f:
        json.dump(index, f)
    return str(dst)


def test_the_checkpoints_kv_scales_are_read_and_bad_ones_refused(tiny_llama, tmp_path):
    heads = json.load(open(os.path.join(tiny_llama, "config.json")))["num_key_value_heads"]
    per_head = [0.01 * (i + 1) for i in range(heads)]
    model_dir = with_scales(tiny_llama, tmp_path / "scaled", 0.05, per_head)
    with LLM(model_dir, dtype="float32", device="cpu", kv_cache_dtype="fp8") as llm:
        layers = llm.engine.runner.model.layers
        torch.testing.assert_close(layers[0].self_attn.kv_scales, torch.tensor([[0.05] * heads, [0.1] * heads]))
        torch.testing.assert_close(layers[1].self_attn.kv_scales, torch.tensor([per_head, per_head[::-1]]))
        assert llm.engine.runner.kv_scales == "checkpoint"
        assert len(llm.generate(prompts()[:2], GREEDY)[0].token_ids) == GREEDY.max_tokens
    with LLM(tiny_llama, dtype="float32", device="cpu", kv_cache_dtype="fp8") as llm:
        assert llm.engine.runner.kv_scales == "default"
        assert bool((llm.engine.runner.model.layers[1].self_attn.kv_scales == 1).all())
    bad = with_scales(tiny_llama, tmp_path / "bad", 0.0, per_head)
    with pytest.raises(InvalidArgument, match="k_scale") as info:
        LLM(bad, dtype="float32", device="cpu", kv_cache_dtype="fp8")
    assert info.value.field == "model"


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_field(tiny_llama):
    with pytest.raises(InvalidArgument) as info:
        LLM(tiny_llama, device="cpu", kv_cache_dtype="int8")
    assert info.value.field == "kv_cache_dtype" and "fp8_e5m2" in str(info.value)


def test_the_handshake_takes_another_kv_dtype_and_refuses_one_it_cannot_convert():
    fmt = KVFormat("m", "float32", 2, 2, 16, 16, "cpu")
    fp8 = KVFormat("m", "float8_e4m3fn", 2, 2, 16, 16, "cpu", kv_scales=(1.0,) * 8)
    fmt.check_peer(fp8)  # converted as the blocks land
    fp8.check_peer(fmt)
    with pytest.raises(KVFormatMismatch) as info:
        fmt.check_peer(KVFormat("m", "int4", 2, 2, 16, 16, "cpu"))
    assert info.value.field == "kv_cache_dtype"


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2)])
def test_fp8_blocks_reach_a_decode_of_another_tensor_parallel_size(tiny_llama, prefill_tp, decode_tp):
    ps = random_prompts([5, 40, 70], seed=12)
    want = plain_fp8(tiny_llama, ps)
    prefill = nixl_engine(tiny_llama, "prefill", tensor_parallel_size=prefill_tp, kv_cache_dtype="fp8")
    decode = nixl_engine(tiny_llama, "decode", tensor_parallel_size=decode_tp, kv_cache_dtype="fp8")
    try:
        connect(prefill, decode)
        assert disaggregated(prefill, decode, ps, [GREEDY] * len(ps)) == want
        assert_pools_full(prefill, decode)
    finally:
        for engine in (prefill, decode):
            engine.close()


def test_through_the_router_an_fp8_decode_behind_a_float_prefill(tmp_path):
    """`--kv-cache-dtype fp8` on the decode only: GetModelInfo says what each tier holds, and the
    stack's output equals the same pair in one process."""
    config_class, shape = FAMILIES["qwen3"]
    model_dir = write_family(str(tmp_path / "q"), config_class, **shape)
    ps = prompts()[:4]
    prefill, decode = nixl_engine(model_dir, "prefill"), nixl_engine(model_dir, "decode", kv_cache_dtype="fp8")
    try:
        connect(prefill, decode)
        want = disaggregated(prefill, decode, ps, [GREEDY] * len(ps))
    finally:
        for engine in (prefill, decode):
            engine.close()
    with pd_stack(model_dir, decode=("--kv-cache-dtype", "fp8")) as ((prefill,), (decode,), router):
        wait_serving(router.address)
        with grpc.insecure_channel(decode.address) as channel:
            info = generate_pb2_grpc.TextGenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        assert (info.dtype, info.kv_cache_dtype, info.kv_scales) == ("float32", "float8_e4m3fn", "default")
        assert greedy_through(router.address, ps, GREEDY.max_tokens) == want
        assert stats(decode.address).num_blocks_pulled > 0
        assert pools_full(prefill.address) and pools_full(decode.address)


def test_a_draft_models_fp8_kv_goes_with_the_prompts_and_stays_home_across_dtypes(tiny_llama, tiny_draft):
    """The draft's cache is FP8 too (its own scales): an FP8 pair ships it with the prompt's
    blocks, as stored, and the decode drafts as a colocated FP8 engine does, whose output is the
    plain FP8 engine's. A pair of two KV dtypes converts the prompt's blocks and leaves the
    draft's (the decode's draft computes its own): the output is the same pair's without drafts."""
    from nixl_engines import assert_drafts_as_colocated, head_across_pd

    ps = random_prompts([12, 30, 45], seed=22)
    spec = {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 3}
    want, got, colocated, drafted, layout, pulled = head_across_pd(tiny_llama, spec, ps, GREEDY,
                                                                   kv_cache_dtype="fp8")
    assert got == want == plain_fp8(tiny_llama, ps)
    assert_drafts_as_colocated(ps, want, colocated, drafted)
    blocks = sum(-(-len(p) // 16) for p in ps)
    assert pulled == blocks * (layout.block_bytes + layout.draft_block_bytes)
    outs = {}
    for drafts in (None, spec):
        prefill = nixl_engine(tiny_llama, "prefill", speculative_config=drafts)
        decode = nixl_engine(tiny_llama, "decode", speculative_config=drafts, kv_cache_dtype="fp8")
        try:
            connect(prefill, decode)
            outs[drafts is None] = disaggregated(prefill, decode, ps, [GREEDY] * len(ps))
            assert decode.runner.connector.num_bytes_pulled == blocks * prefill.runner.connector.layout.block_bytes
            assert_pools_full(prefill, decode)
        finally:
            for engine in (prefill, decode):
                engine.close()
    assert outs[False] == outs[True]


def test_calculated_scales_come_from_the_calibration_text_and_let_pd_pairs_move_blocks_as_stored(tmp_path):
    """calculate_kv_scales without the checkpoint's: each layer's K and V scale per head maps
    twice the calibration text's largest magnitude to FP8's largest value (a throwaway run of
    values computed the K and V); a prefill and a decode compute the same ones, so their blocks
    move as stored and the pair equals a colocated engine with them. A checkpoint's own scales
    win; tensor parallelism is refused naming the field."""
    from baton.engine.common.tokenizer import load_tokenizer
    from baton.engine.worker.kv_calibration import CALIBRATION_TEXT, MAX_CALIBRATION_TOKENS

    for name in ("mistral", "deepseek-v2"):  # (MLA: one scale for its one cached row)
        config_class, shape = FAMILIES[name]
        model_dir = write_family(str(tmp_path / name), config_class, **shape)
        with LLM(model_dir, dtype="float32", device="cpu") as llm:  # the calibration text's K and V, as values
            ids = load_tokenizer(model_dir).encode(CALIBRATION_TEXT)[:MAX_CALIBRATION_TOKENS]
            llm.generate([ids], SamplingParams(max_tokens=1))
            runner = llm.engine.runner
            blocks = runner.kv_cache[:-(-len(ids) // 16)]  # (the first request takes the first blocks)
        blocks = blocks.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)[:, :, :len(ids)]  # [layers, parts, tokens, heads, D]
        want = blocks.abs().amax(dim=(2, 4)) * 2 / 448  # [layers, parts, heads]
        with LLM(model_dir, dtype="float32", device="cpu", kv_cache_dtype="fp8", calculate_kv_scales=True) as llm:
            assert llm.engine.runner.kv_scales == "calculated"
            got = torch.stack([layer.self_attn.kv_scales for layer in llm.engine.runner.model.layers])
            torch.testing.assert_close(got[:, :want.shape[1]], want)
            assert not torch.equal(got, torch.ones_like(got))
            ps = prompts()
            colocated = [o.token_ids for o in llm.generate(ps, GREEDY)]
        prefill, decode = (nixl_engine(model_dir, role, kv_cache_dtype="fp8", calculate_kv_scales=True)
                           for role in ("prefill", "decode"))
        try:
            connect(prefill, decode)
            assert prefill.runner.connector.layout.format.kv_scales == decode.runner.connector.layout.format.kv_scales
            assert disaggregated(prefill, decode, ps, [GREEDY] * len(ps)) == colocated
            peer = decode.runner.connector.peers[prefill.runner.connector.engine_id]
            assert peer.conversion is None  # as stored
            assert_pools_full(prefill, decode)
        finally:
            for engine in (prefill, decode):
                engine.close()
    with pytest.raises(InvalidArgument) as info:
        LLM(model_dir, device="cpu", kv_cache_dtype="fp8", calculate_kv_scales=True, tensor_parallel_size=2)
    assert info.value.field == "calculate_kv_scales"


def test_a_checkpoints_scales_win_over_calculated_ones(tiny_llama, tmp_path):
    heads = json.load(open(os.path.join(tiny_llama, "config.json")))["num_key_value_heads"]
    model_dir = with_scales(tiny_llama, tmp_path / "scaled", 0.05, [0.01] * heads)
    with LLM(model_dir, dtype="float32", device="cpu", kv_cache_dtype="fp8", calculate_kv_scales=True) as llm:
        assert llm.engine.runner.kv_scales == "checkpoint"
        torch.testing.assert_close(llm.engine.runner.model.layers[0].self_attn.kv_scales,
                                   torch.tensor([[0.05] * heads, [0.1] * heads]))


def test_triton_on_a_gpu_before_compute_capability_8_9_refuses_an_e4m3_cache(monkeypatch):
    """Triton converts e4m3 on compute capability 8.9 and up: asked for, it is refused naming
    attention_backend (e5m2 runs); auto falls back to the reference. (The capability is faked:
    no GPU in CI.)"""
    pytest.importorskip("triton")
    from baton.engine.worker.attention_backend import choose_backend

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cuda = torch.device("cuda", 0)
    with pytest.raises(InvalidArgument, match="fp8_e5m2") as info:
        choose_backend("triton", torch.bfloat16, cuda, 8, 2, 64, kv_dtype=torch.float8_e4m3fn)
    assert info.value.field == "attention_backend"
    assert choose_backend("auto", torch.bfloat16, cuda, 8, 2, 64, kv_dtype=torch.float8_e4m3fn) == "torch"
    assert choose_backend("triton", torch.bfloat16, cuda, 8, 2, 64, kv_dtype=torch.float8_e5m2) == "triton"
