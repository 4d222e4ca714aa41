"""Serving benchmark: one workload through the gRPC server and through the offline engine.

Requests arrive as a Poisson process at --request-rate (inf: all at once), optionally capped
at --max-concurrency in flight, with random token-id prompts of --input-len tokens (spread
by --range-ratio) and --output-len new tokens each (greedy, EOS ignored). Metrics follow
`vllm bench serve`: TTFT (arrival to first token), TPOT ((latency - TTFT) / (tokens - 1)),
ITL (gaps between streamed chunks), end-to-end latency, request and token throughput. The
offline side drives the engine's step loop in this process with the same arrivals; the
server side runs `baton serve` in a subprocess and streams over gRPC on 127.0.0.1.

    .venv/bin/python bench/serve.py --max-concurrency 32
    .venv/bin/python bench/serve.py --model models/tiny-llama --num-prompts 200 --request-rate 50
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
FIRST_TOKEN_ID = 3  # skip the usual special ids at the bottom of the vocabulary


@dataclass
class Request:
    prompt: list[int]
    output_len: int
    arrival_s: float  # offset from the start of the run


@dataclass
class Trace:
    """What one request saw: chunk arrival times (from the run's start) and token counts."""
    start_s: float = 0.0
    chunk_s: list[float] = field(default_factory=list)
    tokens: int = 0
    ok: bool = True


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct", help="checkpoint dir (relative: from the repo root)")
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--input-len", type=int, default=256, help="mean prompt length in tokens")
    p.add_argument("--output-len", type=int, default=64, help="mean new tokens per request")
    p.add_argument("--range-ratio", type=float, default=0.5,
                   help="lengths are uniform in [len * (1 - r), len * (1 + r)] (vLLM's random dataset)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at t=0)")
    p.add_argument("--max-concurrency", type=int, default=32, help="most requests in flight (0: no cap)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-offline", action="store_true")
    args = p.parse_args()
    args.model = Path(args.model) if Path(args.model).is_absolute() else REPO / args.model
    return args


def make_workload(args: argparse.Namespace, vocab_size: int) -> list[Request]:
    rng = random.Random(args.seed)

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - args.range_ratio)), int(mean * (1 + args.range_ratio))))

    t, reqs = 0.0, []
    for _ in range(args.num_prompts):
        n_in, n_out = length(args.input_len), length(args.output_len)
        reqs.append(Request([rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n_in)], n_out, t))
        if math.isfinite(args.request_rate):
            t += rng.expovariate(args.request_rate)
    return reqs


# ---- the offline engine, driven with the same arrivals ----------------------------------------
def run_offline(args: argparse.Namespace, workload: list[Request]) -> tuple[list[Trace], float]:
    from baton import SamplingParams
    from baton.engine.config import EngineConfig
    from baton.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_kwargs(str(args.model), max_num_seqs=args.max_num_seqs,
                                                max_num_batched_tokens=args.max_num_batched_tokens))
    engine.add_request("warmup", workload[0].prompt[:8], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv.reset_prefix_cache()
    traces = [Trace() for _ in workload]
    pending = deque(range(len(workload)))
    in_flight, cap = 0, args.max_concurrency or len(workload)
    bar = tqdm(total=len(workload), desc="offline engine", unit="req")
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and in_flight < cap and workload[pending[0]].arrival_s <= now:
            i = pending.popleft()
            r = workload[i]
            traces[i].start_s = max(now, r.arrival_s)
            engine.add_request(str(i), r.prompt, SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True))
            in_flight += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, workload[pending[0]].arrival_s - now))
            continue
        outputs = engine.step()
        now = time.perf_counter() - t0
        for out in outputs:
            trace = traces[int(out.request_id)]
            if out.new_token_ids:
                trace.chunk_s.append(now)
                trace.tokens += len(out.new_token_ids)
            if out.finished:
                in_flight -= 1
                bar.update(1)
    wall = time.perf_counter() - t0
    bar.close()
    return traces, wall


# ---- the gRPC server --------------------------------------------------------------------------
def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "baton.services.cli", "serve", "--model", str(args.model),
                             "--port", "0", "--max-num-seqs", str(args.max_num_seqs),
                             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                             "--max-waiting-requests", str(args.num_prompts + 1)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if line.startswith("serving on "):
            return proc, line.split()[2].rstrip(";")
    proc.kill()
    sys.exit("the server exited before it served; run `baton serve` by hand to see why")


