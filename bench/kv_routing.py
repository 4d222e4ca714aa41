"""KV-aware routing benchmark: a multi-turn chat workload through the router in front of
several colocated instances, under each routing policy, side by side in one run.

Conversations share a system prompt; each turn sends the whole conversation so far (system
prompt, every user message and every reply, as token ids) plus a new user message, so a turn's
prompt starts with the previous turn's prompt and output: the instance that served the previous
turn may hold most of it. Conversations start as a Poisson process (--conversation-rate) and
each sends its next turn when its reply ended (after --think-time). Each instance's KV pool is
sized so that the conversations' KV at their last turn is --kv-ratio times one pool (default 4):
no instance holds every conversation, and a policy that scatters a conversation's turns pays in
misses and evictions. With --routers N, N router replicas share the instances and a
conversation's turns go to them in turn, as a Service spreads requests over a router
Deployment's pods: a router then sees only some of a conversation's turns (prefix_affinity's
table guesses from what it saw pass), while the instances' KV events tell every router alike.

Per policy, on fresh instances: the prefix cache hit rate (prompt tokens the engines found
cached / prompt tokens), TTFT p50/p99, end-to-end latency, and the spread of load across the
instances (requests, and prompt tokens each had to compute: max / mean).

On a 2-core CPU SmolLM2 (the default model) takes minutes per policy; the figures in
docs/architecture.md come from the benchmarks' middle model, a step in milliseconds:

    .venv/bin/python bench/random_checkpoint.py llama-h512 /tmp/random-llama-h512
    .venv/bin/python bench/kv_routing.py --model /tmp/random-llama-h512 --rounds 2
    .venv/bin/python bench/kv_routing.py --conversations 24 --turns 4 --instances 2
    .venv/bin/python bench/kv_routing.py --policies kv_aware --router-config weights.yaml  # kv_overlap_score_weight: 4
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
TOKEN = "bench-token"
FIRST_TOKEN_ID = 3
POLICIES = ("kv_aware", "prefix_affinity", "round_robin")


@dataclass
class Turn:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    held_tokens: int = 0  # full blocks of the conversation so far: what its last instance may still hold
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    ok: bool = True


@dataclass
class Conversation:
    index: int
    start_s: float
    user_turns: list[list[int]]
    turns: list[Turn] = field(default_factory=list)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct",
                   help="checkpoint dir (relative: from the repo root)")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma list of: {', '.join(POLICIES)}, "
                                                                 "least_outstanding")
    p.add_argument("--instances", type=int, default=3)
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=128, help="tokens of the shared system prompt")
    p.add_argument("--user-len", type=int, default=48, help="mean tokens of a user message (uniform, +-50%%)")
    p.add_argument("--output-len", type=int, default=16, help="tokens of each reply (greedy, EOS ignored)")
    p.add_argument("--conversation-rate", type=float, default=4.0, help="conversations starting per second")
    p.add_argument("--think-time", type=float, default=0.2, help="seconds between a reply and the next turn")
    p.add_argument("--kv-ratio", type=float, default=4.0,
                   help="the conversations' KV at their last turn / one instance's KV pool")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine (OMP_NUM_THREADS)")
    p.add_argument("--router-config", help="YAML for the router (e.g. kv_overlap_score_weight)")
    p.add_argument("--routers", type=int, default=1, help="router replicas in front of the instances")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every policy this many times, in ABBA order, and keep each one's fastest (the "
                        "machine's drift, or a neighbour's load, then lands on no policy alone)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.policies = args.policies.split(",")
    args.model = Path(args.model) if Path(args.model).is_absolute() else REPO / args.model
    return args


def make_workload(args, vocab: int) -> tuple[list[int], list[Conversation]]:
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)]

    system = ids(args.system_len)
    t, conversations = 0.0, []
    for i in range(args.conversations):
        users = [ids(rng.randint(args.user_len // 2, args.user_len * 3 // 2)) for _ in range(args.turns)]
        conversations.append(Conversation(i, t, users))
        t += rng.expovariate(args.conversation_rate)
    return system, conversations


def kv_blocks_per_instance(args, system: list[int], conversations: list[Conversation]) -> tuple[int, int]:
    """One pool's blocks (the conversations' final KV / --kv-ratio), and the longest prompt."""
    lengths = [len(system) + sum(map(len, c.user_turns)) + (args.turns - 1) * args.output_len for c in conversations]
    total = sum(-(-n // args.block_size) for n in lengths)
    return max(int(total / args.kv_ratio), -(-(max(lengths) + args.output_len) // args.block_size)), max(lengths)


def start(args, *flags: str) -> tuple[subprocess.Popen, str, str | None]:
    """`baton serve` in a process: it, its address, and the URL of its /metrics (when asked for)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.Popen([sys.executable, "-m", "baton.services.cli", "serve", "--model", str(args.model),
                             "--port", "0", "--internal-token", TOKEN, *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    metrics = None
    for line in proc.stdout:
        if line.startswith("metrics on "):
            metrics = line.split()[2]
        if line.startswith("serving on "):
            return proc, line.split()[2].rstrip(";"), metrics
    proc.kill()
    sys.exit(f"`baton serve {' '.join(flags)}` exited before it served; run it by hand to see why")


def wait_serving(address: str, timeout_s: float = 120.0) -> None:
    from baton.services.rpc.health import backend_health, is_serving

    deadline = time.monotonic() + timeout_s
    while not (is_serving(address) and (h := backend_health(address)) is not None and all(h)):
        if time.monotonic() > deadline:
            sys.exit(f"{address} is not serving after {timeout_s:g}s")
        time.sleep(0.1)


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):  # the router first
        proc.send_signal(2)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def engine_stats(address: str):
    import grpc

    from baton.v1 import internal_pb2, internal_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return internal_pb2_grpc.AdminStub(channel).Stats(internal_pb2.StatsRequest(),
                                                          metadata=(("x-baton-token", TOKEN),), timeout=10)


def decisions(metrics_url: str) -> str:
    """The router's policy decisions by kind, from its /metrics."""
    import re
    import urllib.request

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    counts = {}
    for m in re.finditer(r'^baton:router_policy_decisions_total\{([^}]*)\} ([0-9.e+]+)$', text, re.M):
        decision = re.search(r'decision="([^"]+)"', m.group(1)).group(1)
        counts[decision] = counts.get(decision, 0) + int(float(m.group(2)))
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


async def converse(clients, args, system: list[int], conv: Conversation, t0: float) -> None:
    await asyncio.sleep(max(0.0, conv.start_s - (time.perf_counter() - t0)))
    history = list(system)
    for i, user in enumerate(conv.user_turns):
        client = clients[(conv.index + i) % len(clients)]  # the router replicas take turns
        prompt, turn, output = history + user, Turn(), []
        turn.prompt_tokens = len(prompt)
        # What the last turn left cached: its full blocks (the last output token's KV is never computed).
        turn.held_tokens = (len(history) - (i > 0)) // args.block_size * args.block_size
        sent = time.perf_counter()
        try:
            async for chunk in client.generate(prompt, max_tokens=args.output_len, temperature=0, ignore_eos=True,
                                               output="token_ids"):
                if chunk.token_ids and not output:
                    turn.ttft_s = time.perf_counter() - sent
                output += chunk.token_ids
                if chunk.usage is not None:
                    turn.cached_tokens = chunk.usage.cached_tokens
        except Exception as e:  # noqa: BLE001 - counted as failed
            turn.ok = False
            print(f"a turn failed: {e}", file=sys.stderr)
        turn.e2e_s = time.perf_counter() - sent
        conv.turns.append(turn)
        history = prompt + output
        await asyncio.sleep(args.think_time)


async def drive(args, addresses: list[str], system: list[int], conversations: list[Conversation]) -> float:
    from baton.services.client import AsyncClient

    clients = [AsyncClient(a) for a in addresses]
    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(converse(clients, args, system, c, t0) for c in conversations))
        return time.perf_counter() - t0
    finally:
        for client in clients:
            await client.close()


