"""The router's Generate calls in flight: how many (against max_in_flight), the requests each
became (one, or n completions: the registry Abort looks a client's id up in), the backends
each request was sent to (where an Abort must go), and the requests the Abort API ended."""
from __future__ import annotations

from baton.services.router.backends import Backend
from baton.services.rpc.calls import CallRegistry


class InFlight:
    """`bound`: the most calls at once (None: no bound)."""

    def __init__(self, bound: int | None):
        self.bound = bound
        self.count = 0
        self._calls = CallRegistry()
        self._routed: dict[str, set[Backend]] = {}  # a request id sent to backends -> where it went
        # Ids of requests in flight that the Abort API ended (the decode leg looks here, DecodeRoute).
        self.aborted: set[str] = set()

    def is_live(self, request_id: str) -> bool:
        """A call with this (client's) request id is in flight."""
        return request_id in self._calls.live

    def full(self) -> bool:
        return self.bound is not None and self.count >= self.bound

    def entered(self) -> None:
        """A Generate call is in (counted until `left`)."""
        self.count += 1

    def started(self, request_id: str, ids: list[str]) -> None:
        """The call by the client's id is the requests `ids` (for Abort)."""
        self._calls.started(request_id, ids)

    def sent(self, request_id: str, backend: Backend) -> None:
        self._routed.setdefault(request_id, set()).add(backend)

    def left(self, request_id: str, ids: list[str]) -> None:
        """The call ended: forget its requests, where they went and whether they were aborted."""
        self.count -= 1
        self._calls.ended(request_id)
        for i in ids:
            self._routed.pop(i, None)
            self.aborted.discard(i)

    def abort(self, request_id: str) -> tuple[list[str], set[Backend]] | None:
        """Mark the call's requests aborted: their ids and the backends they reached (None: no
        such call in flight)."""
        ids = self._calls.live.get(request_id)
        if ids is None:
            return None
        self.aborted.update(ids)
        return ids, set().union(*(self._routed.get(i, ()) for i in ids))

    def status(self, request_id: str) -> int:
        """An Abort's answer for a call not in flight: finished lately, or not known."""
        return self._calls.status(request_id)
