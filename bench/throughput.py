"""Offline throughput: Baton's LLM.generate vs transformers' batched generate on one fixed workload.

The workload is random token-id prompts of mixed lengths with per-request output lengths,
greedy and ignoring EOS, so both engines do exactly the same amount of useful work.

    .venv/bin/python bench/throughput.py --quick
    .venv/bin/python bench/throughput.py --model models/tiny-llama
    python bench/throughput.py --device cuda --dtype bfloat16 --random-model llama3-8b --random-model llama3-1b
"""
from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from baton import LLM, SamplingParams
from baton.engine.common.config import EngineConfig
from baton.engine.core.step_loop import StepTimes

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODELS = ["models/tiny-llama", "models/smollm2-135m-instruct"]
FIRST_TOKEN_ID = 3  # skip the usual special ids (unk/bos/eos) at the bottom of the vocab


@dataclass
class Request:
    prompt: list[int]
    output_len: int


@dataclass
class Result:
    engine: str
    wall_s: float
    output_tokens: int  # useful tokens: each request's own output length
    tokens: list[list[int]]  # generated ids per request, for the parity check
    scheduler_share: float | None = None
    steps: int | None = None
    preemptions: int | None = None
    generated_tokens: int | None = None  # everything generated, padding waste included (HF)
    runs: int = 1  # timed runs; the fastest is reported


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", help="checkpoint dir (repeatable or comma list); "
                   f"default: {', '.join(DEFAULT_MODELS)}; relative paths resolve from the repo root")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=64)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    engine = EngineConfig.defaults()  # the engine's own, shown in the help
    p.add_argument("--max-num-seqs", type=int, default=engine["max_num_seqs"], help="(default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=engine["max_num_batched_tokens"],
                   help="(default: %(default)s)")
    p.add_argument("--hf-batch-size", type=int, default=64, help="transformers batch size (64 = all at once)")
    p.add_argument("--min-seconds", type=float, default=20.0,
                   help="repeat rounds of timed runs (one per engine, alternating) until this much time is spent "
                        "(at most --max-repeats rounds) and report each engine's fastest: short runs on a shared "
                        "machine are noisy")
    p.add_argument("--max-repeats", type=int, default=5)
    p.add_argument("--random-model", action="append", default=[], choices=["llama3-8b", "llama3-1b"],
                   help="also a random-weight checkpoint of this shape (bf16; written once under models/)")
    p.add_argument("--skip-hf", action="store_true", help="run Baton only")
    p.add_argument("--profile", action="store_true",
                   help="after the timed runs, profile one more Baton run (torch.profiler) and print where step time "
                        "went: the top operators by their own device (or CPU) time")
    p.add_argument("--quick", action="store_true", help="smoke run: 16 requests, prompts 32-128, outputs 16-32")
    args = p.parse_args()
    if args.quick:
        args.num_requests, args.min_prompt, args.max_prompt, args.min_output, args.max_output = 16, 32, 128, 16, 32
    names = [m for arg in (args.model or ([] if args.random_model else DEFAULT_MODELS)) for m in arg.split(",") if m]
    args.model = [Path(m) if Path(m).is_absolute() else REPO / m for m in names]
    for shape in args.random_model:
        from random_checkpoint import write_random_checkpoint
        args.model.append(Path(write_random_checkpoint(str(REPO / "models" / f"random-{shape}"), shape)))
    return args