def run_policy(args, policy: str, system, conversations, num_blocks: int, max_len: int) -> dict[str, float]:
    engine_flags = ("--num-kv-blocks", str(num_blocks), "--block-size", str(args.block_size),
                    "--max-model-len", str(max_len + args.output_len + args.block_size))
    procs = []
    try:
        engines = [start(args, *engine_flags) for _ in range(args.instances)]
        procs += [p for p, _, _ in engines]
        addresses = [a for _, a, _ in engines]
        router_flags = ("--role", "router", "--policy", policy, "--decode", ",".join(addresses),
                        "--block-size", str(args.block_size), "--metrics-port", "0")
        routers = [start(args, *router_flags, *(("--router-config", args.router_config) if args.router_config else ()))
                   for _ in range(args.routers)]
        procs += [r[0] for r in routers]
        for r in routers:
            wait_serving(r[1])

        async def warm_up():  # each engine's first step (kernel load, allocator) is not the policy's doing
            from baton.services.client import AsyncClient
            for a in addresses:
                async with AsyncClient(a) as client:
                    async for _ in client.generate([FIRST_TOKEN_ID] * 4, max_tokens=2):
                        pass
        asyncio.run(warm_up())
        before = [engine_stats(a) for a in addresses]
        wall = asyncio.run(drive(args, [r[1] for r in routers], system, conversations))
        after = [engine_stats(a) for a in addresses]
        print(f"{policy} decisions: {'; '.join(decisions(r[2]) for r in routers)}")
    finally:
        stop(procs)
    turns = [t for c in conversations for t in c.turns if t.ok]
    ttft, e2e = [t.ttft_s for t in turns], [t.e2e_s for t in turns]
    requests = [a.num_requests - b.num_requests for a, b in zip(after, before)]
    hits = [a.num_prefix_hit_tokens - b.num_prefix_hit_tokens for a, b in zip(after, before)]
    prompt_tokens = sum(t.prompt_tokens for t in turns)
    return {"turns ok": len(turns), "failed": sum(not t.ok for c in conversations for t in c.turns),
            "hit rate %": 100 * sum(t.cached_tokens for t in turns) / prompt_tokens,
            # Later turns that found the whole conversation so far cached (their instance kept it).
            "follow-ups hit whole %": 100 * float(np.mean([t.cached_tokens >= t.held_tokens for c in conversations
                                                            for t in c.turns[1:] if t.ok])),
            "TTFT p50 ms": 1e3 * float(np.percentile(ttft, 50)), "TTFT p99 ms": 1e3 * float(np.percentile(ttft, 99)),
            "E2E p50 ms": 1e3 * float(np.percentile(e2e, 50)), "E2E p99 ms": 1e3 * float(np.percentile(e2e, 99)),
            "wall s": wall,
            "requests max/mean": max(requests) / (sum(requests) / len(requests)),
            "requests min/mean": min(requests) / (sum(requests) / len(requests)),
            "hit tokens max/mean": max(hits) / max(1, sum(hits) / len(hits)),
            "per instance requests": requests}


