"""KV cache events: the engine's events replay to its prefix cache's contents; the router's index,
fed by real engine servers' SubscribeKVEvents streams, equals what each engine really holds
through requests, evictions and a restart of one engine; `kv_aware` sends a conversation's next
turn to the instance that holds it, and its route span says why."""
from __future__ import annotations

import asyncio
import os
import random

import pytest
from helpers import collect, random_prompts

from baton.engine.common.block_hashes import extend_block_hashes
from baton.engine.common.core_messages import GetKVBlockHashes
from baton.engine.common.kv_cache_events import KVEvent, KVEventKind, KVEventLog
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.common.tokenizer import apply_chat_template
from baton.engine.core.kv_cache_manager import KVCacheManager
from baton.engine.core.request import Request
from baton.kv_transfer.base import KVTier
from baton.services.client import AsyncClient
from baton.services.router.kv_index import DEVICE, KVIndex
from baton.services.router.kv_index import HOST as HOST_BIT
from baton.services.router.router import Router, RouterOptions
from baton.services.server.kv_event_hub import KVBlockMirror, KVEventHub, to_proto

BLOCK = 8
ENGINE = dict(block_size=BLOCK, num_kv_blocks=16, max_model_len=128)  # 16 blocks: evictions come soon


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 90))


def test_events_replay_to_the_cache_s_contents_through_admissions_evictions_and_a_reset():
    kv = KVCacheManager(num_blocks=12, block_size=4)
    hub = KVEventHub("e", 4)
    kv.events = log = KVEventLog()
    rng = random.Random(5)
    stems = [[rng.randrange(100) for _ in range(12)] for _ in range(3)]  # shared prefixes
    live, removed = [], 0
    for step in range(300):
        if live and (rng.random() < 0.45 or len(live) > 3):
            req = live.pop(rng.randrange(len(live)))
            req.num_computed_tokens = rng.choice([req.num_tokens, req.num_computed_tokens // 2])  # some aborted early
            kv.free(req)
        else:
            req = Request(f"r{step}", rng.choice(stems)[:rng.randrange(2, 13)] + [rng.randrange(100)
                                                                                   for _ in range(rng.randrange(9))],
                          SamplingParams())
            hits, n = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, req.num_tokens - n, hits) is not None:
                req.num_computed_tokens = req.num_tokens
                live.append(req)
        if step == 200:
            kv.reset_prefix_cache()
        events = log.take()
        removed += sum(len(e.block_hashes) for e in events if e.kind is KVEventKind.REMOVED)
        hub.publish(events)
        assert set(hub.mirror.tiers[KVTier.DEVICE]) == set(kv.cached)
        # Each stored block's parent is the block before it in its chain.
        assert all(p is None or kv.cached.get(p) is None or kv.cached[p].block_hash == p
                   for p in hub.mirror.tiers[KVTier.DEVICE].values())
    assert removed > 20  # evictions and early frees happened
    # A snapshot replayed on an index gives the same set.
    index = KVIndex(4)
    for event in hub.snapshot().events:
        index.apply("e", event)
    assert index.held("e") == set(kv.cached)


def test_the_index_follows_tiers_and_clears():
    index, mirror = KVIndex(4), KVBlockMirror()
    events = [KVEvent(KVEventKind.STORED, [1, 2, 3], None), KVEvent(KVEventKind.TIER_MOVED, [3], tier=KVTier.HOST),
              KVEvent(KVEventKind.STORED, [4], 3, KVTier.HOST), KVEvent(KVEventKind.REMOVED, [1])]
    for e in events:
        index.apply("a", to_proto(e))
        mirror.apply(e)
    assert index.held("a", DEVICE) == {2} and index.held("a", HOST_BIT) == {3, 4}
    assert set(mirror.tiers[KVTier.DEVICE]) == {2} and mirror.tiers[KVTier.HOST] == {3: 2, 4: 3}
    # The prompt 1-2-3-4: instance "a" lost block 1, "b" holds 1, 2 in device memory and 3 in host memory.
    for e in [KVEvent(KVEventKind.STORED, [1, 2, 3], None), KVEvent(KVEventKind.TIER_MOVED, [3], tier=KVTier.HOST)]:
        index.apply("b", to_proto(e))
    assert index.overlap(["a", "b"], [1, 2, 3, 4]) == {"a": (0, 0), "b": (2, 1)}
    index.apply("b", to_proto(KVEvent(KVEventKind.ALL_CLEARED)))
    assert index.held("b", DEVICE | HOST_BIT) == set() and index.blocks.keys() == {2, 3, 4}


def test_a_subscriber_far_behind_gets_a_snapshot_instead_of_the_batches_it_missed(monkeypatch):
    import baton.services.server.kv_event_hub as hub_module

    monkeypatch.setattr(hub_module, "MAX_BEHIND", 3)

    async def go():
        hub = KVEventHub("e", 4)
        hub.publish([KVEvent(KVEventKind.STORED, [1, 2], None)])
        stream = hub.subscribe()
        first = await stream.__anext__()
        assert first.snapshot and first.seq == 1 and [e.kind for e in first.events] == [4, 1]  # ALL_CLEARED, STORED
        hub.publish([KVEvent(KVEventKind.STORED, [3], 2)])
        assert (await stream.__anext__()).seq == 2  # live, in order
        for h in range(10, 16):  # six batches while it reads none: more than MAX_BEHIND
            hub.publish([KVEvent(KVEventKind.STORED, [h], None)])
        resync = await stream.__anext__()
        assert resync.snapshot and resync.seq == 8
        index = KVIndex(4)
        for event in resync.events:
            index.apply("e", event)
        assert index.held("e") == {1, 2, 3, *range(10, 16)}
        hub.publish([KVEvent(KVEventKind.REMOVED, [1])])
        assert (await stream.__anext__()).seq == 9
        await stream.aclose()
        assert not hub._subscribers

    run(go())


# ---- real engines behind a router ---------------------------------------------------------------
async def on(engine, coro):
    """Await a coroutine on a ServerThread's loop from this one."""
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, engine.loop))


