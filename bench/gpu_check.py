"""The GPU-only checks in one command, for a GPU machine whenever one is lent: it writes one report
(report.json and report.txt under --out). Without a CUDA device it says so and exits 0.

Checks now (each passes or fails on its own; the report has every figure):
- the Triton kernels against a PyTorch reference on CUDA: decode (split and not) and prefill,
  float32 and bfloat16, head sizes 64-256, GQA groups 1-8, with and without a sliding window,
  a soft-cap and sinks;
- the Triton MLA latent kernel against the reference at DeepSeek's width (512 + 64, 16 and 128
  heads; decode split and not, prefill over a cached prefix), float32 and bfloat16, and timed;
- the Triton fused-MoE kernel against the grouped PyTorch path at Qwen3-MoE's and gpt-oss's
  expert shapes (float32, bfloat16), and both timed at 1, 64 and 512 tokens;
- the engine on CUDA, float32, greedy-equal to transformers on the same GPU, per family: Llama,
  Gemma 2 (soft-caps, alternating windows: hybrid KV cache groups), Mistral, Phi-3 LongRoPE,
  Qwen3-MoE, DeepSeek-V2 (MLA, small and at V2-Lite's latent width), gpt-oss (sinks, clamped
  experts) — on the auto backend (Triton), its decode steps replaying CUDA graphs (counted), the
  same tokens as with enforce_eager, and its KV pool full afterwards;
- bfloat16 engine runs of the same families (outputs complete, pools full);
- speculative decoding on CUDA: n-gram, suffix, draft-model (the target as its own draft) and
  random EAGLE-1/EAGLE-3 heads' and a DeepSeek-V3 MTP layer's drafts keep the greedy output,
  the self-draft keeps nearly every draft, pools full;
- tensor parallelism over NCCL (two GPUs: two ranks greedy-equal to one, their decode steps
  replaying graphs with the all-reduces inside; skipped on one GPU);
- a vision-language model (LLaVA of random weights) on CUDA, float32: two pictures and a
  text-only prompt batched, chunked through the image spans, greedy-equal to transformers on the
  same GPU, pool full;
- LoRA in the decode graphs: two random adapters and the base model mixed, the same tokens as
  with enforce_eager, graph steps counted, pools full;
- heads wider than the generic Triton kernels take (576) fall back to the reference, while MLA's
  latent of 576 runs on its own Triton kernel;
- the quantized linear kernels (W4A16, W8A16, FP8 weight-only) in bfloat16 at Llama-8B's shapes
  against the dequantized matmul, timed beside bf16 cuBLAS at 1-512 tokens, and a GPTQ and a
  block-FP8 Llama through the engine on CUDA, greedy-equal to transformers on their dequantized
  weights;
- an FP8 KV cache (gpu_check_fp8.py): the Triton kernels reading e4m3 and e5m2 blocks, a KV-bound
  decode step FP8 vs bf16 timed, the engine with kv_cache_dtype fp8 equal to its reference.

    python bench/gpu_check.py --out /tmp/gpu-report
    python bench/gpu_check.py --out /tmp/gpu-report --only spec_decode engine --families gpt-oss
"""
from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
import traceback
from functools import partial

import torch
from gpu_check_fp8 import check_fp8_kv

FAMILIES = {  # transformers config class and a small shape, as the tests have them
    "llama": ("LlamaConfig", dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                                  num_hidden_layers=2)),
    "gemma2": ("Gemma2Config", dict(hidden_size=128, intermediate_size=192, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=64, num_hidden_layers=3, query_pre_attn_scalar=64,
                                    attn_logit_softcapping=20.0, final_logit_softcapping=30.0, sliding_window=48,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "mistral": ("MistralConfig", dict(hidden_size=128, intermediate_size=192, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, sliding_window=40)),
    "phi3-longrope": ("Phi3Config", dict(hidden_size=128, intermediate_size=192, num_attention_heads=2,
                                         num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=512,
                                         original_max_position_embeddings=96,
                                         rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.5,
                                                          "short_factor": [1.0 + i / 16 for i in range(16)],
                                                          "long_factor": [1.0 + i / 4 for i in range(16)]})),
    "qwen3-moe": ("Qwen3MoeConfig", dict(hidden_size=128, intermediate_size=192, moe_intermediate_size=64,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                         num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)),
    "deepseek-v2": ("DeepseekV2Config", dict(hidden_size=128, intermediate_size=192, moe_intermediate_size=64,
                                             num_attention_heads=4, num_hidden_layers=2, kv_lora_rank=64,
                                             q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                             v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                                             n_shared_experts=1, first_k_dense_replace=1)),
    "deepseek-v2-lite-width": ("DeepseekV2Config", dict(
        hidden_size=256, intermediate_size=384, moe_intermediate_size=64, num_attention_heads=16, num_hidden_layers=2,
        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1)),
    # swiglu_limit at its default: transformers 5.17 (the GPU machines') reads neither it nor
    # swiglu_alpha from the config (7.0 and 1.702 always); the CPU tests clamp at 1.0 against 5.24.
    "gpt-oss": ("GptOssConfig", dict(hidden_size=128, intermediate_size=128, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=64, num_hidden_layers=2, num_local_experts=8,
                                     num_experts_per_tok=2, sliding_window=48, swiglu_limit=7.0,
                                     max_position_embeddings=512,
                                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                      "original_max_position_embeddings": 128})),
}


