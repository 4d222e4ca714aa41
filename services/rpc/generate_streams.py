"""GenerateStreams (generate.proto), as every service serves it: a caller opens many Generate
requests on one stream. Each request runs as the service's own Generate would run it (an engine
server's, generation.py; the router's, router_generation.py; a prefill's Streams runs its
Prefill so, prefill.py), with a stand-in for its call's context (StreamContext), and what every
request answers goes back in one message per wake-up of the stream's writer: under load, one per
engine step for all of them, where their own calls would take one message per token each (gRPC's
cost is per message); to a caller of version 2, a response with nothing but tokens goes packed
into the message's StreamTokens rather than as an event of its own. A request ends with an event
of its own status; the call ending (the caller gone) cancels the requests still running, which
aborts them where they run. Over frames (frames.py) the same runs through `serve`, whose writer
is a callback in the event loop's next turn rather than a task to wake."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc

from baton.services.rpc.errors import DETAILS_KEY
from baton.services.rpc.names import STREAMS_VERSION
from baton.services.rpc.stand_in_context import Aborted, DirectContext
from baton.v1 import generate_pb2 as pb
from baton.v1 import generate_pb2_grpc

log = logging.getLogger("baton.rpc")


class StreamContext(DirectContext):
    """The context of one request of a stream: its deadline, its initial metadata sent as an
    event of the stream, and callbacks once it ended (`cancelled()` then: the caller cancelled,
    went away, or the deadline passed), as a call's context has."""

    def __init__(self, stream: int, metadata: tuple, timeout_s: float, outbox: _Outbox):
        super().__init__(metadata)
        self._stream, self._outbox = stream, outbox
        self._deadline = asyncio.get_running_loop().time() + timeout_s if timeout_s > 0 else None
        self._when_done: list[Callable[[StreamContext], object]] = []
        self._cancelled = False

    def add_done_callback(self, callback: Callable[[StreamContext], object]) -> None:
        self._when_done.append(callback)

    def cancelled(self) -> bool:
        return self._cancelled

    def ended(self, cancelled: bool) -> None:
        self._cancelled = cancelled
        for callback in self._when_done:
            callback(self)

    def time_remaining(self):
        return None if self._deadline is None else max(0.0, self._deadline - asyncio.get_running_loop().time())

    async def send_initial_metadata(self, metadata) -> None:
        self._outbox.add(self._stream, headers=pb.StreamHeaders(
            metadata=[pb.StreamMetadatum(key=k, value=v) for k, v in metadata]))

    def respond(self, resp: pb.GenerateResponse | bytes) -> None:
        """A response straight into the stream's next message."""
        self._outbox.add(self._stream, response=resp if isinstance(resp, bytes) else resp.SerializeToString())

    def respond_tokens(self, request_id: str, token_ids: list[int], text: str) -> None:
        """As respond, a response with nothing but these (not a request's last): in the message's
        StreamTokens where the caller reads them, else as a GenerateResponse of its own."""
        if self._outbox.tokens is not None:
            self._outbox.add_tokens(self._stream, token_ids, text)
        else:
            self.respond(pb.GenerateResponse(request_id=request_id, token_ids=token_ids, text=text))


class _Tokens:
    """A message's StreamTokens as plain lists, filled as requests answer."""
    __slots__ = ("streams", "counts", "token_ids", "texts")

    def __init__(self):
        self.streams: list[int] = []
        self.counts: list[int] = []
        self.token_ids: list[int] = []
        self.texts: list[str] = []

    def into(self, batch: pb.StreamEvents) -> None:
        if self.streams:
            tokens = batch.tokens
            tokens.streams.extend(self.streams)
            tokens.counts.extend(self.counts)
            tokens.token_ids.extend(self.token_ids)
            if any(self.texts):
                tokens.texts.extend(self.texts)


