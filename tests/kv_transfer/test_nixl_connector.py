"""Disaggregation over real NIXL transfers (UCX, CPU memory): a prefill engine computes the
prompt and holds its blocks, a decode engine READs them while the request waits in
WAITING_FOR_REMOTE_KVS, and the output equals one colocated engine's (and transformers').
Transport faults and the start-up probe: test_nixl_faults.py."""
from __future__ import annotations

import threading
import weakref

from helpers import gib, random_prompts
from nixl_engines import (
    agent_ids,
    assert_pools_full,
    connect,
    disaggregated,
    events_by_request,
    nixl_engine,
    run_prefill,
    run_until_done,
)

from baton import LLM, SamplingParams
from baton.engine.common.stats import EventType
from baton.engine.common.structured_output import StructuredOutput
from baton.engine.core.request import RequestStatus
from baton.kv_transfer.nixl_connector import merge_runs


def test_merge_runs_joins_blocks_consecutive_on_both_sides():
    assert merge_runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 2)]
    assert merge_runs([1, 2, 3], [7, 9, 10]) == [(1, 7, 1), (2, 9, 2)]
    assert merge_runs([], []) == []


def test_disaggregated_equals_colocated_greedy_and_seeded(tiny_model, hf):
    prompts = random_prompts([3, 16, 17, 40, 77, 130], seed=31)
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    colocated = LLM(tiny_model, dtype="float32", device="cpu")
    want_greedy = [o.token_ids for o in colocated.generate(prompts, greedy)]
    want_seeded = [o.token_ids for o in colocated.generate(prompts, seeded)]
    prefill = nixl_engine(tiny_model, "prefill", max_num_batched_tokens=48)  # long prompts chunked
    decode = nixl_engine(tiny_model, "decode")
    connect(prefill, decode)
    seen_waiting = set()
    schedule = decode.scheduler.schedule

    def schedule_and_watch():  # right after admission: a fast READ may end within the same step
        out = schedule()
        seen_waiting.update(r.request_id for r in decode.scheduler.waiting
                            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        return out

    decode.scheduler.schedule = schedule_and_watch
    assert disaggregated(prefill, decode, prompts, [greedy] * len(prompts)) == want_greedy
    del decode.scheduler.schedule  # (the class's again; its bound method kept here would be a cycle)
    assert want_greedy == [hf.greedy(tiny_model, p, 20) for p in prompts]
    assert len(seen_waiting) == len(prompts)
    assert disaggregated(prefill, decode, prompts, seeded) == want_seeded
    assert decode.runner.connector.num_blocks_pulled > 0
    assert_pools_full(prefill, decode)


def test_decode_prefix_hit_pulls_only_the_missing_blocks(tiny_llama):
    prompt = random_prompts([100], seed=5)[0]  # 6 full blocks + 4 tokens
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = LLM(tiny_llama, dtype="float32", device="cpu").generate([prompt], greedy)[0].token_ids
    prefill, decode = nixl_engine(tiny_llama, "prefill"), nixl_engine(tiny_llama, "decode")
    connect(prefill, decode)
    decode.add_request("local", prompt[:70], greedy)  # leaves 4 full blocks in decode's cache
    run_until_done(decode)
    worker = decode.runner.connector
    assert disaggregated(prefill, decode, [prompt], [greedy]) == [want]
    assert worker.num_blocks_pulled == 3  # blocks 4, 5 and the partial 6th; 0-3 were local hits
    assert worker.num_descriptors <= worker.num_blocks_pulled
    assert_pools_full(prefill, decode)


def test_a_handle_nobody_pulls_is_freed_after_the_timeout(tiny_llama):
    prefill = nixl_engine(tiny_llama, "prefill", hold_timeout_s=0.2)
    run_prefill(prefill, random_prompts([40], seed=2), [SamplingParams(max_tokens=1, temperature=0)])
    assert prefill.num_held_requests == 1
    run_until_done(prefill)  # bounded in time; the hold timeout frees it after ~0.2 s
    assert prefill.runner.connector.num_expired_holds == 1
    assert_pools_full(prefill)


def test_a_decode_too_late_for_the_hold_computes_the_prompt_instead_of_reading_reused_blocks(tiny_llama):
    """A decode that reaches a handle when the prefill's hold may expire before a read would
    end must not read: the blocks go to other requests after the hold, and a one-sided READ
    would load their KV (wrong output). It computes the prompt and equals colocated."""
    import time

    prefill = nixl_engine(tiny_llama, "prefill", hold_timeout_s=1.0, num_kv_blocks=8, max_model_len=128)
    decode = nixl_engine(tiny_llama, "decode", load_timeout_s=0.3)
    connect(prefill, decode)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt, other = random_prompts([100, 100], seed=31)
    handle = run_prefill(prefill, [prompt], [greedy])[0]
    arrived = time.monotonic()  # the decode has the handle at once, but a busy decode gets to it late
    run_until_done(prefill)  # the hold expires (1 s) ...
    run_prefill(prefill, [other], [greedy])  # ... and its blocks hold another prompt's KV now
    req = decode.add_request("late", prompt, greedy, arrival_time=arrived, remote_kv=handle)
    run_until_done(prefill, decode)
    want = LLM(tiny_llama, dtype="float32", device="cpu").generate([prompt], greedy)[0].token_ids
    assert [handle.first_token] + req.output_token_ids[1:] == want and req.output_token_ids[0] == want[0]
    assert decode.runner.connector.num_blocks_pulled == 0 and decode.scheduler.connector.num_late_handles == 1
    assert_pools_full(prefill, decode)


def test_decode_abort_while_loading_frees_blocks_after_the_load(tiny_llama):
    prompts = random_prompts([64, 33], seed=17)
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prefill, decode = nixl_engine(tiny_llama, "prefill"), nixl_engine(tiny_llama, "decode")
    connect(prefill, decode)
    handles = run_prefill(prefill, prompts, [greedy] * 2)
    for i, (p, h) in enumerate(zip(prompts, handles)):
        decode.add_request(f"a{i}", p, greedy, remote_kv=h)
    decode.step()  # admitted: both WAITING_FOR_REMOTE_KVS, loads started
    assert all(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in decode.scheduler.waiting)
    decode.abort_request(["a0"])
    assert decode.num_held_requests == 1  # its blocks stay taken until the READ reports
    run_until_done(prefill, decode)
    assert_pools_full(prefill, decode)


def test_a_restarted_decode_re_handshakes(tiny_llama):
    prompt = random_prompts([45], seed=4)[0]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = LLM(tiny_llama, dtype="float32", device="cpu").generate([prompt], greedy)[0].token_ids
    name = f"decode-r{next(agent_ids)}"
    prefill, decode = nixl_engine(tiny_llama, "prefill"), nixl_engine(tiny_llama, "decode", name=name)
    connect(prefill, decode)
    assert disaggregated(prefill, decode, [prompt], [greedy]) == [want]
    old_metadata = decode.runner.connector.layout.agent_metadata
    decode.runner.connector.close()
    decode = nixl_engine(tiny_llama, "decode", name=name)  # same name, new agent and memory
    assert decode.runner.connector.layout.agent_metadata != old_metadata
    connect(prefill, decode)  # prefill replaces the old peer's metadata
    assert disaggregated(prefill, decode, [prompt], [greedy]) == [want]
    assert_pools_full(prefill, decode)


def test_engines_report_each_request_as_events_in_order(tiny_llama):
    """The plain data telemetry is made from: a chunked prefill, a pull, a hold let go."""
    prompts = random_prompts([40, 70], seed=18)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prefill = nixl_engine(tiny_llama, "prefill", max_num_batched_tokens=32)
    decode = nixl_engine(tiny_llama, "decode")
    connect(prefill, decode)
    for eng in (prefill, decode):
        eng.record_events()
    handles = run_prefill(prefill, prompts, [greedy] * 2)
    ids = [decode.add_request(f"e{i}", p, greedy, remote_kv=h).request_id
           for i, (p, h) in enumerate(zip(prompts, handles))]
    run_until_done(prefill, decode)
    events = events_by_request(prefill, decode)
    for handle, req_id, prompt in zip(handles, ids, prompts):
        mine = events[handle.request_id]
        kinds = [e.type for e in mine]
        assert kinds[0] == EventType.SCHEDULED and kinds[-2:] == [EventType.FINISHED, EventType.HOLD_END]
        assert sum(e.num_tokens for e in mine if e.type == EventType.PREFILL_CHUNK) == len(prompt)
        assert mine[-1].detail == "pulled"
        theirs = events[req_id]
        assert [e.type for e in theirs] == [EventType.KV_WAIT, EventType.KV_LOAD_START, EventType.KV_LOAD_END,
                                            EventType.SCHEDULED, EventType.FINISHED]
        transfer = theirs[2].transfer
        assert transfer.ok and transfer.num_blocks == -(-len(prompt) // 16) and transfer.recompute_from_block is None
        assert transfer.num_bytes == transfer.num_blocks * decode.runner.connector.layout.block_bytes
        assert transfer.start_time <= transfer.end_time and all(a.time <= b.time for a, b in zip(theirs, theirs[1:]))
        request_times = [theirs[0].time, transfer.end_time, theirs[3].time, theirs[4].time]
        assert request_times == sorted(request_times)
    assert_pools_full(prefill, decode)
    snap = decode.snapshot()
    assert snap.num_prompt_tokens_external == sum(map(len, prompts)) and snap.num_generation_tokens == 6


def test_a_hold_released_twice_ends_once_and_a_reused_id_is_held_again(tiny_llama):
    prefill = nixl_engine(tiny_llama, "prefill", hold_timeout_s=60)
    prefill.record_events()
    params = [SamplingParams(max_tokens=1, temperature=0)]
    prompt = random_prompts([40], seed=21)
    [handle] = run_prefill(prefill, prompt, params)
    req_id, worker = handle.request_id, prefill.runner.connector
    prefill.step()  # the hold registers
    worker.release(req_id)
    worker.release(req_id)  # the router's Release and the cancelled call's both come
    run_until_done(prefill)
    ends = [e for e in prefill.take_events().events if e.type == EventType.HOLD_END]
    assert [e.detail for e in ends] == ["released"]
    # The same id again (a client's own ids): its hold is not let go by the stale release.
    prefill.add_request(req_id, prompt[0], SamplingParams(max_tokens=1, temperature=0),
                        hold_for_remote=True)
    for _ in range(5):
        prefill.step()
    assert prefill.num_held_requests == 1
    worker.release(req_id)
    run_until_done(prefill)
    assert_pools_full(prefill)




def test_an_engine_stops_its_threads_when_closed_and_is_freed_when_dropped(tiny_llama):
    """close() stops the connector's progress thread, the grammar compiler's and the host tier's
    copier, and the connector lets its cache go; twice is once. An engine dropped unclosed is
    freed at once, its cache with it (no thread and no reference cycle keeps it), and its
    progress thread ends."""
    before = set(threading.enumerate())
    engine = nixl_engine(tiny_llama, "prefill", num_kv_blocks=14, max_model_len=200, kv_offloading_size=gib(8))
    grammar = SamplingParams(max_tokens=4, temperature=0, structured_output=StructuredOutput("regex", "[ab]+"))
    engine.add_request("g", random_prompts([40], seed=5)[0], grammar)  # its full blocks are written back
    run_until_done(engine)
    started = {t.name for t in set(threading.enumerate()) - before}
    assert {"nixl-progress", "grammar-compiler_0", "host-kv_0"} <= started, started
    engine.close()
    engine.close()
    assert engine.runner.connector._cache is None
    for t in set(threading.enumerate()) - before:
        t.join(5)  # (a pool's worker ends at its next look at the queue)
    assert not [t.name for t in set(threading.enumerate()) - before]

    dropped = nixl_engine(tiny_llama, "decode")
    poller, core, cache = (dropped.runner.connector._poller, weakref.ref(dropped.core),
                           weakref.ref(dropped.runner.kv_cache))
    del dropped
    assert core() is None and cache() is None  # without the garbage collector's help
    poller.join(5)
    assert not poller.is_alive()