def check_kernels() -> dict:
    from baton.kernels import triton_attention as ta
    from baton.testing.attention import paged_reference as reference

    worst, cases = {}, 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype, head_dim, group, bs, softcap, window, sunk in [
            (torch.float32, 64, 4, 16, None, None, False), (torch.float32, 128, 8, 16, None, 300, True),
            (torch.float32, 256, 1, 32, 30.0, None, False), (torch.bfloat16, 64, 4, 16, 20.0, 128, True),
            (torch.bfloat16, 128, 8, 64, None, 1000, False), (torch.float16, 96, 2, 16, 50.0, 64, False)]:
        lens = [3000, 517, 64, 1]
        blocks = sum(math.ceil(n / bs) for n in lens) + 4
        cache = torch.randn(2, blocks, bs, 2, head_dim, device="cuda", generator=gen).to(dtype)
        perm = torch.randperm(blocks, device="cuda", generator=gen)
        width = max(math.ceil(n / bs) for n in lens)
        tables = torch.zeros(len(lens), width, dtype=torch.int32, device="cuda")
        at = 0
        for i, n in enumerate(lens):
            tables[i, :math.ceil(n / bs)] = perm[at:at + math.ceil(n / bs)].int()
            at += math.ceil(n / bs)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        scale = head_dim ** -0.5
        q = torch.randn(len(lens), 2 * group, head_dim, device="cuda", generator=gen).to(dtype)
        sinks = torch.randn(2 * group, device="cuda", generator=gen) * 3 if sunk else None
        ones = torch.ones(len(lens), dtype=torch.int32, device="cuda")
        want = reference(q, cache[0], cache[1], tables, torch.arange(len(lens), device="cuda"), ones, seq_lens,
                         scale, softcap, window, sinks)
        for split in (None, 1, 64):  # the default, one program per sequence, more programs than most have tiles
            got = ta.paged_decode_attention(q, cache[0], cache[1], tables, seq_lens, scale, num_splits=split,
                                            softcap=softcap, window=window, sinks=sinks)
            worst[f"decode {dtype} d{head_dim} g{group} split={split} cap={softcap} w={window} sinks={sunk}"] = (
                (got.float() - want.float()).abs().max().item())
            cases += 1
        q_lens = torch.tensor([200, 517, 64, 1], dtype=torch.int32, device="cuda")
        q_starts = torch.cumsum(q_lens, 0, dtype=torch.int32) - q_lens
        qp = torch.randn(int(q_lens.sum()), 2 * group, head_dim, device="cuda", generator=gen).to(dtype)
        want = reference(qp, cache[0], cache[1], tables, q_starts, q_lens, seq_lens, scale, softcap, window, sinks)
        got = ta.paged_prefill_attention(qp, cache[0], cache[1], tables, q_starts, q_lens, seq_lens, scale,
                                         softcap=softcap, window=window, sinks=sinks)
        worst[f"prefill {dtype} d{head_dim} g{group} cap={softcap} w={window} sinks={sunk}"] = (
            (got.float() - want.float()).abs().max().item())
        cases += 1
    tolerance = {"float32": 2e-4, "bfloat16": 3e-2, "float16": 5e-3}
    bad = {k: v for k, v in worst.items() if v > tolerance[k.split()[1].removeprefix("torch.")]}
    return {"ok": not bad, "cases": cases, "max_abs_error": worst, "over_tolerance": bad}