async def held_by(engine) -> set[int]:
    """What the engine's prefix cache really holds (its core's `cached` map, over its IPC)."""
    return set(await on(engine, engine.server.core.call(GetKVBlockHashes())))


async def index_matches(router: Router, engines, timeout: float = 15.0) -> list[set[int]]:
    """Until the router's index equals each engine's real contents (bounded); returns them."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        real = [await held_by(e) for e in engines]
        seen = [router.kv_index.held(e.address) for e in engines]
        if seen == real or asyncio.get_running_loop().time() > deadline:
            assert seen == real, [(len(s), len(r), len(s ^ r)) for s, r in zip(seen, real)]
            return real
        await asyncio.sleep(0.05)


async def start_router(engines, tokenizer_dir: str, **options) -> Router:
    router = Router(RouterOptions(decode=[e.address for e in engines], port=0, policy="kv_aware",
                                  tokenizer_dir=tokenizer_dir, block_size=BLOCK, health_retry_s=0.1, **options))
    await router.start()
    while len(router.decode.healthy()) < len(engines):
        await asyncio.sleep(0.02)
    return router


def test_the_router_s_index_matches_the_engines_through_requests_evictions_and_a_restart(tiny_llama, serve):
    engines = [serve(tiny_llama, **ENGINE) for _ in range(2)]
    port = int(engines[0].address.rsplit(":", 1)[1])
    prompts = random_prompts([40] * 12, seed=81)  # 5 full blocks each: 60 blocks through 2 x 16

    async def go():
        router = await start_router(engines, tiny_llama)
        try:
            async with AsyncClient(router.address) as client:
                assert await index_matches(router, engines) == [set(), set()]
                await asyncio.gather(*(collect(client, p, max_tokens=4, temperature=0.0) for p in prompts[:4]))
                first = await index_matches(router, engines)
                assert all(first)  # both took requests, and hold blocks
                for p in prompts[4:]:
                    await collect(client, p, max_tokens=4, temperature=0.0)
                real = await index_matches(router, engines)
                sent = {h for p in prompts for h in extend_block_hashes([], p, BLOCK)}
                assert sent - set().union(*real)  # blocks were evicted, and the index let them go
                assert set().union(*real) <= sent  # nothing else (the outputs' blocks are never full: 44 tokens)
                late = await start_router(engines, tiny_llama)  # a router that comes late: the snapshots fill it
                try:
                    await index_matches(late, engines)
                finally:
                    await late.stop(0)

                old_run = router.kv_subscriptions[engines[0].address].run
                engines[0].close()  # a restart of one engine, on the same port
                deadline = asyncio.get_running_loop().time() + 10
                while router.kv_index.held(engines[0].address):  # its stream broke: its entries went
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.02)
                engines[0] = await asyncio.to_thread(serve, tiny_llama, {"port": port}, **ENGINE)
                while len(router.decode.healthy()) < 2:
                    await asyncio.sleep(0.02)
                for p in prompts[:6]:
                    await collect(client, p, max_tokens=4, temperature=0.0)
                real = await index_matches(router, engines)
                assert real[0] and router.kv_subscriptions[engines[0].address].run[1] != old_run[1]
                assert router.kv_subscriptions[engines[0].address].num_resyncs >= 1
        finally:
            await router.stop(0)

    run(go())
    assert all(e.wait_pool_full() for e in engines)


def test_kv_aware_sends_the_follow_up_turn_to_the_instance_holding_the_conversation(tiny_llama, serve,
                                                                                    trace_receiver):
    engines = [serve(tiny_llama, **ENGINE) for _ in range(2)]
    # Distinct from their first block on: only the instance that ran a conversation holds any of it.
    topics = ["Apples grow on trees in the", "Rivers carry water down to", "Stars shine at night over",
              "Trains run on tracks across"]
    conversations = [[{"role": "user", "content": f"{t} world, tell me why."}] for t in topics]

    async def go():
        os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"
        try:
            router = await start_router(engines, tiny_llama, otlp_traces_endpoint=trace_receiver.endpoint)
        finally:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
        tokenizer = router.prompts.tokenizer
        try:
            async with AsyncClient(router.address) as client:
                holders = []
                for conv in conversations:  # first turns: no overlap anywhere, spread round robin
                    _, text, _ = await collect(client, conv, max_tokens=6, temperature=0.0)
                    conv.append({"role": "assistant", "content": text})
                    await index_matches(router, engines)
                    first = extend_block_hashes([], apply_chat_template(tokenizer, conv[:1]), BLOCK)
                    holders.append([e.address for e in engines if first[0] in router.kv_index.held(e.address)])
                assert all(len(h) == 1 for h in holders)
                assert {h[0] for h in holders} == {e.address for e in engines}  # both hold conversations
                for i, conv in enumerate(conversations):
                    conv.append({"role": "user", "content": "And then what happened next?"})
                    ids, _, last = await collect(client, conv, max_tokens=6, temperature=0.0, request_id=f"turn2-{i}")
                    prompt1 = len(apply_chat_template(tokenizer, conv[:1]))
                    # It hit the conversation's blocks: only their holder has them.
                    assert last.usage.cached_tokens >= (prompt1 // BLOCK - 1) * BLOCK > 0
        finally:
            await router.stop(0)
        return holders

    holders = run(go())

    def route_spans(spans):
        roots = {s.attributes["gen_ai.request.id"]: s for s in spans if s.service == "baton-router"
                 and not s.parent_id and str(s.attributes.get("gen_ai.request.id", "")).startswith("turn2-")}
        return {rid: next((s for s in spans if s.name == "route decode" and s.parent_id == root.span_id), None)
                for rid, root in roots.items()}

    assert trace_receiver.wait_for(lambda spans: len(route_spans(spans)) == 4
                                   and all(route_spans(spans).values()), timeout_s=10)
    for i, span in sorted(route_spans(trace_receiver.spans()).items()):
        a = span.attributes
        chosen = a["baton.route.candidates"].index(a["baton.route.chosen"])
        assert a["baton.route.chosen"] == holders[int(i.split("-")[1])][0]
        assert a["baton.route.decision"] == "kv_overlap"
        device = list(a["baton.route.kv.overlap_device_blocks"])
        assert device[chosen] > 0 and device[1 - chosen] == 0  # conversations share nothing
        assert a["baton.route.kv.score"][chosen] == max(a["baton.route.kv.score"])
        assert len(a["baton.route.kv.queued_prefill_blocks"]) == len(a["baton.route.kv.active_blocks"]) == 2


class _Backend:  # what KVAware reads of a backend, with the router's ledger (backends.Backend's)
    def __init__(self, address: str):
        self.address, self.outstanding = address, 0
        self.queued_prefill_blocks = self.active_blocks = 0


def test_kv_aware_weighs_held_blocks_device_above_host_against_load():
    from baton.services.router.backends import Backend
    from baton.services.router.kv_aware import KVAware

    index = KVIndex(4)
    prompt = [11, 12, 13, 14, 15, 16]
    index.apply("a", to_proto(KVEvent(KVEventKind.STORED, prompt[:4], None)))  # a: 4 blocks in device memory
    index.apply("b", to_proto(KVEvent(KVEventKind.STORED, prompt[:4], None, KVTier.HOST)))  # b: the same in host memory
    a, b, c = _Backend("a"), _Backend("b"), _Backend("c")
    policy = KVAware(index, overlap_score_weight=1.0, host_hit_weight=0.5, active_weight=1.0)
    choice = policy.choose([c, b, a], prompt)
    assert choice.backend is a and choice.decision == "kv_overlap" and choice.prefix_hit_blocks == 4
    assert choice.inputs["overlap_device_blocks"] == [0, 0, 4] and choice.inputs["overlap_host_blocks"] == [0, 4, 0]
    assert choice.inputs["score"] == [0, 2, 4]  # b's host blocks count half
    assert choice.charge == (3, 7) and choice.inputs["prompt_blocks"] == 7  # 3 blocks to compute of 7
    # a is busy: 3 blocks queued and 2 in use cost it more than b's host hits save b.
    a.queued_prefill_blocks, a.active_blocks = 3, 2
    choice = policy.choose([c, b, a], prompt)
    assert choice.backend is b and choice.decision == "kv_overlap"  # b still holds the most (in host memory)
    a.active_blocks = b.active_blocks = 20
    assert policy.choose([c, b, a], prompt).decision == "kv_load"  # c, which holds nothing, wins on load
    # A cold instance is not starved by the blocks the others hold: past the load bound it gets the request.
    a.active_blocks = b.active_blocks = 0
    a.outstanding, b.outstanding = 9, 9
    choice = policy.choose([c, b, a], prompt)
    assert choice.backend is c and choice.decision == "kv_load" and choice.inputs["load_bound"] == 9.5  # 1.5 x 19 / 3
    assert choice.inputs["outstanding"] == [0, 9, 9]
    # Nothing held anywhere, nothing in flight: round robin.
    idle = [_Backend(x) for x in "xyz"]
    assert {policy.choose(idle, [1, 2]).backend.address for _ in range(3)} == {"x", "y", "z"}
    # The router's ledger: charged at the pick, the queued part gone at the first token, the rest at the end.
    real = Backend.__new__(Backend)
    real.queued_prefill_blocks = real.active_blocks = 0
    real._charges = {}
    real.charge("r1", (3, 7))
    real.charge("r2", (1, 2))
    real.prefilled("r1")
    assert (real.queued_prefill_blocks, real.active_blocks) == (1, 9)
    real.settle("r1")
    real.settle("r2")
    real.settle("r2")  # twice (a prefill's and a decode's end): no harm
    assert (real.queued_prefill_blocks, real.active_blocks) == (0, 0)


@pytest.mark.parametrize("options, field", [
    (dict(policy="kv_aware"), "tokenizer_dir"),  # it must hash token ids as the engines do
    (dict(policy="kv_aware", tokenizer_dir="m", kv_host_hit_weight=1.5), "kv_host_hit_weight"),
    (dict(policy="kv_aware", tokenizer_dir="m", kv_active_weight=-1), "kv_active_weight"),
    (dict(policy="kv_awares", tokenizer_dir="m"), "policy"),
])
def test_router_options_refuse_a_bad_kv_aware_configuration_naming_the_field(options, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        RouterOptions(decode=["127.0.0.1:1"], **options)
