"""Prefill and decode services over real gRPC and real NIXL on 127.0.0.1: the test plays the
router (Prefill on one server, then Generate with the handle on the other), and the output
equals a colocated engine's."""
from __future__ import annotations

import asyncio
import json
import os

import grpc
import pytest
from helpers import AUTH, TOKEN, pools_full, random_prompts, stats

from baton import LLM, SamplingParams
from baton.services.client import build_request, chunk_from_response
from baton.services.router.decode_leg import instance_failed, prefill_gone
from baton.services.rpc.errors import Failure, details, failure_of_error
from baton.v1 import generate_pb2 as pb
from baton.v1 import generate_pb2_grpc, internal_pb2_grpc


async def prefill_on(prefill_addr: str, prompt, **sampling):
    async with grpc.aio.insecure_channel(prefill_addr) as pch:
        return await internal_pb2_grpc.PrefillStub(pch).Prefill(build_request(prompt, **sampling), metadata=AUTH,
                                                                timeout=60)


async def decode_on(decode_addr: str, reply, prompt, **sampling) -> list[int]:
    """The prefill's first token, then the decode's, pulling the KV that `reply` holds."""
    tokens = list(reply.first.token_ids)
    request = build_request(prompt, **sampling)
    request.kv_handle.CopyFrom(reply.handle)
    async with grpc.aio.insecure_channel(decode_addr) as dch:
        async for resp in generate_pb2_grpc.TextGenerationStub(dch).Generate(request, metadata=AUTH, timeout=60):
            chunk = chunk_from_response(resp)
            tokens += chunk.token_ids
    assert chunk.finish_reason == "length"
    assert chunk.usage.completion_tokens == len(tokens)
    return tokens


async def disaggregated(prefill_addr: str, decode_addr: str, prompt, **sampling) -> list[int]:
    """What the router does: the first token from the prefill, the rest from the decode."""
    return await decode_on(decode_addr, await prefill_on(prefill_addr, prompt, **sampling), prompt, **sampling)


@pytest.fixture
def tiers(serve, tiny_llama):
    prefill = serve(tiny_llama, {"role": "prefill", "internal_token": TOKEN}, max_num_batched_tokens=48)
    decode = serve(tiny_llama, {"role": "decode", "internal_token": TOKEN})
    return prefill, decode


def test_disaggregated_services_equal_colocated(tiers, tiny_llama):
    prefill, decode = tiers
    prompts = random_prompts([5, 17, 40, 90, 130], seed=41)
    params = [dict(max_tokens=12, temperature=0.0, ignore_eos=True),
              dict(max_tokens=12, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)]
    llm = LLM(tiny_llama, dtype="float32", device="cpu")

    async def run():
        return await asyncio.gather(*(disaggregated(prefill.address, decode.address, p, **kw)
                                      for kw in params for p in prompts))

    got = asyncio.run(run())
    want = [o.token_ids for kw in params for o in llm.generate(prompts, SamplingParams(**kw))]
    assert got == want
    assert prefill.wait_pool_full() and decode.wait_pool_full()
    assert prefill.snapshot().num_held_requests == 0


