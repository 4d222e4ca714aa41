"""Traces of the whole stack, received for real: router, prefill and decode in their own
processes export over OTLP/gRPC to a receiver on 127.0.0.1 (conftest's traced_stack); the tests
read what arrived. One trace per request across the tiers, the decode's transfer linked to
the prefill's hold (also when the router is bypassed and the metadata is lost), and errors on
the spans. Their metrics: test_metrics.py."""
from __future__ import annotations

import json
import os
import random
import secrets
import subprocess
import sys

import grpc
import pytest
from helpers import AUTH, TOKEN, collect, pools_full, random_prompts, wait_serving
from telemetry_stack import metrics_url, run, samples

from baton.services.cli.launcher import free_port
from baton.services.client import AsyncClient, build_request
from baton.services.telemetry.trace_view import KIND_CLIENT, KIND_SERVER, TraceReceiver, roots, waterfall
from baton.v1 import generate_pb2_grpc, internal_pb2_grpc

PHASES = ("queue", "prefill", "decode", "kv_wait", "kv_transfer", "kv_handshake")


def request_spans(receiver: TraceReceiver, request_id: str, services: int = 3,
                  names: tuple[str, ...] = ("decode", "kv_transfer", "kv_hold")) -> list:
    """All spans of the trace(s) holding the request's SERVER spans, once each service's and
    the named phases have arrived (a hold ends, and is exported, after the decode pulled)."""
    def ready(spans):
        mine = [s for s in spans if s.attributes.get("gen_ai.request.id") == request_id and s.kind == KIND_SERVER]
        traces = {s.trace_id for s in mine}
        return len({s.service for s in mine}) >= services and set(names) <= {
            s.name for s in spans if s.trace_id in traces}
    assert receiver.wait_for(ready, 30), f"the spans of {request_id} never arrived"
    traces = {s.trace_id for s in receiver.spans() if s.attributes.get("gen_ai.request.id") == request_id}
    return [s for s in receiver.spans() if s.trace_id in traces]


