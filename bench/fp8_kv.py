"""An FP8 KV cache (--kv-cache-dtype fp8) against bf16 and float32 caches on this machine's CPUs,
each figure beside the others in the same run:

- capacity: KV blocks in 1 GiB and requests of an 8k context they hold, measured by the engine
  for SmolLM2-135M (the demo model) and from the block size for a Llama-3.1-8B shape;
- handoff: a 2,048-token prompt moved over NIXL from a prefill to a decode (the hidden-512 Llama):
  bytes and the load's time for float32, bf16 and FP8 pairs, and a bf16 prefill before an FP8
  decode (staged and converted on landing);
- decode: one layer's decode attention at long contexts (the C++ kernel: 16 sequences of 4k
  keys, SmolLM2's 9 query / 3 KV heads of 64), the step's KV bytes read and its time;
- quality: SmolLM2 on real text and a tiny random model of each family: greedy agreement with the
  unquantized cache (share of output tokens equal, first divergence) and the mean |logprob drift|
  of the chosen tokens before the first divergence. Approximate by nature: figures, not a test.
  With --vllm-python (an environment with vLLM's CPU build), vLLM's own FP8 KV cache on the same
  prompts beside Baton's, the peer's agreement with its own float32 cache.

    .venv/bin/python bench/fp8_kv.py
    .venv/bin/python bench/fp8_kv.py --only quality --vllm-python /opt/vllm/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pd_handoff import close, pd_pair, timed_handoffs
from random_checkpoint import SHAPES, write_random_checkpoint

from baton import LLM, SamplingParams
from baton.kernels import cpu_kernels
from baton.kernels.kv_quant import quantize_kv

SMOLLM2 = os.path.join(os.environ.get("BATON_MODELS_DIR", "models"), "smollm2-135m-instruct")
KV_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e5m2")  # auto: float32 on CPU
_GIB = 1 << 30


def capacity(root: str) -> None:
    print("\n## capacity: KV blocks (16 tokens) in 1 GiB, and requests of an 8,192-token context they hold")
    print("| model | kv_cache_dtype | block KiB | blocks per GiB | 8k requests | vs float32 |")
    print("|---|---|---|---|---|---|")
    if os.path.isdir(SMOLLM2):
        base = None
        for kv in KV_DTYPES:
            with LLM(SMOLLM2, dtype="float32", device="cpu", kv_cache_dtype=kv, kv_cache_memory_bytes=_GIB,
                     max_num_seqs=4096, max_model_len=8192) as llm:
                blocks = llm.engine.num_kv_blocks
                block_bytes = llm.engine.runner.kv_cache[0].numel() * llm.engine.runner.kv_cache.element_size()
            base = base or blocks
            print(f"| SmolLM2-135M | {kv} | {block_bytes / 1024:.0f} | {blocks} | {blocks // 512} | "
                  f"{blocks / base:.2f}x |")
    dims = SHAPES["llama3-8b"]
    head_dim = dims["hidden_size"] // dims["num_attention_heads"]
    for kv, size in (("float32", 4), ("bfloat16", 2), ("fp8", 1)):
        block = dims["num_hidden_layers"] * 2 * 16 * dims["num_key_value_heads"] * head_dim * size
        print(f"| Llama-3.1-8B shape | {kv} | {block / 1024:.0f} | {_GIB // block} | {_GIB // block // 512} | "
              f"{4 / size:.2f}x |")


def handoff(root: str) -> None:
    model = write_random_checkpoint(os.path.join(root, "llama-h512"), "llama-h512")
    print("\n## handoff: a 2,048-token prompt, prefill -> decode over NIXL (hidden-512 Llama, 4 layers, 4 KV heads)")
    print("| prefill KV -> decode KV | MiB read | load ms, first | load ms, next (median of 4) | vs bf16 pair |")
    print("|---|---|---|---|---|")
    prompt = torch.randint(3, 1000, (2048,), generator=torch.Generator().manual_seed(1)).tolist()
    base = None
    for n, (pkv, dkv) in enumerate((("bfloat16", "bfloat16"), ("auto", "auto"), ("fp8", "fp8"),
                                    ("bfloat16", "fp8"))):
        prefill, decode = pd_pair(model, f"fp8-{n}", {"kv_cache_dtype": pkv}, {"kv_cache_dtype": dkv})
        times = timed_handoffs(prefill, decode, prompt, 5)
        mib = decode.core.connector.num_bytes_pulled / len(times) / 2**20
        nxt = sorted(times[1:])[len(times[1:]) // 2]
        base = base or nxt
        names = {"auto": "float32", "bfloat16": "bf16"}
        print(f"| {names.get(pkv, pkv)} -> {names.get(dkv, dkv)} | {mib:.1f} | {times[0]:.1f} | {nxt:.1f} | "
              f"{nxt / base:.2f}x |")
        close(prefill, decode)


def decode(root: str) -> None:
    if cpu_kernels.load() is None:
        print("\n## decode: skipped (the C++ kernel did not build here)")
        return
    seqs, ctx, kv_heads, group, head_dim, block_size = 16, 4096, 3, 3, 64, 16
    print(f"\n## decode: one layer's decode attention, {seqs} sequences of {ctx} keys (C++ kernel, float32 queries, "
          f"{kv_heads * group} query / {kv_heads} KV heads of {head_dim}), {torch.get_num_threads()} threads")
    print("| cache | KV MiB read per step | us per step (median of 20) | vs float32 |\n|---|---|---|---|")
    blocks_per_seq = ctx // block_size
    num_blocks = seqs * blocks_per_seq + 1
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=gen) * 0.1
    q = torch.randn(seqs, kv_heads * group, head_dim, generator=gen)
    k, v = (torch.randn(seqs, kv_heads, head_dim, generator=gen) * 0.1 for _ in range(2))
    block_ids = torch.randperm(num_blocks - 1, generator=gen)[:seqs * blocks_per_seq] + 1
    starts = torch.arange(seqs) * blocks_per_seq
    positions = torch.full((seqs,), ctx - 1)
    scales = torch.full((2, kv_heads), 0.1 / 448 * 4)
    base = None
    for name, dtype in (("float32", torch.float32), ("bf16", torch.bfloat16), ("fp8 e4m3", torch.float8_e4m3fn),
                        ("fp8 e5m2", torch.float8_e5m2)):
        fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        cache = torch.stack([quantize_kv(values[:, p], scales[p], dtype) if fp8 else values[:, p].to(dtype)
                             for p in (0, 1)], dim=1)
        qq = q if dtype != torch.bfloat16 else q.to(dtype)  # (the kernel's queries: float32, or bf16's own)
        kk, vv = ((quantize_kv(x, scales[i], dtype) if fp8 else x.to(qq.dtype)) for i, x in enumerate((k, v)))
        times = []
        for _ in range(22):
            t0 = time.perf_counter()
            cpu_kernels.paged_attention(qq, kk, vv, cache[:, 0], cache[:, 1], block_ids, starts, positions,
                                        head_dim ** -0.5, kv_scales=scales if fp8 else None)
            times.append(time.perf_counter() - t0)
        us = 1e6 * sorted(times[2:])[len(times[2:]) // 2]
        base = base or us
        mib = seqs * ctx * 2 * kv_heads * head_dim * cache.element_size() / 2**20
        print(f"| {name} | {mib:.1f} | {us:.0f} | {us / base:.2f}x |")


def _text_prompts(tokenizer) -> list[list[int]]:
    texts = ["The history of the printing press begins in", "Explain why the sky is blue to a child:",
             "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
             "The three largest cities in France are", "A recipe for bread needs flour, water,",
             "In 1969, the first humans to walk on the Moon", "Photosynthesis is the process by which",
             "The key ideas of the theory of relativity are"]
    return [tokenizer.encode(t) for t in texts]


def _agreement(model: str, prompts, kv: str, max_tokens: int, **engine) -> tuple[float, float, float]:
    """(share of output tokens equal to the float cache's, mean first divergence, mean |logprob drift|
    of the chosen token before it) for `kv`."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    runs = {}
    for dtype in ("auto", kv):
        with LLM(model, dtype="float32", device="cpu", kv_cache_dtype=dtype, **engine) as llm:
            runs[dtype] = [(o.token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
                           for o in llm.generate(prompts, params)]
    return _compare(runs["auto"], runs[kv])


def _compare(reference: list[tuple[list[int], list[float]]], other: list[tuple[list[int], list[float]]]
             ) -> tuple[float, float, float]:
    """_agreement's figures from two runs' (token ids, chosen tokens' logprobs) per prompt."""
    equal = total = 0
    firsts, drift = [], []
    for (ref, ref_lp), (got, got_lp) in zip(reference, other):
        first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
        firsts.append(first)
        equal += sum(a == b for a, b in zip(ref, got))
        total += len(ref)
        drift += [abs(ref_lp[i] - got_lp[i]) for i in range(first)]  # (the same token up to `first`)
    return equal / total, sum(firsts) / len(firsts), sum(drift) / max(len(drift), 1)


# vLLM's offline engine in its own environment: greedy token ids and the chosen tokens' logprobs.
_VLLM_RUN = """
import json, sys
from vllm import LLM, SamplingParams
model, kv, tokens, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
llm = LLM(model=model, dtype="float32", kv_cache_dtype=kv, max_model_len=512, enforce_eager=True, seed=0)
params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
print("RESULT" + json.dumps([(list(o.outputs[0].token_ids), [d[t].logprob for t, d in zip(o.outputs[0].token_ids,
                                                                                            o.outputs[0].logprobs)])
                             for o in outs]))
"""


def _vllm_run(python: str, model: str, kv: str, tokens: int, prompts) -> list:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1", OMP_NUM_THREADS="2")
    done = subprocess.run([python, "-c", _VLLM_RUN, model, kv, str(tokens), json.dumps(prompts)], env=env,
                          capture_output=True, text=True, timeout=1200)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")), None)
    if line is None:
        raise RuntimeError(f"vLLM ({kv}) failed: {done.stderr[-2000:]}")
    return json.loads(line.removeprefix("RESULT"))


def quality(root: str, vllm_python: str | None = None) -> None:
    print("\n## quality: greedy agreement with the float32 cache (float32 compute); FP8 scales 1.0 unless calculated")
    print("| model | kv_cache_dtype | tokens equal | mean first divergence (of N) | mean abs logprob drift before it |")
    print("|---|---|---|---|---|")
    if os.path.isdir(SMOLLM2):
        from baton.engine.common.tokenizer import load_tokenizer

        prompts = _text_prompts(load_tokenizer(SMOLLM2))
        for kv, calculated in (("bfloat16", False), ("fp8", False), ("fp8", True), ("fp8_e5m2", False)):
            share, first, drift = _agreement(SMOLLM2, prompts, kv, 64, calculate_kv_scales=calculated)
            name = kv + (", calculated scales" if calculated else "")
            print(f"| SmolLM2-135M (8 prompts) | {name} | {share:.1%} | {first:.1f} (64) | {drift:.4f} |")
        if vllm_python:
            reference = _vllm_run(vllm_python, SMOLLM2, "auto", 64, prompts)
            for kv in ("fp8", "fp8_e5m2"):
                try:
                    share, first, drift = _compare(reference, _vllm_run(vllm_python, SMOLLM2, kv, 64, prompts))
                    print(f"| vLLM, SmolLM2-135M (8 prompts) | {kv} | {share:.1%} | {first:.1f} (64) | "
                          f"{drift:.4f} |")
                except RuntimeError as e:
                    print(f"| vLLM, SmolLM2-135M | {kv} | refused: {str(e).splitlines()[-1][:150]} | | |")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_families import FAMILIES, write_family  # the tests' tiny random checkpoints

    prompts = torch.randint(3, 500, (6, 40), generator=torch.Generator().manual_seed(2)).tolist()
    for name in ("qwen3", "mistral", "gemma2", "gpt-oss", "deepseek-v2"):
        config_class, shape = FAMILIES[name]
        model = write_family(os.path.join(root, name), config_class, **shape)
        share, first, drift = _agreement(model, prompts, "fp8", 16, max_model_len=192)
        print(f"| tiny random {name} (6 prompts) | fp8 | {share:.1%} | {first:.1f} (16) | {drift:.4f} |")


PARTS = {"capacity": capacity, "handoff": handoff, "decode": decode, "quality": quality}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=list(PARTS), default=list(PARTS))
    p.add_argument("--vllm-python", help="the python of an environment with vLLM's CPU build: its FP8 KV quality too")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        for name in args.only:
            PARTS[name](root, args.vllm_python) if name == "quality" else PARTS[name](root)


if __name__ == "__main__":
    main()
