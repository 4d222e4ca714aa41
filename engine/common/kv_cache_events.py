"""KV cache events, as vLLM v1's scheduler publishes them (vllm/distributed/kv_events.py): which
prefix-cache blocks an engine holds, told as they change, so that a router can index what every
instance holds instead of guessing from the prompts it saw pass.

A block is named by its chain hash (block_hashes.hash_block); a tier is a KVTier (the KV seam's). The kinds:
  STORED       blocks became findable in `tier`; parent_hash is the hash of the block before the
               first of them (None: they start a prompt), so a router can follow the chain
  REMOVED      blocks left `tier` (evicted, or registered before their KV was written)
  TIER_MOVED   blocks now live in `tier` and no longer in the other (a host-memory tier offloading
               an evicted device block, or bringing it back)
  ALL_CLEARED  every block of every tier is gone (reset_prefix_cache, or a fresh start)

The KV cache manager calls a sink at the points where a hash enters or leaves its `cached` map:
the offline engine's sink drops them (NO_KV_EVENTS), a server's engine core records them in a
KVEventLog and sends what it recorded with each step's output (CoreStep.kv_events). Plain data:
services/ turns them into the streaming RPC.
"""
from __future__ import annotations

import enum

import msgspec

from baton.kv_transfer.base import KVTier


class KVEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    TIER_MOVED = "tier_moved"
    ALL_CLEARED = "all_cleared"


class KVEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    kind: KVEventKind
    block_hashes: list[int] = []
    parent_hash: int | None = None  # STORED only
    tier: KVTier = KVTier.DEVICE  # STORED / REMOVED: where; TIER_MOVED: where the blocks are now


class NoKVEvents:
    """The sink that publishes nothing (the offline engine, and every engine not asked to)."""

    def stored(self, block_hash: int, parent_hash: int | None, tier: KVTier = KVTier.DEVICE) -> None:
        pass

    def removed(self, block_hash: int, tier: KVTier = KVTier.DEVICE) -> None:
        pass

    def moved(self, block_hash: int, tier: KVTier) -> None:
        pass

    def cleared(self) -> None:
        pass


NO_KV_EVENTS = NoKVEvents()


class KVEventLog(NoKVEvents):
    """Records events until `take`. A block that continues the chain of the last STORED event
    joins it, and consecutive removals (moves) to one tier join one event, so that a prompt's
    blocks cross the wire as one event, as vLLM batches them."""

    def __init__(self):
        self.events: list[KVEvent] = []

    def _joins(self, kind: KVEventKind, tier: KVTier) -> KVEvent | None:
        last = self.events[-1] if self.events else None
        return last if last is not None and last.kind is kind and last.tier == tier else None

    def stored(self, block_hash: int, parent_hash: int | None, tier: KVTier = KVTier.DEVICE) -> None:
        last = self._joins(KVEventKind.STORED, tier)
        if last is not None and parent_hash is not None and last.block_hashes[-1] == parent_hash:
            last.block_hashes.append(block_hash)
        else:
            self.events.append(KVEvent(KVEventKind.STORED, [block_hash], parent_hash, tier))

    def removed(self, block_hash: int, tier: KVTier = KVTier.DEVICE) -> None:
        self._append(KVEventKind.REMOVED, block_hash, tier)

    def moved(self, block_hash: int, tier: KVTier) -> None:
        self._append(KVEventKind.TIER_MOVED, block_hash, tier)

    def _append(self, kind: KVEventKind, block_hash: int, tier: KVTier) -> None:
        last = self._joins(kind, tier)
        if last is not None:
            last.block_hashes.append(block_hash)
        else:
            self.events.append(KVEvent(kind, [block_hash], None, tier))

    def cleared(self) -> None:
        self.events = [KVEvent(KVEventKind.ALL_CLEARED)]  # what came before it no longer matters

    def take(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
