"""Frames: a stream of requests (GenerateStreams, a prefill's Streams) over a bare TCP
connection, TLS where the server serves it, for the router's hops to its engines and a
multiplexing client's to the router (or to an engine). gRPC's cost
is per message, and in Python it is most of what a step costs a relay (one message read, one
written, each ~150-200 us of CPU in grpc.aio's machinery, against ~40-70 us for asyncio's
own transport): the requests and their semantics stay GenerateStreams' (generate_streams.py,
request_streams.py); only the carrier changes, and neither end wakes a task per message (the
caller's are handed over as read, FramesCall.read_each; the server's are written from a callback,
GenerateStreams.serve). Each frame is a 4-byte big-endian length and a
message: a FramesHello each way first (internal.proto), then the caller's StreamCommands and
the server's StreamEvents, as the call's messages would go. The caller closing the connection
ends the call, which ends the requests still running on it. A server (an engine, the router)
listens for frames beside its gRPC port and says where in its ModelInfo (`frames_port`). A
caller that has no hello back within `hello_timeout_s` (a port that drops what it is sent, a
proxy that holds the connection open) gives up as on a connection refused."""
from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator

import grpc
from grpc.aio import AioRpcError, Metadata

from baton.services.rpc.errors import STATUS_CODES
from baton.services.rpc.generate_streams import GenerateStreams
from baton.v1 import generate_pb2 as pb
from baton.v1 import internal_pb2

log = logging.getLogger("baton.rpc")


class FrameError(ValueError):
    """The peer sent what is not a frame (too long: not a Baton peer, or a broken one)."""


class FrameBuffer:
    """Bytes as they arrive, cut into whole frames."""
    __slots__ = ("_data", "_max")

    def __init__(self, max_frame_bytes: int):
        self._data = bytearray()
        self._max = max_frame_bytes

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._data
        buf += data
        frames, at, end = [], 0, len(buf)
        while end - at >= 4:
            size = int.from_bytes(buf[at:at + 4], "big")
            if size > self._max:
                raise FrameError(f"a frame of {size} bytes, more than the {self._max} allowed")
            if at + 4 + size > end:
                break
            frames.append(bytes(buf[at + 4:at + 4 + size]))
            at += 4 + size
        del buf[:at]
        return frames


def frame(message: bytes) -> bytes:
    return len(message).to_bytes(4, "big") + message


class _Writer(asyncio.Protocol):
    """A connection's frames out, paused while the peer reads too slowly (asyncio's flow control)."""

    def __init__(self, max_frame_bytes: int):
        self.transport: asyncio.Transport | None = None
        self.frames = FrameBuffer(max_frame_bytes)
        self._writable = asyncio.Event()
        self._writable.set()
        self.on_resume = None  # called when writing may go on (GenerateStreams.serve's)

    def connection_made(self, transport) -> None:
        self.transport = transport

    @property
    def paused(self) -> bool:
        return not self._writable.is_set()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()
        if self.on_resume is not None:
            self.on_resume()

    async def send(self, message: bytes) -> None:
        self.transport.write(frame(message))
        if not self._writable.is_set():
            await self._writable.wait()


# ---- the server's side -------------------------------------------------------------------------
class _CallContext:
    """What a stream's servicer uses of its call's context (GenerateStreams.Generate)."""

    def __init__(self, metadata: tuple, connection: _ServerConnection):
        self._metadata, self._connection = metadata, connection

    def invocation_metadata(self) -> tuple:
        return self._metadata

    async def send_initial_metadata(self, metadata) -> None:
        await self._connection.send(internal_pb2.FramesHello(
            metadata=[pb.StreamMetadatum(key=k, value=v) for k, v in metadata]).SerializeToString())


