"""The block pool: allocation, refcounts, prefix caching and eviction."""
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.core.kv_cache_manager import KVCacheManager
from baton.engine.core.request import Request


def make(req_id, tokens):
    return Request(req_id, tokens, SamplingParams())


def admit(kv, req):
    """What the scheduler does on admission: prefix lookup, allocate the rest, advance."""
    hits, n = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - n, hits) is not None
    req.num_computed_tokens = req.num_tokens
    return n


def test_allocate_and_free_returns_the_pool():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = make("a", list(range(10))), make("b", list(range(100, 107)))
    admit(kv, a)
    admit(kv, b)
    assert len(kv.request_blocks("a")) == 3 and len(kv.request_blocks("b")) == 2
    assert kv.num_free_blocks == 3
    assert kv.allocate_slots(make("c", list(range(20))), 20) is None  # 5 blocks > 3 free: nothing changes
    assert kv.num_free_blocks == 3 and "c" not in kv.req_blocks
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 8 and kv.usage == 0.0


def test_prefix_hits_share_blocks_and_keep_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make("a", list(range(12)))
    assert admit(kv, a) == 0
    b = make("b", list(range(12)))  # identical prompt: 2 full blocks hit, the last token recomputed
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [h.block_id for h in hits[0]] == kv.block_ids("a")[0][:2]
    kv.allocate_slots(b, 4, hits)
    assert all(kv.blocks[i].ref_cnt == 2 for i in kv.block_ids("a")[0][:2])
    c = make("c", list(range(8)) + [99, 98, 97, 96, 95])  # diverges in block 3
    assert kv.get_computed_blocks(c)[1] == 8


def test_freed_blocks_stay_cached_until_reused_and_tails_go_first():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make("a", list(range(16)))
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    assert kv.get_computed_blocks(make("x", list(range(16))))[1] == 12  # still there after free
    # A new unrelated request takes one block: the tail of "a" is evicted, its prefix survives.
    admit(kv, make("b", [50, 51, 52]))
    assert kv.get_computed_blocks(make("y", list(range(16))))[1] == 12
    assert len(kv.cached) == 3


def test_referenced_blocks_are_never_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make("a", list(range(8)))
    admit(kv, a)  # holds 2 cached blocks
    assert kv.allocate_slots(make("b", list(range(50, 70))), 20) is None  # needs 5, only 2 free
    admit(kv, make("c", list(range(50, 58))))
    assert kv.get_computed_blocks(make("z", list(range(9))))[1] == 8


def test_uncomputed_blocks_lose_their_hash_on_free():
    # A request preempted before its step ran must not leave hashes over KV that was never written.
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make("a", list(range(12)))
    kv.allocate_slots(a, 12)  # registered (scheduled) but num_computed_tokens stays 0
    assert len(kv.cached) == 3
    kv.free(a)
    assert len(kv.cached) == 0 and kv.num_free_blocks == 8
