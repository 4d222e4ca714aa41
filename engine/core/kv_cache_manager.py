"""The paged KV cache's bookkeeping: a fixed pool of blocks, refcounts, and prefix caching.

A block holds `block_size` tokens of one KV cache group's layers (engine/common/kv_groups.py;
without sliding-window layers, one group of every layer). Each request has a block list per
group, all drawn from the one pool. A sliding-window group lets go of the blocks that fell out
of its window (its list keeps None in their place), so a long request holds its window's
blocks there, not its whole context: vLLM's hybrid KV cache manager.

A full block is identified by a hash chained over token ids (hash(parent_hash, block tokens)),
so equal prefixes map to equal blocks; each group caches its own. A prefix hit is as long as
every group can serve: a full-attention group needs every block before it, a sliding group
only the blocks its window reads from there. Free blocks wait in a queue in eviction order; a
freed block keeps its hash and can be hit again until it is handed out for something else.
Only tensors' indices live here.
"""
from __future__ import annotations

from collections import OrderedDict

from baton.engine.common.block_hashes import extend_block_hashes
from baton.engine.common.kv_cache_events import NO_KV_EVENTS
from baton.engine.core.request import Request
from baton.kv_transfer.base import first_needed_block

Hits = list[list["Block | None"]]  # per group, the prefix-cache hits (None: before a sliding group's window)


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "group")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.group = 0  # whose cache its hash is in


def acquire(block: Block, free_queue: OrderedDict) -> None:
    """Take a reference: a block that had none leaves its pool's free queue."""
    if block.ref_cnt == 0:
        del free_queue[block.block_id]
    block.ref_cnt += 1


def release(block: Block, free_queue: OrderedDict) -> None:
    """Drop a reference: a block left with none goes back to its pool's free queue, last (most
    recently used) when it keeps a cache value, first when it has none."""
    block.ref_cnt -= 1
    if block.ref_cnt == 0:
        free_queue[block.block_id] = block
        if block.block_hash is None:
            free_queue.move_to_end(block.block_id, last=False)