class _ServerConnection(_Writer):
    """One caller's connection: its hello picks the stream, then its commands go to the stream's
    servicer and the servicer's messages back, until either side goes."""

    def __init__(self, services: dict[int, GenerateStreams], max_frame_bytes: int, open: set[_ServerConnection]):
        super().__init__(max_frame_bytes)
        self._services = services
        self._open = open  # the listener's connections
        self._commands: asyncio.Queue | None = None  # once the hello came
        self._task: asyncio.Task | None = None

    def data_received(self, data: bytes) -> None:
        try:
            for message in self.frames.feed(data):
                if self._commands is None:
                    self._hello(internal_pb2.FramesHello.FromString(message))
                else:
                    self._commands.put_nowait(pb.StreamCommand.FromString(message))
        except Exception as e:  # noqa: BLE001 - not a frame, or not the message it should be: not a caller to serve
            log.warning("a frames caller sent what cannot be read (%s): closing its connection", e)
            self.transport.abort()

    def _hello(self, hello: internal_pb2.FramesHello) -> None:
        self._commands = asyncio.Queue()
        service = self._services.get(hello.service)
        if service is None:
            refused = internal_pb2.FramesHello(refused=pb.StreamStatus(
                code=grpc.StatusCode.UNIMPLEMENTED.value[0],
                details=f"this server has no {internal_pb2.FramesService.Name(hello.service)} stream"))
            self.transport.write(frame(refused.SerializeToString()))
            self.transport.close()
            return
        context = _CallContext(tuple((m.key, m.value) for m in hello.metadata), self)
        self._task = asyncio.ensure_future(self._serve(service, context))

    async def _next_commands(self) -> AsyncIterator[pb.StreamCommand]:
        while True:
            yield await self._commands.get()

    def write(self, batch: pb.StreamEvents) -> None:
        """A message of the stream's servicer (a Carrier's, generate_streams.py)."""
        if not self.transport.is_closing():
            self.transport.write(frame(batch.SerializeToString()))

    async def _serve(self, service: GenerateStreams, context: _CallContext) -> None:
        try:
            await service.serve(self._next_commands(), context, self)
        finally:
            self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._open.add(self)

    def connection_lost(self, exc) -> None:  # the caller went: its requests end
        self._open.discard(self)
        self.on_resume = None
        if self._task is not None:
            self._task.cancel()
        self._writable.set()


class FramesServer:
    """A frames listener beside a gRPC server: `services` by FramesService number."""

    def __init__(self, services: dict[int, GenerateStreams], max_frame_bytes: int):
        self.services, self.max_frame_bytes = services, max_frame_bytes
        self._server: asyncio.Server | None = None
        self._connections: set[_ServerConnection] = set()
        self.port = 0

    async def start(self, host: str, port: int, tls=None, reuse_port: bool = False) -> int:
        """Listen on host:port (0: any free port); returns the port. `reuse_port`: with the other
        processes of a router set on it (SO_REUSEPORT)."""
        context = tls.server_context() if tls is not None else None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _ServerConnection(self.services, self.max_frame_bytes, self._connections), host, port, ssl=context,
            reuse_port=reuse_port or None)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def close(self) -> None:
        """Stop listening and drop every connection, as a gRPC server's stop cancels its calls:
        their callers see the instance go (the router moves their requests elsewhere)."""
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.transport.abort()


