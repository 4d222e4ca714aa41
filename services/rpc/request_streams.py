"""The caller's side of GenerateStreams (generate.proto): many Generate requests opened on one
stream per server, their responses read in one message per engine step for all of them (gRPC's
cost is per message: a call and a message per token per request is most of what a relay spends).
The router opens a decode instance's requests so, and a prefill's Prefill requests on its
Streams; the client library, with multiplex=True, a client's. A StreamedCall stands where the
request's own Generate call would, read as one (the router's decode leg does): its responses as
bytes, its initial metadata, cancel(), and the request's status raised as grpc.aio.AioRpcError
with the server's failure details. The stream failing fails each request on it with the stream's
status, as their own calls would have failed (the server died, stopped or is unreachable); the
next request opens a new stream. A server without GenerateStreams (another version, or not
Baton) gets each request as a call of its own. The stream speaks version 2 (generate.proto):
responses with nothing but tokens come packed in StreamTokens (read as responses of their own,
or handed to a sink as such), and commands go batched once the server says it reads them."""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from typing import NamedTuple, Protocol

import grpc
from grpc.aio import AioRpcError, Metadata

from baton.services.rpc.errors import DETAILS_KEY, STATUS_CODES
from baton.services.rpc.names import STREAMS_METHOD, STREAMS_VERSION
from baton.v1 import generate_pb2 as pb

log = logging.getLogger("baton.rpc")


_FALL_BACK = object()  # the instance has no GenerateStreams: the request goes as a call of its own
_AGAIN = object()  # a stream over frames failed before any answer: its requests go again over gRPC


class Sink(Protocol):
    """Where a StreamedCall's responses go as they are read (StreamedCall.sink): each returns
    False to decline one, which then goes to the call's reader, as all after it do."""

    def response(self, raw: bytes) -> bool:
        """A serialized GenerateResponse."""

    def tokens(self, token_ids: list[int], text: str) -> bool:
        """A response with nothing but these (StreamTokens'): not the request's last."""


class StreamedTokens(NamedTuple):
    """A response with nothing but tokens, as the stream's message carried it (StreamTokens),
    for a reader that takes it so (StreamedCall.responses) rather than serialized."""
    request_id: str
    token_ids: list[int]
    text: str


class StreamedCall:
    """One request on a server's stream, read as its own Generate call would be."""
    __slots__ = ("_streams", "_stream", "_open", "_events", "_headers", "_done", "_call", "_sink", "_first",
                 "_request_id")

    def __init__(self, streams: RequestStreams, stream: int, open: pb.StreamOpen):
        self._streams, self._stream, self._open = streams, stream, open
        self._events: asyncio.Queue = asyncio.Queue()  # StreamEvents, tokens, or the stream's failure
        self._headers: tuple = ()
        self._done = False
        self._call = None  # the request's own call, where the instance cannot take streams
        self._sink: Sink | None = None
        self._first: bytes | None = None  # the first response read (its request_id, for tokens')
        self._request_id: str | None = None  # as responses carry it (the server's own where the caller gave none)

    def __aiter__(self):
        return self.responses()

    def deliver(self, event) -> None:
        """A StreamEvent for it, the stream's failure (AioRpcError), or _FALL_BACK."""
        if self._sink is not None:
            if isinstance(event, pb.StreamEvent) and event.HasField("response") and self._sink.response(event.response):
                return
            self._sink = None  # declined, or not a response: this and all after it are read as before
        self._events.put_nowait(event)

    def deliver_tokens(self, token_ids: list[int], text: str) -> None:
        """A response of the message's StreamTokens for it."""
        if self._sink is not None:
            if self._sink.tokens(token_ids, text):
                return
            self._sink = None
        self._events.put_nowait((token_ids, text))

    def sink(self, sink: Sink) -> bool:
        """From now on, hand each response to `sink` as the stream's message is read, instead of
        queueing it for the reader, who is then woken only by what the sink declines (the
        router's, once the request was aborted) and by the request's end. Only while nothing is
        queued, so that the sink's responses come after all the reader read: False if something
        is (or the request goes as a call of its own), and the reader may ask again later."""
        if self._call is not None or self._done or not self._events.empty():
            return False
        self._sink = sink
        return True

    async def responses(self, tokens: bool = False) -> AsyncIterator[bytes | StreamedTokens]:
        """Its serialized GenerateResponses, as a call of its own gives them; with `tokens`,
        one with nothing but tokens as StreamedTokens, never serialized."""
        while True:
            event = await self._events.get()
            if isinstance(event, tuple):  # a response of StreamTokens, as its own message
                token_ids, text = event
                if self._request_id is None:
                    self._request_id = (self._open.request.request_id
                                        or pb.GenerateResponse.FromString(self._first or b"").request_id)
                yield (StreamedTokens(self._request_id, token_ids, text) if tokens else
                       pb.GenerateResponse(request_id=self._request_id, token_ids=token_ids,
                                           text=text).SerializeToString())
                continue
            if isinstance(event, AioRpcError):
                self._done = True
                raise event
            if event is _FALL_BACK:
                async for raw in self._fall_back():
                    yield raw
                return
            if event.HasField("response"):
                self._first = self._first or event.response
                yield event.response
            elif event.HasField("headers"):
                self._headers = tuple((m.key, m.value) for m in event.headers.metadata)
            else:
                self._done = True
                self._streams.forget(self._stream)
                status = event.status
                if status.code != 0:
                    trailer = Metadata((DETAILS_KEY, status.status_details)) if status.status_details else Metadata()
                    raise AioRpcError(STATUS_CODES.get(status.code, grpc.StatusCode.UNKNOWN), Metadata(*self._headers),
                                      trailer, status.details)
                return

    def renumbered(self, stream: int) -> pb.StreamOpen:
        """It goes on another stream (one over frames failed before any answer), numbered so: its open."""
        self._stream = stream
        return self._open

    def _fall_back(self):
        open = self._open
        metadata = tuple((m.key, m.value) for m in open.metadata)
        self._call = self._streams.per_call(open.request, metadata=metadata, timeout=open.timeout_s or None)
        return self._call

    async def initial_metadata(self) -> tuple:
        return await self._call.initial_metadata() if self._call is not None else self._headers

    def done(self) -> bool:
        return self._call.done() if self._call is not None else self._done

    def cancel(self) -> None:
        """The caller is gone: the server ends the request (and answers nothing more for it)."""
        if self._call is not None:
            self._call.cancel()
        elif not self._done:
            self._done = True
            self._streams.cancel(self._stream)


