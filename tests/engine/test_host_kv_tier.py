"""The host KV tier (kv_offloading_size) and swap preemption (preemption_mode).

Real engines on the tiny checkpoints: blocks evicted to the host come back equal (outputs equal
to a pool big enough for everything, and to transformers), swap gives recompute's outputs, a
request whose host copies are evicted before it runs recomputes them, and no block of either
tier leaks, also with aborts while copies are in flight. The scheduler's bookkeeping against a
model of both pools: test_host_kv_bookkeeping.py.
"""
from __future__ import annotations

import asyncio
import random
from collections import deque

import pytest
from helpers import gib, random_prompts

from baton import LLM, SamplingParams
from baton.engine.common.config import EngineConfig
from baton.engine.common.errors import InvalidArgument
from baton.engine.core.request import RequestStatus
from baton.kv_transfer.base import KVTier

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
def assert_tiers_settled(llm: LLM) -> None:
    """Every device block free, every host block free (nothing pinned, swapped or in flight)."""
    core = llm.engine.core
    assert not core.has_unfinished_requests()
    assert core.kv.num_free_blocks == core.num_kv_blocks and not core.kv.req_blocks
    host = core.host
    assert host.num_free_blocks == host.num_blocks and not host.swapped and not host.storing
    assert all(b.ref_cnt == 0 for b in host.blocks) and all(b.ref_cnt == 0 for b in core.kv.blocks)


def assert_copies_equal(llm: LLM) -> int:
    """Each block cached on both tiers holds the same bytes in both; returns how many."""
    core = llm.engine.core
    device, host = core.runner.kv_cache, core.runner.host_kv.host_cache
    both = set(core.kv.cached) & set(core.host.cached)
    for h in both:
        assert device[core.kv.cached[h].block_id].equal(host[core.host.cached[h].block_id])
    return len(both)


def conversations(num: int, turns: int, seed: int = 0) -> list[list[list[int]]]:
    """Multi-turn prompts: a shared system prompt, then each turn appends to its conversation."""
    system = random_prompts([40], seed=seed)[0]
    rng = random.Random(seed)
    convs = []
    for c in range(num):
        prompt, conv = list(system), []
        for t in range(turns):
            prompt = prompt + random_prompts([rng.randint(8, 30)], seed=seed * 1000 + c * 10 + t)[0]
            conv.append(list(prompt))
            prompt += [3 + (c + t) % 50] * 6  # stands for the previous answer
        convs.append(conv)
    return convs