# ---- the caller's side -------------------------------------------------------------------------
class FramesCall(_Writer):
    """The caller's side of one connection, read as grpc.aio's stream-stream call is
    (RequestStreams): initial_metadata(), the server's messages as StreamEvents, cancel(); a
    connection that fails or cannot be made raises UNAVAILABLE, a refused hello its status."""

    def __init__(self, opener: FramesOpener, commands: AsyncIterator[pb.StreamCommand], metadata: tuple):
        super().__init__(opener.max_frame_bytes)
        loop = asyncio.get_running_loop()
        self._opener = opener
        self._hello: asyncio.Future = loop.create_future()
        self._inbox: asyncio.Queue = asyncio.Queue()  # StreamEvents, or the failure
        self._on_events = None  # where messages go as they are read, once the reader said (read_each)
        self._writer = asyncio.ensure_future(self._write(commands, metadata))
        self._no_hello = loop.call_later(opener.hello_timeout_s, self._hello_late)

    def _hello_late(self) -> None:
        if not self._hello.done():
            self._fail(self._failure(f"no answer in {self._opener.hello_timeout_s:g} s"))

    def _failure(self, why: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> AioRpcError:
        return AioRpcError(code, Metadata(), Metadata(), f"frames to {self._opener.address}: {why}")

    async def _write(self, commands, metadata: tuple) -> None:
        o = self._opener
        try:
            await asyncio.get_running_loop().create_connection(
                lambda: self, o.host, o.port, ssl=o.ssl_context,
                server_hostname=(o.server_name or o.host) if o.ssl_context is not None else None)
        except (OSError, ssl.SSLError) as e:
            self._fail(self._failure(f"cannot connect ({e})"))
            return
        hello = internal_pb2.FramesHello(service=o.service,
                                         metadata=[pb.StreamMetadatum(key=k, value=v) for k, v in metadata])
        await self.send(hello.SerializeToString())
        async for command in commands:
            if self.transport.is_closing():
                return
            await self.send(command.SerializeToString())

    def data_received(self, data: bytes) -> None:
        try:
            for message in self.frames.feed(data):
                if self._hello.done():
                    events = pb.StreamEvents.FromString(message)
                    if self._on_events is not None:
                        self._on_events(events)
                    else:
                        self._inbox.put_nowait(events)
                    continue
                hello = internal_pb2.FramesHello.FromString(message)
                if hello.HasField("refused"):
                    self._fail(self._failure(hello.refused.details,
                                             STATUS_CODES.get(hello.refused.code, grpc.StatusCode.UNKNOWN)))
                    return
                self._no_hello.cancel()
                self._hello.set_result(tuple((m.key, m.value) for m in hello.metadata))
        except Exception as e:  # noqa: BLE001 - the server sent what cannot be read (or handled: the stream is lost)
            self._fail(self._failure(f"a message could not be read or handled ({e!r})", grpc.StatusCode.INTERNAL))

    def connection_lost(self, exc) -> None:
        self._fail(self._failure(f"the connection was lost ({exc or 'closed by the server'})"))
        self._writable.set()

    def _fail(self, error: AioRpcError) -> None:
        self._no_hello.cancel()
        if not self._hello.done():
            self._hello.set_exception(error)
            self._hello.exception()  # (retrieved: a call failing before anyone asked is not a warning)
        self._inbox.put_nowait(error)
        if self.transport is not None:
            self.transport.abort()
        self._writer.cancel()

    async def initial_metadata(self) -> tuple:
        return await self._hello

    def __aiter__(self):
        return self._events()

    async def _events(self) -> AsyncIterator[pb.StreamEvents]:
        inbox = self._inbox
        while True:
            event = await inbox.get()
            if isinstance(event, AioRpcError):
                raise event
            yield event

    async def read_each(self, on_events) -> None:
        """Hand every message to `on_events` as the connection's bytes are read, in the same turn
        of the event loop (no task woken per message, as iterating takes), until the call fails:
        then raise as iterating would."""
        inbox = self._inbox
        while not inbox.empty():  # (read before the reader came)
            event = inbox.get_nowait()
            if isinstance(event, AioRpcError):
                raise event
            on_events(event)
        self._on_events = on_events
        raise await inbox.get()  # (only the failure comes there now)

    def cancel(self) -> None:
        self._writer.cancel()
        if self.transport is not None:
            self.transport.abort()


class FramesOpener:
    """Where and how to open a server's stream over frames: opened as a grpc.aio channel's
    stream_stream method is called (RequestStreams)."""

    def __init__(self, host: str, port: int, service: int, tls=None, max_frame_bytes: int = 16 << 20,
                 hello_timeout_s: float = 5.0):
        self.host, self.port, self.service = host, port, service
        self.hello_timeout_s = hello_timeout_s  # to connect and be answered
        self.address = f"{host}:{port}"
        self.ssl_context = tls.client_context() if tls is not None else None
        self.server_name = tls.server_name if tls is not None else None
        self.max_frame_bytes = max_frame_bytes

    def __call__(self, commands: AsyncIterator[pb.StreamCommand], metadata: tuple = ()) -> FramesCall:
        return FramesCall(self, commands, metadata)
