"""The host KV tier's bookkeeping without a model: the scheduler and HostKVTier driven for
thousands of random steps against a token-level model of both pools' contents (every token a
request attends to is its own; reference counts match owners; nothing leaks), and the order in
which a swapped request resumes."""
from __future__ import annotations

import random

import pytest

from baton.engine.common.config import EngineConfig
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.common.scheduler_output import ModelRunnerOutput
from baton.engine.core.host_kv_tier import HostKVTier
from baton.engine.core.kv_cache_manager import KVCacheManager
from baton.engine.core.request import Request
from baton.engine.core.scheduler import Scheduler


class FakeRunner:
    """Writes each scheduled token into its slot of a model device pool, checks every token a
    request attends to is its own, and carries out the host tier's copies: swaps at once,
    write-backs and loads only when reported landed (a random number of steps later)."""

    def __init__(self, sched: Scheduler, num_blocks: int, num_host_blocks: int, rng: random.Random):
        self.sched, self.rng, self.bs = sched, rng, sched.kv.block_size
        self.device = [[None] * self.bs for _ in range(num_blocks)]
        self.host = [[None] * self.bs for _ in range(num_host_blocks)]
        self.jobs = []  # (steps left, ops)

    def run(self, out) -> ModelRunnerOutput:
        ops = out.host_kv_ops
        if ops is not None:
            for d, h in ops.swap_out:
                self.host[h] = list(self.device[d])
            for h, d in ops.swap_in:
                self.device[d] = list(self.host[h])
            if ops.offload or ops.load:
                self.jobs.append([self.rng.randint(0, 3), ops])
        sampled = {}
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[req_id]
            blocks, start = self.sched.kv.block_ids(req_id)[0], req.num_computed_tokens - n
            for pos in range(start):  # the KV this step attends to
                assert self.device[blocks[pos // self.bs]][pos % self.bs] == req.all_token_ids[pos], (req_id, pos)
            for pos in range(start, start + n):
                self.device[blocks[pos // self.bs]][pos % self.bs] = req.all_token_ids[pos]
            if req.num_computed_tokens == req.num_tokens:
                sampled[req_id] = [self.rng.randrange(4)]
        result = ModelRunnerOutput(sampled)
        while self.jobs and self.jobs[0][0] <= 0:  # in order, as the copier reports them
            ops = self.jobs.pop(0)[1]
            for d, h in ops.offload:
                self.host[h] = list(self.device[d])
            for h, d in ops.load:
                self.device[d] = list(self.host[h])
            result.host_kv_finished.append(ops.job_id)
        for job in self.jobs:
            job[0] -= 1
        return result


def check_refcounts(sched: Scheduler, kv: KVCacheManager, host: HostKVTier) -> None:
    owners: dict[int, int] = {}
    for groups in kv.req_blocks.values():
        for b in groups[0]:
            owners[b.block_id] = owners.get(b.block_id, 0) + 1
    host_owners: dict[int, int] = {}
    for blocks, _ in host.swapped.values():
        for b in blocks:
            host_owners[b.block_id] = host_owners.get(b.block_id, 0) + 1
    for job in host._jobs.values():
        for d, h, _ in job.stored:
            owners[d.block_id] = owners.get(d.block_id, 0) + 1
            host_owners[h.block_id] = host_owners.get(h.block_id, 0) + 1
        for h in job.read:
            host_owners[h.block_id] = host_owners.get(h.block_id, 0) + 1
    for pool, counts in ((kv, owners), (host, host_owners)):
        for b in pool.blocks:
            assert b.ref_cnt == counts.get(b.block_id, 0)
            assert (b.ref_cnt == 0) == (b.block_id in pool.free_queue)
        assert all(pool.cached[h].block_hash == h for h in pool.cached)


@pytest.mark.parametrize("seed", range(32))
def test_randomized_bookkeeping_of_both_tiers(tmp_path, seed):
    rng = random.Random(seed)
    block_size, max_model_len = rng.choice([2, 4, 8]), rng.choice([32, 64])
    num_blocks, num_host = max_model_len // block_size + rng.randrange(0, 16), rng.randint(1, 40)
    config = EngineConfig(model=str(tmp_path), block_size=block_size, max_num_seqs=rng.randint(1, 6),
                          max_num_batched_tokens=rng.choice([8, 16, 64]), max_model_len=max_model_len,
                          long_prefill_token_threshold=rng.choice([0, 0, 5]),
                          scheduling_policy=rng.choice(["fcfs", "priority"]), kv_offloading_size=1e-6,
                          preemption_mode=rng.choice(["recompute", "swap", "auto"]))
    kv = KVCacheManager(num_blocks, block_size)
    host = HostKVTier(num_host, kv, config.preemption_mode, config.max_num_batched_tokens)
    sched = Scheduler(config, kv, host=host)
    runner = FakeRunner(sched, num_blocks, num_host, rng)
    prefixes = [[rng.randrange(3) for _ in range(rng.randint(0, max_model_len // 2))] for _ in range(3)]
    pending, prompts = [], []
    for i in range(rng.randint(8, 24)):
        prompt = ((rng.choice(prefixes) + [rng.randrange(3) for _ in range(max_model_len)])
                  [:rng.randint(1, max_model_len - 1)])
        if prompts and rng.random() < 0.4:  # a prompt again (a conversation's next turn starts with the last)
            prompt = rng.choice(prompts)
        prompts.append(prompt)
        pending.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 12)),
                               priority=rng.randint(0, 3)))
    for _ in range(4000):
        if pending and rng.random() < 0.3:
            sched.add_request(pending.pop())
        if sched.requests and rng.random() < 0.04:
            sched.finish_requests([rng.choice(list(sched.requests))])
        if rng.random() < 0.005:  # LLM.reset_prefix_cache, with copies in flight
            kv.reset_prefix_cache()
            host.reset_prefix_cache()
        out = sched.schedule()
        check_refcounts(sched, kv, host)
        sched.update_from_output(out, runner.run(out))
        if not pending and not sched.requests and not host.has_pending:
            break
    assert not sched.requests and not pending and not sched.arrivals.held and not host.has_pending
    assert kv.num_free_blocks == kv.num_blocks and host.num_free_blocks == host.num_blocks and not host.swapped
    check_refcounts(sched, kv, host)


def test_a_swapped_request_resumes_before_new_ones_are_admitted(tmp_path):
    from baton.engine.common.stats import EventType

    config = EngineConfig(model=str(tmp_path), block_size=4, max_model_len=32, kv_offloading_size=1e-6,
                          preemption_mode="swap")
    kv = KVCacheManager(9, 4)
    host = HostKVTier(32, kv, "swap", config.max_num_batched_tokens)
    sched = Scheduler(config, kv, host=host)
    sched.events = []
    runner = FakeRunner(sched, 9, 32, random.Random(0))
    a, b = (Request(name, [i + 1] * 12, SamplingParams(max_tokens=16)) for i, name in enumerate("ab"))
    sched.add_request(a)
    sched.add_request(b)
    late = Request("late", [7] * 6, SamplingParams(max_tokens=4))
    while sched.requests or host.has_pending:
        out = sched.schedule()
        if b.request_id in host.swapped and late.request_id not in sched.requests and not late.is_finished:
            sched.add_request(late)  # arrives while b waits in the host tier
        sched.update_from_output(out, runner.run(out))
    order = [(e.request_id, e.type) for e in sched.events if e.type in (EventType.SCHEDULED, EventType.PREEMPTED)]
    assert ("b", EventType.PREEMPTED) in order and host.num_swapped_out >= 1
    resumed = order.index(("b", EventType.SCHEDULED), order.index(("b", EventType.PREEMPTED)))
    assert resumed < order.index(("late", EventType.SCHEDULED)), order
    assert kv.num_free_blocks == kv.num_blocks and host.num_free_blocks == host.num_blocks
