"""Serving benchmark: one workload through the offline engine, a colocated gRPC server, the
router in front of a prefill and a decode service, and the router in front of a colocated
server, side by side in one run.

Requests arrive as a Poisson process at --request-rate (inf: all at once), optionally capped
at --max-concurrency in flight, with random token-id prompts of --input-len tokens (spread
by --range-ratio) and --output-len new tokens each (greedy, EOS ignored); with
--long-every N every Nth prompt is --long-input-len tokens instead (long prompts arriving
while others decode: the interference disaggregation removes). Metrics follow
`vllm bench serve`: TTFT (arrival to first token), TPOT ((latency - TTFT) / (tokens - 1)),
ITL (gaps between streamed chunks), end-to-end latency, request and token throughput. The
offline side drives the engine's step loop in this process with the same arrivals; the
others run `baton serve` processes and stream over gRPC on 127.0.0.1. In `disaggregated`
the prefill and decode engines are each pinned to a core of their own (the colocated
server gets both).

--telemetry runs each service mode again with observability on: `metrics` (/metrics
served), `traced` (metrics, and every request traced over OTLP/gRPC to a sink in this process
that takes the spans and drops them unread, as a collector on another machine would cost
these cores nothing); an HTTP front serves /metrics, so in an -http mode the service that has
one collects metrics even with telemetry off (as vLLM does). --structured FILE runs the offline
and gRPC modes again with every request under that JSON schema (`MODE+json`: a request ends
where its JSON does, or at its output length). --rounds N repeats all runs N times, in ABBA
order, and keeps each one's fastest, so that the machine's drift does not land on one side.

Each service mode also reports the CPU time its processes spent per streamed token, a figure
busy cores cannot distort (/proc's user + system time over the workload, warm-up excluded):
the router's, the fronts' (every `baton serve` process of the engines, their engine cores
excluded), the engine cores' (the serve processes' children: cores and tensor-parallel ranks)
and the client's (this process, the load generator, which shares the machine with them). With
--openai-pid, the `openai` mode reports that server's process as its front and its
descendants as its cores.

    .venv/bin/python bench/serve.py --max-concurrency 32
    .venv/bin/python bench/serve.py --modes colocated,disaggregated,router --long-every 4
    .venv/bin/python bench/serve.py --modes disaggregated --telemetry off,traced --rounds 2
    .venv/bin/python bench/serve.py --modes offline,colocated --structured bench/schemas/records.json
    .venv/bin/python bench/serve.py --modes colocated,colocated-http --max-concurrency 32
    .venv/bin/python bench/serve.py --modes colocated,openai --openai-url http://127.0.0.1:8000   # e.g. vLLM
    .venv/bin/python bench/serve.py --modes offline,colocated,router --engine-cores 1   # a GPU host's split
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from collections import deque
from functools import partial
from pathlib import Path

from load import (  # bench/load.py (this script's folder is on sys.path)
    Request,
    Trace,
    make_workload,
    run_grpc,
    run_http,
)
from report import measured, metrics, print_table  # bench/report.py
from stack import (  # bench/stack.py
    SpanSink,
    cpu_mark,
    pin,
    server_cpu_s,
    split_cpus,
    stack_cpu_s,
    start_stack,
    stop_stack,
    telemetry_flags,
)
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
MODES = ("offline", "colocated", "disaggregated", "router", "colocated-http", "disaggregated-http", "router-http",
         "openai")
TELEMETRY = ("off", "metrics", "traced")



def parse_args() -> argparse.Namespace:
    from baton.engine.common.config import EngineConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct",
                   help="checkpoint dir (relative: from the repo root)")
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--input-len", type=int, default=256, help="mean prompt length in tokens")
    p.add_argument("--output-len", type=int, default=64, help="mean new tokens per request")
    p.add_argument("--range-ratio", type=float, default=0.5,
                   help="lengths are uniform in [len * (1 - r), len * (1 + r)] (vLLM's random dataset)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at t=0)")
    p.add_argument("--max-concurrency", type=int, default=32, help="most requests in flight (0: no cap)")
    engine = EngineConfig.defaults()  # the engine's own, shown in the help
    p.add_argument("--max-num-seqs", type=int, default=engine["max_num_seqs"], help="(default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=engine["max_num_batched_tokens"],
                   help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--long-every", type=int, default=0, help="every Nth prompt is long (0: none)")
    p.add_argument("--long-input-len", type=int, default=2048, help="tokens of a long prompt")
    p.add_argument("--colocated-cores", type=int, default=0,
                   help="pin the colocated server to this many cores (0: all); with 1, the router and the "
                        "client get the other core, so the router's own cost is not taken from the engine")
    p.add_argument("--engine-cores", type=int, default=0,
                   help="give the engine this many cores of its own, as a GPU is on a GPU host: the offline "
                        "engine (this process) and every served engine core run there with as many torch threads, "
                        "and fronts, router and client share the other cores (0: all share all)")
    p.add_argument("--modes", default="offline,colocated,disaggregated,router",
                   help="comma list of: offline, colocated, disaggregated (router + 1 prefill + 1 decode), "
                        "router (router + the colocated server); each service mode with -http is loaded through "
                        "its OpenAI-compatible HTTP front instead of gRPC; openai: the server at --openai-url")
    p.add_argument("--openai-url", help="an OpenAI-compatible server to load in the `openai` mode (e.g. a vLLM "
                                        "server's http://127.0.0.1:8000), with the same workload and metrics")
    p.add_argument("--openai-model", help="the model name it serves (default: the first of its /v1/models)")
    p.add_argument("--openai-pid", type=int, help="that server's process on this machine, for its CPU per token "
                                                  "(its own as the front's, its descendants' as the cores')")
    p.add_argument("--telemetry", default="off", help="comma list of: off, metrics, traced (each service mode "
                                                      "runs once per entry)")
    p.add_argument("--stream-intervals", default="1", help="comma list of the engines' --stream-interval (new "
                                                           "tokens per streamed message): each service mode runs "
                                                           "once per entry, named MODE@N for N > 1")
    p.add_argument("--decode-calls", default="frames",
                   help="comma list of how the router carries its engines' requests: frames (one stream per "
                        "instance over a bare TCP connection, a message per step for all of its requests), "
                        "multiplexed (the same stream over gRPC) or per-call (a call each, a message per token); "
                        "each router mode runs once per entry, named MODE/grpc-mux and MODE/per-call for the last two")
    p.add_argument("--client-calls", default="per-call",
                   help="comma list of how the load's client sends its requests: per-call (a Generate call each), "
                        "multiplexed (all on one GenerateStreams stream per connection, a message per step for all "
                        "of them) or frames (that stream over the server's frames port, the client library's "
                        "default when it multiplexes); each gRPC mode runs once per entry, named MODE/client-mux "
                        "and MODE/client-frames for the last two")
    p.add_argument("--router-workers", type=int, default=1, help="the router's --router-workers (processes on its "
                                                                  "port; the kernel spreads connections over them)")
    p.add_argument("--client-connections", type=int, default=1,
                   help="gRPC connections the load is spread over, request by request (router workers each take "
                        "whole connections)")
    p.add_argument("--rounds", type=int, default=1, help="alternate every run this many times; keep the fastest")
    p.add_argument("--structured", type=Path, help="a JSON schema file: the offline and gRPC modes run again with "
                                                   "every request under it (`MODE+json`), side by side")
    args = p.parse_args()
    args.modes, args.telemetry = args.modes.split(","), args.telemetry.split(",")
    args.stream_intervals = [int(n) for n in args.stream_intervals.split(",")]
    args.decode_calls = args.decode_calls.split(",")
    args.client_calls = args.client_calls.split(",")
    for name, given, known in (("decode-calls", args.decode_calls, ("frames", "multiplexed", "per-call")),
                               ("client-calls", args.client_calls, ("frames", "multiplexed", "per-call"))):
        if set(given) - set(known):
            p.error(f"--{name}: choose from {', '.join(known)}, got {','.join(given)}")
    for name, given, known in (("modes", args.modes, MODES), ("telemetry", args.telemetry, TELEMETRY)):
        if set(given) - set(known):
            p.error(f"--{name}: unknown {', '.join(sorted(set(given) - set(known)))}; choose from {', '.join(known)}")
    if "openai" in args.modes and not args.openai_url:
        p.error("--modes openai: give the server with --openai-url")
    args.model = Path(args.model) if Path(args.model).is_absolute() else REPO / args.model
    split_cpus(args)
    return args



# ---- the offline engine, driven with the same arrivals ----------------------------------------
def run_offline(args: argparse.Namespace, workload: list[Request], schema: str | None = None,
                ) -> tuple[list[Trace], float]:
    from baton import SamplingParams
    from baton.engine.common.config import EngineConfig
    from baton.engine.common.structured_output import StructuredOutput
    from baton.engine.offline.llm_engine import LLMEngine

    if args.engine_cpus:
        import torch

        torch.set_num_threads(len(args.engine_cpus))
    engine = LLMEngine(EngineConfig.from_kwargs(str(args.model), max_num_seqs=args.max_num_seqs,
                                                max_num_batched_tokens=args.max_num_batched_tokens))
    constraint = StructuredOutput("json_schema", schema) if schema else None
    # The warm-up compiles the grammar too: its one-off compile is not the steady state measured.
    engine.add_request("warmup", workload[0].prompt[:8], SamplingParams(max_tokens=2, structured_output=constraint))
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
            engine.add_request(str(i), r.prompt, SamplingParams(
                max_tokens=r.output_len, temperature=0, ignore_eos=True, structured_output=constraint))
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



def print_compile_times(model: Path, schema: str) -> None:
    """The schema's grammar compile time, first use (the tokenizer table included) and cached."""
    from baton.engine.common.structured_output import StructuredOutput
    from baton.engine.common.tokenizer import eos_token_ids
    from baton.engine.worker.grammar import Grammars

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    grammars, so = Grammars(str(model), vocab, list(eos_token_ids(str(model)))), StructuredOutput("json_schema", schema)
    times = []
    for _ in range(2):
        t = time.perf_counter()
        grammars.compile(so).result()
        times.append(time.perf_counter() - t)
    fresh = StructuredOutput("json_schema", json.dumps(json.loads(schema)))  # the same schema as another key
    t = time.perf_counter()
    grammars.compile(fresh).result()
    print(f"grammar compile: first use {times[0] * 1e3:.0f} ms (with the tokenizer table), "
          f"the same schema spelled differently {(time.perf_counter() - t) * 1e3:.0f} ms (xgrammar's own cache), "
          f"cached here {times[1] * 1e6:.0f} µs")
    grammars.close()


