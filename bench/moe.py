"""The MoE layer on CPU: Baton's grouped experts (pairs sorted by expert, one matmul pair per
active expert) vs the per-token loop vs transformers' own experts module (Mixtral's, loaded
with the same weights), tokens/s at 1, 64 and 512 tokens per step, same run, same routing.

    .venv/bin/python bench/moe.py
    .venv/bin/python bench/moe.py --hidden 2048 --inter 1408 --experts 64 --top-k 6   # Qwen1.5-MoE-A2.7B-ish
"""
from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from baton.engine.worker.models.moe import grouped_experts, naive_experts, route


def per_second(fn, tokens: int, min_s: float) -> float:
    fn()  # warm up
    runs, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_s or runs < 3:
        fn()
        runs += 1
    return tokens * runs / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=768, help="each expert's intermediate size")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 512])
    p.add_argument("--min-seconds", type=float, default=1.0)
    p.add_argument("--naive-max-tokens", type=int, default=64, help="the per-token loop above this is skipped")
    args = p.parse_args()
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(0)
    hf = MixtralExperts(MixtralConfig(hidden_size=args.hidden, intermediate_size=args.inter,
                                      num_local_experts=args.experts))
    with torch.no_grad():
        hf.gate_up_proj.normal_(0, 0.02)
        hf.down_proj.normal_(0, 0.02)
    gate_up, down = hf.gate_up_proj.detach(), hf.down_proj.detach()
    router = torch.randn(args.experts, args.hidden) * 0.02
    print(f"{args.experts} experts of {args.hidden} x {args.inter}, top-{args.top_k}, {torch.get_num_threads()} "
          f"threads; tokens/s")
    print(f"{'tokens':>7} {'grouped':>10} {'per-token':>10} {'transformers':>13} {'vs per-token':>13} "
          f"{'vs transformers':>16}")
    with torch.inference_mode():
        for n in args.tokens:
            x = torch.randn(n, args.hidden)
            weights, ids = route(x @ router.T, args.top_k, True)
            got = grouped_experts(x, weights, ids, gate_up, down)
            torch.testing.assert_close(got, hf(x, ids, weights), rtol=1e-4, atol=1e-5)
            grouped = per_second(partial(grouped_experts, x, weights, ids, gate_up, down), n, args.min_seconds)
            naive = (per_second(partial(naive_experts, x, weights, ids, gate_up, down), n, args.min_seconds)
                     if n <= args.naive_max_tokens else float("nan"))
            theirs = per_second(partial(hf, x, ids, weights), n, args.min_seconds)
            print(f"{n:>7} {grouped:>10.0f} {naive:>10.0f} {theirs:>13.0f} {grouped / naive:>12.2f}x "
                  f"{grouped / theirs:>15.2f}x")


if __name__ == "__main__":
    main()
