"""The same engine on a CUDA device (skipped where there is none, as in CI)."""
from __future__ import annotations

import pytest
import torch
from helpers import GREEDY, assert_matches_hf, random_prompts

from baton import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("budget", [2048, 24])
def test_cuda_float32_matches_transformers(tiny_model, hf, budget):
    prompts = random_prompts([3, 17, 40, 130], seed=11)
    llm = LLM(tiny_model, dtype="float32", device="cuda", max_num_batched_tokens=budget, num_kv_blocks=14,
              max_model_len=192)
    outs = llm.generate(prompts + [prompts[2]], GREEDY)  # tight pool: preemption; repeated prompt: prefix hits
    assert_matches_hf(hf, tiny_model, prompts + [prompts[2]], outs)
    assert llm.engine.runner.kv_cache.is_cuda
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_cuda_bfloat16_defaults(tiny_llama):
    llm = LLM(tiny_llama)  # device and dtype "auto": cuda, bfloat16
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16 and llm.engine.runner.kv_cache.is_cuda
    outs = llm.generate(random_prompts([20, 90], seed=12), SamplingParams(max_tokens=16, temperature=0.7, seed=1))
    assert all(1 <= len(o.token_ids) <= 16 for o in outs)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_the_engine_picks_the_triton_kernels_on_cuda(tiny_llama):
    pytest.importorskip("triton")
    llm = LLM(tiny_llama, dtype="float32", device="cuda", num_kv_blocks=64, max_model_len=256)
    assert llm.engine.runner.attention_backend == "triton"


def test_bfloat16_greedy_equals_transformers_in_bfloat16_for_32_tokens(tiny_model, hf):
    """A batch in bf16 on the Triton kernels against transformers in bf16, prompt by prompt.
    Rounding differs between the two (fused QKV, the attention kernel's order of sums), so only
    the first 32 tokens must agree; later ones may diverge where two logits tie in bf16."""
    prompts = random_prompts([3, 17, 40, 130, 260], seed=21)
    llm = LLM(tiny_model, dtype="bfloat16", device="cuda", max_num_batched_tokens=64)
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    want = [hf.greedy(tiny_model, p, 32, dtype=torch.bfloat16, device="cuda") for p in prompts]
    for out, ref, prompt in zip(outs, want, prompts):
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens"
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_gpu_memory_utilization_bounds_what_the_engine_takes(tiny_llama):
    free, total = torch.cuda.mem_get_info()
    share = min(0.3, 0.9 * free / total)
    before = torch.cuda.memory_allocated()
    llm = LLM(tiny_llama, device="cuda", gpu_memory_utilization=share, max_num_seqs=4096, max_model_len=1024)
    cache = llm.engine.runner.kv_cache
    assert 0 < cache.numel() * cache.element_size() <= share * total
    assert torch.cuda.memory_allocated() - before <= share * total


def test_prefill_and_decode_on_the_gpu_hand_off_over_nixl(tiny_llama):
    """Two engines on the GPU, blocks moved VRAM to VRAM by a real NIXL READ (after each
    engine's start-up probe): the output equals one colocated engine's."""
    pytest.importorskip("nixl")
    from nixl_engines import connect, disaggregated, nixl_engine

    prompts = random_prompts([5, 40, 130], seed=22)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * 3
    prefill = nixl_engine(tiny_llama, "prefill", device="cuda", num_kv_blocks=64, max_model_len=256)
    decode = nixl_engine(tiny_llama, "decode", device="cuda", num_kv_blocks=64, max_model_len=256)
    assert prefill.runner.connector.layout.mem_type == "VRAM"
    connect(prefill, decode)
    got = disaggregated(prefill, decode, prompts, params)
    want = LLM(tiny_llama, dtype="float32", device="cuda", num_kv_blocks=64, max_model_len=256).generate(prompts,
                                                                                                     params)
    assert got == [o.token_ids for o in want]
    assert decode.runner.connector.num_blocks_pulled > 0
