"""Disaggregation over real NIXL transfers (UCX, CPU memory): a prefill engine computes the
prompt and holds its blocks, a decode engine READs them while the request waits in
WAITING_FOR_REMOTE_KVS, and the output equals one colocated engine's (and transformers')."""
from __future__ import annotations

import itertools

import pytest
import torch

from baton import LLM, SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.request import RequestStatus
from baton.engine.stats import EventType
from baton.kv_transfer.nixl_connector import make_nixl_connector, merge_runs

from helpers import random_prompts

_ids = itertools.count()


def nixl_engine(model_dir: str, role: str, hold_timeout_s: float = 60.0, agent=None, name=None,
                load_timeout_s: float = 30.0, **kwargs) -> LLMEngine:
    config = EngineConfig(model=model_dir, **{"dtype": "float32", "device": "cpu", **kwargs})
    name = name or f"{role}-{next(_ids)}"  # NIXL agent names must be unique among peers
    return LLMEngine(config, kv_connector=make_nixl_connector(name, config.block_size, hold_timeout_s, agent,
                                                              load_timeout_s))


def connect(prefill: LLMEngine, decode: LLMEngine) -> None:
    """The metadata exchange the services do over gRPC, done directly."""
    decode.runner.connector.add_peer(prefill.runner.connector.layout)
    prefill.runner.connector.add_peer(decode.runner.connector.layout)


def run_prefill(prefill: LLMEngine, prompts, params: list[SamplingParams]) -> list[dict]:
    reqs = [prefill.add_request(f"p{next(_ids)}", prompt, SamplingParams(**{**_fields(p), "max_tokens": 1}),
                                kv_transfer_params={"do_remote_decode": True})
            for prompt, p in zip(prompts, params)]
    while prefill.has_unfinished_requests():
        prefill.step()
    return [r.kv_transfer_params for r in reqs]


def _fields(p: SamplingParams) -> dict:
    return {name: getattr(p, name) for name in SamplingParams.__slots__}