def check_mla_kernel() -> dict:
    from baton.kernels import triton_mla
    from baton.testing.attention import paged_reference as reference

    gen = torch.Generator(device="cuda").manual_seed(3)
    worst, timings = {}, {}
    rank, rope, bs = 512, 64, 16
    for dtype, heads in ((torch.float32, 16), (torch.bfloat16, 16), (torch.bfloat16, 128)):
        lens = [4100, 300, 17, 1]
        blocks = sum(math.ceil(n / bs) for n in lens) + 2
        cache = torch.randn(blocks, bs, 1, rank + rope, device="cuda", generator=gen).to(dtype)
        perm = torch.randperm(blocks, device="cuda", generator=gen)
        tables = torch.zeros(len(lens), max(math.ceil(n / bs) for n in lens), dtype=torch.int32, device="cuda")
        at = 0
        for i, n in enumerate(lens):
            tables[i, :math.ceil(n / bs)] = perm[at:at + math.ceil(n / bs)].int()
            at += math.ceil(n / bs)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        scale = 192 ** -0.5
        q = torch.randn(len(lens), heads, rank + rope, device="cuda", generator=gen).to(dtype)
        ones = torch.ones(len(lens), dtype=torch.int32, device="cuda")
        want = reference(q, cache, cache, tables, torch.arange(len(lens), device="cuda"), ones, seq_lens, scale)
        for split in (None, 1, 64):
            got = triton_mla.mla_decode_attention(q, cache, tables, seq_lens, scale, rank, num_splits=split)
            worst[f"decode {dtype} h{heads} split={split}"] = (
                (got.float() - want[..., :rank].float()).abs().max().item())
        timings[f"decode {dtype} h{heads} ms"] = _timed(
            partial(triton_mla.mla_decode_attention, q, cache, tables, seq_lens, scale, rank))
        q_lens = torch.tensor([256, 300, 7, 1], dtype=torch.int32, device="cuda")
        q_starts = torch.cumsum(q_lens, 0, dtype=torch.int32) - q_lens
        qp = torch.randn(int(q_lens.sum()), heads, rank + rope, device="cuda", generator=gen).to(dtype)
        want = reference(qp, cache, cache, tables, q_starts, q_lens, seq_lens, scale)
        got = triton_mla.mla_prefill_attention(qp, cache, tables, q_starts, q_lens, seq_lens, scale, rank)
        worst[f"prefill {dtype} h{heads}"] = (got.float() - want[..., :rank].float()).abs().max().item()
        timings[f"prefill {dtype} h{heads} ms"] = _timed(
            partial(triton_mla.mla_prefill_attention, qp, cache, tables, q_starts, q_lens, seq_lens, scale, rank))
    tolerance = {"float32": 2e-4, "bfloat16": 3e-2}
    bad = {k: v for k, v in worst.items() if v > tolerance[k.split()[1].removeprefix("torch.")]}
    return {"ok": not bad, "max_abs_error": worst, "over_tolerance": bad, "timings": timings}


