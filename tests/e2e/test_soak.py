"""Soak (opt-in, BATON_TEST_SOAK=1; BATON_SOAK_SECONDS, default 600): Poisson load through a
router in front of 2 prefill and 2 decode processes, with cancellations, deadlines, bad
requests and n > 1 mixed in. Afterwards every client call has ended, no KV block is leaked
or held, and each process's resident memory is within 10% of its value after the first
minute (a tenth of the run when shorter)."""
from __future__ import annotations

import asyncio
import collections
import os
import random
import time

import grpc
import pytest
from helpers import pools_full, random_prompts, stats, wait_serving
from servers import pd_stack

from baton.services.client import AsyncClient

pytestmark = [pytest.mark.soak,
              pytest.mark.skipif(os.environ.get("BATON_TEST_SOAK") != "1",
                                 reason="a long soak (10 minutes by default): BATON_TEST_SOAK=1")]

RATE = 6.0  # requests per second, Poisson
MAX_OPEN = 48  # the load generator's own bound (arrivals beyond it wait)
EXPECTED = {"OK", "CANCELLED", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


async def one(client, rng: random.Random, i: int, outcomes: collections.Counter, tokens: list[int]) -> None:
    kind = rng.choices(["plain", "deadline", "cancel", "bad", "n"], [55, 15, 12, 8, 10])[0]
    prompt = random_prompts([rng.randint(3, 200)], seed=i)[0]
    sampling = dict(max_tokens=rng.randint(1, 64), ignore_eos=rng.random() < 0.8,
                    **({"temperature": 0.0} if i % 2 else {"temperature": 0.9, "seed": i}))
    if kind == "bad":
        sampling[rng.choice(["presence_penalty", "top_p", "logprobs"])] = 99
    if kind == "n":
        sampling.update(n=2, logprobs=1, stop=["e"])
    timeout = rng.uniform(0.2, 3.0) if kind == "deadline" else 120

    async def stream():
        async for chunk in client.generate(prompt, timeout=timeout, **sampling):
            tokens[0] += len(chunk.token_ids)

    task = asyncio.ensure_future(stream())
    try:
        if kind == "cancel":
            done, _ = await asyncio.wait([task], timeout=rng.uniform(0.0, 1.0))
            if not done:
                task.cancel()
        await task
        outcomes["OK"] += 1
    except asyncio.CancelledError:
        outcomes["CANCELLED"] += 1
    except grpc.aio.AioRpcError as e:
        outcomes[e.code().name] += 1
        if e.code().name not in EXPECTED:
            outcomes[f"unexpected: {e.code().name} {e.details()}"] += 1


def test_soak(tiny_llama):
    duration = float(os.environ.get("BATON_SOAK_SECONDS", "600"))
    seqs = ("--max-num-seqs", "32")
    with pd_stack(tiny_llama, num_prefill=2, num_decode=2, prefill=seqs, decode=seqs) as (prefills, decodes, router):
        procs = [*prefills, *decodes, router]
        for p in procs:
            wait_serving(p.address)
        rss: dict[int, list[tuple[float, int]]] = {p.proc.pid: [] for p in procs}
        outcomes: collections.Counter = collections.Counter()
        tokens = [0]

        async def load():
            rng, open_calls, started = random.Random(2026), set(), 0
            t0 = time.monotonic()
            next_sample = t0
            async with AsyncClient(router.address) as client:
                while (now := time.monotonic()) - t0 < duration:
                    if now >= next_sample:
                        for pid in rss:
                            rss[pid].append((now - t0, rss_kib(pid)))
                        next_sample += 10
                    await asyncio.sleep(rng.expovariate(RATE))
                    if len(open_calls) >= MAX_OPEN:
                        await asyncio.wait(open_calls, return_when=asyncio.FIRST_COMPLETED)
                    task = asyncio.ensure_future(one(client, rng, started, outcomes, tokens))
                    open_calls.add(task)
                    task.add_done_callback(open_calls.discard)
                    started += 1
                done, pending = await asyncio.wait(open_calls, timeout=180) if open_calls else (set(), set())
            return started, len(pending)

        started, stuck = asyncio.run(load())
        ended = sum(v for k, v in outcomes.items() if not k.startswith("unexpected"))
        print(f"\nsoak {duration:g}s: {started} requests, {tokens[0]} tokens streamed; outcomes {dict(outcomes)}")
        assert stuck == 0 and ended == started, (started, ended, stuck)
        assert not [k for k in outcomes if k.startswith("unexpected")], outcomes
        for p in procs[:4]:
            assert pools_full(p.address, timeout=30), stats(p.address)
            s = stats(p.address)
            assert s.num_held == 0 and s.num_in_flight_streams == 0, s
        base_at = min(60.0, duration / 10)
        for p in procs:
            samples = rss[p.proc.pid]
            base = next(v for t, v in samples if t >= base_at)
            final = rss_kib(p.proc.pid)
            print(f"  {p.address}: RSS {base / 1024:.0f} MiB at {base_at:g}s, {final / 1024:.0f} MiB at the end "
                  f"({final / base - 1:+.1%})")
            assert final <= base * 1.10, (p.address, base, final)
