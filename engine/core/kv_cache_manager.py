"""The paged KV cache's bookkeeping: a fixed pool of blocks, refcounts, and prefix caching.

Blocks hold `block_size` tokens for all layers. A full block is identified by a hash chained
over token ids (hash(parent_hash, block tokens)), so equal prefixes map to equal blocks.
Free blocks wait in a queue in eviction order; a freed block keeps its hash and can be hit
again until it is handed out for something else. Only tensors' indices live here.
"""
from __future__ import annotations

from collections import OrderedDict

from baton.engine.common.kv_events import NO_KV_EVENTS
from baton.engine.common.block_hashes import extend_block_hashes
from baton.engine.core.request import Request


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None


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


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}  # block hash -> block
        self.req_blocks: dict[str, list[Block]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # how many leading blocks of a request are in `cached`
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        self.events = NO_KV_EVENTS  # told each hash that enters or leaves `cached` (kv_events.py)

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

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    # ---- prefix caching ------------------------------------------------------------------
    def _update_block_hashes(self, request: Request) -> None:
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, root=request.hash_root)

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """The longest run of cached full blocks that prefixes the request, and its token count."""
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        # At least the last token is always recomputed: its logits give the next token.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks covering its first `num_tokens` tokens."""
        start = self.num_cached_blocks.get(request.request_id, 0)
        if not self.enable_caching or num_tokens // self.block_size <= start:
            return  # no block newly full: most decode steps
        self._update_block_hashes(request)
        blocks = self.req_blocks[request.request_id]
        end = min(num_tokens // self.block_size, len(blocks), len(request.block_hashes))
        for i in range(start, end):
            block_hash = request.block_hashes[i]
            if block_hash not in self.cached and blocks[i].block_hash is None:
                blocks[i].block_hash = block_hash
                self.cached[block_hash] = blocks[i]
                self.events.stored(block_hash, request.block_hashes[i - 1] if i else None)
        self.num_cached_blocks[request.request_id] = max(start, end)

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[Block] = (), cache: bool = True) -> list[Block] | None:
        """Make room for `num_new_tokens` beyond the request's computed tokens (plus the prefix
        hits in `new_computed_blocks`). Returns the newly allocated blocks, or None (nothing
        changed) when the pool cannot supply them. `cache=False` defers registering the new
        full blocks (their KV arrives later, from a remote peer)."""
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(new_computed_blocks))
        if not num_new_blocks and not new_computed_blocks:  # most decode steps: room in the last block
            if cache:
                self.cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
            return []
        # Prefix hits sitting in the free queue stop being free once touched.
        num_touched_free = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_touched_free > self.num_free_blocks:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        for block in new_computed_blocks:
            acquire(block, self.free_queue)
        blocks.extend(new_computed_blocks)
        if new_computed_blocks:
            self.num_cached_blocks[request.request_id] = len(blocks)
        new_blocks = [self._pop_free_block() for _ in range(num_new_blocks)]
        blocks.extend(new_blocks)
        # The tokens scheduled now will have KV after this step, so their full blocks can be
        # found by later requests (a request sent twice hits its own prompt).
        if cache:
            self.cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def _pop_free_block(self) -> Block:
        _, block = self.free_queue.popitem(last=False)
        if block.block_hash is not None:  # evict: its old contents are about to be overwritten
            self.events.removed(block.block_hash)
            del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def free(self, request: Request) -> None:
        """Drop the request's references; unreferenced blocks return to the free queue."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        # Blocks were registered when their tokens were scheduled; past num_computed_tokens
        # (a request preempted or aborted before its step ran) their KV was never written.
        num_valid = request.num_computed_tokens // self.block_size
        # Tail blocks first, so a shared prefix outlives the request-specific suffix.
        for index in range(len(blocks) - 1, -1, -1):
            block = blocks[index]
            if block.ref_cnt == 1 and index >= num_valid and block.block_hash is not None:
                self.events.removed(block.block_hash)
                del self.cached[block.block_hash]
                block.block_hash = None
            release(block, self.free_queue)

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        self.events.cleared()