def _timed(fn, repeat: int = 20) -> float:
    """Milliseconds per call on the GPU, after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) * 1e3 / repeat, 3)


def _rand(gen, dtype, *shape, std=1.0):
    return (torch.randn(*shape, device="cuda", generator=gen) * std).to(dtype)


def check_fused_moe() -> dict:
    from baton.engine.worker.models.moe import GLU, SWIGLU, grouped_experts
    from baton.kernels.triton_moe import fused_moe

    gen = torch.Generator(device="cuda").manual_seed(2)
    errors, timings = {}, {}
    # (hidden, intermediate, experts, top k, biased, activation): Qwen3-30B-A3B's and gpt-oss-20b's experts
    for name, (hidden, inter, experts, top_k, biased, glu) in {
            "qwen3-moe": (2048, 768, 128, 8, False, SWIGLU),
            "gpt-oss": (2880, 2880, 32, 4, True, GLU("swiglu_oai", 1.702, 7.0))}.items():
        for dtype in (torch.float32, torch.bfloat16):
            rand = partial(_rand, gen, dtype)
            gate_up, down = rand(experts, 2 * inter, hidden, std=hidden ** -0.5), rand(experts, hidden, inter,
                                                                                         std=inter ** -0.5)
            biases = (rand(experts, 2 * inter, std=0.1), rand(experts, hidden, std=0.1)) if biased else (None, None)
            for tokens in (1, 64, 512):
                x = rand(tokens, hidden)
                logits = torch.randn(tokens, experts, device="cuda", generator=gen)
                top, ids = logits.topk(top_k, dim=-1)
                weights = top.softmax(-1)
                want = grouped_experts(x.float(), weights, ids, gate_up.float(), down.float(), glu,
                                       *[b.float() if b is not None else None for b in biases])
                fused = partial(fused_moe, x, weights, ids, gate_up, down, *biases, glu.kind, glu.alpha, glu.limit)
                key = f"{name} {dtype} t{tokens}"
                errors[key] = ((fused().float() - want).abs().max() / want.abs().max()).item()
                timings[key] = {"fused_ms": _timed(fused), "grouped_ms": _timed(
                    partial(grouped_experts, x, weights, ids, gate_up, down, glu, *biases))}
    tolerance = {"float32": 1e-4, "bfloat16": 2e-2}
    bad = {k: v for k, v in errors.items() if v > tolerance[k.split()[1].removeprefix("torch.")]}
    return {"ok": not bad, "relative_error": errors, "over_tolerance": bad, "timings": timings}


def check_quant_kernels(tmp: str) -> dict:
    """The quantized linear kernels (kernels/triton_quant.py) in bfloat16 at Llama-8B's shapes
    against the dequantized weight's cuBLAS matmul, timed beside bf16 cuBLAS at 1 to 512 tokens:
    W4A16 (GPTQ-style, group 128), W8A16, FP8 weight-only with 128x128 blocks, and W8A8 block FP8
    (activations quantized per token and 128 columns; against the same quantization) where the GPU
    has FP8 tensor cores. Then a tiny GPTQ
    and a block-FP8 Llama through the engine on CUDA, greedy-equal to transformers on the
    dequantized weights (float32)."""
    import torch.nn.functional as F

    from baton import LLM, SamplingParams
    from baton.engine.worker.quant.formats import pack_codes
    from baton.engine.worker.quant.weights import FP8Weight, IntWeight
    from baton.kernels import triton_quant
    from baton.testing.checkpoints import write_random_checkpoint
    from baton.testing.quantized_checkpoints import quantize_checkpoint

    gen = torch.Generator(device="cuda").manual_seed(3)
    errors, timings = {}, {}
    for n, k in ((4096, 4096), (14336, 4096), (4096, 14336)):
        w = torch.randn(n, k, device="cuda", generator=gen) * k ** -0.5
        codes = torch.randint(0, 16, (n, k), device="cuda", generator=gen, dtype=torch.uint8)
        formats = {
            "w4a16": IntWeight(pack_codes(codes, 4), (torch.rand(n, k // 128, device="cuda", generator=gen) * 0.02)
                               .half(), None, 8, 4, 128),
            "w8a16": IntWeight(codes * 16, torch.rand(n, 1, device="cuda", generator=gen) * 0.002, None, 128, 8, k),
            "fp8 block": FP8Weight((w * 64).to(torch.float8_e4m3fn), torch.full((n // 128, k // 128), 1 / 64,
                                                                                 device="cuda"), (128, 128))}
        dense = w.bfloat16()
        fp8 = formats["fp8 block"]
        for tokens in (1, 16, 128, 512):
            x = torch.randn(tokens, k, device="cuda", generator=gen).bfloat16()
            bf16_ms = _timed(partial(F.linear, x, dense))
            runs = {name: (partial(weight.triton_matmul, x), weight.dequantize().float(), x.float())
                    for name, weight in formats.items()}
            runs["fp8 block"] = (partial(triton_quant.fp8_matmul, x, fp8.weight, fp8.scale, fp8.block),
                                 fp8.dequantize().float(), x.float())  # (weight-only, whatever the GPU)
            if torch.cuda.get_device_capability() >= (8, 9):
                xq, xs = triton_quant.quantize_activations(x, 128)
                x_back = xq.float() * xs.repeat_interleave(128, dim=1)[:, :k]
                runs["w8a8 fp8 block"] = (partial(triton_quant.w8a8_matmul, x, fp8.weight, fp8.scale, fp8.block),
                                          fp8.dequantize().float(), x_back)
            for name, (run, weight, x_ref) in runs.items():
                key = f"{name} {n}x{k} t{tokens}"
                want = F.linear(x_ref, weight)
                errors[key] = ((run().float() - want).abs().max() / want.abs().max()).item()
                ms = _timed(run)
                timings[key] = {"ms": ms, "bf16_cublas_ms": bf16_ms, "speedup": round(bf16_ms / ms, 2)}
    bad = {k: v for k, v in errors.items() if v > 2e-2}
    engine = {}
    config_class, shape = FAMILIES["llama"]
    llama = write_random_checkpoint(f"{tmp}/quant-llama", config_class, seed=5, **shape)
    prompts = [[(7 * i + j) % 400 + 3 for j in range(20 + 9 * i)] for i in range(4)]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for scheme, opts in (("gptq-4", dict(group_size=32)), ("fp8-block", dict(block=(64, 64)))):
        model, reference = quantize_checkpoint(llama, f"{tmp}/{scheme}", f"{tmp}/{scheme}-ref", scheme, **opts)
        with LLM(model, dtype="float32", device="cuda") as llm:
            got = [o.token_ids for o in llm.generate(prompts, greedy)]
            full = llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
        want = _hf_greedy(reference, prompts, greedy.max_tokens)
        engine[scheme] = {"equal": got == want, "pool_full": full}
    ok = not bad and all(r["equal"] and r["pool_full"] for r in engine.values())
    return {"ok": ok, "relative_error": errors, "over_tolerance": bad, "timings": timings, "engine": engine}


def _hf_greedy(model_dir: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                                 eos_token_id=None, min_new_tokens=tokens, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


def _count_graph_steps(llm) -> list[int]:
    """The decode steps that go through the engine's CUDA graphs from now on (their batch sizes)."""
    graphs, steps = llm.engine.runner.graphs, []
    if graphs is not None:
        run = graphs.run

        def counted(input_ids, *rest):
            steps.append(len(input_ids))
            return run(input_ids, *rest)
        graphs.run = counted
    return steps