def test_one_trace_per_request_across_router_prefill_transfer_and_decode(traced_stack, trace_receiver):
    router, prefill, decode = traced_stack
    prompts = random_prompts([20, 45, 70], seed=141)
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    parent = (("traceparent", f"00-{client_trace}-{client_span}-01"),)

    async def go():
        async with AsyncClient(router.address) as client:
            plain = [await collect(client, p, max_tokens=8, temperature=0.0, ignore_eos=True, request_id=f"plain-{i}")
                     for i, p in enumerate(prompts)]
            chat = await collect(client, [{"role": "user", "content": "hello there"}], max_tokens=6,
                                 temperature=0.0, ignore_eos=True, request_id="chat-0")
            traced = await collect(client, prompts[0], max_tokens=8, temperature=0.0, ignore_eos=True,
                                   request_id="traced-0", metadata=parent)
            return plain + [chat, traced]

    results = run(go())
    ids = [f"plain-{i}" for i in range(3)] + ["chat-0", "traced-0"]
    speculated = 0
    for request_id, (tokens, _, last) in zip(ids, results):
        spans = request_spans(trace_receiver, request_id)
        assert len({s.trace_id for s in spans}) == 1, f"{request_id} is spread over several traces"
        assert {s.service for s in spans} == {"baton-router", "baton-prefill", "baton-decode"}
        by_id = {s.span_id: s for s in spans}
        (root,) = [s for s in spans if s.parent_id not in by_id]
        assert root.service == "baton-router" and root.kind == KIND_SERVER
        if request_id == "traced-0":  # under the client's own span, in its trace
            assert (root.trace_id, root.parent_id) == (client_trace, client_span)
        else:
            assert root.parent_id == ""
        operation = "chat" if request_id == "chat-0" else "text_completion"
        assert root.name == f"{operation} tiny-llama" and root.attributes["gen_ai.operation.name"] == operation
        # Each engine's SERVER span sits under the router's CLIENT span for that call.
        for service in ("baton-prefill", "baton-decode"):
            (server,) = [s for s in spans if s.service == service and s.kind == KIND_SERVER]
            caller = by_id[server.parent_id]
            assert caller.kind == KIND_CLIENT and caller.service == "baton-router"
            assert caller.attributes["rpc.method"] == ("Prefill" if service == "baton-prefill" else "Generate")
        # The decode's transfer links to the prefill's hold; the blocks were pulled.
        (hold,) = [s for s in spans if s.name == "kv_hold"]
        (transfer,) = [s for s in spans if s.name == "kv_transfer"]
        assert [(t, sid) for t, sid, _ in transfer.links] == [(hold.trace_id, hold.span_id)]
        assert hold.service == "baton-prefill" and transfer.service == "baton-decode"
        assert transfer.attributes["baton.kv.outcome"] == "ok"
        assert hold.attributes["baton.kv.hold.outcome"] == "pulled"
        # Blocks the decode's prefix cache held already are not pulled (traced-0 repeats plain-0).
        (decode_server,) = [s for s in spans if s.service == "baton-decode" and s.kind == KIND_SERVER]
        cached_blocks = decode_server.attributes["gen_ai.usage.cache_read.input_tokens"] // 16
        assert cached_blocks == (1 if request_id == "traced-0" else 0)
        assert transfer.attributes["baton.kv.blocks"] + cached_blocks == hold.attributes["baton.kv.blocks"]
        block_bytes = hold.attributes["baton.kv.bytes"] // hold.attributes["baton.kv.blocks"]
        assert transfer.attributes["baton.kv.bytes"] == transfer.attributes["baton.kv.blocks"] * block_bytes > 0
        # Phases fit inside the request as the client's router saw it (the hold starts inside).
        slack = 2_000_000  # ns: each process stamps with its own clock reading
        for s in spans:
            if s.name in PHASES or s.name == "kv_hold":
                assert root.start_ns - slack <= s.start_ns <= s.end_ns, s.name
            if s.name in PHASES:
                assert s.end_ns <= root.end_ns + slack, (s.name, s.end_ns - root.end_ns)
        assert {"queue", "prefill", "decode", "kv_wait", "kv_transfer", "kv_hold"} <= {s.name for s in spans}
        # Token counts: what the client got, on the router's span and the engines'.
        usage = last.usage
        assert usage.completion_tokens == len(tokens) == (6 if request_id == "chat-0" else 8)
        assert root.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
        assert root.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
        assert root.attributes["gen_ai.response.finish_reasons"] == ["length"]
        (prefill_phase,) = [s for s in spans if s.name == "prefill"]
        assert prefill_phase.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
        (decode_phase,) = [s for s in spans if s.name == "decode"]
        assert decode_phase.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
        drafted = decode_phase.attributes.get("baton.spec_decode.draft_tokens", 0)  # the decode speculates
        kept = decode_phase.attributes.get("baton.spec_decode.accepted_tokens", 0)
        speculated += drafted > 0
        assert 0 <= kept <= drafted and kept < usage.completion_tokens
        for key in ("latency.ttft", "latency.prefill_leg", "latency.handoff", "latency.first_decode_step"):
            assert 0 <= root.attributes[f"baton.{key}"] <= (root.end_ns - root.start_ns) / 1e9, key
        assert "transfer" in waterfall(spans) and "hold" in waterfall(spans)
    assert speculated  # some request's decode span says how its drafts fared
    # The chunked prompt (70 tokens, 32 per step) shows its chunks on the prefill span.
    (chunked,) = [s for s in request_spans(trace_receiver, "plain-2") if s.name == "prefill"]
    assert [e[2]["baton.tokens"] for e in chunked.events if e[0] == "chunk"] == [32, 32, 6]
    assert pools_full(prefill.address) and pools_full(decode.address)


