"""The host KV tier's bookkeeping: a second pool of blocks in host memory behind the device's
(vLLM's `kv_offloading_size`), and swap preemption's (vLLM v0's PreemptionMode.SWAP).

Four flows, all decided here and carried out by the runner's HostKVCopier (host_kv_copier.py);
like the device pool's manager, only block ids live here:
- write-back: when a finished request's full, prefix-cached blocks fall free on the device they
  are copied to the host off the step loop. Each stays pinned on the device (an extra
  reference) until its copy is reported landed, so it cannot be handed out and overwritten
  mid-copy; its hash joins the host's cache only then.
- load: a prefix lookup that misses the device but hits the host allocates device blocks and
  parks the request in WAITING_FOR_REMOTE_KVS (the connector's machinery) while the blocks come
  back; the host blocks are pinned until the load is reported. The host keeps its copy
  (inclusive), so a block read back and freed again costs no second write.
- swap: a preempted request's computed blocks (the partial last one too) go to host blocks it
  owns, copied before the step's forward reuses the device blocks. It resumes as vLLM v0's
  swapped requests do: its blocks are copied back before the forward of the step that runs it
  (no waiting state), and it keeps its place ahead of requests not admitted yet.
- hand-off: a finished prefill's blocks held for a decode peer, when the device pool is short,
  go to host blocks the hold owns, copied in the background; its handle then names those (the
  decode reads them there) and its device blocks fall free once the copy landed.

The device pool has one KV cache group here (the engine turns the hybrid manager off with this
tier): a request's blocks are one list.

LRU across both tiers: the device's free queue evicts its least recently freed block, whose copy
stays on the host; the host's free queue evicts its least recently stored or read one. A hit
on either tier refreshes the block there.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from baton.engine.common.scheduler_output import HostKVOps
from baton.engine.core.kv_cache_manager import Block, KVCacheManager, acquire, release
from baton.engine.core.request import Request
from baton.kv_transfer.base import KVTier


@dataclass(slots=True)
class _Job:
    """What to settle once a job's copies landed."""
    stored: list[tuple[Block, Block, int | None]] = field(default_factory=list)  # device block, host block, hash
    read: list[Block] = field(default_factory=list)  # host blocks pinned for loads
    loaded: list[str] = field(default_factory=list)  # requests whose loads are in the job
    handed_off: list[str] = field(default_factory=list)  # held requests whose blocks the job copies here