def check_engine(tmp: str) -> dict:
    import transformers

    from baton import LLM, SamplingParams
    from baton.testing.checkpoints import write_random_checkpoint

    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    # None crosses Phi-3's original context (96) while it decodes: transformers 5.17 (the GPU
    # machines') computes that crossing otherwise than 5.24, which the CPU tests check it against.
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 60, 140, 300)]
    results = {}
    for name, (config_class, shape) in FAMILIES.items():
        model_dir = write_random_checkpoint(os.path.join(tmp, name), config_class, seed=7, spread_norms=True, **shape)
        row = results[name] = {}
        try:
            llm = LLM(model_dir, dtype="float32", device="cuda", max_num_batched_tokens=128, max_model_len=512)
            row["backend"] = llm.engine.runner.attention_backend
            row["kv_groups"] = len(llm.engine.core.kv_groups.windows)
            replays = _count_graph_steps(llm)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2))
            got = [o.token_ids for o in outs]
            row["baton_s"] = round(time.perf_counter() - t0, 3)
            row["pool_full"] = llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
            row["graph_steps"] = len(replays)  # decode steps that replayed a CUDA graph
            del llm
            eager = LLM(model_dir, dtype="float32", device="cuda", max_num_batched_tokens=128, max_model_len=512,
                        enforce_eager=True)
            row["equal_eager"] = [o.token_ids for o in eager.generate(prompts, greedy)] == got
            del eager
            hf = transformers.AutoModelForCausalLM.from_pretrained(  # eager: SDPA would drop soft-caps
                model_dir, dtype=torch.float32, attn_implementation="eager").cuda().eval()
            want = []
            with torch.inference_mode():
                for p in prompts:
                    ids = torch.tensor([p], device="cuda")
                    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                      eos_token_id=None, min_new_tokens=24, pad_token_id=0)
                    want.append(out[0, len(p):].tolist())
                # Teacher-forced on Baton's own tokens: how far its logprobs are from transformers', and
                # the margin between its two best where the greedy paths part (a near tie: float noise).
                diffs, margins = [], []
                for p, o, w in zip(prompts, outs, want):
                    seq = torch.tensor([p + o.token_ids], device="cuda")
                    ref = hf(seq).logits[0].float().log_softmax(-1)
                    for i, lp in enumerate(o.outputs[0].logprobs):
                        diffs.append(abs(lp.logprob - ref[len(p) - 1 + i, lp.token_id].item()))
                    part = next((i for i, (a, b) in enumerate(zip(o.token_ids, w)) if a != b), None)
                    if part is not None:
                        top = o.outputs[0].logprobs[part].top_logprobs
                        margins.append(round(top[0] - top[1], 6))
                row["max_logprob_diff"] = max(diffs)
                row["margin_where_paths_part"] = margins
            del hf
            row["equal_transformers"] = [g == w for g, w in zip(got, want)]
            bf16 = LLM(model_dir, dtype="bfloat16", device="cuda", max_num_batched_tokens=128, max_model_len=512)
            outs = bf16.generate(prompts, greedy)
            row["bf16_complete"] = all(len(o.token_ids) == 24 for o in outs)
            row["bf16_pool_full"] = bf16.engine.kv.num_free_blocks == bf16.engine.num_kv_blocks
            del bf16
            # Equal, or parted only at a near tie with every logprob within float noise of transformers'.
            noise = row["max_logprob_diff"] < 1e-3 and all(m < 1e-3 for m in row["margin_where_paths_part"])
            row["ok"] = ((all(row["equal_transformers"]) or noise) and row["pool_full"] and row["bf16_complete"]
                         and row["bf16_pool_full"] and row["equal_eager"] and (row["graph_steps"] > 0
                                                                                or row["backend"] != "triton"))
        except Exception:  # noqa: BLE001 - one family's failure is a line in the report
            row["ok"], row["error"] = False, traceback.format_exc(limit=6)
        torch.cuda.empty_cache()
    return {"ok": all(r["ok"] for r in results.values()), "families": results}