def main() -> None:
    args = parse_args()
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    workload = make_workload(args, vocab)
    print(f"model {args.model.name}; {args.num_prompts} requests, input ~{args.input_len}, output ~{args.output_len} "
          f"(range ratio {args.range_ratio}), "
          f"{f'every {args.long_every}th prompt {args.long_input_len} tokens, ' if args.long_every else ''}"
          f"rate {args.request_rate}/s, max concurrency {args.max_concurrency}; {os.cpu_count()} cores")
    sink = SpanSink() if "traced" in args.telemetry else None
    # (a mode with no router runs once, with the default decode calls: frames, which add no suffix to its name)
    runs = [(mode, "off", 1, "frames", "per-call") if mode == "offline" else
            (mode, variant, interval, calls, client)
            for mode in args.modes for variant in (args.telemetry if mode != "offline" else ["off"])
            for interval in (args.stream_intervals if mode not in ("offline", "openai") else [1])
            for calls in (args.decode_calls if mode.startswith(("router", "disaggregated")) else ["frames"])
            for client in (args.client_calls if mode in ("colocated", "router", "disaggregated") else ["per-call"])]
    schema = args.structured.read_text() if args.structured else None
    if schema:
        print_compile_times(args.model, schema)
    if schema:
        runs += [(mode, "json", 1, "frames", "per-call") for mode in args.modes
                 if mode in ("offline", "colocated", "router", "disaggregated")]
    rows = {}
    for round_ in range(args.rounds):
        for mode, variant, interval, calls, client in runs if round_ % 2 == 0 else reversed(runs):  # ABBA
            name = ((mode if variant == "off" else f"{mode}+{variant}") + (f"@{interval}" if interval > 1 else "")
                    + {"multiplexed": "/client-mux", "frames": "/client-frames"}.get(client, "")
                    + {"per-call": "/per-call", "multiplexed": "/grpc-mux"}.get(calls, ""))
            constraint = schema if variant == "json" else None
            if args.engine_cpus:  # this process: the offline engine on the engine's cores, a client on the host's
                pin(os.getpid(), args.engine_cpus if mode == "offline" else args.host_cpus)
            if mode == "offline":
                cpu = time.process_time()
                traces, wall = run_offline(args, workload, constraint)
                row = metrics(traces, wall, workload)
                row.update({"router CPU us/tok": float("nan"), "fronts CPU us/tok": float("nan"),
                            "decode front CPU us/tok": float("nan"), "client CPU us/tok": float("nan"),
                            "cores CPU us/tok": (time.process_time() - cpu) * 1e6 / (sum(t.tokens for t in traces)
                                                                                       or 1)})
            elif mode == "openai":
                # (without its pid, its processes are not ours to read)
                start, cpu = {}, partial(server_cpu_s, args.openai_pid) if args.openai_pid else dict
                traces, wall = asyncio.run(run_http(args, workload, args.openai_url, name, args.openai_model,
                                                    after_warmup=partial(cpu_mark, start, cpu)))
                row = measured(traces, wall, workload, start, cpu_mark({}, cpu))
            else:
                flags = (*telemetry_flags("off" if constraint else variant, sink), "--stream-interval", str(interval))
                procs, address = start_stack(args, mode, flags, {"per-call": ("--no-multiplex",),
                                                                 "multiplexed": ("--no-frames",)}.get(calls, ()))
                start = {}
                try:
                    cpu = partial(stack_cpu_s, procs, mode)
                    mark = partial(cpu_mark, start, cpu)
                    if mode.endswith("-http"):
                        traces, wall = asyncio.run(run_http(args, workload, address, name, after_warmup=mark))
                    else:
                        traces, wall = asyncio.run(run_grpc(args, workload, address, name, constraint, mark, client))
                    row = measured(traces, wall, workload, start, cpu_mark({}, cpu))
                finally:
                    stop_stack(procs)
            row.setdefault("messages/tok", float("nan"))
            tqdm.write(f"round {round_ + 1} {name}: {row['output tok/s']:.1f} output tok/s")
            if name not in rows or row["output tok/s"] > rows[name]["output tok/s"]:
                rows[name] = row
    if sink is not None:
        print(f"\nthe span sink got {sink.exports} exports, {sink.bytes / 1e6:.1f} MB")
        sink.server.stop(0)
    base = "offline" if "offline" in rows and len(rows) == 2 else ("colocated" if "colocated" in rows else None)
    print_table(rows, base)
    if "offline" in rows:  # every served run of the same workload (any client, decode calls or interval)
        print()
        for name in rows:
            if name.partition("/")[0] in ("colocated", "router", "disaggregated"):
                ratio = rows[name]["output tok/s"] / rows["offline"]["output tok/s"]
                print(f"{name}: output token throughput = {ratio:.3f}x the offline engine's")
    if "router" in rows and "colocated" in rows:
        added = rows["router"]["ITL p50 ms"] - rows["colocated"]["ITL p50 ms"]
        print(f"router: p50 ITL {added:+.2f} ms per token ({added / rows['colocated']['ITL p50 ms']:+.1%})")
    if "disaggregated" in rows and "colocated" in rows:
        ratio = rows["disaggregated"]["TPOT p99 ms"] / rows["colocated"]["TPOT p99 ms"]
        print(f"disaggregation: p99 TPOT = {ratio:.3f}x colocated")
    for name in rows:
        if name.endswith("-http") and name.removesuffix("-http") in rows:
            ratio = rows[name]["output tok/s"] / rows[name.removesuffix("-http")]["output tok/s"]
            print(f"HTTP front: {name.removesuffix('-http')} output token throughput over HTTP = {ratio:.3f}x gRPC")
    # Multiplexed against a call per request: the client's (MODE/client-mux) and the router's to
    # its decodes (MODE/per-call is the call per request); the router's streams over frames
    # against the same over gRPC (MODE/grpc-mux), and the client's (MODE/client-frames against
    # MODE/client-mux).
    for suffix, label, against, suffixed_multiplexes in (
            ("/client-mux", "a multiplexing client", "a call per request", True),
            ("/per-call", "multiplexed decodes", "a call per request", False),
            ("/grpc-mux", "streams over frames", "over gRPC", False),
            ("/client-frames", "a client's stream over frames", "over gRPC", True)):
        for name in rows:
            base = (name.replace("/client-frames", "/client-mux") if suffix == "/client-frames"
                    else name.removesuffix(suffix))
            if name == base or base not in rows:
                continue
            mux, per_call = (rows[name], rows[base]) if suffixed_multiplexes else (rows[base], rows[name])
            cpu = ", ".join(f"{who} {mux[f'{who} CPU us/tok'] / per_call[f'{who} CPU us/tok']:.2f}x"
                            for who in ("router", "fronts", "decode front") if per_call[f"{who} CPU us/tok"] > 0)
            print(f"{label}: {base} output token throughput = {mux['output tok/s'] / per_call['output tok/s']:.3f}x "
                  f"{against}; CPU per token {cpu}")
    for name in rows:
        if name.endswith(("/per-call", "/client-mux", "/grpc-mux")) or "/client-" in name:
            continue
        mode, _, interval = name.partition("@")
        if interval and mode in rows:
            ratio = rows[name]["output tok/s"] / rows[mode]["output tok/s"]
            cpu = ", ".join(f"{who} {rows[name][f'{who} CPU us/tok'] / rows[mode][f'{who} CPU us/tok']:.2f}x"
                            for who in ("router", "fronts", "decode front") if rows[mode][f"{who} CPU us/tok"] > 0)
            print(f"--stream-interval {interval}: {mode} output token throughput = {ratio:.3f}x token by token; "
                  f"CPU per token {cpu}")
    for name in rows:
        mode, _, variant = name.partition("@")[0].partition("+")
        if variant and mode in rows:
            ratio = rows[name]["output tok/s"] / rows[mode]["output tok/s"]
            print(f"{variant}: {mode} output token throughput = {ratio:.3f}x without ({1 - ratio:+.1%} cost)")


if __name__ == "__main__":
    main()