class HostKVTier:
    def __init__(self, num_blocks: int, kv: KVCacheManager, preemption_mode: str = "recompute",
                 max_num_batched_tokens: int = 2048):
        self.num_blocks = num_blocks
        self.preemption_mode = preemption_mode
        # auto: swap a victim whose recompute would take more than half a step's token budget
        # (it would crowd the other requests out of the step it resumes in); a shorter one is
        # recomputed, riding along with the step's decodes at little cost, and saves a copy each way.
        self.swap_min_tokens = 0 if preemption_mode == "swap" else max_num_batched_tokens // 2 + 1
        self.kv = kv
        self.block_size = kv.block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Unreferenced blocks in eviction order: empty ones first, then cached ones, LRU first.
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}  # block hash -> host block (its copy landed)
        self.storing: set[int] = set()  # hashes whose write-back is in flight (not written twice)
        self.swapped: dict[str, tuple[list[Block], int]] = {}  # request id -> its host blocks, tokens they hold
        self.holds: dict[str, list[Block]] = {}  # held prefill request id -> the host blocks its handle names
        # the last lookup's host hits, until its blocks are allocated
        self._match: tuple[str, list[Block]] | None = None
        self._ops = HostKVOps()
        self._job = _Job()
        self._jobs: dict[int, _Job] = {}  # in flight
        self._next_job = 1
        self.num_hits = 0  # prompt tokens found here (beyond the device's hits)
        self.num_stored_blocks = self.num_loaded_blocks = 0
        self.num_swapped_out = 0  # preemptions that swapped
        self.num_handed_off = 0  # holds moved here

    # ---- figures -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_empty_blocks(self) -> int:
        """Free and holding no copy (they lead the free queue)."""
        return sum(1 for _ in itertools.takewhile(lambda b: b.block_hash is None, self.free_queue.values()))

    @property
    def has_pending(self) -> bool:
        """Copies decided or in flight: the engine steps until they are settled."""
        return bool(self._jobs) or bool(self._ops)

    # ---- the host pool -----------------------------------------------------------------
    def _alloc(self) -> Block | None:
        if not self.free_queue:
            return None  # every host block is pinned by a copy or a swapped request
        _, block = self.free_queue.popitem(last=False)
        if block.block_hash is not None:  # evicted: its least recently used copy is dropped
            self.kv.events.removed(block.block_hash, KVTier.HOST)
            del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def _ref(self, block: Block) -> None:
        acquire(block, self.free_queue)

    def _unref(self, block: Block) -> None:
        release(block, self.free_queue)

    def _register(self, host: Block, block_hash: int) -> None:
        if block_hash not in self.cached:
            host.block_hash = block_hash
            self.cached[block_hash] = host
            self.kv.events.stored(block_hash, None, KVTier.HOST)  # (the router's index needs no chain for a copy)

    # ---- write-back ------------------------------------------------------------------------
    def store_freed(self, request: Request) -> None:
        """Before the device frees `request`'s blocks: those about to fall free that hold a
        computed, prefix-cached block the host lacks are written back (and pinned until then)."""
        blocks = self.kv.request_blocks(request.request_id)
        num_valid = request.num_computed_tokens // self.block_size
        for block in blocks[:num_valid]:
            h = block.block_hash
            if h is None or block.ref_cnt != 1 or h in self.storing:
                continue
            if h in self.cached:  # already there: a use refreshes it
                host = self.cached[h]
                if host.ref_cnt == 0:
                    self.free_queue.move_to_end(host.block_id)
                continue
            host = self._alloc()
            if host is None:
                return
            block.ref_cnt += 1  # the copy's reference: not freed (nor overwritten) before it lands
            self.storing.add(h)
            self._ops.offload.append((block.block_id, host.block_id))
            self._job.stored.append((block, host, h))

    # ---- prefix lookups and swap-ins ------------------------------------------------------
    def match(self, request: Request, num_device_blocks: int) -> int:
        """Tokens beyond the device's `num_device_blocks` prefix hits that the host holds (its own
        blocks, for a swapped request); they load asynchronously once device blocks are allocated."""
        swapped = self.swapped.get(request.request_id)
        if swapped is not None:
            blocks, num_tokens = swapped
            num_tokens = min(num_tokens, request.num_tokens - 1)  # the last token's logits are wanted
            self._match = (request.request_id, blocks[:-(-num_tokens // self.block_size)])
            return num_tokens
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[num_device_blocks:max_blocks]:
            host = self.cached.get(block_hash)
            if host is None:
                break
            hits.append(host)
        self._match = (request.request_id, hits)
        return len(hits) * self.block_size

    def has_match(self, request: Request) -> bool:
        """Whether the last lookup, `request`'s, found blocks here."""
        return self._match is not None and self._match[0] == request.request_id and bool(self._match[1])

    def load_after_alloc(self, request: Request, block_ids: list[int], num_device_blocks: int) -> None:
        """The device blocks for `match`'s hits are allocated: load into them (a swapped request's
        before this step's forward, which runs it; a prefix's in the background)."""
        hits, self._match = self._match[1], None
        if request.request_id in self.swapped:
            self._ops.swap_in += [(host.block_id, device) for host, device in zip(hits, block_ids)]
            self.num_loaded_blocks += len(hits)
            self.release_owned(request)  # read before anything can reuse them: they go back now
            return
        self.num_hits += len(hits) * self.block_size  # a prefix hit (counted once it loads, not per lookup)
        for host, device in zip(hits, block_ids[num_device_blocks:num_device_blocks + len(hits)], strict=True):
            self._ref(host)  # not evicted while read
            self._ops.load.append((host.block_id, device))
            self._job.read.append(host)
        self._job.loaded.append(request.request_id)
        self.num_loaded_blocks += len(hits)

    # ---- swap ------------------------------------------------------------------------------
    def preempt(self, request: Request) -> bool:
        """Called for a victim before the device frees its blocks: swap them out when the
        preemption mode says so and the host has room (else it is recomputed)."""
        if (self.preemption_mode == "recompute" or request.num_computed_tokens < max(1, self.swap_min_tokens)
                or request.sampling_params.prompt_logprobs is not None):  # (those restart from the first token)
            return False
        return self.swap_out(request)

    def swap_out(self, request: Request) -> bool:
        """Copy a victim's computed blocks to host blocks it owns (before the device frees them);
        false, with nothing changed, when the host cannot take them all."""
        num_tokens = request.num_computed_tokens
        blocks = self.kv.request_blocks(request.request_id)[:-(-num_tokens // self.block_size)]
        # Blocks past the computed ones may carry a hash already (registered when this step
        # scheduled their tokens, under the priority policy) but not their KV: copied, not named.
        num_full = num_tokens // self.block_size
        if (shared := self._share_copies(blocks, num_full)) is None:
            return False
        owned = []
        for i, block in enumerate(blocks):
            host = shared.get(i)
            if host is None:
                host = self._alloc()
                self._ops.swap_out.append((block.block_id, host.block_id))
                if block.block_hash is not None and i < num_full:  # the copy lands before anything reads it
                    self._register(host, block.block_hash)
            owned.append(host)
        self.swapped[request.request_id] = (owned, num_tokens)
        self.num_swapped_out += 1
        return True

    def _share_copies(self, blocks: list[Block], num_full: int) -> dict[int, Block] | None:
        """For a request's device blocks about to be copied here: {index: host block} for those
        among the first `num_full` whose copy the host has, each referenced now (so the
        allocations for the rest stay off them); None, with nothing changed, when the host
        cannot take the rest."""
        shared = {i: self.cached[b.block_hash] for i, b in enumerate(blocks[:num_full]) if b.block_hash in self.cached}
        if len(blocks) - len(shared) + sum(1 for host in shared.values() if host.ref_cnt == 0) > self.num_free_blocks:
            return None
        for host in shared.values():
            self._ref(host)
        return shared

    def release_owned(self, request: Request) -> None:
        """The host blocks a request owns are let go: a swapped request's (it ended or resumed),
        or a hold's (it ended)."""
        swapped = self.swapped.pop(request.request_id, None)
        for host in [*(swapped[0] if swapped else ()), *self.holds.pop(request.request_id, ())]:
            self._unref(host)

    # ---- hand-off ------------------------------------------------------------------------
    def hand_off(self, request: Request, num_blocks: int) -> list[int] | None:
        """Copy the first `num_blocks` blocks of a finished request held for a decode peer to host
        blocks the hold owns, in the background (each device block pinned until its copy lands);
        their ids, or None, with nothing changed, when the host cannot take them all."""
        blocks = self.kv.request_blocks(request.request_id)[:num_blocks]
        num_full = request.num_computed_tokens // self.block_size
        if (shared := self._share_copies(blocks, num_full)) is None:
            return None
        owned = []
        for i, block in enumerate(blocks):
            host = shared.get(i)
            if host is None:
                host = self._alloc()  # the copy's reference, dropped when it lands
                self._ref(host)  # the hold's
                h = block.block_hash if i < num_full and block.block_hash not in self.storing else None
                if h is not None:  # joins the host's prefix cache once it landed
                    self.storing.add(h)
                block.ref_cnt += 1  # the copy's reference on the device block
                self._ops.offload.append((block.block_id, host.block_id))
                self._job.stored.append((block, host, h))
            owned.append(host)
        self._job.handed_off.append(request.request_id)
        self.holds[request.request_id] = owned
        self.num_handed_off += 1
        return [host.block_id for host in owned]

    def reset_prefix_cache(self) -> None:
        """Forget every copy's hash (LLM.reset_prefix_cache); write-backs in flight land unnamed."""
        for host in self.cached.values():
            host.block_hash = None
            if host.ref_cnt == 0:
                self.free_queue.move_to_end(host.block_id, last=False)
        self.cached.clear()
        self.storing.clear()
        for job in (self._job, *self._jobs.values()):
            job.stored = [(device, host, None) for device, host, _ in job.stored]

    # ---- one step --------------------------------------------------------------------------
    def build_ops(self) -> HostKVOps | None:
        """This step's copies for the runner (None: none)."""
        if not self._ops:
            return None
        ops, job = self._ops, self._job
        ops.job_id, self._next_job = self._next_job, self._next_job + 1
        if ops.offload or ops.load:
            self._jobs[ops.job_id] = job
        self._ops, self._job = HostKVOps(), _Job()
        return ops

    def finished(self, job_ids: list[int]) -> tuple[list[str], list[str]]:
        """Settle the jobs the runner reports landed; returns the requests whose loads landed, and
        the held ones whose hand-off copies did."""
        loaded, handed_off = [], []
        for job_id in job_ids:
            job = self._jobs.pop(job_id)
            for device, host, block_hash in reversed(job.stored):  # the request's tail falls free first
                if block_hash is not None:  # (None: the cache was reset meanwhile)
                    self.storing.discard(block_hash)
                    self._register(host, block_hash)
                self._unref(host)
                self.num_stored_blocks += 1
                release(device, self.kv.free_queue)  # the copy's reference (freed meanwhile: back to the free queue)
            for host in job.read:
                self._unref(host)
            loaded += job.loaded
            handed_off += job.handed_off
        return loaded, handed_off
