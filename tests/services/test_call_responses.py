"""A gRPC call's responses on their way out (call_responses.py): the service's own and those its
sinks hand it go in the order they came; token-only responses merge while the caller has not
taken the last one; the router's go out serialized; the call ends once its Generate did and all
was taken, and its Generate's failure is the call's."""
from __future__ import annotations

import asyncio

import pytest

from baton.services.rpc.call_responses import CallResponses, per_call
from baton.v1 import generate_pb2 as pb


def test_tokens_merge_until_taken_and_keep_their_order():
    async def go():
        out = CallResponses(serialized=False)
        out.respond(pb.GenerateResponse(request_id="r", token_ids=[1], text="a"))
        out.respond_tokens("r", [2], "b")
        out.respond_tokens("r", [3], "c")  # the caller has not taken the last: one message
        first = await out.take()
        out.respond_tokens("r", [4], "d")  # taken since: a message of its own
        out.respond(pb.GenerateResponse(request_id="r", token_ids=[5], finish_reason=pb.FINISH_REASON_LENGTH))
        out.respond_tokens("r", [6], "e")  # (never after a last in practice: nothing merges into a full response)
        second = await out.take()
        return first, second
    first, second = asyncio.run(go())
    assert [(list(r.token_ids), r.text) for r in first] == [([1], "a"), ([2, 3], "bc")]
    assert [(list(r.token_ids), r.text) for r in second] == [([4], "d"), ([5], ""), ([6], "e")]


def test_the_routers_go_out_serialized_and_the_call_ends_with_its_generate():
    async def generate(msg, context, responses):
        yield pb.GenerateResponse(request_id=msg.request_id, token_ids=[7]).SerializeToString()
        responses.respond_tokens(msg.request_id, [8], "x")
        responses.respond_tokens(msg.request_id, [9], "y")
        await asyncio.sleep(0)
        yield pb.GenerateResponse(request_id=msg.request_id, finish_reason=pb.FINISH_REASON_STOP).SerializeToString()

    async def go():
        return [r async for r in per_call(generate, serialized=True)(pb.GenerateRequest(request_id="q"), None)]
    got = [pb.GenerateResponse.FromString(r) for r in asyncio.run(go())]
    assert [list(r.token_ids) for r in got] == [[7], [8, 9], []] and got[1].text == "xy"
    assert got[-1].finish_reason == pb.FINISH_REASON_STOP and {r.request_id for r in got} == {"q"}


def test_a_failing_generate_fails_the_call_after_what_it_answered():
    async def generate(msg, context, responses):
        yield pb.GenerateResponse(token_ids=[1])
        raise RuntimeError("the engine went away")

    async def go():
        got = []
        with pytest.raises(RuntimeError, match="went away"):
            async for r in per_call(generate, serialized=False)(pb.GenerateRequest(), None):
                got.append(list(r.token_ids))
        return got
    assert asyncio.run(go()) == [[1]]


def test_a_caller_that_goes_away_ends_its_generate():
    async def go():
        ended = asyncio.Event()

        async def generate(msg, context, responses):
            try:
                yield pb.GenerateResponse(token_ids=[1])
                await asyncio.sleep(60)
            finally:
                ended.set()
        call = per_call(generate, serialized=False)(pb.GenerateRequest(), None)
        assert list((await anext(call)).token_ids) == [1]
        await call.aclose()  # as grpc closes a handler whose caller went away
        await asyncio.wait_for(ended.wait(), 5)
    asyncio.run(go())
