"""The router's side of GenerateStreams (internal.proto): a decode instance's requests opened on
one stream per instance, their responses read in one message per engine step for all of them
(gRPC's cost is per message: a call and a message per token per request is most of what a
relay spends). A StreamedCall stands where the request's own Generate call would, and
decode_leg.py reads it as one: its responses as bytes, its initial metadata, cancel(), and the
request's status raised as grpc.aio.AioRpcError with the decode's failure details. The stream
failing fails each request on it with the stream's status, as their own calls would have failed
(the instance died, stopped or is unreachable): the decode leg moves them. The next request
opens a new stream."""
from __future__ import annotations

import asyncio
import logging

import grpc
from grpc.aio import AioRpcError, Metadata

from baton.services.rpc.errors import DETAILS_KEY
from baton.services.rpc.names import TOKEN_KEY
from baton.v1 import generate_pb2 as pb
from baton.v1 import internal_pb2 as ipb

log = logging.getLogger("baton.router")
METHOD = "/baton.v1.GenerateStreams/Generate"
_CODES = {code.value[0]: code for code in grpc.StatusCode}


_FALL_BACK = object()  # the instance has no GenerateStreams: the request goes as a call of its own


class StreamedCall:
    """One request on a decode's stream, read as its own Generate call would be."""
    __slots__ = ("_streams", "_stream", "_open", "_events", "_headers", "_done", "_call")

    def __init__(self, streams: DecodeStreams, stream: int, open: ipb.StreamOpen):
        self._streams, self._stream, self._open = streams, stream, open
        self._events: asyncio.Queue = asyncio.Queue()  # StreamEvents, or the stream's failure
        self._headers: tuple = ()
        self._done = False
        self._call = None  # the request's own call, where the instance cannot take streams

    def __aiter__(self):
        return self._responses()

    def deliver(self, event) -> None:
        """A StreamEvent for it, the stream's failure (AioRpcError), or _FALL_BACK."""
        self._events.put_nowait(event)

    async def _responses(self):
        while True:
            event = await self._events.get()
            if isinstance(event, AioRpcError):
                self._done = True
                raise event
            if event is _FALL_BACK:
                async for raw in self._fall_back():
                    yield raw
                return
            if event.HasField("response"):
                yield event.response
            elif event.HasField("headers"):
                self._headers = tuple((m.key, m.value) for m in event.headers.metadata)
            else:
                self._done = True
                self._streams.forget(self._stream)
                status = event.status
                if status.code != 0:
                    trailer = Metadata((DETAILS_KEY, status.status_details)) if status.status_details else Metadata()
                    raise AioRpcError(_CODES.get(status.code, grpc.StatusCode.UNKNOWN), Metadata(*self._headers),
                                      trailer, status.details)
                return

    def _fall_back(self):
        open = self._open
        metadata = (*self._streams.token, *((m.key, m.value) for m in open.metadata))
        self._call = self._streams.per_call(open.request, metadata=metadata, timeout=open.timeout_s or None)
        return self._call

    async def initial_metadata(self) -> tuple:
        return await self._call.initial_metadata() if self._call is not None else self._headers

    def done(self) -> bool:
        return self._call.done() if self._call is not None else self._done

    def cancel(self) -> None:
        """The caller is gone: the decode ends the request (and answers nothing more for it)."""
        if self._call is not None:
            self._call.cancel()
        elif not self._done:
            self._done = True
            self._streams.cancel(self._stream)


class DecodeStreams:
    """One decode instance's stream of requests, opened at its first and again after it fails.
    `token`: the stack's token metadata, which the instance checks once for the stream;
    `per_call`: the instance's own Generate, for an instance without GenerateStreams (another
    version, or not Baton), to which its requests then go as calls of their own."""

    def __init__(self, channel: grpc.aio.Channel, token: tuple, per_call):
        self._method = channel.stream_stream(METHOD, request_serializer=ipb.StreamCommand.SerializeToString,
                                             response_deserializer=ipb.StreamEvents.FromString)
        self.token = token
        self.per_call = per_call
        self.supported = True  # until the instance answers UNIMPLEMENTED
        self._commands: asyncio.Queue | None = None  # the open stream's, None at the end
        self._calls: dict[int, StreamedCall] = {}
        self._reader: asyncio.Task | None = None
        self._next = 0
        self.messages_read = 0  # the instance's messages, each carrying every event since its last

    def open(self, msg: pb.GenerateRequest, metadata: tuple, timeout: float | None) -> StreamedCall:
        """Send the request as its own Generate call would go, with this metadata (its binary
        entries are not carried) and deadline."""
        if self._reader is None or self._reader.done():
            self._start()
        self._next += 1
        entries = [ipb.StreamMetadatum(key=k, value=v) for k, v in metadata if isinstance(v, str) and k != TOKEN_KEY]
        open = ipb.StreamOpen(request=msg, metadata=entries, timeout_s=timeout or 0.0)
        call = self._calls[self._next] = StreamedCall(self, self._next, open)
        self._commands.put_nowait(ipb.StreamCommand(stream=self._next, open=open))
        return call

    def cancel(self, stream: int) -> None:
        if self._calls.pop(stream, None) is not None:
            self._commands.put_nowait(ipb.StreamCommand(stream=stream, cancel=ipb.StreamCancel()))

    def forget(self, stream: int) -> None:
        self._calls.pop(stream, None)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()

    def _start(self) -> None:
        commands, calls = self._commands, self._calls = asyncio.Queue(), {}
        call = self._method(self._send(commands), metadata=self.token)
        self._reader = asyncio.ensure_future(self._read(call, calls))

    @staticmethod
    async def _send(commands: asyncio.Queue):
        while True:
            yield await commands.get()

    async def _read(self, call, calls: dict[int, StreamedCall]) -> None:
        error = None
        try:
            async for batch in call:
                self.messages_read += 1
                for event in batch.events:
                    streamed = calls.get(event.stream)
                    if streamed is not None:  # else cancelled here: the decode's late answers are dropped
                        streamed.deliver(event)
            error = AioRpcError(grpc.StatusCode.UNAVAILABLE, Metadata(), Metadata(),
                                "the decode instance ended its requests' stream")
        except AioRpcError as e:
            error = e
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.warning("decode instance has no GenerateStreams: a Generate call per request (%s)", e.details())
                self.supported, error = False, _FALL_BACK
        except asyncio.CancelledError:
            error = AioRpcError(grpc.StatusCode.CANCELLED, Metadata(), Metadata(), "the router closed the stream")
            call.cancel()
            raise
        finally:
            for streamed in calls.values():  # as their own calls would have failed
                streamed.deliver(error)
            calls.clear()
