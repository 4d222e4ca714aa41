"""An engine server's GenerateStreams (internal.proto): the router opens a decode's requests on
one stream per connection. Each request runs as its own Generate (generation.py), with a
stand-in for its call's context (StreamContext), and what every request answers goes back in
one message per wake-up of the stream's writer: under load, one per engine step for all of
them, where their own calls would take one message per token each (gRPC's cost is per
message). A request ends with an event of its own status; the call ending (the router gone)
cancels the requests still running, which aborts them in the engine."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from baton.services.rpc.errors import DETAILS_KEY
from baton.services.rpc.names import TOKEN_KEY
from baton.services.server.call_checks import CallChecks
from baton.v1 import generate_pb2 as pb
from baton.v1 import internal_pb2 as ipb
from baton.v1 import internal_pb2_grpc

log = logging.getLogger("baton.server")


class _Aborted(Exception):
    """The stand-in context's abort (a gRPC handler's abort raises, so does this)."""


class StreamContext:
    """What Generate uses of grpc.aio.ServicerContext, for one request of a stream."""
    __slots__ = ("_stream", "_metadata", "_deadline", "_outbox", "_code", "_details", "status_details")

    def __init__(self, stream: int, metadata: tuple, timeout_s: float, outbox: _Outbox):
        self._stream, self._metadata, self._outbox = stream, metadata, outbox
        self._deadline = asyncio.get_running_loop().time() + timeout_s if timeout_s > 0 else None
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self.status_details = b""  # a google.rpc.Status (errors.details)

    def invocation_metadata(self):
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()):
        self._code, self._details = code, details
        self.status_details = next((v for k, v in trailing_metadata if k == DETAILS_KEY), b"")
        raise _Aborted(details)

    def code(self):
        return self._code

    def details(self):
        return self._details

    def time_remaining(self):
        return None if self._deadline is None else max(0.0, self._deadline - asyncio.get_running_loop().time())

    async def send_initial_metadata(self, metadata) -> None:
        headers = ipb.StreamHeaders(metadata=[ipb.StreamMetadatum(key=k, value=v) for k, v in metadata])
        self._outbox.put(ipb.StreamEvent(stream=self._stream, headers=headers))


class _Outbox:
    """The stream's events waiting for its writer, who takes them all at once; `closed` once no
    request will add more."""
    __slots__ = ("events", "ready", "closed")

    def __init__(self):
        self.events: list[ipb.StreamEvent] = []
        self.ready = asyncio.Event()
        self.closed = False

    def put(self, event: ipb.StreamEvent) -> None:
        self.events.append(event)
        self.ready.set()

    def close(self) -> None:
        self.closed = True
        self.ready.set()

    async def take(self) -> list[ipb.StreamEvent]:
        await self.ready.wait()
        self.ready.clear()
        events, self.events = self.events, []
        return events


class GenerateStreams(internal_pb2_grpc.GenerateStreamsServicer):
    """`generate`: the server's public Generate (GenerationService.Generate)."""

    def __init__(self, generate: Callable[..., AsyncIterator[pb.GenerateResponse]], checks: CallChecks):
        self.generate = generate
        self.checks = checks

    async def Generate(self, commands: AsyncIterator[ipb.StreamCommand], context: grpc.aio.ServicerContext):
        await self.checks.from_stack(context)
        # Each request is the stream's: its own checks see the stream's token.
        token = tuple((k, v) for k, v in context.invocation_metadata() or () if k == TOKEN_KEY)
        outbox, running = _Outbox(), {}
        reader = asyncio.ensure_future(self._read(commands, running, outbox, token))
        try:
            while True:
                events = await outbox.take()
                if events:
                    yield ipb.StreamEvents(events=events)
                if outbox.closed and not outbox.events:
                    return
        finally:  # the caller went away, or the server stops: every request still running ends
            reader.cancel()
            for task in list(running.values()):
                task.cancel()

    async def _read(self, commands, running: dict[int, asyncio.Task], outbox: _Outbox, token: tuple) -> None:
        try:
            async for command in commands:
                if command.HasField("open"):
                    task = running[command.stream] = asyncio.ensure_future(
                        self._run(command.stream, command.open, outbox, token))
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

    async def _run(self, stream: int, open: ipb.StreamOpen, outbox: _Outbox, token: tuple) -> None:
        context = StreamContext(stream, (*token, *((m.key, m.value) for m in open.metadata)), open.timeout_s, outbox)
        code, details = grpc.StatusCode.OK, ""
        try:
            async with asyncio.timeout(open.timeout_s if open.timeout_s > 0 else None):
                async for resp in self.generate(open.request, context):
                    outbox.put(ipb.StreamEvent(stream=stream, response=resp.SerializeToString()))
        except _Aborted:
            code, details = context.code(), context.details()
        except TimeoutError:
            code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        except Exception as e:  # a fault here: this request fails, the stream's others go on
            log.exception("request %s failed", open.request.request_id)
            code, details = grpc.StatusCode.UNKNOWN, f"Unexpected error: {e!r}"
        outbox.put(ipb.StreamEvent(stream=stream, status=ipb.StreamStatus(
            code=code.value[0], details=details, status_details=context.status_details)))