def check_spec_decode(tmp: str) -> dict:
    from baton import LLM, SamplingParams
    from baton.testing.checkpoints import write_random_checkpoint
    from baton.testing.eagle_heads import write_head

    model_dir = write_random_checkpoint(os.path.join(tmp, "spec"), "LlamaConfig", seed=7, hidden_size=128,
                                        intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                                        num_hidden_layers=4)
    heads = {m: write_head(os.path.join(tmp, m), model_dir, m, seed=3) for m in ("eagle", "eagle3")}
    gen = torch.Generator().manual_seed(2)
    base = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (8, 40, 90, 200)]
    prompts = [p + p[:len(p) // 2] for p in base]  # something to look up
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(model_dir, dtype="float32", device="cuda", max_model_len=512).generate(
        prompts, params)]
    results = {"mtp": _check_mtp(tmp, prompts, params)}
    for name, spec in {"ngram": {"method": "ngram", "prompt_lookup_min": 1},
                       "suffix": {"method": "suffix", "suffix_decoding_min_token_prob": 0.05},
                       "draft_model": {"method": "draft_model", "model": model_dir},
                       **{m: {"method": m, "model": head} for m, head in heads.items()}}.items():
        llm = LLM(model_dir, dtype="float32", device="cuda", max_model_len=512, max_num_batched_tokens=64,
                  speculative_config={**spec, "num_speculative_tokens": 4})
        replays = _count_graph_steps(llm)  # verification steps among them: more rows than requests
        t0 = time.perf_counter()
        got = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.core.scheduler.spec_stats
        row = results[name] = {"equal": got == want, "seconds": round(time.perf_counter() - t0, 3),
                               "graph_steps": len(replays), "graph_rows_max": max(replays, default=0),
                               "drafts": stats.num_drafts, "draft_tokens": stats.num_draft_tokens,
                               "accepted": stats.num_accepted_tokens,
                               "pool_full": llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks}
        row["ok"] = row["equal"] and row["pool_full"] and row["graph_steps"] > 0 and (
            name != "draft_model" or row["accepted"] >= 0.95 * max(row["draft_tokens"], 1) > 0)
        del llm
    return {"ok": all(r["ok"] for r in results.values()), "proposers": results}


def _write_random_adapter(model_dir: str, out: str, rank: int, targets: list[str], seed: int) -> str:
    """A PEFT-format LoRA adapter of random A and B (no PEFT needed on the GPU machine)."""
    from safetensors.torch import save_file

    from baton.engine.common.config import read_config
    from baton.engine.worker.lora.adapter import part_shapes
    from baton.engine.worker.models import model_args

    args, gen = model_args(read_config(model_dir)), torch.Generator().manual_seed(seed)
    shapes, tensors = part_shapes(args), {}
    for i in range(args.num_layers):
        for name in targets:
            n_in, n_out = shapes[name]
            where = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{where}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / math.sqrt(n_in)
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) / math.sqrt(rank)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
                   "bias": "none"}, f)
    return out


