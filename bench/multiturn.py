"""The host KV tier and swap preemption, side by side in one run (engine-level, LLMEngine).

1. Multi-turn chat: conversations sharing a system prompt, each turn's prompt the last turn's
   prompt + answer + a new user message. A fixed number of turns are in flight; when one ends its
   conversation's next turn joins the back of the queue, so every conversation comes round again
   only after all the others did, and the working set (the conversations' KV, about
   --working-set-ratio x the device pool) outgrows the device pool. Host tier off vs on (sized to
   hold the whole working set): prefix-cache hit rate (prompt tokens not computed), TTFT p50/p99
   (from submission to the first token), throughput.
2. Long contexts under memory pressure: long prompts whose decodes outgrow a pool that holds a
   few of them at a time: preemption by recompute vs swap (to the host tier and back); outputs
   must be identical.

    .venv/bin/python bench/multiturn.py            # a random llama-h512 checkpoint (CPU: steps of ms)
    .venv/bin/python bench/multiturn.py --quick
    .venv/bin/python bench/multiturn.py --measure-copies   # the copier's inline vs background cost
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from random_checkpoint import write_random_checkpoint  # noqa: E402
from report import print_table  # noqa: E402

from baton import SamplingParams  # noqa: E402
from baton.engine.common.config import EngineConfig  # noqa: E402
from baton.engine.offline.llm_engine import LLMEngine  # noqa: E402

FIRST_TOKEN_ID = 3


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint dir (default: a random llama-h512 written to models/)")
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=96)
    p.add_argument("--user-len", type=int, default=24)
    p.add_argument("--answer-len", type=int, default=16)
    p.add_argument("--in-flight", type=int, default=8, help="turns in flight at once")
    p.add_argument("--working-set-ratio", type=float, default=4.0, help="the conversations' KV / the device pool")
    p.add_argument("--long-requests", type=int, default=6)
    p.add_argument("--long-prompt", type=int, default=384)
    p.add_argument("--long-output", type=int, default=128)
    p.add_argument("--long-budget", type=int, default=512, help="max_num_batched_tokens of the long-context runs "
                   "(auto swaps a victim whose recompute needs more than half of it)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads: on a shared machine one keeps the "
                   "figures steady (OpenMP threads spin on cores the others need)")
    p.add_argument("--quick", action="store_true", help="a smaller run (16 conversations x 4 turns)")
    p.add_argument("--only", choices=("chat", "long"), help="run one of the two comparisons")
    p.add_argument("--measure-copies", action="store_true", help="only time the copier: inline vs background")
    return p.parse_args()


def ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)]


def block_bytes(engine: LLMEngine) -> int:
    cache = engine.runner.kv_cache
    return cache[0].numel() * cache.element_size()


def make_engine(args, model: str, num_blocks: int, host_blocks: int, block_nbytes: int, **kw) -> LLMEngine:
    size = host_blocks * block_nbytes / (1 << 30)
    config = EngineConfig.from_kwargs(model, device=args.device, dtype=args.dtype, block_size=args.block_size,
                                      num_kv_blocks=num_blocks, kv_offloading_size=size, **kw)
    engine = LLMEngine(config)
    engine.record_events()  # for the tokens each step computed
    return engine


class Clock:
    """Wall and CPU seconds (this process's, the copier's thread included: on a shared machine the
    CPU time is the steadier figure), and the tokens the engine computed (prompt recomputes too)."""

    def __init__(self, engine: LLMEngine):
        self.engine, self.tokens = engine, 0
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def step(self) -> list:
        outputs = self.engine.step()
        self.tokens += sum(self.engine.take_events().step_tokens)
        return outputs

    def figures(self) -> dict[str, float]:
        return {"wall s": time.perf_counter() - self.wall, "CPU s": time.process_time() - self.cpu,
                "tokens computed": self.tokens}


# ---- 1. multi-turn chat -----------------------------------------------------------------------
def chat_run(engine: LLMEngine, args, vocab: int) -> dict[str, float]:
    rng = random.Random(args.seed)
    system = ids(rng, args.system_len, vocab)
    history = [list(system) for _ in range(args.conversations)]
    turn = [0] * args.conversations
    ready = deque(range(args.conversations))
    params = SamplingParams(max_tokens=args.answer_len, temperature=0.0, ignore_eos=True)
    live: dict[str, tuple[int, float]] = {}  # request id -> conversation, submit time
    ttft, answers, out_tokens, prompt_tokens, n = [], {}, 0, 0, 0
    clock = Clock(engine)
    while ready or live:
        while ready and len(live) < args.in_flight:
            c = ready.popleft()
            history[c] += ids(random.Random(args.seed * 7919 + c * 31 + turn[c]), args.user_len, vocab)
            req_id = f"c{c}t{turn[c]}"
            engine.add_request(req_id, list(history[c]), params, detokenize=False)
            prompt_tokens += len(history[c])
            live[req_id] = (c, time.perf_counter())
            answers[req_id] = []
            n += 1
        for out in clock.step():
            c, start = live[out.request_id]
            if not answers[out.request_id] and out.new_token_ids:
                ttft.append(time.perf_counter() - start)
            answers[out.request_id] += out.new_token_ids
            out_tokens += len(out.new_token_ids)
            if out.finished:
                del live[out.request_id]
                history[c] += answers[out.request_id]
                turn[c] += 1
                if turn[c] < args.turns:
                    ready.append(c)
    took = clock.figures()
    while engine.has_unfinished_requests():  # write-backs still in flight
        engine.step()
    s, wall = engine.snapshot(), took["wall s"]
    return {"requests": n, "prefix hit rate %": 100 * s.num_prompt_tokens_cached / s.num_prompt_tokens,
            "TTFT p50 ms": np.percentile(ttft, 50) * 1e3, "TTFT p99 ms": np.percentile(ttft, 99) * 1e3,
            "output tok/s": out_tokens / wall, "prompt tok/s": prompt_tokens / wall, **took,
            "host hits (tokens)": s.host_kv_cache_hits, "blocks to host": s.num_host_kv_stored_blocks,
            "blocks from host": s.num_host_kv_loaded_blocks, "preemptions": s.num_preemptions,
            "_answers": answers}


def chat_kv_blocks(args) -> int:
    """Blocks the conversations' KV takes in all (the system prompt's shared)."""
    bs = args.block_size
    last = args.system_len + args.turns * (args.user_len + args.answer_len)
    return args.system_len // bs + args.conversations * (last // bs - args.system_len // bs + 1)


# ---- 2. long contexts under memory pressure ---------------------------------------------------
def long_run(engine: LLMEngine, args, vocab: int) -> dict[str, float]:
    rng = random.Random(args.seed + 1)
    params = SamplingParams(max_tokens=args.long_output, temperature=0.0, ignore_eos=True)
    starts, ttft, answers = {}, {}, {}
    clock = Clock(engine)
    for i in range(args.long_requests):
        engine.add_request(f"l{i}", ids(rng, args.long_prompt, vocab), params, detokenize=False)
        starts[f"l{i}"], answers[f"l{i}"] = time.perf_counter(), []
    while engine.has_unfinished_requests():
        for out in clock.step():
            if not answers[out.request_id] and out.new_token_ids:
                ttft[out.request_id] = time.perf_counter() - starts[out.request_id]
            answers[out.request_id] += out.new_token_ids
    took, s = clock.figures(), engine.snapshot()
    tokens = sum(len(a) for a in answers.values())
    return {"output tok/s": tokens / took["wall s"], **took,
            "TTFT p50 ms": np.percentile(list(ttft.values()), 50) * 1e3,
            "preemptions": s.num_preemptions, "swaps": s.num_swap_preemptions,
            "blocks moved": s.num_host_kv_stored_blocks + s.num_host_kv_loaded_blocks, "_answers": answers}


# ---- the copier's cost ------------------------------------------------------------------------
def measure_copies(engine: LLMEngine, num_blocks: int = 64, reps: int = 20) -> None:
    from baton.engine.common.scheduler_output import HostKVOps
    from baton.engine.worker.host_kv_copier import HostKVCopier

    copier = HostKVCopier(engine.runner.kv_cache, num_blocks)
    pairs = [(2 * i, i) for i in range(num_blocks)]  # every other device block: no runs to merge
    inline, handoff = [], []
    for r in range(reps):
        t = time.perf_counter()
        copier._copy(HostKVOps(r, offload=pairs))
        inline.append(time.perf_counter() - t)
        t = time.perf_counter()
        copier.submit(HostKVOps(r, offload=pairs))
        handoff.append(time.perf_counter() - t)
        while not copier.poll(0.1):
            pass
    copier.close()
    print(f"{num_blocks} blocks of {block_bytes(engine) / (1 << 20):.2f} MiB device -> host: inline "
          f"{np.median(inline) * 1e3:.2f} ms, handed to the thread {np.median(handoff) * 1e3:.3f} ms "
          f"(medians of {reps})")


def main() -> None:
    args = parse_args()
    if args.quick:
        args.conversations, args.turns = 16, 4
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model = args.model or write_random_checkpoint(str(REPO / "models" / "random-llama-h512"), "llama-h512",
                                                  max_position_embeddings=4096)
    probe = make_engine(args, model, 128, 0, 1, max_model_len=1024)
    vocab, nbytes = probe.vocab_size, block_bytes(probe)
    if args.measure_copies:
        return measure_copies(probe)
    del probe

    if args.only != "long":
        run_chat(args, model, vocab, nbytes)
    if args.only != "chat":
        run_long(args, model, vocab, nbytes)


def run_chat(args, model: str, vocab: int, nbytes: int) -> None:
    working_set = chat_kv_blocks(args)
    device_blocks = max(int(working_set / args.working_set_ratio),
                        -(-(args.system_len + args.turns * (args.user_len + args.answer_len)) // args.block_size) * 2)
    print(f"multi-turn chat: {args.conversations} conversations x {args.turns} turns, {args.in_flight} in flight; "
          f"KV working set {working_set} blocks of {nbytes / 1024:.0f} KiB, device pool {device_blocks} "
          f"({working_set / device_blocks:.1f}x), host tier {working_set} blocks")
    rows, answers = {}, {}
    for name, host in (("tier off", 0), ("tier on", working_set)):
        engine = make_engine(args, model, device_blocks, host, nbytes, max_model_len=device_blocks * args.block_size)
        r = chat_run(engine, args, vocab)
        answers[name] = r.pop("_answers")
        rows[name] = r
    print_table(rows, "tier off")
    print(f"outputs identical with the tier on and off: {answers['tier on'] == answers['tier off']}")


def run_long(args, model: str, vocab: int, nbytes: int) -> None:
    # Room for half the long requests' prompts, not for their decodes: they preempt one another.
    full = -(-(args.long_prompt + args.long_output) // args.block_size)
    long_blocks = max(full, max(2, args.long_requests // 2) * -(-args.long_prompt // args.block_size) + 1)
    print(f"\nlong contexts: {args.long_requests} x ({args.long_prompt} prompt + {args.long_output} output) tokens "
          f"in {long_blocks} device blocks (one needs {full}), a step of {args.long_budget} tokens; host tier "
          f"{args.long_requests * full} blocks (recompute: none, as before the tier)")
    rows, answers = {}, {}
    for mode in ("recompute", "swap", "auto"):
        host = 0 if mode == "recompute" else args.long_requests * full
        engine = make_engine(args, model, long_blocks, host, nbytes, preemption_mode=mode,
                             max_num_batched_tokens=args.long_budget,
                             max_model_len=args.long_prompt + args.long_output + args.block_size)
        r = long_run(engine, args, vocab)
        answers[mode] = r.pop("_answers")
        rows[mode] = r
    print_table(rows, "recompute")
    print(f"outputs identical, swap vs recompute: {answers['swap'] == answers['recompute']}, "
          f"auto vs recompute: {answers['auto'] == answers['recompute']}")


if __name__ == "__main__":
    main()
