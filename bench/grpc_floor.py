"""The floor under the router's and the fronts' CPU per streamed message: bare grpc.aio, no
Baton. A source streams small GenerateResponses (one token each) on many calls, a relay passes
them through as the router does (bytes in, bytes out), a client reads them; each is a process
of its own, and each reports its CPU time per message. Paced (a message per stream every
--gap-ms, as an engine's steps release them) and back to back (gRPC batches what is queued).

    .venv/bin/python bench/grpc_floor.py
    .venv/bin/python bench/grpc_floor.py --streams 256 --gap-ms 20
"""
from __future__ import annotations

import argparse
import asyncio
import resource
import subprocess
import sys
import time

import grpc

METHOD = "/bench.Floor/Stream"
_CALL = b"call"


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _serve(stream) -> grpc.aio.Server:
    handler = grpc.method_handlers_generic_handler("bench.Floor", {"Stream": grpc.unary_stream_rpc_method_handler(
        stream, request_deserializer=None, response_serializer=None)})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    return server


async def source(port: int, messages: int, gap_s: float) -> None:
    from baton.v1 import generate_pb2 as pb
    msg = pb.GenerateResponse(request_id="r" * 32, token_ids=[1234]).SerializeToString()
    sent = 0

    async def stream(request, context):
        nonlocal sent
        for _ in range(messages):
            if gap_s:
                await asyncio.sleep(gap_s)
            sent += 1
            yield msg
    await _run(_serve(stream), port, "source", lambda: sent)


async def relay(port: int, upstream: int) -> None:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{upstream}")
    call = channel.unary_stream(METHOD, request_serializer=None, response_deserializer=None)
    relayed = 0

    async def stream(request, context):
        nonlocal relayed
        async for raw in call(_CALL):
            relayed += 1
            yield raw
    await _run(_serve(stream), port, "relay", lambda: relayed)


async def _run(server: grpc.aio.Server, port: int, name: str, count) -> None:
    """Serve until stdin closes, then print CPU per message (counted from the first call on)."""
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)  # "go": the warm-up is over
    cpu, start = _cpu_s(), count()
    await loop.run_in_executor(None, sys.stdin.readline)  # "done"
    print(f"{name} {(_cpu_s() - cpu) * 1e6 / max(1, count() - start):.1f}", flush=True)


async def client(port: int, streams: int, messages: int, marks) -> tuple[float, float]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_stream(METHOD, request_serializer=None, response_deserializer=None)

    async def one() -> int:
        return sum([1 async for _ in call(_CALL)])
    await one()  # warm-up: connections made
    marks("go")
    cpu, t0 = _cpu_s(), time.perf_counter()
    got = sum(await asyncio.gather(*(one() for _ in range(streams))))
    wall = time.perf_counter() - t0
    marks("done")
    return (_cpu_s() - cpu) * 1e6 / got, got / wall


def measure(args, gap_ms: float) -> dict[str, float]:
    from baton.services.rpc.serving import free_port
    ports = [free_port("127.0.0.1") for _ in range(2)]
    me = [sys.executable, __file__]
    procs = [subprocess.Popen([*me, "--role", "source", "--port", str(ports[0]), "--messages", str(args.messages),
                               "--gap-ms", str(gap_ms)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True),
             subprocess.Popen([*me, "--role", "relay", "--port", str(ports[1]), "--upstream", str(ports[0])],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)]
    time.sleep(1.0)

    def marks(line: str) -> None:
        for p in procs:
            p.stdin.write(line + "\n")
            p.stdin.flush()
    try:
        client_us, rate = asyncio.run(client(ports[1], args.streams, args.messages, marks))
        row = {name: float(value) for p in procs for name, value in [p.stdout.readline().split()]}
    finally:
        for p in procs:
            p.kill()
    return {**row, "client": client_us, "messages/s": rate}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=48)
    p.add_argument("--messages", type=int, default=300, help="per stream")
    p.add_argument("--gap-ms", type=float, default=30.0, help="paced: between a stream's messages")
    p.add_argument("--role", choices=["source", "relay"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "source":
        return asyncio.run(source(args.port, args.messages, args.gap_ms / 1e3))
    if args.role == "relay":
        return asyncio.run(relay(args.port, args.upstream))
    print(f"{args.streams} streams x {args.messages} one-token messages; CPU us per message, each its own process")
    print(f"{'':<22} {'source':>8} {'relay':>8} {'client':>8} {'msgs/s':>9}")
    for name, gap in ((f"paced ({args.gap_ms:g} ms)", args.gap_ms), ("back to back", 0.0)):
        row = measure(args, gap)
        print(f"{name:<22} {row['source']:>8.1f} {row['relay']:>8.1f} {row['client']:>8.1f} {row['messages/s']:>9.0f}")


if __name__ == "__main__":
    main()
