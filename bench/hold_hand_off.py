"""A prefill whose decodes lag: its holds fill the device pool. With the host tier's hand-off
on, held blocks move to host memory and the prompts behind them go on; off, they wait for the
holds to end. Side by side in one run: prefills given out within the time limit, and how much
later a handed-off request's output (its handle) leaves than a kept one's.

    .venv/bin/python bench/hold_hand_off.py --model models/smollm2-135m-instruct
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers import random_prompts
from nixl_engines import nixl_engine

from baton import SamplingParams


def run(args, hand_off: bool) -> str:
    eng = nixl_engine(args.model, "prefill", num_kv_blocks=args.device_blocks, max_model_len=args.prompt_len + 16,
                      kv_offloading_size=args.host_gib, hold_timeout_s=600)
    if not hand_off:
        eng.scheduler._device_short = lambda: False  # holds always stay on the device
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prompts = random_prompts([args.prompt_len] * args.num_prompts, seed=1)
    reqs = {f"p{i}": eng.add_request(f"p{i}", p, one, hold_for_remote=True) for i, p in enumerate(prompts)}
    t0 = time.monotonic()
    delays = {"host": [], "device": []}
    while eng.has_unfinished_requests() and time.monotonic() < t0 + args.limit_s:
        for out in eng.step():
            if out.finished:
                delays[out.kv_handle.tier.value].append(time.monotonic() - reqs[out.request_id].finished_time)
    n = sum(map(len, delays.values()))
    ms = {tier: f"{1000 * statistics.mean(d):.2f} ms" if d else "-" for tier, d in delays.items()}
    return (f"{'on' if hand_off else 'off':>4} | {n:>3}/{len(reqs)} in {time.monotonic() - t0:5.2f} s | "
            f"{len(delays['host']):>4} host, {len(delays['device']):>3} device | handle out after finish: "
            f"host {ms['host']}, device {ms['device']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--device-blocks", type=int, default=64)
    p.add_argument("--host-gib", type=float, default=0.2)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--limit-s", type=float, default=20.0, help="how long the decodes lag (no hold ends before)")
    args = p.parse_args()
    print("hand-off | prefills out | where holds went | delay")
    for hand_off in (True, False):
        print(run(args, hand_off))


if __name__ == "__main__":
    main()
