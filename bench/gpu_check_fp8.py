"""bench/gpu_check.py's FP8 KV cache check, on CUDA:
- the Triton decode and prefill kernels reading e4m3 and e5m2 blocks (bfloat16 queries, Llama-8B's
  32 / 8 heads of 128, per-head scales) against the reference over the same blocks' values;
- a decode step's attention at KV-bound sizes (64 sequences of 8,192 keys), FP8 vs bfloat16 blocks,
  timed: the bytes FP8 saves;
- the engine on CUDA (float32 compute) with kv_cache_dtype fp8 (Triton, decode steps replaying CUDA
  graphs) greedy-equal to the same engine on the PyTorch reference (FP8 blocks both), pools full.
"""
from __future__ import annotations

import math
import os

import torch


def _case(gen, lens, block_size, heads, head_dim):
    """A pool's tables for sequences of `lens` keys, and [2, blocks, block_size, heads, D] values."""
    width = max(math.ceil(n / block_size) for n in lens)
    blocks = len(lens) * width + 1
    values = torch.randn(2, blocks, block_size, heads, head_dim, device="cuda", generator=gen) * 0.5
    tables = torch.randperm(blocks - 1, device="cuda", generator=gen)[:len(lens) * width].view(len(lens), width) + 1
    return values, tables.int(), torch.tensor(lens, dtype=torch.int32, device="cuda")


def check_fp8_kv(tmp: str, timed) -> dict:
    from baton import LLM, SamplingParams
    from baton.kernels import triton_attention as ta
    from baton.kernels.kv_quant import dequantize_kv, quantize_kv
    from baton.testing.attention import paged_reference as reference
    from baton.testing.checkpoints import write_random_checkpoint

    gen = torch.Generator(device="cuda").manual_seed(0)
    out: dict = {"max_abs_error": {}, "decode_ms": {}}
    scales = torch.rand(2, 8, device="cuda", generator=gen) * 0.02 + 0.005
    values, tables, lens = _case(gen, [3000, 517, 64, 1], 16, 8, 128)
    q = torch.randn(4, 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        cache = torch.stack([quantize_kv(values[p], scales[p], dtype) for p in (0, 1)])
        wide = torch.stack([dequantize_kv(cache[p], scales[p], torch.float32) for p in (0, 1)])
        ones = torch.ones(4, dtype=torch.int32, device="cuda")
        want = reference(q, wide[0], wide[1], tables, torch.arange(4, device="cuda"), ones, lens, 128 ** -0.5)
        got = ta.paged_decode_attention(q, cache[0], cache[1], tables, lens, 128 ** -0.5, kv_scales=scales)
        out["max_abs_error"][f"decode {dtype}"] = (got.float() - want.float()).abs().max().item()
        q_lens = torch.tensor([200, 517, 64, 1], dtype=torch.int32, device="cuda")
        starts = torch.cumsum(q_lens, 0, dtype=torch.int32) - q_lens
        qp = torch.randn(int(q_lens.sum()), 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
        want = reference(qp, wide[0], wide[1], tables, starts, q_lens, lens, 128 ** -0.5)
        got = ta.paged_prefill_attention(qp, cache[0], cache[1], tables, starts, q_lens, lens, 128 ** -0.5,
                                         kv_scales=scales)
        out["max_abs_error"][f"prefill {dtype}"] = (got.float() - want.float()).abs().max().item()
    kernels_ok = all(v < 3e-2 for v in out["max_abs_error"].values())
    values, tables, lens = _case(gen, [8192] * 64, 16, 8, 128)
    q = torch.randn(64, 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
    for name, dtype in (("bf16", torch.bfloat16), ("fp8 e4m3", torch.float8_e4m3fn)):
        fp8 = dtype != torch.bfloat16
        cache = torch.stack([quantize_kv(values[p], scales[p], dtype) if fp8 else values[p].to(dtype) for p in (0, 1)])
        out["decode_ms"][name] = timed(lambda c=cache, s=(scales if fp8 else None): ta.paged_decode_attention(
            q, c[0], c[1], tables, lens, 128 ** -0.5, kv_scales=s))
        del cache
    out["decode_fp8_vs_bf16"] = round(out["decode_ms"]["fp8 e4m3"] / out["decode_ms"]["bf16"], 3)
    model = write_random_checkpoint(os.path.join(tmp, "fp8-llama"), "LlamaConfig", seed=7, spread_norms=True,
                                    hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                    num_key_value_heads=2, num_hidden_layers=2)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 60, 140, 300)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs = {}
    for backend in ("auto", "torch"):
        llm = LLM(model, dtype="float32", device="cuda", kv_cache_dtype="fp8", attention_backend=backend,
                  max_model_len=512)
        runs[backend] = [o.token_ids for o in llm.generate(prompts, greedy)]
        out[f"engine {backend}: backend, graphs"] = (llm.engine.runner.attention_backend,
                                                     llm.engine.runner.graphs is not None)
        out[f"engine {backend}: pool full"] = llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
        del llm
    out["engine equal to the reference"] = runs["auto"] == runs["torch"]
    out["ok"] = kernels_ok and out["engine equal to the reference"] and all(
        v for k, v in out.items() if k.endswith("pool full"))
    return out
