"""The router's decode requests multiplexed on one stream per instance (GenerateStreams): each
request reads as its own Generate call would (responses, status with its failure details,
cancel, deadline) while the instance answers them all in a message per step; a router without
it (--no-multiplex) streams the same."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from helpers import TOKEN, greedy_through, pools_full, random_prompts
from servers import ServerProcess

from baton import LLM, SamplingParams
from baton.services.cli.main import _router_options, build_parser
from baton.services.router.decode_streams import DecodeStreams
from baton.services.rpc.errors import failure_of_error
from baton.services.rpc.names import token_metadata
from baton.services.rpc.tls import aio_channel
from baton.v1 import generate_pb2 as pb


def request(prompt: list[int], max_tokens: int, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), output=pb.OUTPUT_TOKEN_IDS,
                              sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                         **sampling))


async def read(call) -> list[int]:
    ids = []
    async for raw in call:
        ids += pb.GenerateResponse.FromString(raw).token_ids
    return ids


@pytest.fixture(scope="module")
def server(tiny_llama):
    proc = ServerProcess(tiny_llama, "--internal-token", TOKEN)
    try:
        proc.address  # noqa: B018 - wait until it serves
        yield proc
    finally:
        proc.stop()


def test_requests_on_one_stream_read_as_their_own_calls_in_a_message_per_step(server, tiny_llama):
    prompts = random_prompts([9, 33, 17, 60, 24, 41, 5, 12], seed=201)
    want = [o.token_ids for o in LLM(tiny_llama, dtype="float32", device="cpu").generate(
        prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))]

    async def go():
        channel = aio_channel(server.address, None)
        streams = DecodeStreams(channel, token_metadata(TOKEN), None)
        try:
            calls = [streams.open(request(p, 24), (("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01"),), None)
                     for p in prompts]
            # Beside them: one cancelled after its first token, one past its deadline, one the
            # server refuses naming the field. None of them touches the others.
            cancelled = streams.open(request(prompts[0], 400), (), None)
            late = streams.open(request(prompts[1], 400), (), 0.3)
            bad = streams.open(request(prompts[2], 8, top_p=2.0), (), None)
            await cancelled.__aiter__().__anext__()
            cancelled.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as late_err:
                await read(late)
            with pytest.raises(grpc.aio.AioRpcError) as bad_err:
                await read(bad)
            got = await asyncio.gather(*(read(c) for c in calls))
            return got, streams.messages_read, late_err.value, bad_err.value, cancelled.done()
        finally:
            streams.close()
            await channel.close()

    got, messages, late, bad, cancelled_done = asyncio.run(asyncio.wait_for(go(), 120))
    assert got == want
    assert messages < sum(len(ids) for ids in got) / 2  # the requests' tokens shared the messages
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and failure_of_error(bad).field == "sampling.top_p"
    assert cancelled_done
    assert pools_full(server.address)


def test_a_stream_without_the_stacks_token_is_refused_for_each_request(server):
    async def go():
        channel = aio_channel(server.address, None)
        streams = DecodeStreams(channel, (), None)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read(streams.open(request([1, 2, 3], 4), (), None))
            return err.value
        finally:
            streams.close()
            await channel.close()

    assert asyncio.run(asyncio.wait_for(go(), 60)).code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_router_with_a_call_per_request_streams_the_same(server, tiny_llama):
    args = build_parser().parse_args(["serve", "--role", "router", "--decode", server.address, "--no-multiplex"])
    assert _router_options(args).multiplex is False
    assert _router_options(build_parser().parse_args(["serve", "--role", "router", "--decode", "h:1"])).multiplex
    prompts = random_prompts([14, 50, 7, 29], seed=202)
    want = [o.token_ids for o in LLM(tiny_llama, dtype="float32", device="cpu").generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]
    router = ServerProcess(tiny_llama, "--role", "router", "--internal-token", TOKEN, "--decode", server.address,
                           "--no-multiplex")
    try:
        assert greedy_through(router.address, prompts, 12) == want
    finally:
        router.stop()
    assert pools_full(server.address)