class _Outbox:
    """The stream's next message, its events added in place as requests answer (no copy of
    each), which the writer takes whole; `closed` once no request will add more. `tokens`: the
    message's StreamTokens (None: the caller reads none). An event of a request that has tokens
    in the message seals it (its tokens are read after its events) and begins the next. The
    writer is woken once per message, by `on_ready`: by default the event a task waits for in
    take(); a carrier's writer sets its own (GenerateStreams.serve)."""
    __slots__ = ("batch", "tokens", "_tokened", "_sealed", "ready", "closed", "on_ready", "_woken")

    def __init__(self, compact: bool):
        self.batch = pb.StreamEvents()
        self.tokens = _Tokens() if compact else None
        self._tokened: set[int] = set()  # the requests with tokens in `tokens`
        self._sealed: list[pb.StreamEvents] = []
        self.ready = asyncio.Event()
        self.closed = False
        self.on_ready: Callable[[], object] = self.ready.set
        self._woken = False  # the writer is woken for what is in the outbox now

    def _wake(self) -> None:
        if not self._woken:
            self._woken = True
            self.on_ready()

    def add(self, stream: int, **event) -> None:
        """An event for the request numbered `stream`: its headers, a response or its status."""
        if stream in self._tokened:
            self._sealed.append(self._seal())
        self.batch.events.add(stream=stream, **event)
        self._wake()

    def add_tokens(self, stream: int, token_ids: list[int], text: str) -> None:
        tokens = self.tokens
        tokens.streams.append(stream)
        tokens.counts.append(len(token_ids))
        tokens.token_ids += token_ids
        tokens.texts.append(text)
        self._tokened.add(stream)
        if not self._woken:  # (_wake's own check, here too: this runs for every token, a call fewer)
            self._wake()

    def _seal(self) -> pb.StreamEvents:
        batch, self.batch = self.batch, pb.StreamEvents()
        if self.tokens is not None:
            self.tokens.into(batch)
            self.tokens, self._tokened = _Tokens(), set()
        return batch

    def close(self) -> None:
        self.closed = True
        self._woken = False
        self._wake()

    def empty(self) -> bool:
        return not self.batch.events and not self._tokened and not self._sealed

    def drain(self) -> list[pb.StreamEvents]:
        """The messages to send, in order (more than one where a request's event sealed one)."""
        self._woken = False
        batches, self._sealed = self._sealed, []
        if not self.empty():
            batches.append(self._seal())
        return batches

    async def take(self) -> list[pb.StreamEvents]:
        """drain(), once there is something (or the outbox closed)."""
        await self.ready.wait()
        self.ready.clear()
        return self.drain()


class Carrier(Protocol):
    """What GenerateStreams.serve writes a caller's messages to (frames.py's connection)."""
    paused: bool  # the caller reads too slowly: hold the messages (they merge) until resumed
    on_resume: Callable[[], object] | None  # set by serve: called once it may write again

    def write(self, batch: pb.StreamEvents) -> None:
        """Send the message now (without waiting)."""


class GenerateStreams(generate_pb2_grpc.GenerateStreamsServicer):
    """`generate`: the service's Generate, yielding GenerateResponses, or their bytes (the
    router's, which passes a backend's on as they came). What a request may carry is its own
    Generate's to check: the stack's fields want the stack's token in the request's metadata."""

    def __init__(self, generate: Callable[..., AsyncIterator[pb.GenerateResponse | bytes]]):
        self.generate = generate

    async def Generate(self, commands: AsyncIterator[pb.StreamCommand], context: grpc.aio.ServicerContext):
        outbox, running = await self._answer(context), {}
        reader = asyncio.ensure_future(self._read(commands, running, outbox))
        try:
            while True:
                for batch in await outbox.take():
                    yield batch
                if outbox.closed and outbox.empty():
                    return
        finally:  # the caller went away, or the server stops: every request still running ends
            reader.cancel()
            _cancel_all(running)

    async def serve(self, commands: AsyncIterator[pb.StreamCommand], context, carrier: Carrier) -> None:
        """Generate for a carrier that writes without waiting (frames.py): each message is written
        from a callback in the turn of the event loop after its first event, with no task woken
        per message; until the caller sends no more and its requests ended, or this is cancelled."""
        outbox, running = await self._answer(context), {}

        def flush() -> None:
            if not carrier.paused:  # (else the message grows until the carrier resumes)
                for batch in outbox.drain():
                    carrier.write(batch)
        loop = asyncio.get_running_loop()
        outbox.on_ready = lambda: loop.call_soon(flush)  # (after the rest of this turn's answers)
        carrier.on_resume = flush
        try:
            await self._read(commands, running, outbox)
            for batch in outbox.drain():  # the last statuses, paused or not (the carrier's close sends them)
                carrier.write(batch)
        finally:  # the caller went away, or the server stops: every request still running ends
            _cancel_all(running)

    @staticmethod
    async def _answer(context) -> _Outbox:
        """The call's outbox (its caller reads StreamTokens or not), once the server said it reads
        StreamCommand.more."""
        outbox = _Outbox(STREAMS_VERSION in tuple(context.invocation_metadata() or ()))
        await context.send_initial_metadata((STREAMS_VERSION,))
        return outbox

    async def _read(self, commands, running: dict[int, asyncio.Task], outbox: _Outbox) -> None:
        try:
            async for message in commands:
                for command in (message, *message.more):
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
        except asyncio.CancelledError:  # the caller cancelled it, or went away
            context.ended(cancelled=True)
            raise
        except Aborted:
            code, details = context.code(), context.details()
        except TimeoutError:
            code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        except Exception as e:  # a fault here: this request fails, the stream's others go on
            log.exception("request %s failed", open.request.request_id)
            code, details = grpc.StatusCode.UNKNOWN, f"Unexpected error: {e!r}"
        context.ended(cancelled=code == grpc.StatusCode.DEADLINE_EXCEEDED)
        outbox.add(stream, status=pb.StreamStatus(
            code=code.value[0], details=details,
            status_details=next((v for k, v in context.trailing_metadata if k == DETAILS_KEY), b"")))


def _cancel_all(running: dict[int, asyncio.Task]) -> None:
    for task in list(running.values()):
        task.cancel()