async def run_grpc(args: argparse.Namespace, workload: list[Request], address: str) -> tuple[list[Trace], float]:
    from baton.services.client import AsyncClient

    traces = [Trace() for _ in workload]
    limit = asyncio.Semaphore(args.max_concurrency or len(workload))
    bar = tqdm(total=len(workload), desc="gRPC server", unit="req")
    async with AsyncClient(address) as client:
        async for _ in client.generate(workload[0].prompt[:8], max_tokens=2):  # warm-up
            pass
        t0 = time.perf_counter()

        async def one(i: int, r: Request) -> None:
            await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
            async with limit:
                trace = traces[i]
                trace.start_s = time.perf_counter() - t0
                try:
                    async for chunk in client.generate(r.prompt, max_tokens=r.output_len, temperature=0,
                                                       ignore_eos=True, output="token_ids"):
                        if chunk.token_ids:
                            trace.chunk_s.append(time.perf_counter() - t0)
                            trace.tokens += len(chunk.token_ids)
                except Exception as e:  # noqa: BLE001 - counted as a failed request
                    trace.ok = False
                    tqdm.write(f"request {i} failed: {e}")
            bar.update(1)

        await asyncio.gather(*(one(i, r) for i, r in enumerate(workload)))
        wall = time.perf_counter() - t0
    bar.close()
    return traces, wall


# ---- report -----------------------------------------------------------------------------------
def metrics(traces: list[Trace], wall: float, workload: list[Request]) -> dict[str, float]:
    ok = [(t, r) for t, r in zip(traces, workload) if t.ok and t.chunk_s]
    ttft = [t.chunk_s[0] - t.start_s for t, _ in ok]
    e2e = [t.chunk_s[-1] - t.start_s for t, _ in ok]
    tpot = [(t.chunk_s[-1] - t.chunk_s[0]) / (t.tokens - 1) for t, _ in ok if t.tokens > 1]
    itl = [b - a for t, _ in ok for a, b in zip(t.chunk_s, t.chunk_s[1:])]
    out = {"completed": len(ok), "request/s": len(ok) / wall, "output tok/s": sum(t.tokens for t, _ in ok) / wall,
           "total tok/s": sum(t.tokens + len(r.prompt) for t, r in ok) / wall}
    for name, xs in (("TTFT", ttft), ("TPOT", tpot), ("ITL", itl), ("E2E", e2e)):
        for q in (50, 90, 99):
            out[f"{name} p{q} ms"] = float(np.percentile(xs, q)) * 1e3 if xs else float("nan")
    return out


def print_table(rows: dict[str, dict[str, float]]) -> None:
    names = list(rows)
    keys = list(next(iter(rows.values())))
    header = ["metric", *names] + (["gRPC / offline"] if len(names) == 2 else [])
    lines = [header]
    for k in keys:
        vals = [rows[n][k] for n in names]
        line = [k, *(f"{v:.2f}" for v in vals)]
        if len(names) == 2:
            line.append(f"{vals[1] / vals[0]:.3f}" if vals[0] else "-")
        lines.append(line)
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    text = [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in lines]
    text.insert(1, "-+-".join("-" * w for w in widths))
    print("\n" + "\n".join(text))


def main() -> None:
    args = parse_args()
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    workload = make_workload(args, vocab)
    print(f"model {args.model.name}; {args.num_prompts} requests, input ~{args.input_len}, output ~{args.output_len} "
          f"(range ratio {args.range_ratio}), rate {args.request_rate}/s, max concurrency {args.max_concurrency}")
    rows = {}
    if not args.skip_offline:
        rows["offline engine"] = metrics(*run_offline(args, workload), workload)
    proc, address = start_server(args)
    try:
        rows["gRPC server"] = metrics(*asyncio.run(run_grpc(args, workload, address)), workload)
    finally:
        proc.send_signal(2)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print_table(rows)
    if len(rows) == 2:
        ratio = rows["gRPC server"]["output tok/s"] / rows["offline engine"]["output tok/s"]
        print(f"\nserving overhead: gRPC output token throughput = {ratio:.3f}x the offline engine's")


if __name__ == "__main__":
    main()