# ---- real engines ---------------------------------------------------------------------------
def test_evicted_blocks_come_back_from_the_host_equal(tiny_model, hf):
    convs = conversations(5, 3)
    turns = [[conv[t] for conv in convs] for t in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    big = LLM(tiny_model, dtype="float32", device="cpu")
    tiered = LLM(tiny_model, dtype="float32", device="cpu", num_kv_blocks=14, max_model_len=200,
                 kv_offloading_size=gib(96))
    for prompts in turns:  # each turn's prompts extend the last's: their prefixes were evicted from the device
        want = [o.token_ids for o in big.generate(prompts, params)]
        got = tiered.generate(prompts, params)
        assert [o.token_ids for o in got] == want
    assert want[0] == hf.greedy(tiny_model, turns[-1][0], params.max_tokens)
    s = tiered.engine.snapshot()
    assert s.host_kv_cache_hits > 0 and s.num_host_kv_loaded_blocks > 0 and s.num_host_kv_stored_blocks > 0
    # Loaded blocks are local cache hits (not a peer's): they count as cached prompt tokens.
    assert s.num_prompt_tokens_external == 0 and sum(o.num_cached_tokens for o in got) > 0
    assert s.prefix_cache_hits + s.host_kv_cache_hits > tiered.engine.kv.prefix_hits
    assert assert_copies_equal(tiered) > 0
    assert_tiers_settled(tiered)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_swap_preemption_gives_recompute_outputs(tiny_llama, hf, policy):
    prompts = random_prompts([100, 60, 90, 30, 75, 45], seed=2)
    # Greedy and seeded sampling: a swapped request resumes its random stream where it was.
    params = [GREEDY if i % 2 == 0 else SamplingParams(max_tokens=16, temperature=0.9, seed=7 + i, ignore_eos=True)
              for i in range(len(prompts))]
    priority = [3, 1, 4, 1, 5, 9]
    outs = {}
    for mode in ("recompute", "swap"):
        # 12 blocks of 16 tokens: each request fits alone, the batch does not.
        llm = LLM(tiny_llama, dtype="float32", device="cpu", num_kv_blocks=12, max_model_len=192,
                  scheduling_policy=policy, kv_offloading_size=gib(64), preemption_mode=mode)
        outs[mode] = [o.token_ids for o in llm.generate(prompts, params, priority=priority)]
        s = llm.engine.snapshot()
        assert s.num_preemptions > 0 and s.num_swap_preemptions == (s.num_preemptions if mode == "swap" else 0)
        assert_tiers_settled(llm)
    assert outs["swap"] == outs["recompute"]
    assert outs["swap"][0] == hf.greedy(tiny_llama, prompts[0], GREEDY.max_tokens)


def test_auto_swaps_long_victims_and_recomputes_short_ones(tiny_llama):
    prompts = random_prompts([150, 20, 140, 25, 30], seed=5)
    llm = LLM(tiny_llama, dtype="float32", device="cpu", num_kv_blocks=14, max_model_len=220,
              max_num_batched_tokens=64, kv_offloading_size=gib(64), preemption_mode="auto")
    host, swapped_lengths, recomputed_lengths = llm.engine.core.host, [], []
    real_preempt = host.preempt

    def preempt(request):
        swapped = real_preempt(request)
        (swapped_lengths if swapped else recomputed_lengths).append(request.num_computed_tokens)
        return swapped

    host.preempt = preempt
    big = LLM(tiny_llama, dtype="float32", device="cpu")
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [o.token_ids for o in big.generate(prompts, GREEDY)]
    assert swapped_lengths and all(n > 32 for n in swapped_lengths)  # more than half of the 64-token step
    assert all(n <= 32 for n in recomputed_lengths)
    assert_tiers_settled(llm)


def test_a_request_whose_host_copies_were_evicted_recomputes(tiny_llama, hf):
    target = random_prompts([90], seed=11)[0]
    others = random_prompts([70] * 8, seed=12)
    # The host holds 8 blocks: the others' write-backs push the target's out before it runs again.
    llm = LLM(tiny_llama, dtype="float32", device="cpu", num_kv_blocks=14, max_model_len=200,
              kv_offloading_size=gib(8))
    first = llm.generate([target], GREEDY)[0]
    core = llm.engine.core
    assert len(core.host.cached) == 6  # the 6 full blocks of its 105 computed tokens were written back
    again = llm.generate(others + [target], GREEDY)
    assert again[-1].token_ids == first.token_ids == hf.greedy(tiny_llama, target, GREEDY.max_tokens)
    assert again[-1].num_cached_tokens == 0  # nothing left in either tier: computed whole
    assert [o.token_ids for o in again[:-1]] == [hf.greedy(tiny_llama, p, GREEDY.max_tokens) for p in others]
    assert_tiers_settled(llm)


def test_reset_prefix_cache_forgets_the_host_tier_too(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu", num_kv_blocks=14, max_model_len=200,
              kv_offloading_size=gib(32))
    prompts = random_prompts([60] * 4, seed=41)
    first = llm.generate(prompts, GREEDY)
    assert llm.generate(prompts[:1], GREEDY)[0].num_cached_tokens > 0
    llm.reset_prefix_cache()
    assert not llm.engine.core.host.cached
    again = llm.generate(prompts, GREEDY)
    assert ([o.num_cached_tokens for o in again] == [0] * 4
            and [o.token_ids for o in again] == [o.token_ids for o in first])
    assert_tiers_settled(llm)


def test_no_leaks_with_aborts_while_copies_are_in_flight(tiny_llama):
    engine = LLM(tiny_llama, dtype="float32", device="cpu", num_kv_blocks=12, max_model_len=192,
                 kv_offloading_size=gib(40), preemption_mode="swap").engine
    # The copies are real; their reports come two steps late, as a slow copy's would, so that
    # aborts find requests whose loads are still in flight.
    copier, late = engine.runner.host_kv, deque([[], []])
    real_poll = copier.poll

    def poll(wait_s=0.0):
        late.append(real_poll(0.05))
        return late.popleft()

    copier.poll = poll
    rng = random.Random(3)
    shared = random_prompts([48] * 4, seed=21)  # four prefixes: each is evicted from the device between uses
    prompts = [shared[i % 4] + p for i, p in enumerate(random_prompts([rng.randint(10, 90) for _ in range(40)],
                                                                      seed=22))]
    aborted = {"loading": 0, "swapped": 0, "other": 0}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if pending:
                i, prompt = pending.pop()
                engine.add_request(f"r{i}", prompt[:140], SamplingParams(max_tokens=rng.randint(1, 30),
                                                                           temperature=0.0, ignore_eos=True))
        engine.step()
        sched = engine.core.scheduler
        for request in list(sched.requests.values()):
            if request.request_id in engine.core.host.swapped:  # its blocks are in the host tier (or coming back)
                kind = "swapped"
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:  # its prefix is being loaded
                kind = "loading"
            else:
                kind = "other"
            if rng.random() < (0.5 if kind != "other" else 0.03):
                engine.abort_request([request.request_id])
                aborted[kind] += 1
    assert aborted["loading"] and aborted["swapped"] and aborted["other"], aborted
    s = engine.snapshot()
    assert s.num_host_kv_loaded_blocks and s.num_swap_preemptions
    core = engine.core
    assert core.kv.num_free_blocks == core.num_kv_blocks and not core.kv.req_blocks and not core.scheduler.arrivals.held
    assert core.host.num_free_blocks == core.host.num_blocks and not core.host.swapped


def test_the_tier_in_get_load_and_metrics(serve, tiny_llama):
    from urllib.request import urlopen

    import grpc
    from prometheus_client.parser import text_string_to_metric_families

    from baton.services.client import AsyncClient
    from baton.v1 import generate_pb2 as pb
    from baton.v1 import generate_pb2_grpc

    srv = serve(tiny_llama, {"metrics_port": 0}, num_kv_blocks=14, max_model_len=200, kv_offloading_size=gib(64))
    prompts = random_prompts([60] * 5, seed=31)

    async def go():
        async with AsyncClient(srv.address) as client:
            for _ in range(2):  # the second round finds the first's blocks on the host
                for prompt in prompts:
                    async for _ in client.generate(prompt, max_tokens=2, temperature=0):
                        pass
        async with grpc.aio.insecure_channel(srv.address) as channel:
            return await generate_pb2_grpc.TextGenerationStub(channel).GetLoad(pb.GetLoadRequest())

    load = asyncio.run(asyncio.wait_for(go(), 120))
    assert load.num_host_kv_blocks == 64 and load.host_kv_cache_hits > 0 and 0 < load.host_kv_cache_usage <= 1
    assert srv.wait_pool_full()
    with urlopen(f"http://127.0.0.1:{srv.server.metrics_server.port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    got = {(s.name, s.labels.get("direction")): s.value
           for f in text_string_to_metric_families(text) for s in f.samples}
    assert got[("baton:host_kv_cache_blocks", None)] == 64
    assert got[("baton:host_kv_cache_hits_total", None)] == load.host_kv_cache_hits
    assert got[("baton:host_kv_transferred_blocks_total", "to_host")] > 0
    assert got[("baton:host_kv_transferred_blocks_total", "to_device")] > 0
    assert got[("baton:num_requests_swapped", None)] == 0


def test_cli_flags_reach_the_engine(tiny_llama):
    from baton.services.cli.engine_args import engine_config
    from baton.services.cli.main import build_parser

    args = build_parser().parse_args(["serve", "--model", tiny_llama, "--kv-offloading-size", "0.5",
                                      "--preemption-mode", "auto"])
    config = engine_config(args)
    assert (config.kv_offloading_size, config.preemption_mode) == (0.5, "auto")
    with pytest.raises(InvalidArgument) as err:
        engine_config(build_parser().parse_args(["serve", "--model", tiny_llama, "--preemption-mode", "lru"]))
    assert err.value.field == "preemption_mode"


# ---- validation -----------------------------------------------------------------------------
@pytest.mark.parametrize("args,field", [
    (dict(kv_offloading_size=-1), "kv_offloading_size"),
    (dict(kv_offloading_size="4"), "kv_offloading_size"),
    (dict(kv_offloading_size=1 << 40), "kv_offloading_size"),  # a TiB of GiB: more than the host has
    (dict(preemption_mode="evict"), "preemption_mode"),
    (dict(preemption_mode="swap"), "preemption_mode"),  # swap with no host tier to swap to
])
def test_bad_values_are_refused_naming_the_field(tiny_llama, args, field):
    with pytest.raises(InvalidArgument) as err:
        EngineConfig.from_kwargs(tiny_llama, **args)
    assert err.value.field == field


def test_a_tier_smaller_than_one_block_is_refused(tiny_llama):
    with pytest.raises(InvalidArgument) as err:
        LLM(tiny_llama, dtype="float32", device="cpu", kv_offloading_size=gib(1) / 2)
    assert err.value.field == "kv_offloading_size"


def test_disaggregated_with_host_tiers_on_both_sides(tiny_llama):
    """The decode pulls a peer's KV (never the host's) for a request with a handle; both sides'
    prefix caches write back to their host tiers like any other, and a later decode of a longer
    prompt finds its prefix in the decode's host tier."""
    from nixl_engines import assert_pools_full, connect, disaggregated, nixl_engine

    prompts = random_prompts([70, 90, 60, 80], seed=51)
    longer = [p + random_prompts([20], seed=52 + i)[0] for i, p in enumerate(prompts)]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    big = LLM(tiny_llama, dtype="float32", device="cpu")
    tier = dict(max_model_len=200, kv_offloading_size=gib(64))
    # The prefill's pool holds every prompt until its decode pulls it; the decode's is small.
    prefill = nixl_engine(tiny_llama, "prefill", num_kv_blocks=32, **tier)
    decode = nixl_engine(tiny_llama, "decode", num_kv_blocks=14, **tier)
    connect(prefill, decode)
    assert disaggregated(prefill, decode, prompts, [greedy] * 4) == [o.token_ids for o in big.generate(prompts, greedy)]
    assert decode.runner.connector.num_blocks_pulled > 0 and decode.snapshot().host_kv_cache_hits == 0
    for eng in (prefill, decode):
        while eng.has_unfinished_requests():  # the last write-backs land
            eng.step()
        assert eng.snapshot().num_host_kv_stored_blocks > 0
    pulled = decode.runner.connector.num_blocks_pulled
    # Each longer prompt's prefix: evicted from the decode's 14 device blocks, on its host tier.
    decode_only = [decode.add_request(f"again{i}", p, greedy) for i, p in enumerate(longer)]
    outs = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [outs[r.request_id] for r in decode_only] == [o.token_ids for o in big.generate(longer, greedy)]
    assert decode.snapshot().host_kv_cache_hits > 0 and decode.runner.connector.num_blocks_pulled == pulled
    assert_pools_full(prefill, decode)


def test_kv_events_follow_both_tiers(tiny_llama):
    """The KV cache events of an engine with a host tier replay to what each tier holds: blocks
    offloaded to the host are stored there, host evictions removed from there."""
    from baton.engine.common.kv_cache_events import KVEventLog
    from baton.services.server.kv_event_hub import KVEventHub

    llm = LLM(tiny_llama, dtype="float32", device="cpu", num_kv_blocks=14, max_model_len=200,
              kv_offloading_size=gib(24))
    core, hub = llm.engine.core, KVEventHub("e", 16)
    core.kv.events = log = KVEventLog()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    host_removals = 0
    for prompts in [[conv[t] for conv in conversations(6, 3)] for t in range(3)]:
        llm.generate(prompts, params)
        events = log.take()
        host_removals += sum(len(e.block_hashes) for e in events if e.kind.value == "removed" and e.tier is KVTier.HOST)
        hub.publish(events)
        assert set(hub.mirror.tiers[KVTier.DEVICE]) == set(core.kv.cached)
        assert set(hub.mirror.tiers[KVTier.HOST]) == set(core.host.cached)
    assert core.host.cached and host_removals > 0  # offloaded, and evicted from the host too
