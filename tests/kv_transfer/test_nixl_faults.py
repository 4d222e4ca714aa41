"""Faults at the NIXL transport, injected around the real agent: transfers that fail, fail
half-way, arrive late or never, and malformed handles, each costing the request a recompute
and nothing else; and the start-up READ that finds a cache peers cannot read."""
from __future__ import annotations

import msgspec
import pytest
import torch
from helpers import random_prompts
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
from baton.engine.core.request import RequestStatus
from baton.kv_transfer.nixl_connector import decode_notification


def test_decode_preempts_while_others_wait_for_remote_kv(tiny_llama, hf):
    prompts = random_prompts([90, 60, 75, 30, 85, 45], seed=8)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prefill = nixl_engine(tiny_llama, "prefill")
    # A pool too small for all, and loads that take 3 steps: preemptions happen while
    # later requests still wait for their KV.
    decode = nixl_engine(tiny_llama, "decode", agent=FaultyAgent(f"decode-s{next(agent_ids)}", slow_checks=3),
                         num_kv_blocks=14, max_model_len=160)
    connect(prefill, decode)
    handles = run_prefill(prefill, prompts, [greedy] * len(prompts))
    ids = []
    overlap = []

    def watch():
        if decode.scheduler.num_preemptions and any(
                r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in decode.scheduler.waiting):
            overlap.append(True)

    for i, (prompt, handle) in enumerate(zip(prompts, handles)):
        ids.append(decode.add_request(f"pre{i}", prompt, greedy, remote_kv=handle).request_id)
        if i == 2:  # the first three start decoding before the rest arrive
            for _ in range(3):
                decode.step()
    tokens = run_until_done(prefill, decode, on_step=watch)
    assert decode.scheduler.num_preemptions > 0 and overlap  # preempted while loads were pending
    for prompt, handle, req_id in zip(prompts, handles, ids):
        assert [handle.first_token] + tokens[req_id] == hf.greedy(tiny_llama, prompt, 40)
    assert_pools_full(prefill, decode)


class AgentProxy:
    """A real NIXL agent: every method not overridden is the agent's own."""

    def __init__(self, name):
        from baton.kv_transfer.nixl_connector import new_agent
        self._agent = new_agent(name)

    def __getattr__(self, attr):
        return getattr(self._agent, attr)


