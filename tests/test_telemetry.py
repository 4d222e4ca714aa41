"""Traces and metrics of the whole stack, received for real: router, prefill and decode in
their own processes export over OTLP/gRPC to a receiver on 127.0.0.1 and serve /metrics;
the test reads what arrived. One trace per request across the tiers, the decode's transfer
linked to the prefill's hold (also when the router is bypassed and the metadata is lost),
errors on the spans, and counters equal to a known workload."""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from baton.services.client import AsyncClient, build_request
from baton.services.launcher import free_port
from baton.services.trace_view import KIND_CLIENT, KIND_SERVER, TraceReceiver, roots, waterfall
from baton.v1 import generate_pb2_grpc, internal_pb2_grpc

from conftest import ServerProcess
from helpers import AUTH, TOKEN, collect, pools_full, random_prompts, stats, wait_serving

PHASES = ("queue", "prefill", "decode", "kv_wait", "kv_transfer", "kv_handshake")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def metrics_url(proc: ServerProcess) -> str:
    proc.address  # noqa: B018 - waits until it serves (the metrics line comes first)
    return next(line.split()[2] for line in proc.lines if line.startswith("metrics on "))


def scrape(url: str, openmetrics: bool = False) -> str:
    accept = "application/openmetrics-text; version=1.0.0" if openmetrics else "text/plain"
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": accept}), timeout=10) as resp:
        return resp.read().decode()


def samples(url: str) -> dict[tuple, float]:
    """(sample name, sorted labels without model_name/role) -> value, through the Prometheus parser."""
    out = {}
    for family in text_string_to_metric_families(scrape(url)):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "role")))
            out[(s.name, labels)] = s.value
    return out


@pytest.fixture(scope="module")
def receiver():
    r = TraceReceiver()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def stack(tiny_llama, receiver):
    """Router, prefill and decode processes, every one tracing to the receiver and serving metrics."""
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # the children inherit it: spans arrive within ms
    common = ("--internal-token", TOKEN, "--otlp-traces-endpoint", receiver.endpoint, "--metrics-port", "0",
              "--served-model-name", "tiny-llama")
    prefill = ServerProcess(tiny_llama, "--role", "prefill", "--max-num-batched-tokens", "32", *common)
    decode = ServerProcess(tiny_llama, "--role", "decode", *common)
    procs = [prefill, decode]
    try:
        router = ServerProcess(tiny_llama, "--role", "router", "--prefill", prefill.address, "--decode",
                               decode.address, *common)
        procs.insert(0, router)
        wait_serving(router.address)
        yield router, prefill, decode
    finally:
        os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
        for p in procs:
            p.stop()


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


def test_one_trace_per_request_across_router_prefill_transfer_and_decode(stack, receiver):
    router, prefill, decode = stack
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
    for request_id, (tokens, _, last) in zip(ids, results):
        spans = request_spans(receiver, request_id)
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
        for key in ("latency.ttft", "latency.prefill_leg", "latency.handoff", "latency.first_decode_step"):
            assert 0 <= root.attributes[f"baton.{key}"] <= (root.end_ns - root.start_ns) / 1e9, key
        assert "transfer" in waterfall(spans) and "hold" in waterfall(spans)
    # The chunked prompt (70 tokens, 32 per step) shows its chunks on the prefill span.
    (chunked,) = [s for s in request_spans(receiver, "plain-2") if s.name == "prefill"]
    assert [e[2]["baton.tokens"] for e in chunked.events if e[0] == "chunk"] == [32, 32, 6]
    assert pools_full(prefill.address) and pools_full(decode.address)


def test_the_transfer_links_to_the_hold_when_the_metadata_is_lost(stack, receiver):
    """The test plays a router that drops the trace context: the decode starts its own trace,
    and its transfer still links to the prefill's hold through the KV handle."""
    _, prefill, decode = stack
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
    spans = request_spans(receiver, "bypass-0", services=2)
    (hold,) = [s for s in spans if s.name == "kv_hold"]
    (transfer,) = [s for s in spans if s.name == "kv_transfer"]
    assert hold.trace_id != transfer.trace_id  # two traces: nothing carried the context between them
    assert [(t, sid) for t, sid, _ in transfer.links] == [(hold.trace_id, hold.span_id)]
    decode_root = roots([s for s in spans if s.trace_id == transfer.trace_id])
    assert [s.service for s in decode_root] == ["baton-decode"]


