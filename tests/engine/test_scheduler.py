"""Scheduler behaviour without a model: randomized invariants, policies, stop conditions."""
from __future__ import annotations

import random

import pytest

from baton.engine.common.config import EngineConfig
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.common.scheduler_output import ModelRunnerOutput
from baton.engine.core.kv_cache_manager import KVCacheManager
from baton.engine.core.request import Request, RequestStatus
from baton.engine.core.scheduler import Scheduler


def make_scheduler(tmp_path, num_blocks, **kwargs):
    config = EngineConfig(model=str(tmp_path), **kwargs)
    kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
    return Scheduler(config, kv), kv


def fake_run(sched, out, rng, vocab=4):
    """Sample a random token for every request that caught up with its known tokens."""
    sampled = {}
    for req_id in out.num_scheduled_tokens:
        req = sched.requests[req_id]
        if req.num_computed_tokens == req.num_tokens:
            sampled[req_id] = [rng.randrange(vocab)]
    return ModelRunnerOutput(sampled)


def check_invariants(sched, kv, out):
    cfg = sched.config
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values()) <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    owners: dict[int, int] = {}
    for req_id, groups in kv.req_blocks.items():
        ids = [b.block_id for blocks in groups for b in blocks if b is not None]
        assert len(ids) == len(set(ids)), f"{req_id} holds a block twice"
        for i in ids:
            owners[i] = owners.get(i, 0) + 1
        req = sched.requests[req_id]
        assert all(len(blocks) * cfg.block_size >= req.num_computed_tokens for blocks in groups)
    for block in kv.blocks:
        assert block.ref_cnt == owners.get(block.block_id, 0)
        assert (block.ref_cnt == 0) == (block.block_id in kv.free_queue)
        if block.ref_cnt > 1:  # only prefix-cached blocks are shared
            assert block.block_hash is not None and kv.caches[block.group][block.block_hash] is block
    assert all(cache[h].block_hash == h for cache in kv.caches for h in cache)
    for req in sched.running:
        assert req.status == RequestStatus.RUNNING and req.num_computed_tokens <= req.num_tokens


@pytest.mark.parametrize("seed", range(24))
def test_randomized_invariants(tmp_path, seed):
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    max_model_len = rng.choice([32, 64])
    sched, kv = make_scheduler(
        tmp_path, num_blocks=max_model_len // block_size + rng.randrange(0, 24), block_size=block_size,
        max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.choice([8, 16, 64]),
        max_model_len=max_model_len, enable_prefix_caching=rng.random() < 0.8,
        enable_chunked_prefill=True, long_prefill_token_threshold=rng.choice([0, 0, 5]),
        scheduling_policy=rng.choice(["fcfs", "priority"]))
    pending = []
    for i in range(rng.randint(4, 16)):
        prompt = [rng.randrange(2) for _ in range(rng.randint(1, max_model_len - 1))]
        params = SamplingParams(max_tokens=rng.randint(1, 12), stop_token_ids=[3] if rng.random() < 0.3 else [])
        pending.append(Request(f"r{i}", prompt, params, priority=rng.randint(0, 3)))
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop())
        if sched.requests and rng.random() < 0.05:
            sched.finish_requests([rng.choice(list(sched.requests))])
        out = sched.schedule()
        check_invariants(sched, kv, out)
        sched.update_from_output(out, fake_run(sched, out, rng))
        if not pending and not sched.requests:
            break
    assert not sched.requests and not pending, "requests left unfinished"
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_blocks


def test_priority_policy_picks_lowest_value_first_and_preempts_largest(tmp_path):
    sched, kv = make_scheduler(tmp_path, num_blocks=6, block_size=4, max_num_seqs=3, max_model_len=24,
                               scheduling_policy="priority")
    reqs = [Request(name, [1] * 6, SamplingParams(max_tokens=20), priority=p, arrival_time=float(i))
            for i, (name, p) in enumerate([("low", 5), ("high", 0), ("mid", 1)])]
    for r in reqs:
        sched.add_request(r)
    assert [r.request_id for r in sched.waiting] == ["high", "mid", "low"]
    rng = random.Random(0)
    first_victim = None
    while sched.requests and first_victim is None:
        out = sched.schedule()
        if out.preempted_req_ids:
            first_victim = out.preempted_req_ids
        sched.update_from_output(out, fake_run(sched, out, rng))
    assert first_victim == {"low"}  # the largest (priority, arrival), although it is not the last running


def test_fcfs_preempts_the_last_running(tmp_path):
    sched, kv = make_scheduler(tmp_path, num_blocks=6, block_size=4, max_num_seqs=3, max_model_len=24)
    for name in ["a", "b", "c"]:
        sched.add_request(Request(name, [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=20)))
    rng = random.Random(0)
    while True:
        out = sched.schedule()
        if out.preempted_req_ids:
            assert out.preempted_req_ids == {"c"} and sched.waiting[0].request_id == "c"
            break
        sched.update_from_output(out, fake_run(sched, out, rng))


def test_stop_conditions(tmp_path):
    sched, kv = make_scheduler(tmp_path, num_blocks=16, block_size=4, max_model_len=12)
    cases = {
        "eos": (SamplingParams(max_tokens=5), [7], RequestStatus.FINISHED_STOPPED, 1),
        "eos_ignored": (SamplingParams(max_tokens=3, ignore_eos=True), [7, 7, 7],
                        RequestStatus.FINISHED_LENGTH_CAPPED, 3),
        "stop_id": (SamplingParams(max_tokens=5, stop_token_ids=[9]), [1, 9], RequestStatus.FINISHED_STOPPED, 2),
        "min_tokens": (SamplingParams(max_tokens=5, min_tokens=2), [7, 7, 7], RequestStatus.FINISHED_STOPPED, 3),
        "model_len": (SamplingParams(max_tokens=50), [1] * 10, RequestStatus.FINISHED_LENGTH_CAPPED, 4),
    }
    for name, (params, tokens, status, n_out) in cases.items():
        req = Request(name, [1] * 8, params, eos_token_ids=frozenset({7}))
        sched.add_request(req)
        for token in tokens:
            out = sched.schedule()
            sched.update_from_output(out, ModelRunnerOutput({name: [token]}))
            if req.is_finished:
                break
        assert (req.status, req.num_output_tokens) == (status, n_out), name
    assert kv.num_free_blocks == kv.num_blocks


def test_abort_frees_blocks_wherever_the_request_is(tmp_path):
    sched, kv = make_scheduler(tmp_path, num_blocks=8, block_size=4, max_num_seqs=1, max_model_len=32)
    a, b = Request("a", [1] * 9, SamplingParams()), Request("b", [2] * 9, SamplingParams())
    sched.add_request(a)
    sched.add_request(b)
    sched.schedule()
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.WAITING
    assert [r.request_id for r in sched.finish_requests(["a", "b", "nope"])] == ["a", "b"]
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert sched.schedule().finished_req_ids == {"a", "b"}
    assert kv.num_free_blocks == kv.num_blocks


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step(tmp_path):
    sched, kv = make_scheduler(tmp_path, num_blocks=16, block_size=4, max_num_batched_tokens=16,
                               max_model_len=16, enable_chunked_prefill=False)
    sched.add_request(Request("a", [1] * 10, SamplingParams()))
    sched.add_request(Request("b", [2] * 10, SamplingParams()))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 10}  # b's 10 tokens do not fit the 6 left
