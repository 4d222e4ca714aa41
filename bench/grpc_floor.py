"""The floor under the router's and the fronts' CPU per streamed message: bare grpc.aio, no
Baton. A source streams small GenerateResponses (one token each) on many calls, a relay passes
them through as the router does (bytes in, bytes out), a client reads them; each is a process
of its own, and each reports its CPU time per message. Paced (a message per stream every
--gap-ms, as an engine's steps release them) and back to back (gRPC batches what is queued).
`--transport asyncio` runs the same over bare asyncio TCP (a connection per stream, frames of a
length and the bytes): the floor of any Python process that wakes for each message, gRPC or not.

    .venv/bin/python bench/grpc_floor.py
    .venv/bin/python bench/grpc_floor.py --streams 256 --gap-ms 20
    .venv/bin/python bench/grpc_floor.py --streams 1 --gap-ms 10 --messages 1000 --transport grpc,asyncio
"""
from __future__ import annotations

import argparse
import asyncio
import resource
import struct
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


def _message() -> bytes:
    from baton.v1 import generate_pb2 as pb
    return pb.GenerateResponse(request_id="r" * 32, token_ids=[1234]).SerializeToString()


async def _paced(messages: int, gap_s: float):
    """Each message's turn, --gap-ms apart (none: back to back)."""
    for _ in range(messages):
        if gap_s:
            await asyncio.sleep(gap_s)
        yield


async def source(port: int, messages: int, gap_s: float) -> None:
    msg, sent = _message(), 0

    async def stream(request, context):
        nonlocal sent
        async for _ in _paced(messages, gap_s):
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
    await _report(name, count)


async def _report(name: str, count) -> None:
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)  # "go": the warm-up is over
    cpu, start = _cpu_s(), count()
    await loop.run_in_executor(None, sys.stdin.readline)  # "done"
    print(f"{name} {(_cpu_s() - cpu) * 1e6 / max(1, count() - start):.1f}", flush=True)


# ---- the same over bare asyncio TCP: a connection per stream, each frame a length and its bytes,
# an empty frame ending the stream --------------------------------------------------------------
_END = struct.pack("<I", 0)


def _frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


class _Frames(asyncio.Protocol):
    """A connection's frames, each handed to `on_frame` as it completes (b"" for the end)."""

    def __init__(self, on_frame):
        self.on_frame, self.buffer = on_frame, bytearray()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while len(self.buffer) >= 4:
            size = struct.unpack_from("<I", self.buffer)[0]
            if len(self.buffer) < 4 + size:
                return
            payload = bytes(self.buffer[4:4 + size])
            del self.buffer[:4 + size]
            self.on_frame(payload)


async def tcp_source(port: int, messages: int, gap_s: float) -> None:
    frame, sent = _frame(_message()), 0

    async def stream(reader, writer):
        nonlocal sent
        async for _ in _paced(messages, gap_s):
            sent += 1
            writer.write(frame)
            await writer.drain()
        writer.write(_END)
        await writer.drain()
        writer.close()
    await _run_tcp(stream, port, "source", lambda: sent)


async def tcp_relay(port: int, upstream: int) -> None:
    loop = asyncio.get_running_loop()
    relayed = 0

    async def stream(reader, writer):
        ended = loop.create_future()

        def on_frame(payload: bytes) -> None:
            nonlocal relayed
            writer.write(_frame(payload))
            if not payload:
                ended.set_result(None)
            else:
                relayed += 1
        transport, _ = await loop.create_connection(lambda: _Frames(on_frame), "127.0.0.1", upstream)
        await ended
        transport.close()
        await writer.drain()
        writer.close()
    await _run_tcp(stream, port, "relay", lambda: relayed)


async def _run_tcp(stream, port: int, name: str, count) -> None:
    async with await asyncio.start_server(stream, "127.0.0.1", port):
        await _report(name, count)


async def _tcp_stream(port: int) -> int:
    loop = asyncio.get_running_loop()
    ended, got = loop.create_future(), 0

    def on_frame(payload: bytes) -> None:
        nonlocal got
        if payload:
            got += 1
        else:
            ended.set_result(got)
    transport, _ = await loop.create_connection(lambda: _Frames(on_frame), "127.0.0.1", port)
    try:
        return await ended
    finally:
        transport.close()


async def client(port: int, streams: int, messages: int, marks, transport: str = "grpc") -> tuple[float, float]:
    if transport == "asyncio":
        async def one() -> int:
            return await _tcp_stream(port)
    else:
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


def measure(args, gap_ms: float, transport: str) -> dict[str, float]:
    from baton.services.rpc.serving import free_port
    ports = [free_port("127.0.0.1") for _ in range(2)]
    me = [sys.executable, __file__, "--transport", transport]
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
        client_us, rate = asyncio.run(client(ports[1], args.streams, args.messages, marks, transport))
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
    p.add_argument("--transport", default="grpc", help="comma list of: grpc, asyncio (bare TCP frames)")
    p.add_argument("--role", choices=["source", "relay"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    transports = args.transport.split(",")
    if set(transports) - {"grpc", "asyncio"}:
        p.error(f"--transport: choose from grpc, asyncio, got {args.transport}")
    tcp = transports == ["asyncio"]
    if args.role == "source":
        return asyncio.run((tcp_source if tcp else source)(args.port, args.messages, args.gap_ms / 1e3))
    if args.role == "relay":
        return asyncio.run((tcp_relay if tcp else relay)(args.port, args.upstream))
    print(f"{args.streams} streams x {args.messages} one-token messages; CPU us per message, each its own process")
    print(f"{'':<32} {'source':>8} {'relay':>8} {'client':>8} {'msgs/s':>9}")
    for transport in transports:
        for name, gap in ((f"paced ({args.gap_ms:g} ms)", args.gap_ms), ("back to back", 0.0)):
            row = measure(args, gap, transport)
            print(f"{transport + ', ' + name:<32} {row['source']:>8.1f} {row['relay']:>8.1f} {row['client']:>8.1f} "
                  f"{row['messages/s']:>9.0f}")


if __name__ == "__main__":
    main()
