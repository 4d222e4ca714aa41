"""The router alone at a GPU's token rate: its CPU per streamed token with the engines taken out
of the picture. A token source process stands in for the prefill and decode tiers: it speaks
their RPCs (health, Prefill, Generate and GenerateStreams) and gives every request in flight a
token each --step-ms, as a GPU engine's step would, cheaply (5-30 µs of CPU per token to a
multiplexing router, about 100 to a call per request). The real
router (`baton serve --role router`) sits between it and a client (the client library: plain
calls, or multiplexed over gRPC or over frames; or an OpenAI client streaming completions from
the router's HTTP front), so what the run measures is the router's own work per token at
rates two CPU cores running engines could never produce (48 streams at 10 ms steps is 4,800
tokens/s; 256 is 25,600).

The source listens for frames too (services/rpc/frames.py), as an engine does, and says where in
its ModelInfo. Reported per variant (client calls x router-to-decode calls): tokens/s delivered, the router's
CPU time per token (from /proc, warm-up excluded), the router's share of one core, and the
source's and the client's CPU per token beside it (they share the machine's cores); and first,
the floor a machine puts under a front's CPU per token where each token is a write of its own
(an HTTP stream's, one connection per request): what one loopback write costs, back to back and
a step apart.

    .venv/bin/python bench/router_load.py
    .venv/bin/python bench/router_load.py --streams 48,256 --step-ms 10 --tokens 256
    .venv/bin/python bench/router_load.py --client-calls frames,multiplexed --decode-calls frames
    .venv/bin/python bench/router_load.py --client-calls frames,http --decode-calls frames
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from stack import TOKEN, stop_stack, wait_serving  # bench/stack.py (this script's folder is on sys.path)

from baton.services.rpc.frames import FramesServer
from baton.services.rpc.names import SERVICE_NAME, STREAMS_VERSION
from baton.testing.processes import cpu_seconds, descendants
from baton.v1 import generate_pb2 as pb
from baton.v1 import generate_pb2_grpc, internal_pb2, internal_pb2_grpc

TOKEN_ID = 1234
TOKEN_TEXT = " tok"  # each token's text, for callers that asked for text (an HTTP client's events carry it)


# ---- the token source: a prefill and a decode tier that compute nothing -------------------------
class Decoding:
    """A request the source streams: its response bytes (one token, the same each step) and how
    many tokens are left; `last` carries the finish reason."""
    __slots__ = ("stream", "left", "each", "last", "answered", "text")

    def __init__(self, stream: int, msg: pb.GenerateRequest):
        self.stream = stream
        self.answered = False  # its first response went (as an event: a decode's always does)
        self.left = max(1, msg.sampling.max_tokens - 1)  # (the prefill gave the first)
        self.text = "" if msg.output == pb.OUTPUT_TOKEN_IDS else TOKEN_TEXT
        self.each = pb.GenerateResponse(request_id=msg.request_id, token_ids=[TOKEN_ID],
                                        text=self.text).SerializeToString()
        self.last = pb.GenerateResponse(request_id=msg.request_id, token_ids=[TOKEN_ID], text=self.text,
                                        finish_reason=pb.FINISH_REASON_LENGTH,
                                        usage=pb.Usage(completion_tokens=self.left + 1)).SerializeToString()


class Connection:
    """One caller's GenerateStreams: its requests and the events of its next message (the
    responses between a request's first and last as StreamTokens, where the caller reads them)."""

    def __init__(self, compact: bool):
        self.decoding: dict[int, Decoding] = {}
        self.batch = pb.StreamEvents()
        self.compact = compact
        self.ready = asyncio.Event()

    def step(self) -> None:
        done, streams, texts = [], [], []
        for d in self.decoding.values():
            d.left -= 1
            if d.left <= 0:
                self.batch.events.add(stream=d.stream, response=d.last)
                self.batch.events.add(stream=d.stream, status=pb.StreamStatus())
                done.append(d.stream)
            elif self.compact and d.answered:
                streams.append(d.stream)
                texts.append(d.text)
            else:
                self.batch.events.add(stream=d.stream, response=d.each)
                d.answered = True
        for stream in done:
            del self.decoding[stream]
        if streams:
            self.batch.tokens.streams.extend(streams)
            self.batch.tokens.counts.extend([1] * len(streams))
            self.batch.tokens.token_ids.extend([TOKEN_ID] * len(streams))
            if any(texts):
                self.batch.tokens.texts.extend(texts)
        if self.batch.events or streams:
            self.ready.set()


