"""A prefill short of device blocks moves the blocks it holds for a decode peer to its host KV
tier, and the decode reads them there (issue: a second KV tier in host memory).

Real engines with the real NIXL connector on the tiny checkpoint: a prefill whose device pool
cannot hold every prompt it serves until the decodes pull them finishes them all, hands some
off on the host and keeps others on the device, the decode's output equals an engine with
room for everything, and neither tier of either engine leaks a block, also when the caller
leaves while a hand-off copy is in flight.
"""
from __future__ import annotations

from helpers import gib, random_prompts
from nixl_engines import agent_ids, assert_pools_full, connect, disaggregated, nixl_engine

from baton import LLM, SamplingParams
from baton.kv_transfer.base import KVTier

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def assert_host_free(*engines) -> None:
    for eng in engines:
        host = eng.core.host
        assert not eng.scheduler.arrivals.handing_off and not host.holds and not host.storing
        assert host.num_free_blocks == host.num_blocks and all(b.ref_cnt == 0 for b in host.blocks)


def test_a_short_prefill_hands_held_blocks_to_its_host_tier_and_the_decode_reads_them_there(tiny_llama):
    prompts = random_prompts([70, 90, 60, 80, 75], seed=61)  # 5 + 6 + 4 + 5 + 5 blocks of 16 tokens
    tier = dict(max_model_len=192, kv_offloading_size=gib(64))
    # 12 device blocks: two prompts at a time, and a hold on the device keeps the next waiting.
    prefill = nixl_engine(tiny_llama, "prefill", num_kv_blocks=12, **tier)
    decode = nixl_engine(tiny_llama, "decode", num_kv_blocks=40, **tier)
    connect(prefill, decode)
    handles = []
    watch = prefill.scheduler._finish

    def finish(request, status):  # the handles as the engine gives them out
        watch(request, status)
        handles.append(request)
    prefill.scheduler._finish = finish
    outs = disaggregated(prefill, decode, prompts, [GREEDY] * len(prompts))
    big = LLM(tiny_llama, dtype="float32", device="cpu")
    assert outs == [o.token_ids for o in big.generate(prompts, GREEDY)]
    tiers = [r.kv_handle.tier for r in handles]
    # Those that finished while others waited went to the host; the last ones stayed.
    assert KVTier.HOST in tiers and tiers[-1] is KVTier.DEVICE, tiers
    assert prefill.snapshot().num_host_hand_offs == tiers.count(KVTier.HOST)
    assert decode.runner.connector.num_blocks_pulled == sum(-(-len(p) // 16) for p in prompts)
    assert_pools_full(prefill, decode)
    assert_host_free(prefill)


def test_a_heads_kv_comes_with_the_blocks_held_on_the_device_only(tiny_llama, tmp_path):
    """With EAGLE-3 heads on both: a handle of device blocks brings the head's blocks too, one of
    host blocks does not (the host tier keeps no head KV; that decode's head starts over at its
    first decoded position). The output is the colocated engine's either way."""
    from baton.testing.eagle_heads import write_head

    head = write_head(str(tmp_path / "head"), tiny_llama, "eagle3")
    spec = dict(max_model_len=192, kv_offloading_size=gib(64),
                speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3})
    prompts = random_prompts([70, 90, 60, 80, 75], seed=61)
    prefill = nixl_engine(tiny_llama, "prefill", num_kv_blocks=12, **spec)
    decode = nixl_engine(tiny_llama, "decode", num_kv_blocks=40, **spec)
    connect(prefill, decode)
    handles = []
    watch = prefill.scheduler._finish

    def finish(request, status):
        watch(request, status)
        handles.append(request)
    prefill.scheduler._finish = finish
    outs = disaggregated(prefill, decode, prompts, [GREEDY] * len(prompts))
    assert outs == [o.token_ids for o in LLM(tiny_llama, dtype="float32", device="cpu").generate(prompts, GREEDY)]
    handles = [r.kv_handle for r in handles]  # (as the decode got them: a hand-off moved some to the host)
    assert {h.tier for h in handles} == {KVTier.HOST, KVTier.DEVICE}
    layout = decode.runner.connector.layout
    assert decode.runner.connector.num_bytes_pulled == sum(
        len(h.block_ids) * (layout.block_bytes + layout.draft_block_bytes * (h.tier is KVTier.DEVICE)) for h in handles)
    assert decode.scheduler.spec_stats.num_drafts > 0
    assert_pools_full(prefill, decode)
    assert_host_free(prefill)


def test_a_caller_gone_while_its_hand_off_copy_is_in_flight_frees_both_tiers(tiny_llama):
    prompts = random_prompts([70, 90, 60], seed=62)
    prefill = nixl_engine(tiny_llama, "prefill", num_kv_blocks=12, max_model_len=192, kv_offloading_size=gib(64))
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    reqs = [prefill.add_request(f"p{next(agent_ids)}", p, one, hold_for_remote=True) for p in prompts]
    outs = {}
    while not prefill.scheduler.arrivals.handing_off:
        for out in prefill.step():
            outs[out.request_id] = out
    gone = next(iter(prefill.scheduler.arrivals.handing_off))
    assert prefill.core.release_hold(gone)
    while prefill.has_unfinished_requests() or prefill.num_held_requests:
        for out in prefill.step():
            outs[out.request_id] = out
            if out.request_id != gone and out.kv_handle is not None:  # the decode that pulls the others
                prefill.core.release_hold(out.request_id)
    assert outs[gone].finished and outs[gone].kv_handle is None  # nothing to pull now
    assert all(outs[r.request_id].finished for r in reqs)
    assert_pools_full(prefill)
    assert_host_free(prefill)


def test_through_the_router_the_decode_reads_handed_off_blocks_from_the_prefills_host_tier(tiny_llama):
    """The tier rides the handle over gRPC and the host pool the KV handshake: concurrent prompts
    through router -> prefill (short of device blocks) -> decode equal the offline engine."""
    import asyncio

    from helpers import collect, pools_full, stats, wait_serving
    from servers import pd_stack

    from baton.services.client import AsyncClient

    prompts = random_prompts([70, 90, 60, 80, 75, 65], seed=63)
    tier = ("--max-model-len", "192", "--kv-offloading-size", str(gib(64)))
    prefill_flags = ("--num-kv-blocks", "12", "--max-num-batched-tokens", "32", *tier)  # slow prompts: all queue
    with pd_stack(tiny_llama, prefill=prefill_flags, decode=tier) as ((prefill,), (decode,), router):
        wait_serving(router.address)

        async def run():
            async with AsyncClient(router.address) as client:
                return await asyncio.gather(*(collect(client, p, max_tokens=8, temperature=0, ignore_eos=True)
                                              for p in prompts))
        outs = asyncio.run(asyncio.wait_for(run(), 120))
        big = LLM(tiny_llama, dtype="float32", device="cpu")
        assert [ids for ids, _, _ in outs] == [o.token_ids for o in big.generate(prompts, GREEDY)]
        assert stats(prefill.address).num_host_hand_offs > 0
        assert stats(decode.address).num_blocks_pulled == sum(-(-len(p) // 16) for p in prompts)
        assert pools_full(prefill.address) and pools_full(decode.address)
