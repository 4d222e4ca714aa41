"""Draft model KV in a P/D deployment: recompute it on the decode, or ship it from the prefill?
(The figures behind shipping it: engine/worker/spec_decode/draft_model.py.)

Recompute (what a decode would do without the draft's KV, and what a prefill does to ship it):
the real engine (float32, CPU, --threads threads) runs a request of N random prompt tokens with
a draft; the proposer's forwards with a span of more than one row (its first catch-up, over the
prompt and the first token) are timed. Ship: the draft's KV for N tokens
(whole blocks, DraftModelProposer.block_bytes) READ by NIXL between two agents in this process,
as bench/kv_transfer.py's raw_read does it (one descriptor, UCX, CPU memory), beside the READ of
the target's own KV for N tokens and of both together (one handle would carry both: "marginal" is
what the draft's bytes add to the target's READ). Shipping moves the draft's forward over the
prompt to the prefill ("prefill's extra work": the recompute figure, paid there instead).
Drafts: "random-2L" (bench/spec_decode.py's random two-layer h128 draft) and "self" (the
target as its own draft: a draft as big as the target).

    .venv/bin/python bench/draft_handoff.py
    .venv/bin/python bench/draft_handoff.py --lengths 512,2048,4096 --repeats 5 --json /tmp/draft_handoff.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from baton.engine.common.config import EngineConfig
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.offline.llm_engine import LLMEngine
from baton.engine.worker.spec_decode.draft_model import DraftModelProposer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_decode import random_draft  # bench/spec_decode.py

from kv_transfer import raw_read  # bench/kv_transfer.py

REPO = Path(__file__).resolve().parent.parent


def recompute(model: str, draft: str, lengths: list[int], repeats: int, k: int) -> tuple[dict, int, int]:
    """Seconds of the draft's first catch-up, each run, per length; the draft's and the target's KV
    bytes per block."""
    longest = max(lengths)
    blocks = 2 * (-(-(longest + 2 * k + 8) // 16)) + 8
    engine = LLMEngine(EngineConfig.from_kwargs(
        model, dtype="float32", device="cpu", max_model_len=longest + 2 * k + 8, num_kv_blocks=blocks,
        max_num_batched_tokens=max(2048, longest + 2 * k + 8), enable_prefix_caching=False,
        speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": k}))
    runner = engine.runner
    proposer, block_size = runner.drafting.proposer, engine.config.block_size
    assert isinstance(proposer, DraftModelProposer), type(proposer)
    forward, caught_up = proposer._forward, []

    def timed(ids, spans, num_decodes):
        t0 = time.perf_counter()
        out = forward(ids, spans, num_decodes)
        if any(b - a > 1 for a, b, _ in spans):
            caught_up.append((sum(b - a for a, b, _ in spans), time.perf_counter() - t0))
        return out
    proposer._forward = timed
    rng = random.Random(0)
    vocab = engine.vocab_size
    params = SamplingParams(max_tokens=2 + k, temperature=0.0, ignore_eos=True)

    def one(n: int, tag: str) -> float:
        caught_up.clear()
        engine.add_request(tag, [rng.randrange(3, vocab) for _ in range(n)], params, detokenize=False)
        while engine.has_unfinished_requests():
            engine.step()
        rows, seconds = caught_up[0]  # (the prompt and the token its prefill sampled)
        assert rows == n + 1 and len(caught_up) == 1, caught_up
        return seconds

    for n in lengths:  # (the first run at a length pays for its buffers: several times the next)
        one(n, f"warmup-{n}")
    times = {n: [one(n, f"{n}-{i}") for i in range(repeats)] for n in lengths}
    target_block = (runner.kv_cache[0].numel() * runner.kv_cache.element_size())
    return times, DraftModelProposer.block_bytes(proposer.model, block_size), target_block


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(REPO / "models/smollm2-135m-instruct"))
    p.add_argument("--lengths", default="512,2048", help="prompt lengths in tokens")
    p.add_argument("--drafts", default="random-2L,self", help="comma list of: random-2L, self")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point; the median is reported")
    p.add_argument("--read-repeats", type=int, default=20, help="timed READs per size (cheap; median)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    torch.set_num_threads(args.threads)
    print(f"float32, CPU, {torch.get_num_threads()} threads, median of {args.repeats} runs per recompute and "
          f"{args.read_repeats} per READ", flush=True)
    reads: dict[int, float] = {}

    def read(nbytes: int) -> float:  # (one pair of agents per size)
        if nbytes not in reads:
            reads[nbytes] = raw_read(nbytes, args.read_repeats)
        return reads[nbytes]
    scratch = tempfile.TemporaryDirectory()  # (removed at exit: the random draft is not left behind)
    paths = {"random-2L": lambda: random_draft(args.model, scratch.name), "self": lambda: args.model}
    report = []
    for name in args.drafts.split(","):
        times, draft_block, target_block = recompute(args.model, paths[name](), lengths, args.repeats,
                                                     args.num_speculative_tokens)
        for n, runs in times.items():
            t = statistics.median(runs)
            blocks = -(-n // 16)  # (the engine's block size: 16)
            draft_bytes, target_bytes = blocks * draft_block, blocks * target_block
            ship, target, both = read(draft_bytes), read(target_bytes), read(draft_bytes + target_bytes)
            report.append({"draft": name, "tokens": n, "recompute_ms": round(t * 1e3, 2),
                           "prefill_extra_ms": round(t * 1e3, 2), "ship_read_ms": round(ship * 1e3, 3),
                           "ship_bytes": draft_bytes, "target_read_ms": round(target * 1e3, 3),
                           "target_bytes": target_bytes, "both_read_ms": round(both * 1e3, 3),
                           "marginal_ship_ms": round((both - target) * 1e3, 3), "recompute_over_ship":
                           round(t / ship, 1), "recompute_over_marginal": round(t / max(both - target, 1e-9), 1),
                           "recompute_runs_ms": [round(x * 1e3, 2) for x in runs]})
            print(f"  {name} {n} tokens: recompute runs (ms) {report[-1]['recompute_runs_ms']}", flush=True)
    cols = [("draft", "draft"), ("tokens", "N"), ("recompute_ms", "recompute ms (decode)"),
            ("ship_read_ms", "ship READ ms"), ("ship_bytes", "ship bytes"), ("target_read_ms", "target READ ms"),
            ("both_read_ms", "target+draft READ ms"), ("marginal_ship_ms", "marginal ship ms"),
            ("recompute_over_ship", "recompute/ship"), ("prefill_extra_ms", "prefill's extra work ms")]
    rows = [[h for _, h in cols]] + [[str(r[k]) for k, _ in cols] for r in report]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    print("\n" + "\n".join(lines))
    print("\nrecompute: the draft's first catch-up on the decode (N + 1 rows); ship READ: one NIXL READ of the "
          "draft's KV (whole blocks); marginal: what those bytes add to the target's READ; prefill's extra work: "
          "the same draft forward, paid by the prefill when shipping")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
