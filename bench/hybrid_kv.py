"""Sliding-window memory: how many long requests one fixed KV pool holds at once, with the hybrid
KV cache manager (sliding-window groups let go of blocks out of their window) and without it
(every layer keeps every block), for a Gemma-3-shaped model.

The scheduler and the KV cache manager run as the engine runs them, steps and all; the model
is left out (a sampled token costs nothing), since what is measured is the pool's bookkeeping:
the same bytes of KV memory, cut into blocks of each layout's size. Defaults: Gemma 3 12B's
layers (48, every sixth global, a 1,024-token window), 8k-token contexts (7,936 prompt tokens
and 256 outputs), a pool of the bytes that 8 such requests take when every layer keeps every
block, 64 requests.

    .venv/bin/python bench/hybrid_kv.py
    .venv/bin/python bench/hybrid_kv.py --layers 34 --window 1024 --pool-requests 16
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time

from baton.engine.common.config import EngineConfig
from baton.engine.common.kv_groups import group_layers
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.common.scheduler_output import ModelRunnerOutput
from baton.engine.core.kv_cache_manager import KVCacheManager
from baton.engine.core.request import Request
from baton.engine.core.scheduler import Scheduler


def run(windows: list[int | None], hybrid: bool, args) -> dict:
    groups = group_layers(windows, hybrid)
    bs = args.block_size
    layer_blocks = args.pool_requests * len(windows) * -(-args.context // bs)  # the pool, in one layer's blocks
    num_blocks = layer_blocks // groups.layers_per_block
    with tempfile.TemporaryDirectory() as model:
        config = EngineConfig(model=model, block_size=bs, max_num_seqs=256, max_num_batched_tokens=args.step_tokens,
                              max_model_len=args.context)
    kv = KVCacheManager(num_blocks, bs, enable_caching=False, windows=groups.windows)
    sched = Scheduler(config, kv)
    rng = random.Random(0)
    prompt_len = args.context - args.output_len
    for i in range(args.requests):
        sched.add_request(Request(f"r{i}", [rng.randrange(32000) for _ in range(prompt_len)],
                                  SamplingParams(max_tokens=args.output_len, ignore_eos=True)))
    steps = decode_steps = decoding = peak = 0
    start = time.perf_counter()
    while sched.requests:
        out = sched.schedule()
        sampled = {}
        for req_id in out.num_scheduled_tokens:
            req = sched.requests[req_id]
            if req.num_computed_tokens == req.num_tokens:
                sampled[req_id] = [0]
        in_decode = sum(1 for r in sched.running if r.num_output_tokens > 0)
        if in_decode:
            decode_steps += 1
            decoding += in_decode
        peak = max(peak, len(sched.running))
        sched.update_from_output(out, ModelRunnerOutput(sampled))
        steps += 1
    assert kv.num_free_blocks == kv.num_blocks
    return {"layout": "hybrid" if groups.hybrid else "every block", "groups": len(groups.windows),
            "layers_per_block": groups.layers_per_block, "blocks": num_blocks, "peak_running": peak,
            "mean_decoding": decoding / max(decode_steps, 1), "steps": steps,
            "preemptions": sched.num_preemptions, "wall_s": time.perf_counter() - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--pattern", type=int, default=6, help="every N-th layer is global (Gemma 3: 6)")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--step-tokens", type=int, default=8192)
    p.add_argument("--pool-requests", type=int, default=8, help="the pool: the bytes this many contexts take "
                                                                   "when every layer keeps every block")
    p.add_argument("--requests", type=int, default=64)
    args = p.parse_args()
    windows = [None if (i + 1) % args.pattern == 0 else args.window for i in range(args.layers)]
    print(f"{args.layers} layers ({windows.count(None)} global, window {args.window}), {args.context}-token contexts, "
          f"pool = {args.pool_requests} contexts of every layer, {args.requests} requests")
    rows = [run(windows, False, args), run(windows, True, args)]
    for r in rows:
        print(f"  {r['layout']:<12} {r['groups']:>3} groups of {r['layers_per_block']:>2} layers, {r['blocks']:>6} "
              f"blocks: peak running {r['peak_running']:>3}, mean decoding {r['mean_decoding']:6.1f}, "
              f"{r['steps']:>5} steps, {r['preemptions']:>3} preemptions ({r['wall_s']:.1f} s)")
    print(f"hybrid / every block: peak running {rows[1]['peak_running'] / rows[0]['peak_running']:.2f}x, "
          f"mean decoding {rows[1]['mean_decoding'] / rows[0]['mean_decoding']:.2f}x, "
          f"steps {rows[0]['steps'] / rows[1]['steps']:.2f}x fewer")


if __name__ == "__main__":
    main()
