"""GenerateStreams (generate.proto), as every service serves it: a caller opens many Generate
requests on one stream. Each request runs as the service's own Generate would run it (an engine
server's, generation.py; the router's, router_generation.py), with a stand-in for its call's
context (StreamContext), and what every request answers goes back in one message per wake-up of
the stream's writer: under load, one per engine step for all of them, where their own calls
would take one message per token each (gRPC's cost is per message). A request ends with an
event of its own status; the call ending (the caller gone) cancels the requests still running,
which aborts them where they run."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from baton.services.rpc.errors import DETAILS_KEY
from baton.services.rpc.stand_in_context import Aborted, StandInContext
from baton.v1 import generate_pb2 as pb
from baton.v1 import generate_pb2_grpc

log = logging.getLogger("baton.rpc")


class StreamContext(StandInContext):
    """The context of one request of a stream: its deadline, and its initial metadata sent as
    an event of the stream."""

    def __init__(self, stream: int, metadata: tuple, timeout_s: float, outbox: _Outbox):
        super().__init__(metadata)
        self._stream, self._outbox = stream, outbox
        self._deadline = asyncio.get_running_loop().time() + timeout_s if timeout_s > 0 else None

    def time_remaining(self):
        return None if self._deadline is None else max(0.0, self._deadline - asyncio.get_running_loop().time())

    async def send_initial_metadata(self, metadata) -> None:
        self._outbox.add(self._stream, headers=pb.StreamHeaders(
            metadata=[pb.StreamMetadatum(key=k, value=v) for k, v in metadata]))

    def respond(self, resp: pb.GenerateResponse | bytes) -> None:
        """A response straight into the stream's next message, past the request's generator:
        only in the order the generator's would have gone (the engine server's and the router's
        sinks)."""
        self._outbox.add(self._stream, response=resp if isinstance(resp, bytes) else resp.SerializeToString())


class _Outbox:
    """The stream's next message, its events added in place as requests answer (no copy of
    each), which the writer takes whole; `closed` once no request will add more."""
    __slots__ = ("batch", "ready", "closed")

    def __init__(self):
        self.batch = pb.StreamEvents()
        self.ready = asyncio.Event()
        self.closed = False

    def add(self, stream: int, **event) -> None:
        """An event for the request numbered `stream`: its headers, a response or its status."""
        self.batch.events.add(stream=stream, **event)
        self.ready.set()

    def close(self) -> None:
        self.closed = True
        self.ready.set()

    async def take(self) -> pb.StreamEvents:
        await self.ready.wait()
        self.ready.clear()
        batch, self.batch = self.batch, pb.StreamEvents()
        return batch


class GenerateStreams(generate_pb2_grpc.GenerateStreamsServicer):
    """`generate`: the service's Generate, yielding GenerateResponses, or their bytes (the
    router's, which passes a backend's on as they came). What a request may carry is its own
    Generate's to check: the stack's fields want the stack's token in the request's metadata."""

    def __init__(self, generate: Callable[..., AsyncIterator[pb.GenerateResponse | bytes]]):
        self.generate = generate

    async def Generate(self, commands: AsyncIterator[pb.StreamCommand], context: grpc.aio.ServicerContext):
        outbox, running = _Outbox(), {}
        reader = asyncio.ensure_future(self._read(commands, running, outbox))
        try:
            while True:
                batch = await outbox.take()
                if batch.events:
                    yield batch
                if outbox.closed and not outbox.batch.events:
                    return
        finally:  # the caller went away, or the server stops: every request still running ends
            reader.cancel()
            for task in list(running.values()):
                task.cancel()

    async def _read(self, commands, running: dict[int, asyncio.Task], outbox: _Outbox) -> None:
        try:
            async for command in commands:
                if command.HasField("open"):
                    task = running[command.stream] = asyncio.ensure_future(
                        self._run(command.stream, command.open, outbox))
                    task.add_done_callback(lambda _, stream=command.stream: running.pop(stream, None))
                else:  # the caller cancelled the request
                    task = running.get(command.stream)
                    if task is not None:
                        task.cancel()
            # The caller sends no more: the stream ends once its requests have.
            while running:
                await asyncio.wait(list(running.values()))
        finally:
            outbox.close()

    async def _run(self, stream: int, open: pb.StreamOpen, outbox: _Outbox) -> None:
        context = StreamContext(stream, tuple((m.key, m.value) for m in open.metadata), open.timeout_s, outbox)
        code, details = grpc.StatusCode.OK, ""
        try:
            async with asyncio.timeout(open.timeout_s if open.timeout_s > 0 else None):
                async for resp in self.generate(open.request, context):
                    outbox.add(stream, response=resp if isinstance(resp, bytes) else resp.SerializeToString())
        except Aborted:
            code, details = context.code(), context.details()
        except TimeoutError:
            code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        except Exception as e:  # a fault here: this request fails, the stream's others go on
            log.exception("request %s failed", open.request.request_id)
            code, details = grpc.StatusCode.UNKNOWN, f"Unexpected error: {e!r}"
        outbox.add(stream, status=pb.StreamStatus(
            code=code.value[0], details=details,
            status_details=next((v for k, v in context.trailing_metadata if k == DETAILS_KEY), b"")))
