"""The serving benchmarks' load: a workload of random token-id prompts arriving as a Poisson
process (`make_workload`), replayed at most --max-concurrency at once (`drive`) through the
client library over gRPC (`run_grpc`) or through an OpenAI-compatible server's streamed
/v1/completions (`run_http`), each request's chunks timed (`Trace`) for bench/report.py."""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import time
from dataclasses import dataclass, field

from tqdm import tqdm

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


def make_workload(args: argparse.Namespace, vocab_size: int) -> list[Request]:
    rng = random.Random(args.seed)

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - args.range_ratio)), int(mean * (1 + args.range_ratio))))

    t, reqs = 0.0, []
    for i in range(args.num_prompts):
        long = args.long_every and i % args.long_every == args.long_every - 1
        n_in, n_out = args.long_input_len if long else length(args.input_len), length(args.output_len)
        reqs.append(Request([rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n_in)], n_out, t))
        if math.isfinite(args.request_rate):
            t += rng.expovariate(args.request_rate)
    return reqs


async def drive(args: argparse.Namespace, workload: list[Request], mode: str, send) -> tuple[list[Trace], float]:
    """Replay the workload's arrivals (at most --max-concurrency at once) through
    `send(request, trace, t0)`, which streams one request and records its chunks in trace."""
    traces = [Trace() for _ in workload]
    limit = asyncio.Semaphore(args.max_concurrency or len(workload))
    bar = tqdm(total=len(workload), desc=mode, unit="req")
    t0 = time.perf_counter()

    async def one(i: int, r: Request) -> None:
        await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
        async with limit:
            trace = traces[i]
            trace.start_s = time.perf_counter() - t0
            try:
                await send(r, trace, t0)
            except Exception as e:  # noqa: BLE001 - counted as a failed request
                trace.ok = False
                tqdm.write(f"request {i} failed: {e}")
        bar.update(1)

    await asyncio.gather(*(one(i, r) for i, r in enumerate(workload)))
    wall = time.perf_counter() - t0
    bar.close()
    return traces, wall


async def run_grpc(args: argparse.Namespace, workload: list[Request], address: str, mode: str,
                   schema: str | None = None, after_warmup=None, client_calls: str = "per-call"
                   ) -> tuple[list[Trace], float]:
    from baton.services.client import AsyncClient

    # Connections of their own (a subchannel pool each), taken in turn.
    clients = [AsyncClient(address, [("grpc.use_local_subchannel_pool", 1)], multiplex=client_calls != "per-call",
                           frames=client_calls == "frames")
               for _ in range(args.client_connections)]
    turn = itertools.count()
    try:
        constraint = {"json_schema": schema} if schema else {}
        for client in clients:  # warm-up (and compile), and each connection made
            async for _ in client.generate(workload[0].prompt[:8], max_tokens=2, **constraint):
                pass
        if after_warmup is not None:
            after_warmup()

        async def send(r: Request, trace: Trace, t0: float) -> None:
            client = clients[next(turn) % len(clients)]
            async for chunk in client.generate(r.prompt, max_tokens=r.output_len, temperature=0,
                                               ignore_eos=True, output="token_ids", **constraint):
                if chunk.token_ids:
                    trace.chunk_s.append(time.perf_counter() - t0)
                    trace.tokens += len(chunk.token_ids)

        return await drive(args, workload, mode, send)
    finally:
        for client in clients:
            await client.close()


async def run_http(args: argparse.Namespace, workload: list[Request], url: str, mode: str,
                   model: str | None = None, after_warmup=None) -> tuple[list[Trace], float]:
    """The same workload over an OpenAI-compatible server's /v1/completions (token-id prompts,
    streamed); a chunk is an event that carries text, tokens counted from the usage."""
    import aiohttp

    async with aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        if model is None:
            async with session.get("/v1/models") as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{url}/v1/models: HTTP {resp.status}: {await resp.text()}")
                model = (await resp.json())["data"][0]["id"]

        async def stream(prompt: list[int], max_tokens: int, trace: Trace | None, t0: float) -> None:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
            async with session.post("/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
                async for line in resp.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]") or trace is None:
                        continue
                    event = json.loads(line[6:])
                    if event.get("choices") and event["choices"][0].get("text"):
                        trace.chunk_s.append(time.perf_counter() - t0)
                    if event.get("usage"):
                        trace.tokens = event["usage"]["completion_tokens"]

        await stream(workload[0].prompt[:8], 2, None, 0.0)  # warm-up
        if after_warmup is not None:
            after_warmup()
        return await drive(args, workload, mode, lambda r, trace, t0: stream(r.prompt, r.output_len, trace, t0))