class FaultyAgent(AgentProxy):
    """The real NIXL agent, with faults injected at the transport only: chosen transfers end in
    ERR after moving their blocks (`fail_requests`), or fail half-way (`half_requests`: the
    first half of the blocks moves, the rest of the destination is overwritten with garbage,
    then ERR); transfers report PROC for their first `slow_checks` polls (`late_requests`: only
    theirs, for that many)."""

    def __init__(self, name, fail_requests: set[str] = frozenset(), slow_checks: int = 0,
                 half_requests: set[str] = frozenset(), late_requests: dict[str, int] | None = None):
        super().__init__(name)
        self.fail_requests, self.half_requests = fail_requests, half_requests
        self.slow_checks, self.late_requests = slow_checks, late_requests or {}
        self._failing, self._late = set(), {}
        self._checks: dict[int, int] = {}
        self._descs: dict[int, list] = {}  # id of a descriptor list -> its (address, bytes, device)

    def get_xfer_descs(self, descs, mem_type):
        out = self._agent.get_xfer_descs(descs, mem_type)
        self._descs[id(out)] = list(descs)
        return out

    def initialize_xfer(self, op, local, remote, peer, notif=b""):
        import ctypes

        request = decode_notification(notif).request_id
        if request in self.half_requests:
            here, there = self._descs[id(local)], self._descs[id(remote)]
            half = [sum(size for _, size, _ in here) // 2]  # bytes that arrive

            def cut(descs):  # the first `half` bytes of a descriptor list
                out, left = [], half[0]
                for addr, size, dev in descs:
                    if left > 0:
                        out.append((addr, min(size, left), dev))
                    left -= size
                return out
            for addr, size, _ in here:  # what does not arrive is garbage, not stale blocks
                ctypes.memset(addr, 0x7F, size)
            local, remote = (self._agent.get_xfer_descs(cut(d), "DRAM") for d in (here, there))
        handle = self._agent.initialize_xfer(op, local, remote, peer, notif)
        if request in self.fail_requests or request in self.half_requests:
            self._failing.add(id(handle))
        self._late[id(handle)] = self.late_requests.get(request, self.slow_checks)
        return handle

    def check_xfer_state(self, handle):
        state = self._agent.check_xfer_state(handle)
        self._checks[id(handle)] = seen = self._checks.get(id(handle), 0) + 1
        if state == "PROC" or seen <= self._late.get(id(handle), self.slow_checks):
            return "PROC"
        return "ERR" if id(handle) in self._failing else state


def test_failed_loads_recompute_with_the_same_output(tiny_llama):
    prompts = random_prompts([50, 80, 20], seed=13)
    greedy = SamplingParams(max_tokens=15, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(tiny_llama, dtype="float32", device="cpu").generate(prompts, greedy)]
    prefill = nixl_engine(tiny_llama, "prefill")
    handles = run_prefill(prefill, prompts, [greedy] * 3)
    decode = nixl_engine(tiny_llama, "decode", agent=FaultyAgent(f"decode-f{next(agent_ids)}",
                                                                 {handles[1].request_id}))
    connect(prefill, decode)
    ids = [decode.add_request(f"f{i}", p, greedy, remote_kv=h).request_id
           for i, (p, h) in enumerate(zip(prompts, handles))]
    tokens = run_until_done(prefill, decode)
    assert [[h.first_token] + tokens[r] for h, r in zip(handles, ids)] == want
    assert decode.scheduler.arrivals.num_failed_loads == 1
    assert_pools_full(prefill, decode)


def test_transfers_that_fail_arrive_late_or_fail_half_way_give_the_clean_output(tiny_llama):
    """Faults at the transport: the output equals a clean run's, each failed pull is counted
    and recomputed, a late one is waited for and not recomputed."""
    prompts = random_prompts([70, 45, 90, 33, 64, 20], seed=15)
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True)] * 3
    want = [o.token_ids for o in LLM(tiny_llama, dtype="float32", device="cpu").generate(prompts, params)]
    prefill = nixl_engine(tiny_llama, "prefill")
    handles = run_prefill(prefill, prompts, params)
    remote = [h.request_id for h in handles]
    agent = FaultyAgent(f"decode-x{next(agent_ids)}", fail_requests={remote[0]}, half_requests={remote[2], remote[3]},
                        late_requests={remote[4]: 40, remote[5]: 15})
    decode = nixl_engine(tiny_llama, "decode", agent=agent)
    connect(prefill, decode)
    ids = [decode.add_request(f"x{i}", p, sp, remote_kv=h).request_id
           for i, (p, sp, h) in enumerate(zip(prompts, params, handles))]
    tokens = run_until_done(prefill, decode)
    assert [[h.first_token] + tokens[r] for h, r in zip(handles, ids)] == want
    assert decode.scheduler.arrivals.num_failed_loads == 3  # the failed and the two half-way ones, not the late ones
    assert_pools_full(prefill, decode)


def test_a_load_that_never_finishes_times_out_and_recomputes(tiny_llama):
    prompt = random_prompts([50], seed=14)[0]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = LLM(tiny_llama, dtype="float32", device="cpu").generate([prompt], greedy)[0].token_ids
    prefill = nixl_engine(tiny_llama, "prefill", hold_timeout_s=1.0)  # the decode reads well within it (0.2 s)
    stuck = FaultyAgent(f"decode-t{next(agent_ids)}", slow_checks=10**9)  # reports PROC forever
    decode = nixl_engine(tiny_llama, "decode", agent=stuck, load_timeout_s=0.2)
    connect(prefill, decode)
    assert disaggregated(prefill, decode, [prompt], [greedy]) == [want]
    assert decode.scheduler.arrivals.num_failed_loads == 1
    assert_pools_full(prefill, decode)


