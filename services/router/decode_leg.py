"""The router's decode leg, with mid-stream failover: a decode instance (or colocated server)
streams the request; when the instance fails (it dies, resets the connection, goes away),
the request moves to another healthy one as its prompt plus the tokens already streamed
(GenerateRequest.resume) and the client's stream goes on where it stopped, no token repeated
or missing. The new instance recomputes that prefix (its prefix cache may hold it), or, for a
chat with images, pulls the prompt's blocks from a prefill that computed it again (the router's
`reprefill`) and recomputes only the streamed tokens; the
engine counts the resumed tokens as outputs, so max_tokens, penalties, stop strings and a
seed's draws continue as in an uninterrupted run. At most max_migrations moves per request."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from baton.services.router.backends import Backend, Lease
from baton.services.rpc.errors import failure_of_error, pass_on
from baton.services.rpc.request_streams import StreamedCall
from baton.services.rpc.stand_in_context import Responses
from baton.v1 import generate_pb2 as pb

# The instance failed, not the request: another may serve it. CANCELLED from a backend is its
# own doing (a client's cancel is a CancelledError here): it stopped with the call in flight.
# UNAVAILABLE with no reason is a connection that failed before any server answered.
INSTANCE_FAILED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
# A decode's answer when the prefill holding the prompt's blocks cannot give them (unreachable,
# restarted as another engine, or its KV of another format), or when it must compute KV over the
# prompt's images, which it was sent as spans only: the request goes on without the blocks.
PREFILL_GONE = frozenset({pb.FAILURE_REASON_KV_PEER_UNREACHABLE, pb.FAILURE_REASON_KV_PEER_RESTARTED,
                          pb.FAILURE_REASON_KV_FORMAT_MISMATCH, pb.FAILURE_REASON_IMAGES_NOT_SENT})


def prefill_gone(e: grpc.aio.AioRpcError) -> bool:
    return failure_of_error(e).reason in PREFILL_GONE


def instance_failed(e: grpc.aio.AioRpcError) -> bool:
    """The instance, not the request, failed: unreachable, stopped, or its engine core died."""
    reason = failure_of_error(e).reason
    return reason == pb.FAILURE_REASON_ENGINE_UNAVAILABLE or (
        e.code() in INSTANCE_FAILED and reason not in PREFILL_GONE)


class Relay:
    """What the client has been sent of one completion: its token ids, to resume from. The
    router asks backends for token ids always, and takes them out again for a client that
    asked for text only. The responses it passes on as they came are read for their ids only
    when they are needed (a failover), or a batch at a time: protobuf merges messages whose
    bytes are joined (repeated fields concatenate, the last scalar set wins), so one parse of
    the joined responses gives their token ids in order and the finish reason, if any."""
    __slots__ = ("strip_ids", "_ids", "_unread", "_finished")
    _UNREAD_MAX = 256  # responses kept unread at most (memory: a long completion's)

    def __init__(self, msg: pb.GenerateRequest):
        self.strip_ids = msg.output == pb.OUTPUT_TEXT
        if self.strip_ids:
            msg.output = pb.OUTPUT_TEXT_AND_TOKEN_IDS
        self._ids: list[int] = []
        self._unread: list[bytes] = []
        self._finished = False

    @property
    def token_ids(self) -> list[int]:
        self._catch_up()
        return self._ids

    @property
    def finished(self) -> bool:
        """The client has the last response: nothing to resume."""
        self._catch_up()
        return self._finished

    def _catch_up(self) -> None:
        if self._unread:
            self._read(pb.GenerateResponse.FromString(b"".join(self._unread)))
            self._unread.clear()

    def _read(self, resp: pb.GenerateResponse) -> None:
        self._ids += resp.token_ids
        self._finished = self._finished or resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED

    def forward(self, resp: pb.GenerateResponse | bytes) -> bytes:
        """A response as the client gets it: as it came, but for the token ids a client that
        asked for text only did not ask for."""
        if isinstance(resp, bytes):
            if not self.strip_ids:
                self._unread.append(resp)
                if len(self._unread) >= self._UNREAD_MAX:
                    self._catch_up()  # (and the bytes go)
                return resp
            resp = pb.GenerateResponse.FromString(resp)
        self._catch_up()  # those before it first, in order
        self._read(resp)
        if self.strip_ids and resp.token_ids:
            resp.ClearField("token_ids")
        return resp.SerializeToString()

    def forward_tokens(self, token_ids: list[int]) -> list[int]:
        """A response's token ids (StreamTokens'), as the client gets them."""
        if self._unread:  # (a call fewer per token: this runs for every token the router relays)
            self._catch_up()
        self._ids += token_ids
        return [] if self.strip_ids else token_ids


def resumed(msg: pb.GenerateRequest, token_ids: list[int]) -> pb.GenerateRequest:
    """The request as another instance takes it over: no KV handle (the blocks went to the
    failed instance), the streamed tokens to recompute and go on from."""
    out = pb.GenerateRequest()
    out.CopyFrom(msg)
    out.ClearField("kv_handle")
    out.resume.ids[:] = token_ids
    return out


def aborted_response(msg: pb.GenerateRequest) -> bytes:
    """The last response of a call the Abort API ended (its backend call is cancelled after)."""
    return pb.GenerateResponse(request_id=msg.request_id, finish_reason=pb.FINISH_REASON_ABORT).SerializeToString()


async def pass_on_or_take_out(backend: Backend, e: grpc.aio.AioRpcError, context) -> None:
    """An error from a backend call. The request's own (or its prefill's) goes to the client
    as it came, details included; a failed instance is taken out, and the caller decides
    between another instance and UNAVAILABLE."""
    if not instance_failed(e):
        await pass_on(context, e)
    backend.failed()


@dataclass(slots=True)
class DecodeRoute:
    """What the decode leg needs of the router for one request."""
    pick: Callable[[list[Backend]], Lease | None]  # a lease on a decode instance but those tried; None: none left
    why_none: Callable[[], str]  # why no decode instance can take it
    max_migrations: int
    aborted: set[str]  # request ids the Abort API ended
    # For a request moving to another decode: its prompt computed again at a prefill, whose KV
    # handle the next decode pulls (a chat with images: the decode then reads none of them);
    # None where the next decode computes the prompt itself.
    reprefill: Callable[[pb.GenerateRequest], Awaitable[pb.KVHandle | None]] | None = None
    release: Callable[[pb.KVHandle], None] | None = None  # a handle no decode will pull: let it go


class ClientSink:
    """A decode's responses passed straight to where the client's call takes them as they are read
    (StreamedCall.sink), none after an Abort (the decode leg's loop ends the request)."""
    __slots__ = ("stream", "relay", "trace", "request_id", "aborted")

    def __init__(self, stream: Responses, relay: Relay, trace, request_id: str, aborted: set[str]):
        self.stream, self.relay, self.trace, self.request_id, self.aborted = stream, relay, trace, request_id, aborted

    def response(self, raw: bytes) -> bool:
        if self.request_id in self.aborted:
            return False
        self.trace.last = out = self.relay.forward(raw)
        self.stream.respond(out)
        return True

    def tokens(self, token_ids: list[int], text: str) -> bool:
        if self.request_id in self.aborted:
            return False
        self.stream.respond_tokens(self.request_id, self.relay.forward_tokens(token_ids), text)
        return True


def end_call(lease: Lease, call) -> None:
    lease.end()
    if not call.done():  # the client went away (cancel, deadline): stop the backend's work too
        call.cancel()


async def decode_leg(route: DecodeRoute, msg: pb.GenerateRequest, metadata: tuple, context, trace, relay: Relay,
                     let_go: Callable[[], None] | None = None, stream: Responses | None = None):
    """Stream msg from decode instances, moving it on failure. `let_go`: tells the prefill holding
    the blocks msg.kv_handle names to free them, called here if no decode ever pulls them.
    `stream`: where the client's call takes responses straight, the request alone on it: once a
    decode on a stream of requests answered, its responses go there as they are read
    (ClientSink), with no coroutine woken per token; this loop wakes for the end."""
    tried: list[Backend] = []
    try:
        while True:
            lease = route.pick(tried)
            if lease is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, route.why_none() + (
                    f" (tried {', '.join(b.address for b in tried)})" if tried else ""))
            decode = lease.backend
            if tried:
                trace.retried("decode")
            tried.append(decode)
            span, call_metadata = trace.client_call("decode", decode, "Generate", metadata)
            call = decode.open_generate(msg, call_metadata, context.time_remaining())
            answered, error = False, None
            sink = ClientSink(stream, relay, trace, msg.request_id, route.aborted) if stream is not None else None
            try:
                async for raw in call:
                    if not answered:
                        answered = True
                        lease.prefilled()
                        if msg.HasField("kv_handle"):
                            let_go = None  # the decode has the blocks: it, or the prefill's timeout, ends the hold
                            trace.decode_answer(await call.initial_metadata())
                    if msg.request_id in route.aborted:  # the Abort API (it may have reached the decode too late)
                        yield aborted_response(msg)
                        return
                    trace.first_token()  # a no-op after the first
                    yield relay.forward(raw)
                    if sink is not None and isinstance(call, StreamedCall) and call.sink(sink):
                        sink = None  # (sunk: this loop wakes for the request's end now, or an Abort)
                return
            except grpc.aio.AioRpcError as e:
                error = e
                if relay.finished:  # its last message arrived before the failure: the answer is whole
                    if instance_failed(e):
                        decode.failed()
                    return
                if prefill_gone(e) and msg.HasField("kv_handle"):
                    # This decode is fine: it computes the prompt itself, from the first token on.
                    let_go, msg = None, resumed(msg, relay.token_ids)
                    tried.pop()
                    trace.fallback("prefill_gone")
                    continue
                await pass_on_or_take_out(decode, e, context)
            except BaseException as e:  # the client went away
                error = e
                raise
            finally:
                end_call(lease, call)
                trace.call_ended(span, "decode", decode, error)
            if len(tried) > route.max_migrations:
                names = ", ".join(b.address for b in tried)
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode instances {names} failed "
                                    f"({error.details()}); moved {len(tried) - 1} times, "
                                    "the most max_migrations allows")
            if msg.request_id in route.aborted:  # the Abort API, while the request was between instances
                yield aborted_response(msg)
                return
            if let_go is None and relay.token_ids:  # else the next instance pulls the held blocks, or starts over
                msg = resumed(msg, relay.token_ids)
                trace.migrated(decode, len(relay.token_ids))
                handle = await route.reprefill(msg) if route.reprefill is not None else None
                if handle is not None:  # the next decode pulls the prompt and computes the resumed tokens
                    msg.kv_handle.CopyFrom(handle)
                    let_go = lambda handle=handle: route.release(handle)  # noqa: E731
    finally:
        if let_go is not None:  # the blocks may still be held for a reader that will never come
            let_go()