def test_the_transfer_links_to_the_hold_when_the_metadata_is_lost(traced_stack, trace_receiver):
    """The test plays a router that drops the trace context: the decode starts its own trace,
    and its transfer still links to the prefill's hold through the KV handle."""
    _, prefill, decode = traced_stack
    prompt = random_prompts([50], seed=142)[0]

    async def go():
        request = build_request(prompt, max_tokens=6, temperature=0.0, ignore_eos=True, request_id="bypass-0")
        async with grpc.aio.insecure_channel(prefill.address) as channel:
            reply = await internal_pb2_grpc.PrefillStub(channel).Prefill(request, metadata=AUTH, timeout=30)
        assert reply.handle.trace_context["traceparent"]
        request.kv_handle.CopyFrom(reply.handle)
        async with grpc.aio.insecure_channel(decode.address) as channel:
            return [r async for r in generate_pb2_grpc.TextGenerationStub(channel).Generate(request, metadata=AUTH)]

    run(go())
    spans = request_spans(trace_receiver, "bypass-0", services=2)
    (hold,) = [s for s in spans if s.name == "kv_hold"]
    (transfer,) = [s for s in spans if s.name == "kv_transfer"]
    assert hold.trace_id != transfer.trace_id  # two traces: nothing carried the context between them
    assert [(t, sid) for t, sid, _ in transfer.links] == [(hold.trace_id, hold.span_id)]
    decode_root = roots([s for s in spans if s.trace_id == transfer.trace_id])
    assert [s.service for s in decode_root] == ["baton-decode"]


def test_a_bad_request_ends_its_spans_with_the_grpc_code(traced_stack, trace_receiver):
    router, _, _ = traced_stack

    async def go():
        async with AsyncClient(router.address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(client, [5, 6, 7], max_tokens=4, temperature=-1.0, request_id="bad-0")
            return e.value

    error = run(go())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in error.details()
    assert trace_receiver.wait_for(lambda spans: sum(
        1 for s in spans if s.attributes.get("gen_ai.request.id") == "bad-0" and s.end_ns) >= 2, 30)
    servers = [s for s in trace_receiver.spans() if s.attributes.get("gen_ai.request.id") == "bad-0"]
    assert {s.service for s in servers} == {"baton-router", "baton-prefill"}
    for s in servers:
        assert s.is_error and s.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert s.attributes["error.type"] == "INVALID_ARGUMENT" and "temperature" in s.status_message


def test_a_constrained_request_traces_and_counts_its_wait_for_its_grammar(traced_stack, trace_receiver):
    router, prefill, decode = traced_stack
    schema = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})

    async def go():
        async with AsyncClient(router.address) as client:
            return await collect(client, [5, 6, 7], max_tokens=32, temperature=0.0, json_schema=schema,
                                 request_id="json-0")

    _, text, _ = run(go())
    assert isinstance(json.loads(text)["ok"], bool)
    spans = request_spans(trace_receiver, "json-0", names=("decode", "grammar"))
    grammar = [s for s in spans if s.name == "grammar"]
    assert {s.service for s in grammar} == {"baton-prefill", "baton-decode"}  # each engine compiles it
    assert all(s.attributes["baton.structured_output.kind"] == "json_schema" and s.end_ns >= s.start_ns
               for s in grammar)
    for proc in (prefill, decode):
        counts = samples(metrics_url(proc))
        assert counts[("baton:structured_output_requests_total", (("kind", "json_schema"),))] >= 1
        assert counts[("baton:grammar_wait_seconds_count", ())] >= 1


def test_a_decode_killed_mid_stream_ends_the_trace_with_an_error(traced_stack, trace_receiver):
    """Last in this module: it kills the shared decode."""
    router, _, decode = traced_stack
    prompt = random_prompts([30], seed=145)[0]

    async def go():
        got = []
        async with AsyncClient(router.address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for chunk in client.generate(prompt, max_tokens=500, temperature=0.0, ignore_eos=True,
                                                   request_id="killed-0"):
                    # A chunk may carry several tokens (a busy front merges what queued up).
                    if len(got) < 5 <= len(got) + len(chunk.token_ids):
                        decode.kill()
                    got += chunk.token_ids
            return e.value

    error = run(go())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert trace_receiver.wait_for(lambda spans: any(
        s.attributes.get("gen_ai.request.id") == "killed-0" and s.service == "baton-router" and s.end_ns
        for s in spans), 30)
    spans = [s for s in trace_receiver.spans() if s.trace_id in {
        x.trace_id for x in trace_receiver.spans() if x.attributes.get("gen_ai.request.id") == "killed-0"}]
    (root,) = [s for s in spans if s.service == "baton-router" and s.kind == KIND_SERVER]
    assert root.is_error and root.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]
    (call,) = [s for s in spans if s.kind == KIND_CLIENT and s.attributes["rpc.method"] == "Generate"]
    assert call.is_error and call.attributes["error.type"] == "UNAVAILABLE"