class _Commands:
    """What a stream sends, in order: a message per command, or, once the server said it reads
    them (`batched`), every command queued while the last message was on its way in one."""

    def __init__(self):
        self._queue: asyncio.Queue = asyncio.Queue()
        self.batched = False
        self.sent = 0  # messages

    def put(self, command: pb.StreamCommand) -> None:
        self._queue.put_nowait(command)

    async def messages(self):
        queue = self._queue
        while True:
            message = await queue.get()
            if self.batched:
                while not queue.empty():
                    message.more.append(queue.get_nowait())
            self.sent += 1
            yield message


class RequestStreams:
    """One server's stream of requests, opened at the first and again after it fails. `per_call`:
    the server's Generate (its responses as bytes), for a server without GenerateStreams.
    `method`: the stream's, where it is not GenerateStreams' (a prefill's Streams, whose requests
    are Prefill calls: `per_call` is then Prefill, read as a call streaming one response).
    `frames`: where set (a FramesOpener, frames.py), the next stream goes over frames instead of
    gRPC; one that fails before the server answered sends its requests again over gRPC, as the
    streams after it go (a firewalled port must not cost a request), until the owner sets it
    again."""

    def __init__(self, channel: grpc.aio.Channel, per_call, method: str = STREAMS_METHOD):
        self._method = channel.stream_stream(method, request_serializer=pb.StreamCommand.SerializeToString,
                                             response_deserializer=pb.StreamEvents.FromString)
        self._method_name = method
        self.per_call = per_call
        self.supported = True  # until the instance answers UNIMPLEMENTED
        self.frames = None  # a FramesOpener: streams over frames rather than gRPC
        self._commands: _Commands | None = None  # what the open stream sends (None: none opened yet)
        self._calls: dict[int, StreamedCall] = {}
        self._reader: asyncio.Task | None = None
        self._next = 0
        self.messages_read = 0  # the instance's messages, each carrying every event since its last

    def open(self, msg: pb.GenerateRequest, metadata, timeout: float | None) -> StreamedCall:
        """Send the request as its own Generate call would go, with this metadata (its binary
        entries are not carried) and deadline; to a server without GenerateStreams, as a call of
        its own (which reads as a StreamedCall does)."""
        if not self.supported:
            return self.per_call(msg, metadata=metadata, timeout=timeout)
        if self._reader is None or self._reader.done():
            self._start()
        self._next += 1
        command = pb.StreamCommand(stream=self._next)  # (built in place: a message set into another is copied)
        open = command.open
        open.request.CopyFrom(msg)
        for key, value in metadata or ():
            if isinstance(value, str):
                open.metadata.add(key=key, value=value)
        open.timeout_s = timeout or 0.0
        call = self._calls[self._next] = StreamedCall(self, self._next, open)
        self._commands.put(command)
        return call

    def cancel(self, stream: int) -> None:
        if self._calls.pop(stream, None) is not None:
            self._commands.put(pb.StreamCommand(stream=stream, cancel=pb.StreamCancel()))

    def forget(self, stream: int) -> None:
        self._calls.pop(stream, None)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()

    def _start(self) -> None:
        commands, calls = self._commands, self._calls = _Commands(), {}
        frames = self.frames
        call = (frames or self._method)(commands.messages(), metadata=(STREAMS_VERSION,))
        self._reader = asyncio.ensure_future(self._read(call, calls, commands, frames and frames.address))

    @property
    def messages_sent(self) -> int:
        return self._commands.sent if self._commands is not None else 0

    async def _read(self, call, calls: dict[int, StreamedCall], commands: _Commands, frames: str | None) -> None:
        """`frames`: the address the stream goes to over frames (None: over gRPC)."""
        # (what an unforeseen failure here leaves the requests on the stream: they fail too)
        error = AioRpcError(grpc.StatusCode.UNKNOWN, Metadata(), Metadata(), "the requests' stream failed")
        received = False  # the server has answered on this stream
        try:
            commands.batched = STREAMS_VERSION in tuple(await call.initial_metadata() or ())
            if frames:
                log.info("a requests' stream over frames to %s is open", frames)

            def on_events(batch: pb.StreamEvents) -> None:
                nonlocal received
                received = True
                self.messages_read += 1
                deliver_batch(batch, calls)
            if frames:  # a FramesCall hands its messages over as they are read (no task woken each)
                await call.read_each(on_events)  # (it raises the connection's end)
            else:
                async for batch in call:
                    on_events(batch)
            error = AioRpcError(grpc.StatusCode.UNAVAILABLE, Metadata(), Metadata(),
                                "the server ended its requests' stream")
        except AioRpcError as e:
            error = e
            if frames and not received:
                log.warning("a requests' stream over frames failed before any answer (%s): over gRPC again",
                            e.details())
                self.frames, error = None, _AGAIN
            elif e.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.warning("the server has no %s: a call per request (%s)", self._method_name, e.details())
                self.supported, error = False, _FALL_BACK
            elif not received:  # (a server without it may also reset the stream: INTERNAL) each asks alone
                log.warning("a requests' stream (%s) failed before any answer (%s): a call each", self._method_name,
                            e.details())
                error = _FALL_BACK
        except asyncio.CancelledError:
            error = AioRpcError(grpc.StatusCode.CANCELLED, Metadata(), Metadata(), "the stream was closed")
            call.cancel()
            raise
        finally:
            if error is _AGAIN and calls:
                self._start()
                for streamed in calls.values():
                    self._send_again(streamed)
            else:
                for streamed in calls.values():  # as their own calls would have failed
                    streamed.deliver(error)
            calls.clear()

    def _send_again(self, streamed: StreamedCall) -> None:
        """A request of a stream that failed before any answer, opened on the current one."""
        self._next += 1
        self._calls[self._next] = streamed
        command = pb.StreamCommand(stream=self._next)
        command.open.CopyFrom(streamed.renumbered(self._next))
        self._commands.put(command)


def deliver_batch(batch: pb.StreamEvents, calls: dict[int, StreamedCall]) -> None:
    """A message's events, then its StreamTokens, each to its request (a request cancelled here
    is not in `calls`: its late answers are dropped)."""
    for event in batch.events:
        streamed = calls.get(event.stream)
        if streamed is not None:
            streamed.deliver(event)
    if not batch.HasField("tokens"):
        return
    tokens = batch.tokens
    token_ids, texts = list(tokens.token_ids), list(tokens.texts) or itertools.repeat("")
    at, call_of = 0, calls.get
    for stream, count, text in zip(tokens.streams, tokens.counts, texts):
        streamed = call_of(stream)
        if streamed is not None:
            streamed.deliver_tokens(token_ids[at:at + count], text)
        at += count
