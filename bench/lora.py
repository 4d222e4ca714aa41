"""Multi-LoRA throughput: one offline workload with its requests spread over 1, 4 and 16
adapters (rank 16 on every projection), side by side with the same workload on the base model
alone, in one run; and what loading an adapter at run time costs.

Adapters are random, written in PEFT's layout (adapter_config.json + adapter_model.safetensors).
max_loras is the number of adapters, so every adapter can share each step. Configurations run
interleaved (base, 1, 4, 16, then backwards), and the faster of each pair is reported.

    .venv/bin/python bench/lora.py --model models/smollm2-135m-instruct
    .venv/bin/python bench/lora.py --model models/llama-h512 --num-requests 64
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import torch
from safetensors.torch import save_file

from baton import LLM, SamplingParams
from baton.engine.common.config import read_config
from baton.engine.worker.lora.adapter import part_shapes
from baton.engine.worker.models import model_args

_PARENT = {"o_proj": "self_attn", "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn"}


def write_random_adapter(model_dir: str, out_dir: str, rank: int, seed: int) -> str:
    args = model_args(read_config(model_dir))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(args.num_layers):
        for module, (fan_in, fan_out) in part_shapes(args).items():
            prefix = f"base_model.model.model.layers.{layer}.{_PARENT.get(module, 'mlp')}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * fan_in ** -0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(part_shapes(args)),
                   "base_model_name_or_path": model_dir, "bias": "none"}, f)
    return out_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", default="1,4,16", help="adapter counts to compare with the base model")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the fastest of each is reported")
    args = p.parse_args()
    counts = [int(c) for c in args.adapters.split(",")]
    vocab = model_args(read_config(args.model)).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_random_adapter(args.model, os.path.join(tmp, f"a{i}"), args.rank, i) for i in range(max(counts))]
        llm = LLM(args.model, device="cpu", dtype="float32", enable_lora=True, max_loras=max(counts),
                  max_lora_rank=args.rank, max_num_seqs=args.num_requests, enable_prefix_caching=False)
        load_s = []
        for i, path in enumerate(paths):
            t0 = time.perf_counter()
            llm.load_adapter(f"a{i}", path)
            load_s.append(time.perf_counter() - t0)
        llm.generate(prompts[:4], SamplingParams(max_tokens=4), lora_request=["a0", None, "a1", None])  # warm-up
        best: dict[int, float] = {}
        order = [0] + counts
        for r in range(args.rounds):
            for n in (order if r % 2 == 0 else order[::-1]):
                adapters = [f"a{i % n}" if n else None for i in range(args.num_requests)]
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, lora_request=adapters)
                wall = time.perf_counter() - t0
                assert sum(len(o.token_ids) for o in outs) == args.num_requests * args.output_len
                best[n] = min(best.get(n, float("inf")), wall)
                print(f"  round {r + 1}: {n or 'base'} adapters: {wall:.1f}s", flush=True)
        tokens = args.num_requests * args.output_len
        print(f"model {args.model}, {args.num_requests} requests of {args.prompt_len} prompt + "
              f"{args.output_len} output tokens, rank {args.rank} on every projection, "
              f"{torch.get_num_threads()} threads")
        print(f"{'adapters':>10} {'tok/s':>10} {'vs base':>8}")
        for n in order:
            print(f"{n or 'base':>10} {tokens / best[n]:>10.1f} {best[0] / best[n]:>7.3f}x")
        print(f"adapter load at run time (read, check, register; {len(paths)} adapters): "
              f"median {sorted(load_s)[len(load_s) // 2] * 1e3:.1f} ms, max {max(load_s) * 1e3:.1f} ms; "
              f"first use puts it on the device: {llm.engine.runner.lora.num_loads} device loads")


if __name__ == "__main__":
    main()
