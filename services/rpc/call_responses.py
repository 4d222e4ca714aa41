"""Generate as a gRPC call of its own serves it (a call per request, as any stub calls): the
service's Generate runs in a task of its own, given this call's `CallResponses` beside the call's
context, to which its sinks hand the responses after the first as the step (or, at the router,
the decode's message) reads them; the call's handler yields what came since it last woke, once
woken for all of it, instead of once per token through the generators. Responses with nothing
but tokens merge while the caller reads slower than they come (one message, their ids and text
joined), as they would under a stream interval; one that keeps up gets a message per token.
`Pending` and `feeding` serve the OpenAI front's event streams the same way."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from baton.v1 import generate_pb2 as pb


class Pending:
    """What came for a call's handler to send, in order, and its wake-up: the handler is woken
    once for all that came since it last took (CallResponses', the OpenAI front's EventStream)."""
    __slots__ = ("items", "_ready", "_ended")

    def __init__(self):
        self.items: list = []
        self._ready = asyncio.Event()
        self._ended = False

    def push(self, item) -> None:
        self.items.append(item)
        self._ready.set()

    def end(self) -> None:
        self._ended = True
        self._ready.set()

    async def take(self) -> list | None:
        """All that came since the last take, once something did; None once it ended and all is taken."""
        while not self.items:
            if self._ended:
                return None
            self._ready.clear()
            await self._ready.wait()
        items, self.items = self.items, []
        return items


class CallResponses:
    """One call's responses on their way out, in the order they came: its Generate's own (`feed`)
    and those its sinks hand it (`respond`, `respond_tokens`, as a DirectContext takes them).
    `serialized`: the call's responses go out as bytes (the router's)."""
    __slots__ = ("_pending", "_merging", "_serialized")

    def __init__(self, serialized: bool):
        self._pending = Pending()
        self._merging: pb.GenerateResponse | None = None  # the last response, while tokens may join it
        self._serialized = serialized

    def respond(self, resp: pb.GenerateResponse | bytes) -> None:
        self._merging = None
        self._pending.push(resp)

    def respond_tokens(self, request_id: str, token_ids: list[int], text: str) -> None:
        merging = self._merging
        if merging is not None:  # (the caller has not taken the last yet)
            merging.token_ids.extend(token_ids)
            merging.text += text
            return
        self._merging = resp = pb.GenerateResponse(request_id=request_id, token_ids=token_ids, text=text)
        self._pending.push(resp)

    async def feed(self, responses: AsyncIterator) -> None:
        """The Generate's own responses (its first, its last, any its sinks did not take)."""
        try:
            async for resp in responses:
                self.respond(resp)
        finally:
            self._pending.end()

    async def take(self) -> list[pb.GenerateResponse | bytes] | None:
        """Pending.take's, serialized where the call's go out so."""
        items = await self._pending.take()
        self._merging = None
        if items is None or not self._serialized:
            return items
        return [r if isinstance(r, bytes) else r.SerializeToString() for r in items]


@contextlib.asynccontextmanager
async def feeding(feed: Awaitable[None]):
    """`feed` (what fills a Pending and ends it) run as a task of its own while the handler takes
    from it: leaving the block normally raises the feed's failure, if any (an abort's included,
    which is then the call's); leaving it early (the caller went away) cancels the feed, which
    ends its Generate and so its requests, and waits until it let go of them."""
    feeder = asyncio.ensure_future(feed)
    try:
        yield
        await feeder
    finally:
        if not feeder.done():
            feeder.cancel()
            await asyncio.wait([feeder])


def per_call(generate: Callable[..., AsyncIterator], serialized: bool) -> Callable[..., AsyncIterator]:
    """`generate(msg, context, responses)` as a gRPC call's handler."""
    async def Generate(msg: pb.GenerateRequest, context):
        responses = CallResponses(serialized)
        async with feeding(responses.feed(generate(msg, context, responses))):
            while (items := await responses.take()) is not None:
                for resp in items:
                    yield resp
    return Generate
