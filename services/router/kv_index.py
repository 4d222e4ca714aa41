"""The router's global index of which instance holds which prefix-cache blocks in which tier,
built from every instance's KV events (the internal Admin.SubscribeKVEvents stream), as llm-d's
precise prefix-cache scorer and Dynamo's KV router keep theirs.

One subscription per instance, kept open: each stream opens with a snapshot (ALL_CLEARED, then
the blocks held), then live batches numbered one after the other. A batch out of sequence, or of
another run of the engine (instance id, epoch), means something was lost: the instance's entries
are dropped and it is subscribed to again. A stream that breaks (the instance died, restarts, or
cannot be reached) drops its entries too, and is retried with backoff until it answers; the next
snapshot brings the entries back.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from baton.services.rpc.names import token_metadata
from baton.v1 import generate_pb2 as pb
from baton.v1 import internal_pb2 as ipb
from baton.v1 import internal_pb2_grpc

log = logging.getLogger("baton.router")

DEVICE, HOST = 1, 2  # tier bits: a block may sit in both tiers at once
_TIER_BITS = {pb.KV_TIER_DEVICE: DEVICE, pb.KV_TIER_HOST: HOST}
_BACKOFF_S = (0.1, 2.0)  # first and longest wait before subscribing again


class KVIndex:
    """block hash -> {instance address: tier bits}, and per instance the hashes it holds (so that
    its entries go at once when it clears, restarts or disconnects)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.blocks: dict[int, dict[str, int]] = {}
        self.by_instance: dict[str, set[int]] = {}

    def _set(self, address: str, block_hash: int, bits: int) -> None:
        holders = self.blocks.get(block_hash)
        if bits:
            if holders is None:
                holders = self.blocks[block_hash] = {}
            holders[address] = bits
            self.by_instance.setdefault(address, set()).add(block_hash)
        elif holders is not None and holders.pop(address, None) is not None:
            if not holders:
                del self.blocks[block_hash]
            self.by_instance[address].discard(block_hash)

    def _bits(self, address: str, block_hash: int) -> int:
        return self.blocks.get(block_hash, {}).get(address, 0)

    def apply(self, address: str, event: ipb.KVEvent) -> None:
        kind, tier = event.kind, _TIER_BITS.get(event.tier, DEVICE)
        if kind == ipb.KV_EVENT_KIND_STORED:
            for h in event.block_hashes:
                self._set(address, h, self._bits(address, h) | tier)
        elif kind == ipb.KV_EVENT_KIND_REMOVED:
            for h in event.block_hashes:
                self._set(address, h, self._bits(address, h) & ~tier)
        elif kind == ipb.KV_EVENT_KIND_TIER_MOVED:
            for h in event.block_hashes:
                self._set(address, h, tier)
        elif kind == ipb.KV_EVENT_KIND_ALL_CLEARED:
            self.drop(address)

    def drop(self, address: str) -> None:
        """Forget everything the instance held."""
        for h in self.by_instance.pop(address, ()):
            holders = self.blocks[h]
            del holders[address]
            if not holders:
                del self.blocks[h]

    def held(self, address: str, tier: int = DEVICE) -> set[int]:
        """The hashes the instance holds in a tier."""
        return {h for h in self.by_instance.get(address, ()) if self.blocks[h][address] & tier}

    def overlap(self, addresses: list[str], hashes: list[int]) -> dict[str, tuple[int, int]]:
        """Per instance, how many of the prompt's leading blocks it holds: (in device memory, in
        host memory only). The run ends at the first block the instance holds in neither."""
        counts = {a: [0, 0] for a in addresses}
        live = set(addresses)
        for h in hashes:
            holders = self.blocks.get(h)
            if holders is None:
                break
            for a in list(live):
                bits = holders.get(a, 0)
                if not bits:
                    live.discard(a)
                else:
                    counts[a][0 if bits & DEVICE else 1] += 1
            if not live:
                break
        return {a: (d, host) for a, (d, host) in counts.items()}


class KVEventSubscription:
    """One instance's KV event stream, applied to the index and kept open until closed."""

    def __init__(self, index: KVIndex, backend, internal_token: str | None):
        self.index = index
        self.backend = backend
        self.address = backend.address
        self.metadata = token_metadata(internal_token)
        self.run: tuple[str, int] | None = None  # the (instance id, epoch) whose batches are applied
        self.seq = 0  # the last batch applied
        self.num_resyncs = 0  # subscriptions after the first (a break, a gap, a restart)
        self._warned_block_size = False
        self._task = asyncio.ensure_future(self._follow())

    async def _follow(self) -> None:
        stub = internal_pb2_grpc.AdminStub(self.backend.channel)
        backoff = _BACKOFF_S[0]
        while True:
            try:
                # wait_for_ready: an instance that is down is subscribed to the moment it is back.
                call = stub.SubscribeKVEvents(ipb.SubscribeKVEventsRequest(), metadata=self.metadata,
                                              wait_for_ready=True)
                async for batch in call:
                    if not self._accept(batch):
                        call.cancel()
                        break
                    backoff = _BACKOFF_S[0]
            except grpc.aio.AioRpcError as e:  # down, restarting or loading: expected; anything else is not
                expected = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
                log.log(logging.DEBUG if expected else logging.WARNING, "KV events of %s: %s: %s", self.address,
                        e.code().name, e.details())
            self.index.drop(self.address)
            self.run, self.seq = None, 0
            self.num_resyncs += 1
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, _BACKOFF_S[1])

    def _accept(self, batch: ipb.KVEventBatch) -> bool:
        """Apply a batch; false when it does not follow the last one (subscribe again)."""
        fresh = batch.snapshot or (batch.events and batch.events[0].kind == ipb.KV_EVENT_KIND_ALL_CLEARED)
        if not fresh and ((batch.instance_id, batch.epoch) != self.run or batch.seq != self.seq + 1):
            log.warning("KV events of %s: batch %d of %s/%d after %d of %s: subscribing again", self.address,
                        batch.seq, batch.instance_id, batch.epoch, self.seq, self.run)
            return False
        self.run, self.seq = (batch.instance_id, batch.epoch), batch.seq
        if batch.block_size != self.index.block_size:  # its hashes can never match the router's
            if not self._warned_block_size:
                self._warned_block_size = True
                log.error("%s caches blocks of %d tokens, the router hashes prompts in blocks of %d (--block-size): "
                          "its KV events are ignored", self.address, batch.block_size, self.index.block_size)
            return True
        for event in batch.events:
            self.index.apply(self.address, event)
        return True

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.index.drop(self.address)