def test_a_bad_request_ends_its_spans_with_the_grpc_code(stack, receiver):
    router, _, _ = stack

    async def go():
        async with AsyncClient(router.address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(client, [5, 6, 7], max_tokens=4, temperature=-1.0, request_id="bad-0")
            return e.value

    error = run(go())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in error.details()
    assert receiver.wait_for(lambda spans: sum(
        1 for s in spans if s.attributes.get("gen_ai.request.id") == "bad-0" and s.end_ns) >= 2, 30)
    servers = [s for s in receiver.spans() if s.attributes.get("gen_ai.request.id") == "bad-0"]
    assert {s.service for s in servers} == {"baton-router", "baton-prefill"}
    for s in servers:
        assert s.is_error and s.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert s.attributes["error.type"] == "INVALID_ARGUMENT" and "temperature" in s.status_message


def test_metrics_count_a_known_workload(stack, receiver):
    router, prefill, decode = stack
    urls = [metrics_url(p) for p in (router, prefill, decode)]
    before = [samples(u) for u in urls]
    shared = random_prompts([64], seed=143)[0]  # sent twice: the second hits 3 cached blocks (48 tokens)
    prompts = [shared, shared] + random_prompts([10, 33], seed=144)
    max_tokens = [5, 7, 9, 11]

    async def go():
        async with AsyncClient(router.address) as client:
            for p, n in zip(prompts, max_tokens):  # one at a time: the second finds the first's blocks
                await collect(client, p, max_tokens=n, temperature=0.0, ignore_eos=True)

    run(go())
    assert pools_full(prefill.address) and pools_full(decode.address)
    after = [samples(u) for u in urls]

    def delta(i: int, name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[i].get(key, 0.0) - before[i].get(key, 0.0)

    n = len(prompts)
    assert delta(0, "baton:request_success_total", finished_reason="length") == n
    assert delta(0, "baton:router_backend_requests_total", tier="prefill", backend=prefill.address) == n
    assert delta(0, "baton:router_backend_requests_total", tier="decode", backend=decode.address) == n
    assert delta(0, "baton:router_handoff_seconds_count") == n
    assert delta(0, "baton:time_to_first_token_seconds_count") == n
    # The prefill: every prompt once, one token each, one cached prefix, every hold pulled.
    assert delta(1, "baton:prompt_tokens_total") == sum(map(len, prompts))
    assert delta(1, "baton:prompt_tokens_by_source_total", source="local_cache_hit") == 48
    assert delta(1, "baton:prefix_cache_hits_total") == 48
    assert delta(1, "baton:generation_tokens_total") == n
    assert delta(1, "baton:request_success_total", finished_reason="length") == n
    assert delta(1, "baton:kv_hold_outcomes_total", outcome="pulled") == n
    assert delta(1, "baton:request_prompt_tokens_sum") == sum(map(len, prompts))
    # The decode: the rest of the tokens; every prompt's KV pulled but the repeat's, which its own
    # prefix cache held whole (4 blocks: 64 tokens); what Admin.Stats counts too.
    assert delta(2, "baton:generation_tokens_total") == sum(max_tokens) - n
    assert delta(2, "baton:prompt_tokens_by_source_total", source="external_kv_transfer") == sum(map(len, prompts)) - 64
    assert delta(2, "baton:prompt_tokens_by_source_total", source="local_cache_hit") == 64
    assert delta(2, "baton:kv_transfer_outcomes_total", outcome="ok") == n
    assert delta(2, "baton:request_generation_tokens_sum") == sum(max_tokens)
    s = stats(decode.address)
    block_bytes = after[2][("baton:nixl_bytes_transferred_sum", ())] / s.num_blocks_pulled
    assert delta(2, "baton:nixl_bytes_transferred_sum") == (4 + 1 + 3) * block_bytes
    assert delta(2, "baton:nixl_xfer_time_seconds_count") == n - 1
    assert after[2][("baton:num_requests_running", ())] == 0
    assert after[2][("baton:num_requests_waiting_by_reason", (("reason", "remote_kvs"),))] == 0
    assert after[2][("baton:kv_cache_usage_perc", ())] == 0
    # Latency histograms lead to their traces: exemplars, in the OpenMetrics format.
    text = scrape(urls[2], openmetrics=True)
    exemplars = [line for line in text.splitlines() if line.startswith("baton:e2e_request_latency_seconds_bucket")
                 and "# {trace_id=" in line]
    assert exemplars, "no exemplar on the e2e histogram"
    trace_id = exemplars[0].split('trace_id="')[1][:32]
    assert receiver.wait_for(lambda spans: any(sp.trace_id == trace_id for sp in spans), 10)


def test_the_grafana_dashboard_is_fresh_and_queries_what_the_services_export(stack):
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "deploy", "grafana", "dashboard.py")
    spec = importlib.util.spec_from_file_location("dashboard", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.OUT.read_text() == module.render(), "stale: run python deploy/grafana/dashboard.py"
    board = json.loads(module.OUT.read_text())
    exported = set()  # family names (as declared) and sample names, from all three services
    for proc in stack:
        for family in text_string_to_metric_families(scrape(metrics_url(proc))):
            exported.add(family.name)
            exported.update(s.name for s in family.samples)
    queried = {name for panel in board["panels"] for target in panel.get("targets", ())
               for name in re.findall(r"baton:[a-z0-9_:]+", target["expr"])}
    queried.add(re.search(r"baton:[a-z0-9_:]+", board["templating"]["list"][0]["definition"]).group())
    missing = {name for name in queried
               if name not in exported and re.sub(r"_(total|bucket|sum|count)$", "", name) not in exported}
    assert not missing and len(queried) > 20, missing
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])