def num_hits(hits: Hits) -> int:
    """How many leading blocks a prefix hit covers."""
    return len(hits[0]) if hits else 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 windows: tuple[int | None, ...] = (None,)):
        """`windows`: each KV cache group's sliding window (None: full attention)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.windows = tuple(windows)
        self.hybrid = any(w is not None for w in self.windows)
        self._nothing_new: list[list[int]] = [[] for _ in self.windows]  # (read only) most decode steps' answer
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.caches: list[dict[int, Block]] = [{} for _ in self.windows]  # per group: block hash -> block
        # The group whose cache the router hears of (kv_events) and GetKVBlockHashes lists: the
        # first full-attention one, whose blocks stay while their request runs.
        self.event_group = next((g for g, w in enumerate(self.windows) if w is None), 0)
        self.cached = self.caches[self.event_group]
        self.req_blocks: dict[str, list[list[Block | None]]] = {}  # request id -> its blocks, per group
        self.num_cached_blocks: dict[str, int] = {}  # how many leading blocks of a request are in the caches
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        self.events = NO_KV_EVENTS  # told each hash that enters or leaves `cached` (kv_cache_events.py)

    # ---- figures -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block ids per group, -1 where a sliding group holds none."""
        groups = self.req_blocks.get(request_id)
        if groups is None:
            return [[] for _ in self.windows]
        return [[-1 if b is None else b.block_id for b in blocks] for blocks in groups]

    def request_blocks(self, request_id: str) -> list[Block]:
        """The request's blocks where there is one group (the host tier's callers)."""
        return self.req_blocks.get(request_id, [[]])[0]

    def num_blocks_missing(self, request: Request) -> int:
        """Blocks the request still lacks for all its known tokens (a sliding group's: its window's)."""
        groups = self.req_blocks.get(request.request_id)
        end, need = -(-request.num_tokens // self.block_size), 0
        for g, window in enumerate(self.windows):
            have = len(groups[g]) if groups else 0
            need += max(0, end - max(have, first_needed_block(request.num_tokens, window, self.block_size)))
        return need

    # ---- prefix caching ------------------------------------------------------------------
    def _update_block_hashes(self, request: Request) -> None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, root=request.hash_root)

    def get_computed_blocks(self, request: Request) -> tuple[Hits, int]:
        """The longest run of cached blocks every group can serve as the request's prefix (per
        group), and its token count."""
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        # At least the last token is always recomputed: its logits give the next token.
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        n = len(hashes)
        for g, window in enumerate(self.windows):  # full attention: every block before the end
            if window is None:
                n = next((i for i, h in enumerate(hashes[:n]) if h not in self.caches[g]), n)
        shorter = True
        while shorter and n:  # sliding groups: their windows' blocks; each may shorten the hit for the others
            shorter = False
            for g, window in enumerate(self.windows):
                if window is not None and (m := self._window_hit(g, hashes, n, window)) < n:
                    n, shorter = m, True
        self.prefix_queries += request.num_tokens
        self.prefix_hits += n * self.block_size
        if not n:
            return [], 0
        firsts = [first_needed_block(n * self.block_size, w, self.block_size) for w in self.windows]
        return [[None if i < first else cache[h] for i, h in enumerate(hashes[:n])]
                for cache, first in zip(self.caches, firsts)], n * self.block_size

    def _window_hit(self, group: int, hashes: list[int], n: int, window: int) -> int:
        """The longest hit of at most `n` blocks whose window's blocks `group` has cached."""
        cache, bs = self.caches[group], self.block_size
        while n:
            first = first_needed_block(n * bs, window, bs)
            missing = next((i for i in range(n - 1, first - 1, -1) if hashes[i] not in cache), None)
            if missing is None:
                return n
            n = missing  # every hit ending past it reads it
        return 0

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks covering its first `num_tokens` tokens."""
        start = self.num_cached_blocks.get(request.request_id, 0)
        if not self.enable_caching or num_tokens // self.block_size <= start:
            return  # no block newly full: most decode steps
        self._update_block_hashes(request)
        groups = self.req_blocks[request.request_id]
        end = min(num_tokens // self.block_size, len(groups[0]), len(request.block_hashes))
        for g, (blocks, cache) in enumerate(zip(groups, self.caches)):
            for i in range(start, end):
                block, block_hash = blocks[i], request.block_hashes[i]
                if block is None or block.block_hash is not None or block_hash in cache:
                    continue
                block.block_hash, block.group = block_hash, g
                cache[block_hash] = block
                if g == self.event_group:
                    self.events.stored(block_hash, request.block_hashes[i - 1] if i else None)
        self.num_cached_blocks[request.request_id] = max(start, end)

    def _uncache(self, block: Block) -> None:
        del self.caches[block.group][block.block_hash]
        if block.group == self.event_group:
            self.events.removed(block.block_hash)
        block.block_hash = None

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: Hits = (),
                       cache: bool = True) -> list[list[int]] | None:
        """Make room for `num_new_tokens` beyond the request's computed tokens (plus the prefix
        hits in `new_computed_blocks`). Returns the new block ids per group (-1 where a sliding
        group takes none), or None (nothing changed but blocks out of a window let go) when the
        pool cannot supply them. `cache=False`: the new tokens' KV arrives later, from a remote
        peer or the host tier; their full blocks are registered then, and a sliding group takes
        blocks only for the window before the tokens' end."""
        bs = self.block_size
        groups = self.req_blocks.get(request.request_id)
        if groups is None:
            groups = [[] for _ in self.windows]
        num_computed = request.num_computed_tokens + num_hits(new_computed_blocks) * bs
        end = num_computed + num_new_tokens
        num_required = -(-end // bs)
        if self.hybrid:  # a window that moved on lets its oldest blocks go first: this allocation may reuse them
            self._leave_window(groups, num_computed)
        if num_required <= len(groups[0]) and not new_computed_blocks:  # most decode steps: room in the last block
            if cache:
                self.cache_blocks(request, min(end, request.num_tokens))
            return self._nothing_new
        # Where each group's blocks start mattering: at the first query computed here (loads: after them).
        live = num_computed if cache else end
        firsts = [first_needed_block(live, w, bs) for w in self.windows]
        hits = [[b if i >= first else None for i, b in enumerate(group_hits)]
                for group_hits, first in zip(new_computed_blocks, firsts)]
        start = len(groups[0]) + num_hits(new_computed_blocks)
        num_new = sum(num_required - max(start, first) for first in firsts if num_required > max(start, first))
        # Prefix hits sitting in the free queue stop being free once touched.
        num_touched_free = sum(1 for group_hits in hits for b in group_hits if b is not None and b.ref_cnt == 0)
        if num_new + num_touched_free > self.num_free_blocks:
            return None
        self.req_blocks[request.request_id] = groups
        for blocks, group_hits in zip(groups, hits):  # every group's hits first: the pops below skip them
            for block in group_hits:
                if block is not None:
                    acquire(block, self.free_queue)
            blocks.extend(group_hits)
        new_ids = []
        for blocks, first in zip(groups, firsts):
            new = [self._pop_free_block() if i >= first else None for i in range(start, num_required)]
            blocks.extend(new)
            new_ids.append([-1 if b is None else b.block_id for b in new])
        if new_computed_blocks:
            self.num_cached_blocks[request.request_id] = start
        # The tokens scheduled now will have KV after this step, so their full blocks can be
        # found by later requests (a request sent twice hits its own prompt).
        if cache:
            self.cache_blocks(request, min(end, request.num_tokens))
        return new_ids

    def _leave_window(self, groups: list[list[Block | None]], num_computed: int) -> None:
        """Let go of each sliding group's blocks that no query from `num_computed` on reads (their
        hashes stay: a later prompt may still hit them)."""
        for blocks, window in zip(groups, self.windows):
            first = min(first_needed_block(num_computed, window, self.block_size), len(blocks))
            i = first - 1
            while i >= 0 and blocks[i] is not None:  # the holes are a prefix: back to where it ends
                release(blocks[i], self.free_queue)
                blocks[i] = None
                i -= 1

    def _pop_free_block(self) -> Block:
        _, block = self.free_queue.popitem(last=False)
        if block.block_hash is not None:  # evict: its old contents are about to be overwritten
            self._uncache(block)
        block.ref_cnt = 1
        return block

    def free(self, request: Request) -> None:
        """Drop the request's references; unreferenced blocks return to the free queue."""
        groups = self.req_blocks.pop(request.request_id, None) or []
        self.num_cached_blocks.pop(request.request_id, None)
        # Blocks were registered when their tokens were scheduled; past num_computed_tokens
        # (a request preempted or aborted before its step ran) their KV was never written.
        num_valid = request.num_computed_tokens // self.block_size
        # Tail blocks first, so a shared prefix outlives the request-specific suffix.
        for index in range(len(groups[0]) - 1 if groups else -1, -1, -1):
            for blocks in groups:
                block = blocks[index]
                if block is None:
                    continue
                if block.ref_cnt == 1 and index >= num_valid and block.block_hash is not None:
                    self._uncache(block)
                release(block, self.free_queue)

    def reset_prefix_cache(self) -> None:
        for cache in self.caches:
            for block in cache.values():
                block.block_hash = None
            cache.clear()
        self.events.cleared()
