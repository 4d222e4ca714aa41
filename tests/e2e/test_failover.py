"""Failures the client never sees: under a load of long streams through a router in front of
2 prefill and 2 decode processes, a `kill -9` of a decode mid-stream or of a prefill mid-load
leaves every stream complete and token-for-token equal to an uninterrupted run (greedy and
seeded, a third of them under a JSON schema); the survivors' pools are full afterwards."""
from __future__ import annotations

import asyncio
import json
import random

import jsonschema
import pytest
from helpers import TOKEN, collect, pools_full, random_prompts, stats, wait_serving
from servers import pd_stack

from baton import LLM, SamplingParams
from baton.engine.common.structured_output import StructuredOutput
from baton.services.client import AsyncClient

NUM_STREAMS = 24


# Every third stream is under a JSON schema: killed mid-JSON, it goes on under its grammar.
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "tag": {"type": "string", "maxLength": 6}},
    "required": ["n", "tag"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False}


def long_workload(seed: int):
    rng = random.Random(seed)
    prompts = random_prompts([rng.randint(20, 90) for _ in range(NUM_STREAMS)], seed)
    params = [dict(max_tokens=rng.randint(250, 350), ignore_eos=True,
                   **({"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.95, "seed": 500 + i}),
                   **({"json_schema": json.dumps(SCHEMA)} if i % 3 == 0 else {}))
              for i in range(NUM_STREAMS)]
    return prompts, params


@pytest.fixture
def stack(tiny_llama):
    with pd_stack(tiny_llama, num_prefill=2, num_decode=2) as (prefill, decode, router):
        for p in (router, *prefill, *decode):
            wait_serving(p.address)
        yield prefill, decode, router


def offline(tiny_llama, prompts, params):
    def sampling(p: dict) -> SamplingParams:
        p = dict(p)
        schema = p.pop("json_schema", None)
        return SamplingParams(**p, structured_output=StructuredOutput("json_schema", schema) if schema else None)

    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    outs = llm.generate(prompts, [sampling(p) for p in params])
    for out, p in zip(outs, params):
        if "json_schema" in p:
            jsonschema.validate(json.loads(out.text), SCHEMA)
    return [o.token_ids for o in outs]


async def streams_with_a_kill(address: str, prompts, params, kill, when_tokens: int, multiplex: bool = False):
    """Every stream's token ids; `kill()` once every stream has when_tokens tokens (0: once
    the first token of any stream arrived). `multiplex`: the client sends them on one stream."""
    progress = [0] * len(prompts)
    killed = asyncio.Event()

    async def one(client, i):
        ids = []
        async for chunk in client.generate(prompts[i], timeout=120, **params[i]):
            ids += chunk.token_ids
            progress[i] = len(ids)
            if not killed.is_set() and (min(progress) >= when_tokens if when_tokens else True):
                killed.set()
                kill()
        return ids

    async with AsyncClient(address, multiplex=multiplex) as client:
        return await asyncio.gather(*(one(client, i) for i in range(len(prompts))))


# A multiplexing client's tokens pass the router's decode leg by its sink (decode_leg.sink_into):
# the tokens it relayed that way are the ones the request resumes from.
@pytest.mark.parametrize("multiplex", [False, True], ids=["calls", "client-multiplexed"])
def test_a_decode_killed_mid_stream_costs_no_stream_a_token(stack, tiny_llama, multiplex):
    prefill, decode, router = stack
    prompts, params = long_workload(seed=901)
    want = offline(tiny_llama, prompts, params)
    got = asyncio.run(asyncio.wait_for(
        streams_with_a_kill(router.address, prompts, params, decode[0].kill, 3, multiplex), 240))
    assert got == want
    moved = stats(decode[1].address).num_requests
    assert moved > NUM_STREAMS // 2, "streams of the killed decode finished on the survivor"
    assert all(pools_full(p.address) for p in (*prefill, decode[1]))


def test_a_prefill_killed_mid_load_costs_no_stream_a_token(stack, tiny_llama):
    prefill, decode, router = stack
    prompts, params = long_workload(seed=902)
    want = offline(tiny_llama, prompts, params)
    got = asyncio.run(asyncio.wait_for(streams_with_a_kill(router.address, prompts, params, prefill[0].kill, 0), 240))
    assert got == want
    assert all(pools_full(p.address) for p in (prefill[1], *decode))

    async def after():  # the stack goes on answering on the surviving prefill
        async with AsyncClient(router.address) as client:
            return [await collect(client, p, **kw) for p, kw in zip(prompts[:4], params[:4])]

    assert [ids for ids, _, _ in asyncio.run(after())] == want[:4]


def test_a_read_against_a_killed_prefill_recomputes_fast_and_a_restarted_one_is_met_anew(tiny_llama, spawn):
    """The decode has met the prefill; the prefill dies holding a request's blocks: the
    decode's pull fails within 2 s and it computes the prompt itself. The prefill restarts on
    the same port as a new engine: the decode meets it again and pulls from it."""
    import time

    from test_disaggregated_services import decode_on, prefill_on

    from baton.services.cli.launcher import free_port

    port = free_port("127.0.0.1")
    prefill = spawn(tiny_llama, "--role", "prefill", "--internal-token", TOKEN, "--port", str(port))
    decode = spawn(tiny_llama, "--role", "decode", "--internal-token", TOKEN)
    prompt = random_prompts([70], seed=903)[0]
    sampling = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = offline(tiny_llama, [prompt], [sampling])[0]

    def run(coro):
        return asyncio.run(asyncio.wait_for(coro, 60))

    assert run(decode_on(decode.address, run(prefill_on(prefill.address, prompt, **sampling)), prompt,
                         **sampling)) == want  # met
    before = stats(decode.address)
    reply = run(prefill_on(prefill.address, prompt, **sampling))
    prefill.kill()
    t0 = time.monotonic()
    assert run(decode_on(decode.address, reply, prompt, **sampling)) == want
    took = time.monotonic() - t0
    after = stats(decode.address)
    assert after.num_failed_loads == before.num_failed_loads + 1 and took < 2.0, (took, after)
    print(f"\nrecomputed after a failed pull in {took:.3f}s")

    prefill = spawn(tiny_llama, "--role", "prefill", "--internal-token", TOKEN, "--port", str(port))
    wait_serving(prefill.address)
    reply = run(prefill_on(prefill.address, prompt, **sampling))
    assert run(decode_on(decode.address, reply, prompt, **sampling)) == want
    again = stats(decode.address)
    assert again.num_failed_loads == after.num_failed_loads and again.num_blocks_pulled > after.num_blocks_pulled
    assert pools_full(decode.address) and pools_full(prefill.address)


def test_a_flood_is_shed_at_once_and_the_admitted_meet_their_deadlines(tiny_llama, spawn):
    import time

    import grpc

    server = spawn(tiny_llama)
    router = spawn(tiny_llama, "--role", "router", "--decode", server.address, "--max-in-flight", "4")
    wait_serving(router.address)
    prompts = random_prompts([30] * 40, seed=904)

    async def one(client, prompt):
        t0 = time.monotonic()
        try:
            ids, _, last = await collect(client, prompt, max_tokens=60, temperature=0.0, ignore_eos=True, timeout=30)
            return "done", len(ids), time.monotonic() - t0
        except grpc.aio.AioRpcError as e:
            return e.code().name, e.details(), time.monotonic() - t0

    async def flood():
        async with AsyncClient(router.address) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(asyncio.wait_for(flood(), 120))
    done = [r for r in results if r[0] == "done"]
    shed = [r for r in results if r[0] == "RESOURCE_EXHAUSTED"]
    assert len(done) + len(shed) == len(results), results
    assert len(done) >= 4 and all(n == 60 for _, n, _ in done)
    assert len(shed) >= 20 and all(took < 1.0 and "max_in_flight" in why for _, why, took in shed)


def test_past_max_migrations_a_stream_ends_unavailable_naming_the_instances(tiny_llama, spawn):
    import grpc

    servers = [spawn(tiny_llama) for _ in range(2)]  # colocated servers as the decode tier
    router = spawn(tiny_llama, "--role", "router", "--decode", ",".join(s.address for s in servers),
                   "--max-migrations", "0")
    wait_serving(router.address)
    prompts, params = long_workload(seed=905)

    async def go():
        async def one(client, i):
            try:
                return await collect(client, prompts[i], timeout=60, **params[i])
            except grpc.aio.AioRpcError as e:
                return e

        async with AsyncClient(router.address) as client:
            tasks = [asyncio.ensure_future(one(client, i)) for i in range(4)]
            await asyncio.sleep(0.3)
            servers[0].kill()
            results = await asyncio.gather(*tasks)
        return results

    results = asyncio.run(asyncio.wait_for(go(), 120))
    failed = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(failed) == 2, results
    assert all(e.code() == grpc.StatusCode.UNAVAILABLE and servers[0].address in e.details()
               and "max_migrations" in e.details() for e in failed), [e.details() for e in failed]


def test_a_decode_that_drains_past_its_grace_hands_its_streams_over(tiny_llama, spawn):
    """Ctrl-C on a decode whose streams outlast its grace period: it cancels them, and the
    router moves them to the other instance."""
    servers = [spawn(tiny_llama, "--grace-period", "0.2") for _ in range(2)]
    router = spawn(tiny_llama, "--role", "router", "--decode", ",".join(s.address for s in servers))
    wait_serving(router.address)
    prompts, params = long_workload(seed=906)
    prompts, params = prompts[:4], [dict(p, max_tokens=600) for p in params[:4]]
    want = offline(tiny_llama, prompts, params)

    async def go():
        async with AsyncClient(router.address) as client:
            tasks = [asyncio.ensure_future(collect(client, p, timeout=60, **kw)) for p, kw in zip(prompts, params)]
            await asyncio.sleep(0.3)
            assert await asyncio.to_thread(servers[0].stop) == 0  # SIGINT: drain, then cancel what is left
            return [ids for ids, _, _ in await asyncio.gather(*tasks)]

    assert asyncio.run(asyncio.wait_for(go(), 120)) == want


def test_a_stream_that_failed_after_its_last_message_is_not_moved():
    """gRPC hands over every message before the error: an instance that sent the finish and
    then died leaves a whole answer, which must not be resumed elsewhere (fake backends: the
    one place a fake is fine, to inject the fault)."""
    from types import SimpleNamespace

    import grpc

    from baton.services.router.backends import Lease
    from baton.services.router.decode_leg import DecodeRoute, Relay, decode_leg
    from baton.v1 import generate_pb2 as pb

    class Call:
        def __init__(self, responses, fail):
            self.responses, self.fail = responses, fail

        async def _stream(self):
            for resp in self.responses:
                yield resp.SerializeToString()
            if self.fail:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, details="Socket closed")

        def __aiter__(self):
            return self._stream()

        def done(self):
            return True

    calls = []

    class Backend(SimpleNamespace):
        def open_generate(self, msg, metadata, timeout):
            calls.append((self.address, list(msg.resume.ids)))
            return self.script()

        def failed(self):
            self.healthy = False

        def prefilled(self, request_id):  # the router's load ledger (kv_aware's): nothing charged here
            pass

        def settle(self, request_id):
            pass

    dying = Backend(address="a", outstanding=0, num_routed=0, charge=lambda *a: None, script=lambda: Call(
        [pb.GenerateResponse(token_ids=[5, 6]),
         pb.GenerateResponse(token_ids=[2], finish_reason=pb.FINISH_REASON_STOP)],
        True))
    spare = Backend(address="b", outstanding=0, num_routed=0, charge=lambda *a: None, script=lambda: Call(
        [pb.GenerateResponse(token_ids=[9], finish_reason=pb.FINISH_REASON_LENGTH)], False))

    def pick(tried):
        return Lease(next(b for b in (dying, spare) if b not in tried), "x", (0, 0))

    route = DecodeRoute(pick, lambda: "none left", max_migrations=2, aborted=set())
    trace = SimpleNamespace(retried=lambda *a: None, client_call=lambda *a: (None, ()), first_token=lambda: None,
                            call_ended=lambda *a: None, migrated=lambda *a: None)

    class Context:
        def time_remaining(self):
            return None

        async def abort(self, code, details):
            raise AssertionError(f"aborted: {code} {details}")

    async def go():
        msg = pb.GenerateRequest(request_id="x", text="hi")
        return [pb.GenerateResponse.FromString(raw) async for raw in
                decode_leg(route, msg, (), Context(), trace, Relay(msg))]

    got = asyncio.run(go())
    assert [list(r.token_ids) for r in got] == [[5, 6], [2]] and got[-1].finish_reason == pb.FINISH_REASON_STOP
    assert calls == [("a", [])] and dying.outstanding == 0 and not dying.healthy


def test_the_relay_resumes_from_exactly_the_tokens_it_passed_on():
    """What failover resumes from: the relay keeps the responses it passes on as bytes and reads
    them for their token ids in batches (joined bytes parse as one merged message), past its
    batch size too; a text-only client's responses lose their ids, and the finish is seen."""
    from baton.services.router.decode_leg import Relay
    from baton.v1 import generate_pb2 as pb

    n = Relay._UNREAD_MAX + 37  # past a batch
    rng = random.Random(5)
    ids = [rng.randrange(1, 50_000) for _ in range(n)]

    def tokens(upto: int) -> list[int]:  # every fifth response carries two
        return [7] + [t for j, u in enumerate(ids[:upto]) for t in ([u] if j % 5 else [u, u + 1])]
    for output in (pb.OUTPUT_TOKEN_IDS, pb.OUTPUT_TEXT):
        msg = pb.GenerateRequest(output=output)
        relay = Relay(msg)
        assert msg.output != pb.OUTPUT_TEXT  # the backend is asked for the ids
        first = relay.forward(pb.GenerateResponse(token_ids=[7], text="a"))
        sent = [first]
        for i, token in enumerate(ids):
            last = i == n - 1
            raw = pb.GenerateResponse(token_ids=[token] if i % 5 else [token, token + 1], text="b",
                                      finish_reason=pb.FINISH_REASON_LENGTH if last else 0).SerializeToString()
            sent.append(relay.forward(raw))
            assert not relay.finished or last
            if output == pb.OUTPUT_TOKEN_IDS:
                assert sent[-1] == raw  # passed on as it came
            if i == 100:
                assert relay.token_ids == tokens(101)  # read mid-stream, then on
        assert relay.finished
        want = tokens(n)
        assert relay.token_ids == want
        got = [pb.GenerateResponse.FromString(r) for r in sent]
        assert [t for r in got for t in r.token_ids] == (want if output == pb.OUTPUT_TOKEN_IDS else [])
        assert [r.text for r in got] == ["a"] + ["b"] * n