def main() -> None:
    import json

    args = parse_args()
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    rows, shown = {}, False
    runs = [p for r in range(args.rounds) for p in (args.policies if r % 2 == 0 else args.policies[::-1])]
    for policy in runs:
        system, conversations = make_workload(args, vocab)  # the same workload, fresh records
        num_blocks, max_len = kv_blocks_per_instance(args, system, conversations)
        if not shown:
            shown = True
            ideal = sum((len(system) + sum(map(len, c.user_turns[:k])) + k * args.output_len - (k > 0))
                        // args.block_size * args.block_size for c in conversations for k in range(args.turns))
            prompts = sum(len(system) + sum(map(len, c.user_turns[:k + 1])) + k * args.output_len
                          for c in conversations for k in range(args.turns))
            print(f"{args.routers} router(s); at most {100 * ideal / prompts:.1f}% of prompt tokens can hit "
                  f"(each turn finds its whole conversation so far)")
            print(f"model {args.model.name}; {args.instances} instances of {num_blocks} KV blocks of {args.block_size} "
                  f"tokens; {args.conversations} conversations x {args.turns} turns (system prompt {args.system_len}, "
                  f"user ~{args.user_len}, reply {args.output_len} tokens; longest prompt {max_len}); their KV is "
                  f"{args.kv_ratio:g}x one pool; {args.conversation_rate:g} conversations/s; {os.cpu_count()} cores")
        row = run_policy(args, policy, system, conversations, num_blocks, max_len)
        print(f"{policy}: wall {row['wall s']:.1f} s, hit rate {row['hit rate %']:.1f}%, TTFT p99 "
              f"{row['TTFT p99 ms']:.0f} ms, requests per instance {row.pop('per instance requests')}", flush=True)
        if policy not in rows or row["wall s"] < rows[policy]["wall s"]:
            rows[policy] = row
    rows = {p: rows[p] for p in args.policies}
    names = list(rows)
    base = "round_robin" if "round_robin" in rows else names[-1]
    header = ["metric", *names, *(f"{n} / {base}" for n in names if n != base)]
    lines = [header]
    for k in rows[names[0]]:
        line = [k, *(f"{rows[n][k]:.2f}" for n in names)]
        line += [f"{rows[n][k] / rows[base][k]:.3f}" if rows[base][k] else "-" for n in names if n != base]
        lines.append(line)
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    text = [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in lines]
    text.insert(1, "-+-".join("-" * w for w in widths))
    print("\n" + "\n".join(text))


if __name__ == "__main__":
    main()