def test_failed_and_unpulled_transfers_say_so_in_their_events(tiny_llama):
    prompts = random_prompts([50, 40], seed=19)
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prefill = nixl_engine(tiny_llama, "prefill", hold_timeout_s=1.0)
    prefill.record_events()
    handles = run_prefill(prefill, prompts, [greedy] * 2)
    # A read ends within load_timeout_s, well within the hold: the decode reads (and fails).
    decode = nixl_engine(tiny_llama, "decode", agent=FaultyAgent(f"decode-g{next(agent_ids)}",
                                                                 {handles[0].request_id}), load_timeout_s=0.2)
    decode.record_events()
    connect(prefill, decode)
    decode.add_request("g0", prompts[0], greedy, remote_kv=handles[0])  # the second is never pulled
    run_until_done(prefill, decode)
    events = events_by_request(prefill, decode)
    (end,) = [e for e in events["g0"] if e.type == EventType.KV_LOAD_END]
    assert not end.transfer.ok and end.transfer.recompute_from_block == 0 and end.transfer.error
    assert events[handles[1].request_id][-1].detail == "expired"
    assert_pools_full(prefill, decode)


def test_a_malformed_handle_fails_its_own_load_not_the_engine(tiny_llama):
    prompts = random_prompts([40, 50], seed=20)
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(tiny_llama, dtype="float32", device="cpu").generate(prompts, greedy)]
    prefill, decode = nixl_engine(tiny_llama, "prefill"), nixl_engine(tiny_llama, "decode")
    connect(prefill, decode)
    handles = run_prefill(prefill, prompts, [greedy] * 2)
    handles[0] = msgspec.structs.replace(handles[0], block_ids=handles[0].block_ids[:-1])  # one block short
    ids = [decode.add_request(f"m{i}", p, greedy, remote_kv=h).request_id
           for i, (p, h) in enumerate(zip(prompts, handles))]
    tokens = run_until_done(prefill, decode)
    assert [[h.first_token] + tokens[r] for h, r in zip(handles, ids)] == want  # the first recomputed
    assert decode.scheduler.arrivals.num_failed_loads == 1
    assert_pools_full(prefill, decode)  # the short handle's hold expired or was released, not leaked


def test_the_start_up_probe_reads_a_block_of_the_cache(tiny_llama):
    """The READ every engine on a GPU makes at start-up (of VRAM there), here of CPU memory:
    a second real agent reads the cache's first block and finds its bytes."""
    engine = nixl_engine(tiny_llama, "probe", num_kv_blocks=16, max_model_len=256)
    engine.runner.kv_cache[0].normal_()
    before = engine.runner.kv_cache.clone()
    engine.runner.connector.check_reachable(engine.runner.kv_cache)
    assert torch.equal(engine.runner.kv_cache, before)  # the pattern it read was put back


class RefusingAgent(AgentProxy):
    """A real NIXL agent whose transfers end in ERR, as with UCX lacking the memory's transport."""

    def transfer(self, handle):
        return "ERR"


class IdleAgent(RefusingAgent):
    """A real NIXL agent whose transfers say DONE having moved nothing."""

    def transfer(self, handle):
        return "DONE"


@pytest.mark.parametrize("agent,why", [(RefusingAgent, r"the READ ended in ERR"),
                                       (IdleAgent, r"the READ reported done, but the block's bytes did not arrive")])
def test_a_cache_peers_cannot_read_stops_the_start_saying_why(tiny_llama, agent, why):
    from baton.kv_transfer.base import KVUnreachable

    engine = nixl_engine(tiny_llama, "probe", num_kv_blocks=16, max_model_len=256)
    before = engine.runner.kv_cache.clone()
    with pytest.raises(KVUnreachable, match=r"cannot move KV blocks in DRAM on cpu over NIXL/UCX \(" + why
                                           + r"\); for GPU memory UCX needs its CUDA transports"):
        engine.runner.connector.check_reachable(engine.runner.kv_cache, agent(f"faulty-{next(agent_ids)}"))
    assert torch.equal(engine.runner.kv_cache, before)