def run_until_done(*engines, on_step=None, max_steps=20_000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        busy = False
        for eng in engines:
            if eng.has_unfinished_requests() or eng.num_held_requests:
                busy = True
                for out in eng.step():
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if on_step:
            on_step()
        if not busy:
            return tokens
    state = [(e.scheduler.waiting, e.scheduler.running, e.scheduler.held, e.runner.connector._loading,
              e.runner.connector._holds) for e in engines]
    raise AssertionError(f"engines did not finish: {state}")  # bounded: never hangs


def assert_pools_full(*engines):
    for eng in engines:
        assert eng.num_held_requests == 0
        assert eng.kv.num_free_blocks == eng.num_kv_blocks


def disaggregated(prefill, decode, prompts, params, on_step=None) -> list[list[int]]:
    handles = run_prefill(prefill, prompts, params)
    ids = []
    for i, (prompt, p, handle) in enumerate(zip(prompts, params, handles)):
        req = decode.add_request(f"d{next(_ids)}", prompt, p, kv_transfer_params=handle)
        ids.append(req.request_id)
    tokens = run_until_done(prefill, decode, on_step=on_step)
    return [[h["first_token"]] + tokens.get(r, []) for h, r in zip(handles, ids)]


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
    decode.scheduler.schedule = schedule
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


def test_decode_preempts_while_others_wait_for_remote_kv(tiny_llama, hf):
    prompts = random_prompts([90, 60, 75, 30, 85, 45], seed=8)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prefill = nixl_engine(tiny_llama, "prefill")
    # A pool too small for all, and loads that take 3 steps: preemptions happen while
    # later requests still wait for their KV.
    decode = nixl_engine(tiny_llama, "decode", agent=FaultyAgent(f"decode-s{next(_ids)}", slow_checks=3),
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
        ids.append(decode.add_request(f"pre{i}", prompt, greedy, kv_transfer_params=handle).request_id)
        if i == 2:  # the first three start decoding before the rest arrive
            for _ in range(3):
                decode.step()
    tokens = run_until_done(prefill, decode, on_step=watch)
    assert decode.scheduler.num_preemptions > 0 and overlap  # preempted while loads were pending
    for prompt, handle, req_id in zip(prompts, handles, ids):
        assert [handle["first_token"]] + tokens[req_id] == hf.greedy(tiny_llama, prompt, 40)
    assert_pools_full(prefill, decode)


class FaultyAgent:
    """The real NIXL agent, with faults injected at the transport only: chosen transfers end in
    ERR after moving their blocks (`fail_requests`), or fail half-way (`half_requests`: the
    first half of the blocks moves, the rest of the destination is overwritten with garbage,
    then ERR); transfers report PROC for their first `slow_checks` polls (`late_requests`: only
    theirs, for that many)."""

    def __init__(self, name, fail_requests: set[str] = frozenset(), slow_checks: int = 0,
                 half_requests: set[str] = frozenset(), late_requests: dict[str, int] | None = None):
        from baton.kv_transfer.nixl_connector import _new_agent
        self._agent = _new_agent(name)
        self.fail_requests, self.half_requests = fail_requests, half_requests
        self.slow_checks, self.late_requests = slow_checks, late_requests or {}
        self._failing, self._late = set(), {}
        self._checks: dict[int, int] = {}
        self._descs: dict[int, list] = {}  # id of a descriptor list -> its (address, bytes, device)

    def __getattr__(self, attr):
        return getattr(self._agent, attr)

    def get_xfer_descs(self, descs, mem_type):
        out = self._agent.get_xfer_descs(descs, mem_type)
        self._descs[id(out)] = list(descs)
        return out

    def initialize_xfer(self, op, local, remote, peer, notif=b""):
        import ctypes

        request = notif.decode()
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
    decode = nixl_engine(tiny_llama, "decode", agent=FaultyAgent(f"decode-f{next(_ids)}",
                                                                 {handles[1]["remote_request_id"]}))
    connect(prefill, decode)
    ids = [decode.add_request(f"f{i}", p, greedy, kv_transfer_params=h).request_id
           for i, (p, h) in enumerate(zip(prompts, handles))]
    tokens = run_until_done(prefill, decode)
    assert [[h["first_token"]] + tokens[r] for h, r in zip(handles, ids)] == want
    assert decode.scheduler.num_failed_loads == 1
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
    remote = [h["remote_request_id"] for h in handles]
    agent = FaultyAgent(f"decode-x{next(_ids)}", fail_requests={remote[0]}, half_requests={remote[2], remote[3]},
                        late_requests={remote[4]: 40, remote[5]: 15})
    decode = nixl_engine(tiny_llama, "decode", agent=agent)
    connect(prefill, decode)
    ids = [decode.add_request(f"x{i}", p, sp, kv_transfer_params=h).request_id
           for i, (p, sp, h) in enumerate(zip(prompts, params, handles))]
    tokens = run_until_done(prefill, decode)
    assert [[h["first_token"]] + tokens[r] for h, r in zip(handles, ids)] == want
    assert decode.scheduler.num_failed_loads == 3  # the failed and the two half-way ones, not the late ones
    assert_pools_full(prefill, decode)


def test_a_load_that_never_finishes_times_out_and_recomputes(tiny_llama):
    prompt = random_prompts([50], seed=14)[0]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = LLM(tiny_llama, dtype="float32", device="cpu").generate([prompt], greedy)[0].token_ids
    prefill = nixl_engine(tiny_llama, "prefill", hold_timeout_s=0.5)
    stuck = FaultyAgent(f"decode-t{next(_ids)}", slow_checks=10**9)  # reports PROC forever
    decode = nixl_engine(tiny_llama, "decode", agent=stuck, load_timeout_s=0.2)
    connect(prefill, decode)
    assert disaggregated(prefill, decode, [prompt], [greedy]) == [want]
    assert decode.scheduler.num_failed_loads == 1
    assert_pools_full(prefill, decode)


def test_a_handle_nobody_pulls_is_freed_after_the_timeout(tiny_llama):
    prefill = nixl_engine(tiny_llama, "prefill", hold_timeout_s=0.2)
    run_prefill(prefill, random_prompts([40], seed=2), [SamplingParams(max_tokens=1, temperature=0)])
    assert prefill.num_held_requests == 1
    run_until_done(prefill)  # bounded by max_steps; the timeout frees it after ~0.2 s
    assert prefill.runner.connector.num_expired_holds == 1
    assert_pools_full(prefill)


def test_decode_abort_while_loading_frees_blocks_after_the_load(tiny_llama):
    prompts = random_prompts([64, 33], seed=17)
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prefill, decode = nixl_engine(tiny_llama, "prefill"), nixl_engine(tiny_llama, "decode")
    connect(prefill, decode)
    handles = run_prefill(prefill, prompts, [greedy] * 2)
    for i, (p, h) in enumerate(zip(prompts, handles)):
        decode.add_request(f"a{i}", p, greedy, kv_transfer_params=h)
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
    name = f"decode-r{next(_ids)}"
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


def events_by_request(*engines) -> dict[str, list]:
    out: dict[str, list] = {}
    for eng in engines:
        for ev in eng.take_events().events:
            out.setdefault(ev.request_id, []).append(ev)
    return out


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
    ids = [decode.add_request(f"e{i}", p, greedy, kv_transfer_params=h).request_id
           for i, (p, h) in enumerate(zip(prompts, handles))]
    run_until_done(prefill, decode)
    events = events_by_request(prefill, decode)
    for handle, req_id, prompt in zip(handles, ids, prompts):
        mine = events[handle["remote_request_id"]]
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


def test_failed_and_unpulled_transfers_say_so_in_their_events(tiny_llama):
    prompts = random_prompts([50, 40], seed=19)
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prefill = nixl_engine(tiny_llama, "prefill", hold_timeout_s=0.3)
    prefill.record_events()
    handles = run_prefill(prefill, prompts, [greedy] * 2)
    decode = nixl_engine(tiny_llama, "decode", agent=FaultyAgent(f"decode-g{next(_ids)}",
                                                                 {handles[0]["remote_request_id"]}))
    decode.record_events()
    connect(prefill, decode)
    decode.add_request("g0", prompts[0], greedy, kv_transfer_params=handles[0])  # the second is never pulled
    run_until_done(prefill, decode)
    events = events_by_request(prefill, decode)
    (end,) = [e for e in events["g0"] if e.type == EventType.KV_LOAD_END]
    assert not end.transfer.ok and end.transfer.recompute_from_block == 0 and end.transfer.error
    assert events[handles[1]["remote_request_id"]][-1].detail == "expired"
    assert_pools_full(prefill, decode)


def test_a_malformed_handle_fails_its_own_load_not_the_engine(tiny_llama):
    prompts = random_prompts([40, 50], seed=20)
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(tiny_llama, dtype="float32", device="cpu").generate(prompts, greedy)]
    prefill, decode = nixl_engine(tiny_llama, "prefill"), nixl_engine(tiny_llama, "decode")
    connect(prefill, decode)
    handles = run_prefill(prefill, prompts, [greedy] * 2)
    handles[0] = {**handles[0], "remote_block_ids": handles[0]["remote_block_ids"][:-1]}  # one block short
    ids = [decode.add_request(f"m{i}", p, greedy, kv_transfer_params=h).request_id
           for i, (p, h) in enumerate(zip(prompts, handles))]
    tokens = run_until_done(prefill, decode)
    assert [[h["first_token"]] + tokens[r] for h, r in zip(handles, ids)] == want  # the first recomputed
    assert decode.scheduler.num_failed_loads == 1
    assert_pools_full(prefill, decode)  # the short handle's hold expired or was released, not leaked


def test_a_hold_released_twice_ends_once_and_a_reused_id_is_held_again(tiny_llama):
    prefill = nixl_engine(tiny_llama, "prefill", hold_timeout_s=60)
    prefill.record_events()
    params = [SamplingParams(max_tokens=1, temperature=0)]
    prompt = random_prompts([40], seed=21)
    [handle] = run_prefill(prefill, prompt, params)
    req_id, worker = handle["remote_request_id"], prefill.runner.connector
    prefill.step()  # the hold registers
    worker.release(req_id)
    worker.release(req_id)  # the router's Release and the cancelled call's both come
    run_until_done(prefill)
    ends = [e for e in prefill.take_events().events if e.type == EventType.HOLD_END]
    assert [e.detail for e in ends] == ["released"]
    # The same id again (a client's own ids): its hold is not let go by the stale release.
    prefill.add_request(req_id, prompt[0], SamplingParams(max_tokens=1, temperature=0),
                        kv_transfer_params={"do_remote_decode": True})
    for _ in range(5):
        prefill.step()
    assert prefill.num_held_requests == 1
    worker.release(req_id)
    run_until_done(prefill)
    assert_pools_full(prefill)


def test_the_start_up_probe_reads_a_block_of_the_cache(tiny_llama):
    """The READ every engine on a GPU makes at start-up (of VRAM there), here of CPU memory:
    a second real agent reads the cache's first block and finds its bytes."""
    engine = nixl_engine(tiny_llama, "probe", num_kv_blocks=16, max_model_len=256)
    engine.runner.kv_cache[0].normal_()
    before = engine.runner.kv_cache.clone()
    engine.runner.connector.check_reachable(engine.runner.kv_cache)
    assert torch.equal(engine.runner.kv_cache, before)  # the pattern it read was put back


class RefusingAgent:
    """A real NIXL agent whose transfers end in ERR, as with UCX lacking the memory's transport."""

    def __init__(self, name):
        from baton.kv_transfer.nixl_connector import _new_agent
        self._agent = _new_agent(name)

    def __getattr__(self, attr):
        return getattr(self._agent, attr)

    def transfer(self, handle):
        return "ERR"


class IdleAgent(RefusingAgent):
    """A real NIXL agent whose transfers say DONE having moved nothing."""

    def transfer(self, handle):
        return "DONE"


@pytest.mark.parametrize("agent,why", [(RefusingAgent, r"the READ ended in ERR"),
                                       (IdleAgent, r"the READ reported done, but the block's bytes did not arrive")])
def test_a_cache_peers_cannot_read_stops_the_start_saying_why(tiny_llama, agent, why):
    from baton.engine.errors import StartupError

    engine = nixl_engine(tiny_llama, "probe", num_kv_blocks=16, max_model_len=256)
    before = engine.runner.kv_cache.clone()
    with pytest.raises(StartupError, match=r"cannot move KV blocks in DRAM on cpu over NIXL/UCX \(" + why
                                           + r"\); for GPU memory UCX needs its CUDA transports"):
        engine.runner.connector.check_reachable(engine.runner.kv_cache, agent(f"faulty-{next(_ids)}"))
    assert torch.equal(engine.runner.kv_cache, before)