class TokenSource(generate_pb2_grpc.TextGenerationServicer, internal_pb2_grpc.PrefillServicer):
    def __init__(self, step_s: float):
        self.step_s = step_s
        self.frames_port = 0  # its frames listener's
        self.connections: set[Connection] = set()
        self.stepped = asyncio.Event()  # set and replaced each step (for calls of their own)

    async def steps(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            for conn in self.connections:
                conn.step()
            self.stepped.set()
            self.stepped = asyncio.Event()

    async def Prefill(self, msg: pb.GenerateRequest, context) -> internal_pb2.PrefillResponse:
        return self.prefilled(msg)

    async def Streams(self, commands, context):
        """Prefill's stream of requests: every request a message opened answered in one message."""
        await context.send_initial_metadata((STREAMS_VERSION,))
        async for message in commands:
            batch = pb.StreamEvents()
            for command in (message, *message.more):
                if command.HasField("open"):
                    batch.events.add(stream=command.stream,
                                     response=self.prefilled(command.open.request).SerializeToString())
                    batch.events.add(stream=command.stream, status=pb.StreamStatus())
            yield batch

    @staticmethod
    def prefilled(msg: pb.GenerateRequest) -> internal_pb2.PrefillResponse:
        return internal_pb2.PrefillResponse(
            first=pb.GenerateResponse(request_id=msg.request_id, token_ids=[TOKEN_ID],
                                      text="" if msg.output == pb.OUTPUT_TOKEN_IDS else TOKEN_TEXT),
            handle=pb.KVHandle(request_id=msg.request_id, engine_id="source", num_tokens=1))

    async def Release(self, handle, context) -> internal_pb2.ReleaseResponse:
        return internal_pb2.ReleaseResponse()

    async def ListAdapters(self, msg, context) -> pb.ListAdaptersResponse:
        return pb.ListAdaptersResponse()

    async def GetModelInfo(self, msg, context) -> pb.ModelInfo:
        return pb.ModelInfo(frames_port=self.frames_port)

    async def Generate(self, msg: pb.GenerateRequest, context):
        """TextGeneration's: a call per request."""
        d = Decoding(0, msg)
        each, last = pb.GenerateResponse.FromString(d.each), pb.GenerateResponse.FromString(d.last)
        while d.left > 1:
            await self.stepped.wait()
            d.left -= 1
            yield each
        await self.stepped.wait()
        yield last


async def carry(batches, carrier) -> None:
    """A stream servicer's messages written to a frames connection as they come."""
    async for batch in batches:
        carrier.write(batch)


class SourcePrefills:
    """The source's prefill stream (Prefill/Streams) over frames."""

    def __init__(self, source: TokenSource):
        self.source = source

    async def serve(self, commands, context, carrier) -> None:
        await carry(self.source.Streams(commands, context), carrier)


class SourceStreams(generate_pb2_grpc.GenerateStreamsServicer):
    """The source's GenerateStreams: each step's tokens for all of a caller's requests in one message."""

    def __init__(self, source: TokenSource):
        self.source = source

    async def Generate(self, commands, context):
        conn = Connection(STREAMS_VERSION in tuple(context.invocation_metadata() or ()))
        await context.send_initial_metadata((STREAMS_VERSION,))
        self.source.connections.add(conn)
        reader = asyncio.ensure_future(self._read(commands, conn))
        try:
            while True:
                await conn.ready.wait()
                conn.ready.clear()
                batch, conn.batch = conn.batch, pb.StreamEvents()
                yield batch
        finally:
            reader.cancel()
            self.source.connections.discard(conn)

    async def serve(self, commands, context, carrier) -> None:
        """The same over frames (a FramesServer's connection is the carrier)."""
        await carry(self.Generate(commands, context), carrier)

    @staticmethod
    async def _read(commands, conn: Connection) -> None:
        async for message in commands:
            for command in (message, *message.more):
                if command.HasField("open"):
                    conn.decoding[command.stream] = Decoding(command.stream, command.open.request)
                else:
                    conn.decoding.pop(command.stream, None)


async def serve_source(step_s: float) -> None:
    source = TokenSource(step_s)
    server = grpc.aio.server()
    generate_pb2_grpc.add_TextGenerationServicer_to_server(source, server)
    streams = SourceStreams(source)
    generate_pb2_grpc.add_GenerateStreamsServicer_to_server(streams, server)
    internal_pb2_grpc.add_PrefillServicer_to_server(source, server)
    checks = health.aio.HealthServicer()
    await checks.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    frames = FramesServer({internal_pb2.FRAMES_SERVICE_GENERATE: streams,
                           internal_pb2.FRAMES_SERVICE_PREFILL: SourcePrefills(source)}, 16 << 20)
    source.frames_port = await frames.start("127.0.0.1", 0)
    stepping = asyncio.ensure_future(source.steps())
    print(f"serving on 127.0.0.1:{port}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the bench closes stdin
    stepping.cancel()
    frames.close()
    await server.stop(None)


# ---- the bench ---------------------------------------------------------------------------------
def start(*argv: str) -> tuple[subprocess.Popen, str]:
    """The process, and its address (its OpenAI API's URL where started with --http-port: a router
    prints that line before it serves)."""
    proc = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    url = None
    for line in proc.stdout:
        if line.startswith("OpenAI API on "):
            url = line.split()[3].removesuffix("/v1")
        if line.startswith("serving on "):
            address = line.split()[2].rstrip(";")
            wait_serving(address)  # a router serves once its backends do
            return proc, url or address
    sys.exit(f"{' '.join(argv)} exited before it served")


def stop(proc: subprocess.Popen) -> None:
    proc.stdin.close()  # (the source's cue to stop)
    stop_stack([proc])


async def load(address: str, client_calls: str, streams: int, requests: int, tokens: int, on_warm) -> tuple[int, float]:
    """`requests` requests of `tokens` tokens, `streams` of them in flight at a time: the tokens
    received and the seconds it took, after a warm-up round."""
    async with client_of(address, client_calls) as generate:
        received = 0

        async def one() -> None:
            nonlocal received
            count = await generate(tokens)  # (not `received += await ...`: that reads received before waiting)
            received += count

        await asyncio.gather(*(one() for _ in range(min(streams, 8))))  # warm-up
        on_warm()
        received, t0, left = 0, time.perf_counter(), requests

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await one()

        await asyncio.gather(*(worker() for _ in range(streams)))
        return received, time.perf_counter() - t0


@contextlib.asynccontextmanager
async def client_of(address: str, client_calls: str):
    """generate(tokens) -> the tokens one streamed request received: through the client library
    (a call per request, or multiplexed over gRPC or frames), or as an OpenAI client streams a
    completion over HTTP (`http`: `address` is the router's OpenAI API; an event per chunk)."""
    if client_calls == "http":
        import aiohttp

        async with aiohttp.ClientSession(address, timeout=aiohttp.ClientTimeout(total=None),
                                         connector=aiohttp.TCPConnector(limit=0)) as session:
            async with session.get("/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]

            async def generate(tokens: int) -> int:
                body = {"model": model, "prompt": [1, 2, 3], "max_tokens": tokens, "stream": True,
                        "stream_options": {"include_usage": True}}
                async with session.post("/v1/completions", json=body) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
                    count = 0
                    async for line in resp.content:
                        if line.startswith(b'data: {') and b'"usage":{' in line:
                            count = json.loads(line[6:])["usage"]["completion_tokens"]
                    return count
            yield generate
        return
    from baton.services.client import AsyncClient

    async with AsyncClient(address, multiplex=client_calls != "per-call", frames=client_calls == "frames") as client:
        async def generate(tokens: int) -> int:
            count = 0
            async for chunk in client.generate([1, 2, 3], max_tokens=tokens, output="token_ids"):
                count += len(chunk.token_ids)
            return count
        yield generate


def run(args: argparse.Namespace, source: str, streams: int, client_calls: str, decode_calls: str) -> dict:
    router, address = start("-m", "baton.services.cli", "serve", "--role", "router", "--prefill", source,
                             "--decode", source, "--port", "0", "--internal-token", TOKEN,
                             *(("--http-port", "0") if client_calls == "http" else ()),
                             *{"per-call": ("--no-multiplex",), "multiplexed": ("--no-frames",)}.get(decode_calls, ()))
    pids = {"router": [router.pid, *descendants(router.pid)], "client": [os.getpid()]}
    before = {}

    def on_warm() -> None:
        before.update({who: sum(map(cpu_seconds, p)) for who, p in pids.items()})
        before["source"] = cpu_seconds(args.source_pid)

    try:
        received, wall = asyncio.run(load(address, client_calls, streams,
                                          args.requests_per_stream * streams, args.tokens, on_warm))
        used = {who: sum(map(cpu_seconds, p)) - before[who] for who, p in pids.items()}
        used["source"] = cpu_seconds(args.source_pid) - before["source"]
    finally:
        stop(router)
    return {"tok/s": received / wall, "router CPU us/tok": 1e6 * used["router"] / received,
            "router core share": used["router"] / wall, "source CPU us/tok": 1e6 * used["source"] / received,
            "client CPU us/tok": 1e6 * used["client"] / received}


def send_floor(gap_s: float, sends: int = 200) -> float:
    """This machine's floor under a streamed token: the CPU time (µs) one write of an event's
    size costs on a loopback TCP connection whose reader is another thread, `gap_s` after the
    last (a front writes each connection once a step; after an idle step a core's caches are
    cold, and on a VM its wake-up is costly)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        writer = socket.create_connection(server.getsockname())
        reader, _ = server.accept()
    writer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    drain = threading.Thread(target=lambda: [None for _ in iter(lambda: reader.recv(1 << 16), b"")], daemon=True)
    drain.start()
    spent, event = 0, b"x" * 230
    for _ in range(sends):
        time.sleep(gap_s)
        t = time.thread_time_ns()
        writer.send(event)
        spent += time.thread_time_ns() - t
    writer.close()
    drain.join()
    reader.close()
    return spent / sends / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="48,256", help="comma list: requests in flight")
    p.add_argument("--step-ms", type=float, default=10.0, help="the source's step: a token per request each")
    p.add_argument("--tokens", type=int, default=128, help="tokens per request")
    p.add_argument("--requests-per-stream", type=int, default=4)
    p.add_argument("--client-calls", default="per-call,multiplexed,frames",
                   help="comma list: a call per request, one GenerateStreams stream over gRPC, or over frames "
                        "(the client library), or http: streamed completions from the router's OpenAI API")
    p.add_argument("--decode-calls", default="per-call,multiplexed,frames", help="comma list: the router's, as "
                                                                                "--client-calls")
    p.add_argument("--source", type=float, default=None, help=argparse.SUPPRESS)  # run as the token source
    args = p.parse_args()
    if args.source is not None:
        asyncio.run(serve_source(args.source))
        return
    source, address = start(__file__, "--source", str(args.step_ms / 1000))
    args.source_pid = source.pid
    print(f"router <- token source (a token per request every {args.step_ms:g} ms), {args.tokens} tokens a "
          f"request, {os.cpu_count()} cores")
    print(f"this machine's floor: one loopback TCP write of an event costs {send_floor(0):.1f} µs of CPU back to "
          f"back, {send_floor(args.step_ms / 1000):.1f} µs a step apart (a front writes each of its connections "
          f"once a step)")
    try:
        rows = {}
        for streams in (int(s) for s in args.streams.split(",")):
            for client in args.client_calls.split(","):
                for decode in args.decode_calls.split(","):
                    name = f"{streams} streams, client {client}, decode {decode}"
                    rows[name] = run(args, address, streams, client, decode)
                    print(f"{name}: {rows[name]['tok/s']:.0f} tok/s, router "
                          f"{rows[name]['router CPU us/tok']:.1f} us/tok", flush=True)
        keys = list(next(iter(rows.values())))
        width = max(map(len, rows))
        print("\n" + " | ".join([" " * width, *keys]))
        for name, row in rows.items():
            print(" | ".join([name.ljust(width), *(f"{row[k]:.2f}".rjust(len(k)) for k in keys)]))
    finally:
        stop(source)


if __name__ == "__main__":
    main()
