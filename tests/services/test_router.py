"""The router in front of real prefill and decode processes on 127.0.0.1: output equal to a
colocated engine, the policies' spread, failures of either tier, a tier still starting,
cancellation through both tiers (`baton up`: test_baton_up.py)."""
from __future__ import annotations

import asyncio
import random
import time

import grpc
import openai
import pytest
from helpers import TOKEN, collect, pools_full, random_prompts, stats, wait_serving, workload
from servers import ServerProcess

from baton import LLM, SamplingParams
from baton.services.cli.launcher import free_port
from baton.services.client import AsyncClient
from baton.services.router.policies import PrefixAffinity
from baton.services.rpc.health import is_serving
from baton.services.rpc.names import ROUTER_LIVENESS


def engine(model: str, role: str, *flags: str, start=ServerProcess) -> ServerProcess:
    """An engine of the stack; `start`: ServerProcess, or the spawn fixture (stopped at teardown)."""
    return start(model, "--role", role, "--internal-token", TOKEN, *flags)


def router(model: str, policy: str, prefill: list[ServerProcess], decode: list[ServerProcess]) -> ServerProcess:
    return ServerProcess(model, "--role", "router", "--internal-token", TOKEN, "--policy", policy,
                         "--prefill", ",".join(p.address for p in prefill),
                         "--decode", ",".join(p.address for p in decode))


def counts(procs: list[ServerProcess]) -> list[int]:
    return [stats(p.address).num_requests for p in procs]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


@pytest.fixture(scope="module")
def stack(tiny_llama):
    """Two prefill and two decode engines, shared by the tests that leave them running."""
    procs = [engine(tiny_llama, "prefill", "--max-num-batched-tokens", "48") for _ in range(2)]
    procs += [engine(tiny_llama, "decode") for _ in range(2)]
    try:
        for p in procs:
            p.address  # noqa: B018 - wait until each serves
        yield procs[:2], procs[2:]
    finally:
        for p in procs:
            p.stop()


@pytest.fixture
def start_router(stack, tiny_llama):
    """start_router(policy) -> a serving router in front of the stack's engines; each is the
    test's, stopped at its teardown."""
    routers: list[ServerProcess] = []

    def start(policy: str) -> ServerProcess:
        r = router(tiny_llama, policy, *stack)
        routers.append(r)
        wait_serving(r.address)
        return r

    yield start
    for r in routers:
        r.stop()


def test_through_the_router_equals_colocated_for_32_streams(stack, start_router, tiny_llama):
    prefill, decode = stack
    r = start_router("round_robin")
    prompts, params = workload(32, seed=71)
    want = LLM(tiny_llama, dtype="float32", device="cpu").generate(prompts, [SamplingParams(**p) for p in params])

    async def go():
        async with AsyncClient(r.address) as client:
            return await asyncio.gather(*(collect(client, p, **kw) for p, kw in zip(prompts, params)))

    got = run(go())
    assert [ids for ids, _, _ in got] == [o.token_ids for o in want]
    assert [text for _, text, _ in got] == [o.text for o in want]
    assert all(last.finish_reason == "length" and last.usage.completion_tokens == len(ids) for ids, _, last in got)
    assert all(pools_full(p.address) for p in prefill + decode)
    assert stats(prefill[0].address).num_held == stats(prefill[1].address).num_held == 0


def test_round_robin_and_least_outstanding_spread_requests(stack, start_router):
    prefill, decode = stack
    prompt = random_prompts([40], seed=72)[0]

    async def sequential(address: str, n: int):
        async with AsyncClient(address) as client:
            for _ in range(n):
                await collect(client, prompt, max_tokens=4, temperature=0.0)

    rr = start_router("round_robin")
    before = counts(prefill + decode)
    run(sequential(rr.address, 8))
    assert [a - b for a, b in zip(counts(prefill + decode), before)] == [4, 4, 4, 4]

    lo = start_router("least_outstanding")

    async def one_long_then_short():
        async with AsyncClient(lo.address) as client:
            stream = client.generate(prompt, max_tokens=400, temperature=0.0, ignore_eos=True)
            # The long one holds a decode instance while the rest run: once its second token is
            # here, the decode has it (the first is the prefill's, sent while the decode pulls).
            await stream.__anext__()
            await stream.__anext__()
            before = counts(decode)
            await sequential(lo.address, 6)
            after = counts(decode)
            await stream.aclose()
            return sorted(a - b for a, b in zip(after, before))

    assert run(one_long_then_short()) == [0, 6]  # all went to the idle decode instance