def test_streams_meeting_a_new_prefill_together_share_one_handshake(tiers, tiny_llama):
    prefill, decode = tiers
    prompts = random_prompts([12, 40, 7, 66, 25, 31], seed=43)
    greedy = dict(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def run():
        replies = await asyncio.gather(*(prefill_on(prefill.address, p, **greedy) for p in prompts))
        # Every handle in hand before the decode has met the prefill: all six arrive at once.
        return await asyncio.gather(*(decode_on(decode.address, r, p, **greedy) for r, p in zip(replies, prompts)))

    got = asyncio.run(run())
    assert decode.server.kv_peers.num_handshakes == 1
    assert got == [o.token_ids for o in LLM(tiny_llama, dtype="float32", device="cpu").generate(
        prompts, SamplingParams(**greedy))]
    assert prefill.wait_pool_full() and decode.wait_pool_full()


def test_internal_calls_need_the_token_and_a_consistent_handle(tiers):
    prefill, decode = tiers

    async def run():
        async with grpc.aio.insecure_channel(prefill.address) as pch, \
                grpc.aio.insecure_channel(decode.address) as dch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await internal_pb2_grpc.PrefillStub(pch).Prefill(build_request([5, 6, 7]), timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            reply = await internal_pb2_grpc.PrefillStub(pch).Prefill(build_request([5, 6, 7], max_tokens=4),
                                                                     metadata=AUTH, timeout=10)
            bad = build_request([5, 6, 7, 8], max_tokens=4)  # not the prompt the handle holds
            bad.kv_handle.CopyFrom(reply.handle)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in generate_pb2_grpc.TextGenerationStub(dch).Generate(bad, timeout=10):
                    pass
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED  # handles are internal too
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in generate_pb2_grpc.TextGenerationStub(dch).Generate(bad, metadata=AUTH, timeout=10):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("kv_handle.num_tokens")
            short = build_request([5, 6, 7], max_tokens=4)  # the right prompt, a block list that is not
            short.kv_handle.CopyFrom(reply.handle)
            short.kv_handle.block_ids.append(0)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in generate_pb2_grpc.TextGenerationStub(dch).Generate(short, metadata=AUTH, timeout=10):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("kv_handle.block_ids")
            with pytest.raises(grpc.aio.AioRpcError) as err:  # the decode role serves no Prefill
                await internal_pb2_grpc.PrefillStub(dch).Prefill(build_request([5]), metadata=AUTH, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED

    asyncio.run(run())
    # The refused handle was never pulled: the prefill still holds it until its timeout.
    assert prefill.snapshot().num_held_requests == 1


# ---- each tier its own process ----------------------------------------------------------------
def tier(spawn, model, role, *flags):
    return spawn(model, "--role", role, "--internal-token", TOKEN, *flags)


GREEDY = dict(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_processes_disaggregated_equal_colocated_and_pools_refill(spawn, tiny_llama):
    prefill = tier(spawn, tiny_llama, "prefill", "--max-num-batched-tokens", "32")
    decode = tier(spawn, tiny_llama, "decode")
    prompts = random_prompts([9, 33, 70, 120], seed=51)
    want = [o.token_ids
            for o in LLM(tiny_llama, dtype="float32", device="cpu").generate(prompts, SamplingParams(**GREEDY))]

    async def run():
        return await asyncio.gather(*(disaggregated(prefill.address, decode.address, p, **GREEDY) for p in prompts))

    assert asyncio.run(run()) == want
    assert stats(decode.address).num_blocks_pulled > 0
    assert pools_full(prefill.address) and pools_full(decode.address)


def test_a_dead_prefill_gives_a_recompute_or_a_clean_error(spawn, tiny_llama):
    decode, known, unknown = (tier(spawn, tiny_llama, role) for role in ("decode", "prefill", "prefill"))
    prompt = random_prompts([60], seed=52)[0]
    want = LLM(tiny_llama, dtype="float32", device="cpu").generate([prompt], SamplingParams(**GREEDY))[0].token_ids

    async def pull_after_kill(prefill, meet_first: bool):
        async with grpc.aio.insecure_channel(prefill.address) as pch, \
                grpc.aio.insecure_channel(decode.address) as dch:
            if meet_first:  # decode knows this prefill (cached NIXL peer) before it dies
                await disaggregated(prefill.address, decode.address, prompt, **GREEDY)
            reply = await internal_pb2_grpc.PrefillStub(pch).Prefill(build_request(prompt, **GREEDY),
                                                                     metadata=AUTH, timeout=30)
            prefill.kill()
            request = build_request(prompt, **GREEDY)
            request.kv_handle.CopyFrom(reply.handle)
            tokens = [reply.handle.first_token]
            async for resp in generate_pb2_grpc.TextGenerationStub(dch).Generate(request, metadata=AUTH, timeout=30):
                tokens += resp.token_ids
            return tokens

    # Known peer: the READ fails, the decode recomputes the prompt, same output.
    assert asyncio.run(pull_after_kill(known, meet_first=True)) == want
    assert stats(decode.address).num_failed_loads == 1
    # Unknown peer: the handshake cannot happen, a clean UNAVAILABLE naming the field.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(pull_after_kill(unknown, meet_first=False))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "kv_handle" in err.value.details()
    assert pools_full(decode.address)


def test_a_restarted_decode_meets_the_prefill_again(spawn, tiny_llama):
    prefill, decode, restarted = (tier(spawn, tiny_llama, role) for role in ("prefill", "decode", "decode"))
    prompt = random_prompts([45], seed=53)[0]
    want = LLM(tiny_llama, dtype="float32", device="cpu").generate([prompt], SamplingParams(**GREEDY))[0].token_ids
    assert asyncio.run(disaggregated(prefill.address, decode.address, prompt, **GREEDY)) == want
    decode.kill()
    decode = restarted  # a new process: new NIXL agent, new memory
    assert asyncio.run(disaggregated(prefill.address, decode.address, prompt, **GREEDY)) == want
    assert pools_full(prefill.address) and pools_full(decode.address)


def test_a_first_token_that_ends_the_request_leaves_nothing_held(tiers, tiny_llama):
    prefill, _ = tiers
    prompt = random_prompts([20], seed=61)[0]
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]

    async def run(**sampling):
        async with grpc.aio.insecure_channel(prefill.address) as channel:
            return await internal_pb2_grpc.PrefillStub(channel).Prefill(build_request(prompt, **sampling),
                                                                        metadata=AUTH, timeout=30)

    stopped = asyncio.run(run(max_tokens=8, temperature=0.0, stop_token_ids=[first]))
    assert not stopped.HasField("handle") and chunk_from_response(stopped.first).finish_reason == "stop"
    one = asyncio.run(run(max_tokens=1, temperature=0.0))
    assert not one.HasField("handle") and chunk_from_response(one.first).finish_reason == "length"
    goes_on = asyncio.run(run(max_tokens=8, temperature=0.0))
    assert goes_on.HasField("handle") and chunk_from_response(goes_on.first).finish_reason is None
    assert prefill.snapshot().num_held_requests == 1  # only the one a decode will pull


@pytest.mark.parametrize("decode_engine,field", [({"block_size": 32}, "block_size"),
                                                 ({"speculative_config": "eagle3 head"}, "draft_method")])
def test_a_decode_of_another_kv_format_is_refused_naming_the_field(serve, tiny_llama, tmp_path, decode_engine, field):
    """Blocks of 16 tokens cannot land in a pool of 32-token blocks, nor can a decode's EAGLE
    head go on from a prefill that ran none: the handshake refuses the pair before any block
    moves, with a typed reason the router falls back on."""
    if "speculative_config" in decode_engine:
        from baton.testing.eagle_heads import write_head
        decode_engine = {"speculative_config": {"method": "eagle3", "num_speculative_tokens": 3,
                                                "model": write_head(str(tmp_path / "head"), tiny_llama, "eagle3")}}
    prefill = serve(tiny_llama, {"role": "prefill", "internal_token": TOKEN})
    decode = serve(tiny_llama, {"role": "decode", "internal_token": TOKEN}, **decode_engine)

    async def run():
        reply = await prefill_on(prefill.address, [5, 6, 7, 8], max_tokens=4)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await decode_on(decode.address, reply, [5, 6, 7, 8], max_tokens=4)
        return err.value

    err = asyncio.run(run())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert failure_of_error(err) == Failure(pb.FAILURE_REASON_KV_FORMAT_MISMATCH, f"kv_layout.format.{field}")
    assert field in err.details() and prefill_gone(err) and not instance_failed(err)
    assert decode.wait_pool_full()


def test_services_with_eagle_heads_equal_colocated(serve, tiny_llama, tmp_path):
    """Prefill and decode servers running the same EAGLE-3 head: the head's KV rides the
    handshake's layouts and the pull; greedy output equals the colocated engine's. (Sampled output
    keeps the target's distribution, not its draws: drafts take draws of their own.)"""
    from baton.testing.eagle_heads import write_head

    spec = {"method": "eagle3", "num_speculative_tokens": 3,
            "model": write_head(str(tmp_path / "head"), tiny_llama, "eagle3")}
    prefill = serve(tiny_llama, {"role": "prefill", "internal_token": TOKEN}, speculative_config=spec)
    decode = serve(tiny_llama, {"role": "decode", "internal_token": TOKEN}, speculative_config=spec)
    prompts = random_prompts([17, 40, 90], seed=43)
    greedy = dict(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def run():
        return await asyncio.gather(*(disaggregated(prefill.address, decode.address, p, **greedy) for p in prompts))

    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    assert asyncio.run(run()) == [o.token_ids for o in llm.generate(prompts, SamplingParams(**greedy))]
    assert decode.snapshot().num_spec_draft_tokens > 0
    pulled = stats(decode.address)  # each block with its head's: the target's layers' K and V, and the head's
    per_token = sum(kv_bytes_per_token(path) for path in (tiny_llama, spec["model"]))
    assert pulled.num_bytes_pulled == pulled.num_blocks_pulled * 16 * per_token > 0
    assert prefill.wait_pool_full() and decode.wait_pool_full()


def kv_bytes_per_token(model_dir: str) -> int:
    """A float32 checkpoint's (or head's) K and V of one token, every layer."""
    from baton.engine.worker.models.args import decoder_args

    with open(os.path.join(model_dir, "config.json")) as f:
        a = decoder_args(json.load(f))
    return a.num_layers * a.kv_parts * a.num_kv_heads * a.head_dim * 4


def test_the_router_tells_a_failed_instance_from_a_failed_request_by_reason():
    def error(code, reason=pb.FAILURE_REASON_UNSPECIFIED, field=None):
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*details(code, "m", reason, field)),
                                    details="m")

    assert instance_failed(error(grpc.StatusCode.UNAVAILABLE))  # no server answered
    assert instance_failed(error(grpc.StatusCode.UNAVAILABLE, pb.FAILURE_REASON_ENGINE_UNAVAILABLE))
    assert not instance_failed(error(grpc.StatusCode.INVALID_ARGUMENT, field="sampling.top_p"))
    for reason in (pb.FAILURE_REASON_KV_PEER_UNREACHABLE, pb.FAILURE_REASON_KV_PEER_RESTARTED):
        assert prefill_gone(error(grpc.StatusCode.UNAVAILABLE, reason))
        assert not instance_failed(error(grpc.StatusCode.UNAVAILABLE, reason))  # the decode is fine
    assert not prefill_gone(error(grpc.StatusCode.UNAVAILABLE))
