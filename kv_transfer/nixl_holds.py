"""A prefill's side of the NIXL connector: the blocks it holds for decode readers, and how each
hold ends (nixl_connector.py has the path of a request). A hold registers one step after its
request finished (with the next step's metadata), so the reader's word may come first: it is
kept and ends the hold as it registers. A hold nobody ends within its deadline expires."""
from __future__ import annotations

import logging

from baton.kv_transfer.base import HoldOutcome, KVHoldEnd

log = logging.getLogger("baton.kv_transfer")

_EARLY_TTL_S = 60.0  # a hold registers one step after its request finished: far less


class Holds:
    def __init__(self):
        self.deadlines: dict[str, float] = {}  # request id -> when it expires
        self._ended: list[KVHoldEnd] = []  # since the last take
        # Holds that ended before they were registered (a read, or a release, that came first;
        # request id -> (when, outcome)), and reads of holds already let go: forgotten after _EARLY_TTL_S.
        self._early: dict[str, tuple[float, HoldOutcome]] = {}
        self._recent: dict[str, tuple[float, HoldOutcome]] = {}  # let go lately (id -> when, how): a repeat is no news
        self.num_expired = 0

    def __bool__(self) -> bool:
        return bool(self.deadlines)

    def register(self, req_id: str, deadline: float) -> None:
        self._recent.pop(req_id, None)  # a new hold under a reused id
        early = self._early.pop(req_id, None)
        if early is None:
            self.deadlines[req_id] = deadline
        else:  # already read (or released): let go at once
            self._ended.append(KVHoldEnd(req_id, early[1], early[0]))
            self._recent[req_id] = early

    def end(self, req_id: str, outcome: HoldOutcome, now: float) -> None:
        if self.deadlines.pop(req_id, None) is not None:
            self._ended.append(KVHoldEnd(req_id, outcome, now))
            self._recent[req_id] = (now, outcome)
        elif req_id not in self._recent:  # finished this step: its hold registers with the next step's metadata
            self._early[req_id] = (now, outcome)
        # else: a second release, or a read of a hold let go already: nothing more to end

    def take(self, now: float) -> list[KVHoldEnd]:
        """The holds that ended since the last call, those expired by `now` included."""
        for seen in (self._early, self._recent):  # an early one: its hold was let go before the read
            for req_id, (when, _) in list(seen.items()) if seen else ():
                if now - when > _EARLY_TTL_S:
                    del seen[req_id]
        for req_id, deadline in list(self.deadlines.items()):
            if now >= deadline:
                self.num_expired += 1
                log.warning("KV blocks of %s were not pulled in time; freeing them", req_id)
                self.end(req_id, HoldOutcome.EXPIRED, now)
        ended, self._ended = self._ended, []
        return ended