def test_prefix_affinity_keeps_a_shared_prefix_on_one_prefill_instance(stack, start_router):
    prefill, _ = stack
    r = start_router("prefix_affinity")
    shared = random_prompts([64], seed=73)[0]  # four blocks
    suffixes = random_prompts([5, 9, 13, 17, 21, 25], seed=74)
    before = [stats(p.address) for p in prefill]

    async def go():
        async with AsyncClient(r.address) as client:
            for s in suffixes:
                await collect(client, shared + s, max_tokens=3, temperature=0.0)

    run(go())
    after = [stats(p.address) for p in prefill]
    routed = sorted(a.num_requests - b.num_requests for a, b in zip(after, before))
    assert routed == [0, 6]
    hot = max(range(2), key=lambda i: after[i].num_requests - before[i].num_requests)
    # The first request computes the prefix; the five after it hit all four blocks.
    assert after[hot].num_prefix_hit_tokens - before[hot].num_prefix_hit_tokens >= 5 * 64


class _Load:  # what PrefixAffinity reads of a backend
    def __init__(self, address: str):
        self.address, self.outstanding, self.num_routed = address, 0, 0


def test_prefix_affinity_bounds_the_load_one_hot_prefix_puts_on_one_instance():
    policy = PrefixAffinity(load_factor=1.5, slack=3, table_size=1000)
    backends = [_Load("a:1"), _Load("b:1"), _Load("c:1")]
    hot = [11, 22, 33]  # one prefix's block hashes
    picks = []
    for _ in range(30):  # none finishes: the load only grows
        b = policy.choose(backends, hot).backend
        b.outstanding += 1
        b.num_routed += 1
        picks.append(b.address)
    assert picks[:3] == ["a:1"] * 3  # affinity while the load allows it
    loads = [b.outstanding for b in backends]
    assert max(loads) <= max(1.5 * 30 / 3, min(loads) + 3) and min(loads) > 0, loads
    # A different prefix is not pulled along: it goes to the least loaded.
    assert policy.choose(backends, [44, 55]).backend is min(backends, key=lambda b: (b.outstanding, b.num_routed))


