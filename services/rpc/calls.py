"""What the runtime API of an engine server and of the router share: WatchLoad's loop, and
the registry of Generate calls in flight that Abort looks requests up in."""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable

from baton.v1 import generate_pb2 as pb

RECENT_IDS = 10_000  # finished request ids remembered, so that a late Abort says ALREADY_FINISHED
_DEFAULT_INTERVAL_MS, _MIN_INTERVAL_MS = 500, 50


async def watch(get_load: Callable[[], Awaitable[pb.Load]], msg: pb.GetLoadRequest) -> AsyncIterator[pb.Load]:
    """The load now, then again each time it differs (looked at every interval_ms)."""
    interval = max(msg.interval_ms or _DEFAULT_INTERVAL_MS, _MIN_INTERVAL_MS) / 1000
    last = None
    while True:
        load = await get_load()
        if load != last:
            last = load
            yield load
        await asyncio.sleep(interval)


class CallRegistry:
    """The Generate calls in flight, by the request id the client knows, with the ids of the
    requests they became (one, or n completions), and the ids that finished lately."""

    def __init__(self):
        self.live: dict[str, list[str]] = {}
        self.recent: OrderedDict[str, None] = OrderedDict()

    def started(self, request_id: str, ids: list[str]) -> None:
        self.live[request_id] = ids

    def ended(self, request_id: str) -> None:
        if self.live.pop(request_id, None) is not None:
            self.recent[request_id] = None
            if len(self.recent) > RECENT_IDS:
                self.recent.popitem(last=False)

    def status(self, request_id: str) -> int:
        return pb.ABORT_STATUS_ALREADY_FINISHED if request_id in self.recent else pb.ABORT_STATUS_NOT_FOUND
