"""The processes of a benchmark's stack: `baton serve` services started on free ports (each
pinned to cores where asked) and waited for until they serve, their CPU time, an OTLP span sink
that parses nothing, and their shutdown (bench/serve.py's modes, bench/router_load.py's router)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from baton.testing.processes import cpu_seconds, descendants

TOKEN = "bench-token"  # the stack's internal token


def start_service(args: argparse.Namespace, *flags: str, cpus: set[int] | None = None) -> tuple[subprocess.Popen, str]:
    """`baton serve` in a process (on `cpus`; with --engine-cores, its engine core's torch
    threads as many as the engine's cores); its address (the URL of its OpenAI front, when
    started with one)."""
    threads = {"OMP_NUM_THREADS": str(len(args.engine_cpus))} if args.engine_cpus else {}
    proc = subprocess.Popen([sys.executable, "-m", "baton.services.cli", "serve", "--model", str(args.model),
                             "--port", "0", "--max-num-seqs", str(args.max_num_seqs),
                             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                             "--max-waiting-requests", str(args.num_prompts + 1), "--internal-token", TOKEN, *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, **threads},
                            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    url, address = None, None  # (a router prints its OpenAI front's line before it serves)
    for line in proc.stdout:
        if line.startswith("serving on "):
            address = line.split()[2].rstrip(";")
            wait_serving(address)  # a router serves once its backends do
        if line.startswith("OpenAI API on "):
            url = line.split()[3].removesuffix("/v1")
        if address is not None and (url is not None or "--http-port" not in flags):
            return proc, url or address
    proc.kill()
    sys.exit(f"`baton serve {' '.join(flags)}` exited before it served; run it by hand to see why")


def wait_serving(address: str, timeout_s: float = 60.0) -> None:
    from baton.services.rpc.health import is_serving

    deadline = time.monotonic() + timeout_s
    while not is_serving(address):
        if time.monotonic() > deadline:
            sys.exit(f"{address} is not serving after {timeout_s:g}s")
        time.sleep(0.1)


def start_stack(args: argparse.Namespace, mode: str, flags: tuple[str, ...] = (), router_flags: tuple[str, ...] = ()
                ) -> tuple[list[subprocess.Popen], str]:
    """The processes of one mode, router last; the address clients call (the URL of the front
    service's OpenAI API in an -http mode). `flags` go to every one, `router_flags` to the router."""
    cores, host = args.cpus, args.host_cpus or None  # (host: with --engine-cores, all but the engine's cores)
    mode, http = mode.removesuffix("-http"), ("--http-port", "0") if mode.endswith("-http") else ()
    if mode in ("colocated", "router"):
        procs = [start_service(args, *flags, *(http if mode == "colocated" else ()),
                               cpus=host or set(cores[:args.colocated_cores or len(cores)]))]
        if mode == "router":
            procs.append(start_service(args, "--role", "router", "--decode", procs[0][1], *flags, *http,
                                       "--router-workers", str(args.router_workers), *router_flags, cpus=host))
    else:  # disaggregated: one core each (the same core twice on a one-core machine)
        procs = [start_service(args, "--role", role, *flags, cpus=host or {cores[i % len(cores)]})
                 for i, role in enumerate(("prefill", "decode"))]
        procs.append(start_service(args, "--role", "router", "--prefill", procs[0][1], "--decode", procs[1][1],
                                   *flags, *http, "--router-workers", str(args.router_workers), *router_flags,
                                   cpus=host))
    if args.engine_cpus:  # the engine cores (serve processes' children), and no other, on the engine's cores
        for proc, _ in procs[:-1] if mode != "colocated" else procs:
            for core in descendants(proc.pid):
                pin(core, args.engine_cpus)
    return [p for p, _ in procs], procs[-1][1]


def split_cpus(args: argparse.Namespace) -> None:
    """This process's cores (args.cpus); with --engine-cores N, the first N the engine's
    (args.engine_cpus), as a device is on a GPU host, and the rest the host's (args.host_cpus:
    fronts, router, client); both empty without."""
    cores = args.cpus = sorted(os.sched_getaffinity(0))  # (read once: this process pins itself later)
    if args.engine_cores and not 0 < args.engine_cores < len(cores):
        sys.exit(f"--engine-cores {args.engine_cores}: this machine has {len(cores)} cores, and the host needs one")
    if args.engine_cores and args.colocated_cores:
        sys.exit("--engine-cores and --colocated-cores both place the colocated server: give one of them")
    args.engine_cpus = set(cores[:args.engine_cores])
    args.host_cpus = set(cores[args.engine_cores:]) if args.engine_cores else set()


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of a process onto `cpus` (the affinity a process is given is its threads' own)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except OSError:  # (gone meanwhile)
            pass


class SpanSink:
    """An OTLP/gRPC trace endpoint that counts what it is sent and parses none of it."""

    def __init__(self):
        from concurrent import futures

        import grpc

        self.bytes = self.exports = 0

        def export(request: bytes, context) -> bytes:
            self.bytes += len(request)
            self.exports += 1
            return b""  # an empty ExportTraceServiceResponse

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "opentelemetry.proto.collector.trace.v1.TraceService",
            {"Export": grpc.unary_unary_rpc_method_handler(export)})])
        self.endpoint = f"http://127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()


def telemetry_flags(variant: str, sink: SpanSink | None) -> tuple[str, ...]:
    if variant == "off":
        return ()
    flags = ("--metrics-port", "0")
    return flags + ("--otlp-traces-endpoint", sink.endpoint) if variant == "traced" else flags


def stack_cpu_s(procs: list[subprocess.Popen], mode: str) -> dict[str, float]:
    """CPU seconds so far of the stack's router (the last process, where there is one, and its
    workers), its engines' serve processes (fronts; of them the one that streams the tokens, a
    decode's or a colocated server's) and their descendants (engine cores, ranks)."""
    routed = mode.removesuffix("-http") in ("router", "disaggregated")
    engines = procs[:-1] if routed else procs
    router = [procs[-1].pid, *descendants(procs[-1].pid)]  # with --router-workers, its workers
    return {"router": sum(map(cpu_seconds, router)) if routed else float("nan"),
            "fronts": sum(cpu_seconds(p.pid) for p in engines), "decode front": cpu_seconds(engines[-1].pid),
            "cores": sum(cpu_seconds(child) for p in engines for child in descendants(p.pid))}


def server_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds so far of an outside server: its process (its front, as vLLM's API server is)
    and its descendants (its engine cores)."""
    front = cpu_seconds(pid)
    return {"router": float("nan"), "fronts": front, "decode front": front,
            "cores": sum(cpu_seconds(child) for child in descendants(pid))}


def cpu_mark(into: dict, processes) -> dict[str, float]:
    """CPU seconds so far of the servers' processes (`processes()`'s: stack_cpu_s, server_cpu_s)
    and of this one, the client's; also put into `into`."""
    into.update(processes(), client=time.process_time())
    return into


def stop_stack(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):  # the router first
        proc.send_signal(2)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
