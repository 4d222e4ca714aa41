"""Several router processes on one port (--router-workers): connections spread over them and
every stream equals the offline engine's, multiplexing clients' over the shared frames port too;
/metrics (the metrics port's and the HTTP front's) shows each worker's series; an Abort reaches
its call through any connection; a stop drains every worker; a worker that dies ends the set
with status 1, and none outlives the set."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
import urllib.request

import grpc
import pytest
from helpers import alive, pools_full, random_prompts, wait_serving
from servers import pd_stack

from baton import LLM, SamplingParams
from baton.services.client import AsyncClient
from baton.v1 import generate_pb2 as pb
from baton.v1 import generate_pb2_grpc

NUM_CONNECTIONS = 16  # all on one worker: 2 * 2**-16


@pytest.fixture(scope="module")
def stack(tiny_llama):
    with pd_stack(tiny_llama, router=("--router-workers", "2", "--http-port", "0", "--metrics-port", "0")) as (
            (prefill,), (decode,), router):
        wait_serving(router.address)
        yield router, prefill, decode


def workers_of(router) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(router.proc.pid)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found]


def printed(router, pattern: str) -> str:
    """What the set (not one of its workers, whose lines are marked) printed that matches."""
    return next(m.group(1) for line in router.lines if (m := re.match(pattern, line)))


def request_counts(url: str) -> dict[str, float]:
    """request_success_total by worker, from a /metrics page."""
    counts: dict[str, float] = {}
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line.startswith("baton:request_success_total{"):
            worker = re.search(r'worker="(\d+)"', line).group(1)
            counts[worker] = counts.get(worker, 0) + float(line.rsplit(" ", 1)[1])
    return counts


async def on_own_connections(address: str, prompts, **sampling) -> list[list[int]]:
    """Each prompt over a connection of its own (a channel with its own subchannel pool)."""
    async def one(prompt):
        async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            stub = generate_pb2_grpc.TextGenerationStub(channel)
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(**sampling))
            return [t async for resp in stub.Generate(request, timeout=60) for t in resp.token_ids]
    return await asyncio.gather(*(one(p) for p in prompts))


def test_connections_spread_over_the_workers_and_streams_equal_the_engine(stack, tiny_llama):
    router, prefill, decode = stack
    assert len(workers_of(router)) == 2
    prompts = random_prompts([5 + i for i in range(NUM_CONNECTIONS)], seed=501)
    want = LLM(tiny_llama, dtype="float32", device="cpu").generate(
        prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    got = asyncio.run(asyncio.wait_for(on_own_connections(router.address, prompts, max_tokens=8, temperature=0,
                                                          ignore_eos=True), 120))
    assert got == [w.token_ids for w in want]
    metrics_url = printed(router, r"metrics on (\S+)")
    counts = request_counts(metrics_url)
    assert set(counts) == {"0", "1"} and sum(counts.values()) == NUM_CONNECTIONS, counts
    http_url = printed(router, r"OpenAI API on (\S+)/v1")
    assert request_counts(f"{http_url}/metrics") == counts  # the HTTP front shows the whole set too
    assert pools_full(prefill.address) and pools_full(decode.address)


def test_multiplexing_clients_stream_over_the_set_s_one_frames_port(stack, tiny_llama):
    """The workers share the frames port as they share the gRPC one: each multiplexing client's
    stream goes over it (a connection of its own), whichever worker takes the connection."""
    router, prefill, decode = stack
    prompts = random_prompts([9 + 3 * i for i in range(8)], seed=502)
    want = [o.token_ids for o in LLM(tiny_llama, dtype="float32", device="cpu").generate(
        prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]

    async def one(client: AsyncClient, prompt: list[int]) -> list[int]:
        return [t async for c in client.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True)
                for t in c.token_ids]

    async def go():
        clients = [AsyncClient(router.address, multiplex=True) for _ in prompts]
        try:
            got = await asyncio.gather(*(one(client, p) for client, p in zip(clients, prompts)))
            return got, [client.streams.frames for client in clients]
        finally:
            for client in clients:
                await client.close()

    got, frames = asyncio.run(asyncio.wait_for(go(), 120))
    assert got == want
    assert all(f is not None for f in frames) and len({f.port for f in frames}) == 1  # (none fell back to gRPC)
    assert pools_full(prefill.address) and pools_full(decode.address)


def test_an_abort_reaches_its_call_through_any_connection(stack):
    router, prefill, decode = stack

    async def go():
        options = [("grpc.use_local_subchannel_pool", 1)]
        async def abort() -> int:  # over a new connection, landing on either worker
            async with grpc.aio.insecure_channel(router.address, options=options) as other:
                answer = await generate_pb2_grpc.TextGenerationStub(other).Abort(
                    pb.AbortRequest(request_ids=["anywhere"]), timeout=10)
                return answer.results[0].status

        async with grpc.aio.insecure_channel(router.address, options=options) as channel:
            stream = generate_pb2_grpc.TextGenerationStub(channel).Generate(pb.GenerateRequest(
                request_id="anywhere", token_ids=pb.TokenIds(ids=random_prompts([20], seed=502)[0]),
                sampling=pb.SamplingParams(max_tokens=600, temperature=0, ignore_eos=True)), timeout=60)
            responses = [await stream.read()]
            statuses = [await abort()]
            while (resp := await stream.read()) is not grpc.aio.EOF:
                responses.append(resp)
            statuses += [await abort() for _ in range(4)]  # the call has ended: whichever worker answers
            return responses, statuses

    responses, statuses = asyncio.run(asyncio.wait_for(go(), 120))
    assert statuses[0] == pb.ABORT_STATUS_ABORTED
    assert set(statuses[1:]) == {pb.ABORT_STATUS_ALREADY_FINISHED}
    assert responses[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert sum(len(r.token_ids) for r in responses) < 600
    assert pools_full(prefill.address) and pools_full(decode.address)


def test_a_worker_that_dies_ends_the_set_and_none_outlives_it(tiny_llama):
    """A worker killed: the set exits 1 (for its supervisor to restart it). The set's process
    killed: its workers die with it. A stop: every worker drains and exits, status 0."""
    for ending in ("worker killed", "set killed", "stopped"):
        with pd_stack(tiny_llama, num_prefill=0, router=("--router-workers", "2")) as (_, _, router):
            wait_serving(router.address)
            workers = workers_of(router)
            assert len(workers) == 2
            if ending == "worker killed":
                os.kill(workers[0], signal.SIGKILL)
                assert router.proc.wait(30) == 1
            elif ending == "set killed":
                router.kill()
            else:
                assert router.stop() == 0
            deadline = time.monotonic() + 30
            while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not any(alive(pid) for pid in workers), ending
