"""Tensor parallelism on this machine's CPUs (gloo), each figure beside tensor_parallel_size 1
in the same run:

- overhead: the 4-layer hidden-512 Llama decoding, TP 2 vs TP 1: step time, and per step the
  time rank 0 spends handing the step to the other rank (the shared-memory ring) and inside the
  collectives (two all-reduces per layer, the embedding's and the logits' all-gather; waiting
  for the other rank included);
- wide: a hidden-2048 Llama, TP 2 (one thread per rank) vs TP 1 (two threads): output tokens/s
  at 1 and 8 in flight, and where TP 2's step goes;
- handoff: a 2,048-token prompt moved over NIXL from a prefill of TP 2 to a decode of TP 1 vs
  TP 1 to TP 1: READs, descriptors, bytes, and the load's time.

    .venv/bin/python bench/tensor_parallel.py
    .venv/bin/python bench/tensor_parallel.py --only overhead handoff
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pd_handoff import close, pd_pair, timed_handoffs
from random_checkpoint import write_random_checkpoint

from baton.engine.common.config import EngineConfig
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.offline.llm_engine import LLMEngine
from baton.engine.worker.parallel.tensor_parallel import TPGroup


class CollectiveClock:
    """Time rank 0 spends in TPGroup's collectives (this process holds rank 0)."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0
        for name in ("all_reduce", "all_gather"):
            setattr(TPGroup, name, self._timed(getattr(TPGroup, name)))

    def _timed(self, fn):
        def timed(group, x):
            t0 = time.perf_counter()
            try:
                return fn(group, x)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        return timed


CLOCK = CollectiveClock()


def engine(model: str, tp: int, threads: int, **kwargs) -> LLMEngine:
    torch.set_num_threads(threads)  # (a TP engine sets its own: one per rank here)
    return LLMEngine(EngineConfig(model=model, dtype="float32", device="cpu", tensor_parallel_size=tp,
                                  max_model_len=4096, **kwargs))


def decode_run(eng: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()  # the prompts first: what follows is decode only
    workers = eng.core.workers
    start = (eng.times.steps, eng.times.step_s, CLOCK.seconds, CLOCK.calls, workers.broadcast_s if workers else 0.0)
    t0, tokens = time.perf_counter(), 0
    while eng.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in eng.step())
    wall = time.perf_counter() - t0
    steps = eng.times.steps - start[0]
    return {"tokens_per_s": tokens / wall, "step_ms": 1e3 * (eng.times.step_s - start[1]) / steps,
            "collective_us": 1e6 * (CLOCK.seconds - start[2]) / steps, "collectives": (CLOCK.calls - start[3]) / steps,
            "broadcast_us": 1e6 * ((workers.broadcast_s if workers else 0.0) - start[4]) / steps}


def prompts_of(n: int, length: int, vocab: int = 1000) -> list[list[int]]:
    g = torch.Generator().manual_seed(n * 7 + length)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def overhead(root: str) -> None:
    model = write_random_checkpoint(os.path.join(root, "llama-h512"), "llama-h512")
    print("\n## overhead: 4-layer hidden-512 Llama, 8 in flight, 64-token prompts, 64 output tokens (decode steps)")
    print("| TP | step ms | broadcast us/step | collectives us/step (calls) | tokens/s |\n|---|---|---|---|---|")
    for tp in (1, 2):
        eng = engine(model, tp, threads=2 if tp == 1 else 1)
        r = decode_run(eng, prompts_of(8, 64), 64)
        eng.core.close()
        print(f"| {tp} | {r['step_ms']:.2f} | {r['broadcast_us']:.0f} | {r['collective_us']:.0f} "
              f"({r['collectives']:.0f}) | {r['tokens_per_s']:.0f} |")


def wide(root: str) -> None:
    model = write_random_checkpoint(os.path.join(root, "llama-h2048"), "llama-h2048")
    print("\n## wide: 4-layer hidden-2048 Llama (32k vocabulary), 128-token prompts, 32 output tokens")
    print("| TP (threads per rank) | in flight | tokens/s | step ms | collectives ms/step | broadcast us/step |")
    print("|---|---|---|---|---|---|")
    for inflight in (1, 8):
        for tp, threads in ((1, 2), (2, 1)):
            eng = engine(model, tp, threads)
            r = decode_run(eng, prompts_of(inflight, 128, 32000), 32)
            eng.core.close()
            print(f"| {tp} ({threads}) | {inflight} | {r['tokens_per_s']:.1f} | {r['step_ms']:.1f} | "
                  f"{r['collective_us'] / 1e3:.2f} | {r['broadcast_us']:.0f} |")


def handoff(root: str) -> None:
    model = write_random_checkpoint(os.path.join(root, "llama-h512"), "llama-h512")
    print("\n## handoff: a 2,048-token prompt, prefill -> decode over NIXL (hidden-512 Llama, 4 layers, 4 KV heads)")
    print("| prefill TP -> decode TP | READs (descriptors) | MiB read by decode rank 0 | load ms, first | "
          "load ms, next |\n|---|---|---|---|---|")
    prompt = prompts_of(1, 2048)[0]
    for n, (ptp, dtp) in enumerate(((1, 1), (2, 1))):
        prefill, decode = pd_pair(model, f"tp-{n}", {"tensor_parallel_size": ptp}, {"tensor_parallel_size": dtp},
                                  threads={"prefill": 2 if ptp == 1 else 1, "decode": 2 if dtp == 1 else 1})
        reader, times = decode.core.connector, timed_handoffs(prefill, decode, prompt, 2)
        print(f"| {ptp} -> {dtp} | {reader.num_descriptors // 2} | {reader.num_bytes_pulled / 2**21:.1f} | "
              f"{times[0]:.1f} | {times[1]:.1f} |")
        close(prefill, decode)


PARTS = {"overhead": overhead, "wide": wide, "handoff": handoff}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=["overhead", "wide", "handoff"],
                   default=["overhead", "wide", "handoff"])
    p.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "baton-bench-models"))
    args = p.parse_args()
    print(f"# tensor parallelism, {os.cpu_count()} CPUs, torch {torch.__version__}")
    for part in args.only:
        PARTS[part](args.models)


if __name__ == "__main__":
    main()
