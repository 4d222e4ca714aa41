"""Generate as a gRPC call of its own serves it (a call per request, as any stub calls): the
service's Generate runs in a task of its own, given this call's `CallResponses` beside the call's
context, to which its sinks hand the responses after the first as the step (or, at the router,
the decode's message) reads them; the call's handler yields what came since it last woke, once
woken for all of it, instead of once per token through the generators. Responses with nothing
but tokens merge while the caller reads slower than they come (one message, their ids and text
joined), as they would under a stream interval; one that keeps up gets a message per token."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from baton.v1 import generate_pb2 as pb


class CallResponses:
    """One call's responses on their way out, in the order they came: its Generate's own (`feed`)
    and those its sinks hand it (`respond`, `respond_tokens`, as a DirectContext takes them).
    `serialized`: the call's responses go out as bytes (the router's)."""
    __slots__ = ("_items", "_merging", "_ready", "_ended", "_serialized")

    def __init__(self, serialized: bool):
        self._items: list[pb.GenerateResponse | bytes] = []
        self._merging: pb.GenerateResponse | None = None  # the last item, while tokens may join it
        self._ready = asyncio.Event()
        self._ended = False
        self._serialized = serialized

    def respond(self, resp: pb.GenerateResponse | bytes) -> None:
        self._merging = None
        self._items.append(resp)
        self._ready.set()

    def respond_tokens(self, request_id: str, token_ids: list[int], text: str) -> None:
        merging = self._merging
        if merging is not None:  # (the caller has not taken the last yet)
            merging.token_ids.extend(token_ids)
            merging.text += text
            return
        self._merging = resp = pb.GenerateResponse(request_id=request_id, token_ids=token_ids, text=text)
        self._items.append(resp)
        self._ready.set()

    async def feed(self, responses: AsyncIterator) -> None:
        """The Generate's own responses (its first, its last, any its sinks did not take)."""
        try:
            async for resp in responses:
                self.respond(resp)
        finally:
            self._ended = True
            self._ready.set()

    async def take(self) -> list[pb.GenerateResponse | bytes] | None:
        """All that came since the last take, once something did; None once it ended and all is taken."""
        while not self._items:
            if self._ended:
                return None
            self._ready.clear()
            await self._ready.wait()
        items, self._items, self._merging = self._items, [], None
        if self._serialized:
            return [r if isinstance(r, bytes) else r.SerializeToString() for r in items]
        return items


def per_call(generate: Callable[..., AsyncIterator], serialized: bool) -> Callable[..., AsyncIterator]:
    """`generate(msg, context, responses)` as a gRPC call's handler."""
    async def Generate(msg: pb.GenerateRequest, context):
        responses = CallResponses(serialized)
        feeder = asyncio.ensure_future(responses.feed(generate(msg, context, responses)))
        try:
            while (items := await responses.take()) is not None:
                for resp in items:
                    yield resp
            await feeder  # (its failure, an abort's included, is the call's)
        finally:
            if not feeder.done():  # the caller went away: the Generate ends, which ends its requests
                feeder.cancel()
                await asyncio.wait([feeder])
    return Generate