def prometheus_query(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        return json.load(resp)["data"]


def test_a_real_prometheus_scrapes_the_stack(stack, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary: .ci/run installs Debian's package where apt-get can run")
    router, prefill, decode = stack
    targets = [metrics_url(p).split("/")[2] for p in stack]
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": [
        {"job_name": "baton", "static_configs": [{"targets": targets}]}]}))
    port = free_port("127.0.0.1")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--enable-feature=exemplar-storage"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        async def go():
            async with AsyncClient(router.address) as client:
                for p in random_prompts([12, 40], seed=146):
                    await collect(client, p, max_tokens=5, temperature=0.0, ignore_eos=True)

        deadline, roles = time.monotonic() + 60, set()
        while roles != {"router", "prefill", "decode"}:
            assert time.monotonic() < deadline and proc.poll() is None, f"prometheus saw only {roles}"
            run(go())  # new requests while waiting: each scrape has fresh exemplars to store
            time.sleep(1)
            try:
                result = prometheus_query(port, "/api/v1/query?query=baton:request_success_total")["result"]
            except OSError:  # still starting
                continue
            roles = {r["metric"]["role"] for r in result}
        # Colons kept through the OpenMetrics negotiation, histograms and gauges alike.
        for query in ("baton:time_to_first_token_seconds_bucket", 'baton:kv_cache_usage_perc{role="decode"}',
                      'baton:router_handoff_seconds_count{role="router"}', "baton:nixl_bytes_transferred_sum"):
            assert prometheus_query(port, "/api/v1/query?query=" + urllib.parse.quote(query))["result"], query
        # A slow bucket leads to its trace: exemplars stored with the trace id.
        exemplars = prometheus_query(port, "/api/v1/query_exemplars?query=baton:e2e_request_latency_seconds_bucket"
                                     f"&start={time.time() - 300}&end={time.time() + 5}")
        assert any(len(e["labels"]["trace_id"]) == 32 for series in exemplars for e in series["exemplars"])
    finally:
        proc.terminate()
        proc.wait(20)


def test_a_decode_killed_mid_stream_ends_the_trace_with_an_error(stack, receiver):
    """Last in this module: it kills the shared decode."""
    router, _, decode = stack
    prompt = random_prompts([30], seed=145)[0]

    async def go():
        got = []
        async with AsyncClient(router.address) as client:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for chunk in client.generate(prompt, max_tokens=500, temperature=0.0, ignore_eos=True,
                                                   request_id="killed-0"):
                    got += chunk.token_ids
                    if len(got) == 5:
                        decode.kill()
            return e.value

    error = run(go())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert receiver.wait_for(lambda spans: any(
        s.attributes.get("gen_ai.request.id") == "killed-0" and s.service == "baton-router" and s.end_ns
        for s in spans), 30)
    spans = [s for s in receiver.spans() if s.trace_id in {
        x.trace_id for x in receiver.spans() if x.attributes.get("gen_ai.request.id") == "killed-0"}]
    (root,) = [s for s in spans if s.service == "baton-router" and s.kind == KIND_SERVER]
    assert root.is_error and root.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]
    (call,) = [s for s in spans if s.kind == KIND_CLIENT and s.attributes["rpc.method"] == "Generate"]
    assert call.is_error and call.attributes["error.type"] == "UNAVAILABLE"


def test_tracing_off_makes_no_tracer_and_otel_variables_apply(monkeypatch, tiny_llama, serve):
    from baton.services import tracing
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


def test_a_router_without_prefill_traces_and_counts_its_colocated_fallback(tiny_llama, spawn, receiver):
    common = ("--internal-token", TOKEN, "--otlp-traces-endpoint", receiver.endpoint, "--metrics-port", "0")
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
    spans = request_spans(receiver, "fallback-0", services=2, names=("prefill", "decode"))
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