def make_workload(vocab_size: int, args: argparse.Namespace) -> list[Request]:
    rng = random.Random(args.seed)
    # Lengths first, so every model gets the same shape of workload whatever its vocab size.
    lengths = [(rng.randint(args.min_prompt, args.max_prompt), rng.randint(args.min_output, args.max_output))
               for _ in range(args.num_requests)]
    return [Request([rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(p)], o) for p, o in lengths]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def baton_runner(model_dir: Path, workload: list[Request], args: argparse.Namespace):
    """Loads the engine and warms it up; returns the timed run."""
    llm = LLM(str(model_dir), dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    # Warm-up pays for first-call allocations; 8 + 4 tokens fill no 16-token KV block, so it
    # leaves nothing in the prefix cache for the timed run to hit.
    llm.generate([r.prompt[:8] for r in workload[:2]], greedy(4))

    def timed_run() -> Result:
        llm.reset_prefix_cache()  # a repeat must not hit the previous run's prompts
        llm.engine.core.loop.times = StepTimes()
        preempted_before = llm.engine.scheduler.num_preemptions
        t0 = time.perf_counter()
        outs = llm.generate([r.prompt for r in workload], [greedy(r.output_len) for r in workload], use_tqdm=True)
        wall = time.perf_counter() - t0
        times = llm.engine.times
        return Result("baton", wall, sum(len(o.token_ids) for o in outs), [o.token_ids for o in outs],
                      scheduler_share=times.scheduler_s / times.step_s, steps=times.steps,
                      preemptions=llm.engine.scheduler.num_preemptions - preempted_before)
    timed_run.llm = llm
    return timed_run


def profile_baton(llm, workload: list[Request], device: str) -> None:
    """One more run under torch.profiler: wall time against the time kernels kept the device
    busy (the rest is host work: Python, scheduling, launches, syncs), and the top operators."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.startswith("cuda")
    llm.reset_prefix_cache()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
        t0 = time.perf_counter()
        llm.generate([r.prompt for r in workload], [greedy(r.output_len) for r in workload])
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    if on_gpu:
        busy = sum(e.self_device_time_total for e in events) / 1e6
        print(f"\nprofile: wall {wall:.2f} s, device busy {busy:.2f} s ({100 * busy / wall:.0f}%); "
              f"the rest is host time the device waited on")
    print(events.table(sort_by="self_cuda_time_total" if on_gpu else "self_cpu_time_total", row_limit=25))


def fastest_interleaved(timed_runs, args: argparse.Namespace) -> list[Result]:
    """Rounds of one timed run per engine, alternating, until --min-seconds is spent (at most
    --max-repeats rounds); each engine's fastest run. Alternating puts both engines through
    the same stretches of a shared machine's noise, so the ratio holds better than either time."""
    rounds = [[run() for run in timed_runs]]
    while len(rounds) < args.max_repeats and sum(r.wall_s for rnd in rounds for r in rnd) < args.min_seconds:
        rounds.append([run() for run in timed_runs])
    best = [min(runs, key=lambda r: r.wall_s) for runs in zip(*rounds)]
    for result in best:
        result.runs = len(rounds)
    return best


@torch.inference_mode()
def hf_generate(model, batch: list[Request], device: str) -> list[list[int]]:
    """One left-padded batch (pad id 0, masked out); every row runs to the batch's longest output."""
    width = max(len(r.prompt) for r in batch)
    ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in batch], device=device)
    mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch], device=device)
    n = max(r.output_len for r in batch)
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                         eos_token_id=None, pad_token_id=0)
    return out[:, width:].tolist()


def hf_runner(model_dir: Path, workload: list[Request], args: argparse.Namespace):
    """Loads the model and warms it up; returns the timed run."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    hf_generate(model, [Request(r.prompt[:8], 4) for r in workload[:2]], args.device)  # warm-up
    batches = [workload[i:i + args.hf_batch_size] for i in range(0, len(workload), args.hf_batch_size)]

    def timed_run() -> Result:
        tokens = []
        t0 = time.perf_counter()
        for batch in tqdm(batches, desc="hf batches", unit="batch"):
            tokens += hf_generate(model, batch, args.device)
        wall = time.perf_counter() - t0
        return Result("transformers", wall, sum(r.output_len for r in workload),
                      [t[:r.output_len] for t, r in zip(tokens, workload)],
                      generated_tokens=sum(len(t) for t in tokens))
    return timed_run


def print_table(model_name: str, workload: list[Request], results: list[Result]) -> None:
    hf = next((r for r in results if r.engine == "transformers"), None)
    header = ["model", "engine", "requests", "prompt tokens", "output tokens", "wall s", "output tok/s",
              "vs transformers", "scheduler share", "steps", "runs"]
    rows = [header]
    for r in results:
        tps = r.output_tokens / r.wall_s
        rows.append([model_name, r.engine, str(len(workload)), str(sum(len(w.prompt) for w in workload)),
                     str(r.output_tokens), f"{r.wall_s:.2f}", f"{tps:.1f}",
                     f"{tps / (hf.output_tokens / hf.wall_s):.2f}x" if hf else "-",
                     f"{100 * r.scheduler_share:.1f}%" if r.scheduler_share is not None else "-",
                     str(r.steps) if r.steps is not None else "-", str(r.runs)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    print("\n" + "\n".join(lines))


def print_notes(results: list[Result]) -> None:
    baton = next(r for r in results if r.engine == "baton")
    print(f"baton: preemptions {baton.preemptions}; scheduler share = (schedule + update_from_output) / step wall time")
    hf = next((r for r in results if r.engine == "transformers"), None)
    if hf:
        print(f"transformers: output tokens count only each request's own length; it generated "
              f"{hf.generated_tokens} tokens in all, since every row of a batch runs to the batch's longest "
              f"output (and prefills its padding)")
        same = baton.tokens[0] == hf.tokens[0]
        print(f"greedy parity on request 0: {'yes' if same else 'no'} (informative only: padded batches may differ)")


def main() -> None:
    args = parse_args()
    print(f"torch {torch.__version__}, device {args.device}, dtype {args.dtype}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"workload: {args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt}, "
          f"outputs {args.min_output}-{args.max_output}, seed {args.seed}, greedy, ignore EOS")
    for model_dir in args.model:
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        workload = make_workload(vocab_size, args)
        print(f"\n== {model_dir.name}")
        runners = [baton_runner(model_dir, workload, args)]
        if not args.skip_hf:
            runners.append(hf_runner(model_dir, workload, args))
        results = fastest_interleaved(runners, args)
        print_table(model_dir.name, workload, results)
        print_notes(results)
        if args.profile:
            profile_baton(runners[0].llm, workload, args.device)


if __name__ == "__main__":
    main()