def check_lora(tmp: str) -> dict:
    from baton import LLM, SamplingParams
    from baton.testing.checkpoints import write_random_checkpoint

    model_dir = write_random_checkpoint(os.path.join(tmp, "lora"), "LlamaConfig", seed=7, hidden_size=256,
                                        intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                                        num_hidden_layers=2)
    adapters = {"a": _write_random_adapter(model_dir, os.path.join(tmp, "lora-a"), 8, ["q_proj", "v_proj"], 1),
                "b": _write_random_adapter(model_dir, os.path.join(tmp, "lora-b"), 16,
                                           ["q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"], 2)}
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 40, 90, 17, 60, 130)]
    names = [None, "a", "b", "a", "b", None]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    runs = {}
    for eager in (False, True):
        llm = LLM(model_dir, dtype="float32", device="cuda", max_model_len=512, lora_modules=adapters, max_loras=2,
                  max_lora_rank=16, enforce_eager=eager)
        replays = _count_graph_steps(llm)
        runs[eager] = ([o.token_ids for o in llm.generate(prompts, params, lora_request=names)], len(replays),
                       llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks)
        del llm
    base = runs[False][0][0]
    return {"ok": runs[False][0] == runs[True][0] and runs[False][1] > 0 and runs[False][2] and runs[True][2],
            "equal_eager": runs[False][0] == runs[True][0], "graph_steps": runs[False][1],
            "adapters_change_output": sum(o != base for o in runs[False][0][1:5]), "pool_full": runs[False][2]}


def check_vision(tmp: str) -> dict:
    import numpy as np
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    from baton import LLM, SamplingParams
    from baton.testing.checkpoints import write_random_llava

    model_dir = write_random_llava(os.path.join(tmp, "llava"), seed=3)
    rng = np.random.default_rng(1)
    pictures = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((37, 45), (64, 30))]
    hf = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    image_token = hf.config.image_token_index
    text = [rng.integers(3, 500, n).tolist() for n in (12, 20, 9)]
    prompts = [text[0][:4] + [image_token] + text[0][4:], [image_token] + text[1], text[2]]
    data = [[pictures[0]], [pictures[1]], []]
    llm = LLM(model_dir, dtype="float32", device="cuda", max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(
        [{"prompt_token_ids": p, "multi_modal_data": {"image": d}} if d else p for p, d in zip(prompts, data)], params)]
    processor, want = AutoImageProcessor.from_pretrained(model_dir, backend="pil"), []
    per_image = (hf.config.vision_config.image_size // hf.config.vision_config.patch_size) ** 2
    with torch.inference_mode():
        for p, d in zip(prompts, data):
            ids = torch.tensor([[t for token in p for t in ([token] * per_image if token == image_token else [token])]],
                               device="cuda")
            extra = ({"pixel_values": torch.from_numpy(processor(images=d, return_tensors="np")["pixel_values"]).cuda()}
                     if d else {})
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                              do_sample=False, eos_token_id=None, **extra)
            want.append(out[0, ids.shape[1]:].tolist())
    pool_full = llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
    return {"ok": got == want and pool_full, "equal_transformers": [g == w for g, w in zip(got, want)],
            "pool_full": pool_full}


def check_tensor_parallel(tmp: str) -> dict:
    """Two ranks over NCCL, one GPU each, greedy-equal to one rank (needs two GPUs)."""
    from baton import LLM, SamplingParams
    from baton.testing.checkpoints import write_random_checkpoint

    if torch.cuda.device_count() < 2:
        return {"ok": True, "skipped": f"NCCL tensor parallelism needs 2 GPUs; {torch.cuda.device_count()} here"}
    model_dir = write_random_checkpoint(os.path.join(tmp, "tp"), "LlamaConfig", seed=7, hidden_size=256,
                                        intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                                        num_hidden_layers=2, vocab_size=1001)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (5, 60, 300)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    runs = {}
    for tp in (1, 2):
        with LLM(model_dir, dtype="float32", device="cuda:0", tensor_parallel_size=tp, max_model_len=512) as llm:
            replays = _count_graph_steps(llm)  # (NCCL's all-reduces inside the graphs)
            t0 = time.perf_counter()
            runs[tp] = ([o.token_ids for o in llm.generate(prompts, params)], round(time.perf_counter() - t0, 3),
                        llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks, len(replays))
    return {"ok": runs[1][0] == runs[2][0] and runs[2][2] and runs[2][3] > 0, "equal": runs[1][0] == runs[2][0],
            "seconds": {tp: r[1] for tp, r in runs.items()}, "pool_full": runs[2][2], "graph_steps": runs[2][3]}