def test_tracing_off_makes_no_tracer_and_otel_variables_apply(monkeypatch, tiny_llama, serve):
    from baton.services.telemetry import tracing
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert tracing.make_tracer("both", "x") is None
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.make_tracer("both", "x", "127.0.0.1:4317") is None
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        tracing.make_tracer("both", "x", "127.0.0.1:4317")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    receiver = TraceReceiver()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "my-baton")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        server = serve(tiny_llama)

        async def go(address, request_id):
            async with AsyncClient(address) as client:
                await collect(client, [5, 6, 7, 8], max_tokens=3, temperature=0.0, request_id=request_id)

        run(go(server.address, "env-0"))
        assert receiver.wait_for(lambda spans: any(s.attributes.get("gen_ai.request.id") == "env-0" for s in spans))
        (top,) = [s for s in receiver.spans() if s.attributes.get("gen_ai.request.id") == "env-0"]
        assert top.service == "my-baton" and top.role == "both"
        assert server.server.tracer.resource.attributes["deployment.environment"] == "test"
        assert server.server.tracer.resource.attributes["service.instance.id"] == server.server.engine_id
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
        run(go(serve(tiny_llama).address, "env-1"))
        assert not receiver.wait_for(
            lambda spans: any(s.attributes.get("gen_ai.request.id") == "env-1" for s in spans), 1.5)
    finally:
        receiver.stop()


def test_baton_trace_prints_a_waterfall(tiny_llama, serve, monkeypatch):
    port = free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, "-m", "baton.services.cli", "trace", "--port", str(port), "--quiet",
                             "0.3"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "receiving OTLP/gRPC traces" in proc.stdout.readline()
        assert f"OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:{port}" in proc.stdout.readline()
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        server = serve(tiny_llama, {"otlp_traces_endpoint": f"127.0.0.1:{port}"})

        async def go():
            async with AsyncClient(server.address) as client:
                await collect(client, random.Random(0).sample(range(3, 500), 40), max_tokens=6, temperature=0.0)

        run(go())
        lines = [proc.stdout.readline() for _ in range(6)]
    finally:
        proc.terminate()
        proc.wait(10)
    assert lines[0].startswith("trace ") and "text_completion tiny-llama" in lines[0]
    assert [line.split()[:2] for line in lines[2:6]] == [["colocated", "request"], ["colocated", "queue"],
                                                          ["colocated", "prefill"], ["colocated", "decode"]]
    assert all("|" in line and "ms" in line for line in lines[2:6])


def test_a_router_without_prefill_traces_and_counts_its_colocated_fallback(tiny_llama, spawn, trace_receiver):
    common = ("--internal-token", TOKEN, "--otlp-traces-endpoint", trace_receiver.endpoint, "--metrics-port", "0")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    try:
        decode = spawn(tiny_llama, "--role", "decode", *common)
        router = spawn(tiny_llama, "--role", "router", "--decode", decode.address, *common)
        wait_serving(router.address)
    finally:
        os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)

    async def go():
        async with AsyncClient(router.address) as client:
            return await collect(client, random_prompts([30], seed=147)[0], max_tokens=5, temperature=0.0,
                                 ignore_eos=True, request_id="fallback-0")

    _, _, last = run(go())
    spans = request_spans(trace_receiver, "fallback-0", services=2, names=("prefill", "decode"))
    (root,) = [s for s in spans if s.service == "baton-router" and s.kind == KIND_SERVER]
    assert root.attributes["baton.fallback"] == "no_prefill"
    assert root.attributes["gen_ai.usage.output_tokens"] == last.usage.completion_tokens == 5
    # The decode computed the prompt itself: its own prefill phase, no transfer, no hold.
    assert {s.name for s in spans if s.service == "baton-decode"} >= {"queue", "prefill", "decode"}
    assert not {"kv_transfer", "kv_hold", "kv_wait"} & {s.name for s in spans}
    counted = samples(metrics_url(router))
    assert counted[("baton:router_colocated_fallbacks_total", (("reason", "no_prefill"),))] == 1
    assert counted[("baton:router_policy_decisions_total", (("decision", "round_robin"), ("policy", "round_robin"),
                                                             ("tier", "decode")))] == 1