def test_a_killed_decode_s_streams_move_to_the_survivor_and_it_comes_back(tiny_llama, spawn):
    """kill -9 of a decode mid-stream: its streams resume on the other decode from the tokens
    already streamed, and end as an uninterrupted run would; the restarted one is used again."""
    prefill = engine(tiny_llama, "prefill", start=spawn)
    port = free_port("127.0.0.1")
    decode = [engine(tiny_llama, "decode", "--port", str(port), start=spawn),
              engine(tiny_llama, "decode", start=spawn)]
    # The second decode instance named through DNS (localhost), as a headless service would be.
    r = spawn(tiny_llama, "--role", "router", "--internal-token", TOKEN, "--prefill", prefill.address,
              "--decode", decode[0].address, "--decode", "localhost:" + decode[1].address.split(":")[1])
    wait_serving(r.address)
    prompt = random_prompts([30], seed=75)[0]
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    want, want_long = (llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
                       .token_ids for n in (6, 400))

    async def long_stream(client, started: asyncio.Event):
        ids = []
        try:
            async for chunk in client.generate(prompt, max_tokens=400, temperature=0.0, ignore_eos=True):
                ids += chunk.token_ids
                if len(ids) >= 3:
                    started.set()
        except grpc.aio.AioRpcError as e:
            return e
        return ids

    async def go():
        async with AsyncClient(r.address) as client:
            events = [asyncio.Event() for _ in range(4)]
            tasks = [asyncio.ensure_future(long_stream(client, e)) for e in events]
            await asyncio.gather(*(e.wait() for e in events))
            decode[0].kill()
            results = await asyncio.gather(*tasks)
            after = [await collect(client, prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
                     for _ in range(4)]
            return results, after

    results, after = run(go())
    assert results == [want_long] * 4  # no token repeated, missing or different
    assert [ids for ids, _, _ in after] == [want] * 4
    # Its own two, the two that moved over, then every new request.
    assert stats(decode[1].address).num_requests == 2 + 2 + 4

    decode[0] = engine(tiny_llama, "decode", "--port", str(port), start=spawn)  # restarted on its address
    decode[0].address  # noqa: B018

    async def until_used():
        async with AsyncClient(r.address) as client:
            while stats(decode[0].address).num_requests == 0:
                assert (await collect(client, prompt, max_tokens=6, temperature=0.0, ignore_eos=True))[0] == want
                await asyncio.sleep(0.1)

    run(until_used())
    assert pools_full(prefill.address) and all(pools_full(d.address) for d in decode)


def test_without_a_prefill_instance_decode_computes_the_prompt(tiny_llama, tmp_path, spawn):
    prefill, decode = engine(tiny_llama, "prefill", start=spawn), engine(tiny_llama, "decode", start=spawn)
    config = tmp_path / "router.yaml"  # backends from a config file this time
    config.write_text(f"prefill: [{prefill.address}]\ndecode: [{decode.address}]\npolicy: least_outstanding\n")
    r = spawn(tiny_llama, "--role", "router", "--internal-token", TOKEN, "--router-config", str(config))
    wait_serving(r.address)
    prompts, params = workload(8, seed=76)
    want = LLM(tiny_llama, dtype="float32", device="cpu").generate(prompts, [SamplingParams(**p) for p in params])

    async def go():
        async with AsyncClient(r.address) as client:
            return await asyncio.gather(*(collect(client, p, **kw) for p, kw in zip(prompts, params)))

    assert [ids for ids, _, _ in run(go())] == [o.token_ids for o in want]  # through the prefill
    prefill.kill()
    assert [ids for ids, _, _ in run(go())] == [o.token_ids for o in want]  # colocated fallback
    assert stats(decode.address).num_blocks_pulled > 0 and pools_full(decode.address)
    decode.kill()

    async def no_decode():
        async with AsyncClient(r.address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(client, prompts[0], max_tokens=4)
            return err.value

    err = run(no_decode())
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "decode" in err.details()
    # Not ready without a decode, yet alive: the chart's liveness probe asks for the process itself.
    deadline = time.monotonic() + 10
    while is_serving(r.address) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not is_serving(r.address) and is_serving(r.address, service=ROUTER_LIVENESS)


class BrokenBackend:
    """Reports SERVING, then fails every call with UNAVAILABLE: an instance that dies between
    its health report and the request. The fault is injected here; the router is real."""

    def __init__(self):
        from concurrent import futures

        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        self.calls = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        status = health.HealthServicer()
        for name in ("", "baton.v1.TextGeneration"):
            status.set(name, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(status, self.server)

        def fail(request, context):
            self.calls += 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "injected: the instance went away")

        self.server.add_generic_rpc_handlers([
            grpc.method_handlers_generic_handler("baton.v1.TextGeneration",
                                                 {"Generate": grpc.unary_stream_rpc_method_handler(fail)}),
            grpc.method_handlers_generic_handler("baton.v1.Prefill",
                                                 {"Prefill": grpc.unary_unary_rpc_method_handler(fail)})])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()


def test_a_failure_before_the_first_token_is_retried_on_another_instance(stack, tiny_llama, spawn):
    prefill, decode = stack
    broken = BrokenBackend()
    prompt = random_prompts([40], seed=79)[0]
    greedy = dict(max_tokens=5, temperature=0.0, ignore_eos=True)
    want = LLM(tiny_llama, dtype="float32", device="cpu").generate([prompt], SamplingParams(**greedy))[0].token_ids

    def start(*backends: str) -> str:
        address = spawn(tiny_llama, "--role", "router", "--internal-token", TOKEN, *backends).address
        wait_serving(address)
        return address

    async def send(address: str, n: int):
        async with AsyncClient(address) as client:
            return [(await collect(client, prompt, request_id=f"retry-{i}", **greedy)) for i in range(n)]

    try:
        # A broken prefill: the prefill call goes to the other one.
        got = run(send(start("--prefill", f"{broken.address},{prefill[0].address}", "--decode", decode[0].address), 6))
        assert [ids for ids, _, _ in got] == [want] * 6 and broken.calls >= 1
        assert [last.request_id for _, _, last in got] == [f"retry-{i}" for i in range(6)]  # ids pass through
        # A broken decode on the colocated path (no prefill): retried on the other decode.
        calls = broken.calls
        got = run(send(start("--decode", f"{broken.address},{decode[0].address}"), 6))
        assert [ids for ids, _, _ in got] == [want] * 6 and broken.calls > calls
        # A decode failing after the prefill's first token went out: UNAVAILABLE, and the
        # prefill's hold is released at once, not at its timeout.
        address = start("--prefill", prefill[0].address, "--decode", broken.address)

        async def after_first():
            async with AsyncClient(address) as client:
                ids = []
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for chunk in client.generate(prompt, **greedy):
                        ids += chunk.token_ids
                return ids, err.value

        ids, err = run(after_first())
        assert ids == want[:1] and err.code() == grpc.StatusCode.UNAVAILABLE and broken.address in err.details()
        assert pools_full(prefill[0].address) and stats(prefill[0].address).num_expired_holds == 0
    finally:
        broken.server.stop(0)


def test_cancelling_50_streams_at_the_router_frees_both_tiers(stack, start_router):
    prefill, decode = stack
    r = start_router("round_robin")
    rng = random.Random(77)
    prompts = random_prompts([rng.randint(10, 100) for _ in range(50)], seed=78)

    async def cancel_after(client, prompt, n_chunks: int, delay: float):
        deadline = rng.choice([None, None, rng.uniform(0.05, 0.5)])  # some end by their deadline instead
        stream = client.generate(prompt, max_tokens=200, temperature=0.0, ignore_eos=True, timeout=deadline)
        task = asyncio.ensure_future(stream.__anext__())  # n_chunks 0: cancelled before any token
        await asyncio.sleep(delay)
        try:
            await task
            for _ in range(n_chunks):
                await stream.__anext__()
        finally:
            task.cancel()
            await stream.aclose()

    async def go():
        async with AsyncClient(r.address) as client:
            await asyncio.gather(*(cancel_after(client, p, rng.randint(0, 6), rng.uniform(0, 0.05))
                                   for p in prompts), return_exceptions=True)

    run(go())
    for p in prefill + decode:
        assert pools_full(p.address), stats(p.address)
        s = stats(p.address)
        assert s.num_held == 0 and s.num_expired_holds == 0  # released at once, not by the timeout


# ---- `baton up` -------------------------------------------------------------------------------
def test_a_router_whose_tier_is_starting_says_so(tiny_llama):
    """Before any decode has served (still loading, say), a request is refused UNAVAILABLE naming
    the tier and how many of its instances are ready, over gRPC and the OpenAI front alike."""
    http_port = free_port("127.0.0.1")
    r = ServerProcess(tiny_llama, "--role", "router", "--internal-token", TOKEN, "--http-port", str(http_port),
                      "--decode", f"127.0.0.1:{free_port('127.0.0.1')}")  # nothing listens there yet
    try:
        async def refused():
            async with AsyncClient(r.address) as client:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await collect(client, [5, 6, 7], max_tokens=2)
                return err.value

        err = run(refused())
        assert err.code() == grpc.StatusCode.UNAVAILABLE and err.details() == "decode tier starting: 0 of 1 ready"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as http_err:
            client.models.list()
        assert http_err.value.status_code == 503 and "decode tier starting: 0 of 1 ready" in str(http_err.value)
    finally:
        r.stop()