def _check_mtp(tmp: str, prompts: list[list[int]], params) -> dict:
    """DeepSeek-V3's MTP layer drafting on CUDA (its MLA on the Triton kernel, its experts fused):
    the greedy output the same as without it."""
    from baton import LLM
    from baton.testing.checkpoints import write_random_checkpoint
    from baton.testing.mtp_checkpoint import write_mtp

    whole = write_random_checkpoint(os.path.join(tmp, "v3-whole"), "DeepseekV3Config", seed=7, hidden_size=128,
                                    intermediate_size=192, moe_intermediate_size=64, num_attention_heads=4,
                                    num_hidden_layers=4, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=32,
                                    qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                                    n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2)
    model_dir = write_mtp(os.path.join(tmp, "v3-mtp"), whole)
    runs = []
    for spec in (None, {"method": "mtp", "num_speculative_tokens": 3}):
        llm = LLM(model_dir, dtype="float32", device="cuda", max_model_len=512, speculative_config=spec)
        runs.append(([o.token_ids for o in llm.generate(prompts, params)], llm.engine.core.scheduler.spec_stats,
                     llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks))
        del llm
    stats = runs[1][1]
    row = {"equal": runs[0][0] == runs[1][0], "drafts": stats.num_drafts, "draft_tokens": stats.num_draft_tokens,
           "accepted": stats.num_accepted_tokens, "pool_full": runs[1][2]}
    row["ok"] = row["equal"] and row["pool_full"] and row["drafts"] > 0
    return row


def check_wide_heads() -> dict:
    from baton.engine.worker.attention_backend import choose_backend

    picked = choose_backend("auto", torch.bfloat16, torch.device("cuda"), 16, 1, 576)
    latent = choose_backend("auto", torch.bfloat16, torch.device("cuda"), 16, 1, 576, latent=True)
    return {"ok": picked == "torch" and latent == "triton", "auto_for_576": picked, "auto_for_mla_576": latent}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="a folder for report.json and report.txt")
    p.add_argument("--only", nargs="+", help="run these checks only (default: all)")
    p.add_argument("--families", nargs="+", help="the engine check's families (default: all)")
    args = p.parse_args()
    if args.families:
        for name in set(FAMILIES) - set(args.families):
            del FAMILIES[name]
    os.makedirs(args.out, exist_ok=True)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here: nothing to check")
        return
    import triton

    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        for name, check in (("triton_kernels", check_kernels), ("mla_kernel", check_mla_kernel),
                            ("fused_moe", check_fused_moe), ("wide_heads", check_wide_heads),
                            ("quant_kernels", lambda: check_quant_kernels(tmp)),
                            ("spec_decode", lambda: check_spec_decode(tmp)), ("engine", lambda: check_engine(tmp)),
                            ("tensor_parallel", lambda: check_tensor_parallel(tmp)),
                            ("lora", lambda: check_lora(tmp)), ("vision", lambda: check_vision(tmp)),
                            ("fp8_kv", lambda: check_fp8_kv(tmp, _timed))):
            if args.only and name not in args.only:
                continue
            t0 = time.perf_counter()
            try:
                report[name] = check()
            except Exception:  # noqa: BLE001
                report[name] = {"ok": False, "error": traceback.format_exc(limit=8)}
            report[name]["seconds"] = round(time.perf_counter() - t0, 1)
            print(f"{name}: {'ok' if report[name]['ok'] else 'FAILED'} ({report[name]['seconds']} s)", flush=True)
            with open(os.path.join(args.out, "report.json"), "w") as f:  # after each check: a cut-short run keeps some
                json.dump(report, f, indent=1)
    with open(os.path.join(args.out, "report.txt"), "w") as f:
        f.write(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
