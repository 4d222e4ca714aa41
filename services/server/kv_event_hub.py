"""An engine server's KV cache events (internal Admin.SubscribeKVEvents): its engine core's
events (engine/common/kv_cache_events.py), numbered and fanned out to subscribers, a router's index above all.

The hub keeps a mirror of what the core holds, built from the same events from the core's start
on, so that a subscriber joining at any time gets a snapshot first: ALL_CLEARED, then STORED for
every block held (in chains), numbered with the last batch it includes; live batches follow with
the next numbers. Snapshot and subscription are taken in one synchronous step on the event loop,
so nothing falls between them. A subscriber that lets MAX_BEHIND batches pile up gets a fresh
snapshot instead of them (a slow router must not hold the server's memory).
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator

from baton.engine.common.kv_cache_events import KVEvent, KVEventKind, KVEventLog
from baton.kv_transfer.base import KVTier
from baton.services.rpc.kv_wire import TIER_TO_WIRE
from baton.v1 import internal_pb2 as ipb

MAX_BEHIND = 4096  # batches queued for one subscriber before it is sent a snapshot instead

KINDS = {KVEventKind.STORED: ipb.KV_EVENT_KIND_STORED, KVEventKind.REMOVED: ipb.KV_EVENT_KIND_REMOVED,
         KVEventKind.TIER_MOVED: ipb.KV_EVENT_KIND_TIER_MOVED, KVEventKind.ALL_CLEARED: ipb.KV_EVENT_KIND_ALL_CLEARED}


def to_proto(event: KVEvent) -> ipb.KVEvent:
    return ipb.KVEvent(kind=KINDS[event.kind], block_hashes=event.block_hashes, parent_hash=event.parent_hash,
                       tier=TIER_TO_WIRE[event.tier])


class KVBlockMirror:
    """What an engine's prefix cache holds, as its events tell: per tier, block hash -> parent
    hash, in the order the blocks were stored."""

    def __init__(self):
        self.tiers: dict[KVTier, dict[int, int | None]] = {tier: {} for tier in KVTier}

    def apply(self, event: KVEvent) -> None:
        held = self.tiers[event.tier]
        if event.kind is KVEventKind.STORED:
            parent = event.parent_hash
            for h in event.block_hashes:
                held[h] = parent
                parent = h
        elif event.kind is KVEventKind.REMOVED:
            for h in event.block_hashes:
                held.pop(h, None)
        elif event.kind is KVEventKind.TIER_MOVED:
            others = [t for name, t in self.tiers.items() if name != event.tier]
            for h in event.block_hashes:
                parents = [t.pop(h) for t in others if h in t]
                held[h] = parents[0] if parents else None
        else:  # ALL_CLEARED
            for t in self.tiers.values():
                t.clear()

    def as_events(self) -> list[KVEvent]:
        """ALL_CLEARED, then what is held as STORED events (a chain's blocks in one event)."""
        log = KVEventLog()
        log.cleared()
        for tier, held in self.tiers.items():
            for h, parent in held.items():
                log.stored(h, parent, tier)
        return log.take()


class _Subscriber:
    __slots__ = ("batches", "wake", "resync")

    def __init__(self):
        self.batches: deque[ipb.KVEventBatch] = deque()
        self.wake = asyncio.Event()
        self.resync = True  # a snapshot is due before any batch


class KVEventHub:
    def __init__(self, instance_id: str, block_size: int):
        self.instance_id = instance_id
        self.epoch = time.time_ns()  # this run of the engine: a restarted one has another
        self.block_size = block_size
        self.seq = 0  # of the last batch published
        self.mirror = KVBlockMirror()
        self._subscribers: set[_Subscriber] = set()

    def _batch(self, events: list[KVEvent], snapshot: bool = False) -> ipb.KVEventBatch:
        return ipb.KVEventBatch(instance_id=self.instance_id, epoch=self.epoch, seq=self.seq, snapshot=snapshot,
                                block_size=self.block_size, events=[to_proto(e) for e in events])

    def publish(self, events: list[KVEvent]) -> None:
        """One step's events from the core (CoreClient's on_kv_events), on the event loop."""
        self.seq += 1
        for event in events:
            self.mirror.apply(event)
        batch = None
        for sub in self._subscribers:
            if sub.resync:
                continue  # its snapshot, still to come, will include these
            if len(sub.batches) >= MAX_BEHIND:
                sub.batches.clear()
                sub.resync = True
            else:
                batch = batch or self._batch(events)
                sub.batches.append(batch)
            sub.wake.set()

    def snapshot(self) -> ipb.KVEventBatch:
        return self._batch(self.mirror.as_events(), snapshot=True)

    async def subscribe(self) -> AsyncIterator[ipb.KVEventBatch]:
        """A snapshot, then live batches until the caller stops iterating."""
        sub = _Subscriber()
        self._subscribers.add(sub)
        try:
            while True:
                if sub.resync:
                    sub.resync = False
                    sub.batches.clear()
                    yield self.snapshot()
                elif sub.batches:
                    yield sub.batches.popleft()
                else:
                    sub.wake.clear()
                    await sub.wake.wait()
        finally:
            self._subscribers.discard(sub)
