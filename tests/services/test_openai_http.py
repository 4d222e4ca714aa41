"""The OpenAI-compatible HTTP front, driven by the official `openai` client and by plain HTTP:
on a colocated server and on the router in front of prefill and decode processes, its text
equals the gRPC API's; parameters carry over; errors get OpenAI's body with the right status;
a client that disconnects mid-stream leaves every pool full; /metrics answers on the front's
port as on the metrics port (vLLM serves it on its API port)."""
from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
import urllib.request

import openai
import pytest
from helpers import collect, pools_full, random_prompts, wait_serving
from servers import ServerProcess, pd_stack
from telemetry_stack import metrics_url, samples

from baton.services.cli.launcher import free_port
from baton.services.client import AsyncClient
from baton.services.openai.protocol import Completion, sse
from baton.v1 import generate_pb2 as pb

CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


def grpc_text(address: str, prompt, **sampling) -> tuple[str, object]:
    async def go():
        async with AsyncClient(address) as client:
            _, text, last = await collect(client, prompt, **sampling)
            return text, last
    return asyncio.run(go())


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def disconnect_mid_stream(url: str, after_events: int = 3) -> int:
    """A streamed completion read for a few events, then the connection dropped."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": [5, 6, 7, 8], "max_tokens": 600, "stream": True,
                                                        "temperature": 0, "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    events = 0
    while events < after_events:
        if resp.readline().startswith(b"data: "):
            events += 1
    conn.close()
    return resp.status


def scrape(url: str, openmetrics: bool = False) -> tuple[str, set[str]]:
    """A /metrics page's Content-Type and sample names (through the parser of its format)."""
    if openmetrics:
        from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse
    else:
        from prometheus_client.parser import text_string_to_metric_families as parse
    accept = "application/openmetrics-text; version=1.0.0" if openmetrics else "text/plain"
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": accept}), timeout=10) as resp:
        text = resp.read().decode()
        return resp.headers["Content-Type"], {s.name for family in parse(text) for s in family.samples}


def check_metrics_pages_agree(front: str, port: str, counter: tuple) -> None:
    """The front's /metrics is the metrics port's page: the same Content-Type and names in both
    formats (`baton:` names kept in OpenMetrics too), and the same count of `counter`."""
    for openmetrics in (False, True):
        (kind, names), (port_kind, port_names) = scrape(front, openmetrics), scrape(port, openmetrics)
        assert kind == port_kind and kind.startswith("application/openmetrics-text" if openmetrics else "text/plain")
        assert names == port_names and counter[0] in names, names ^ port_names
    assert samples(front)[counter] == samples(port)[counter] >= 1


def check_the_openai_client_equals_grpc(url: str, grpc_address: str, model: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == [model]
    want, last = grpc_text(grpc_address, CHAT, max_tokens=24, temperature=0, ignore_eos=True)
    whole = client.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == want and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == last.usage.prompt_tokens and whole.usage.completion_tokens == 24
    streamed, usage = "", None
    for chunk in client.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}):
        if chunk.choices:
            streamed += chunk.choices[0].delta.content or ""
        else:
            usage = chunk.usage
    assert streamed == want and usage.completion_tokens == 24
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: its prefix was cached
    prompt = "The capital of France is"
    want, _ = grpc_text(grpc_address, prompt, max_tokens=12, temperature=0, ignore_eos=True)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert text == want
    # Streamed as whole: with logprobs (each token's whole response, handed to the call straight),
    # and two prompts (merged: every response through the generators), each choice its own.
    for prompts, extra in (([prompt], {"logprobs": 2}), ([prompt, [5, 6, 7]], {})):
        kwargs = dict(model=model, prompt=prompts, max_tokens=7, temperature=0, extra_body={"ignore_eos": True},
                      **extra)
        whole = client.completions.create(**kwargs)
        texts, tokens, finish = {}, {}, {}
        for chunk in client.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                tokens[c.index] = tokens.get(c.index, []) + (c.logprobs.tokens if c.logprobs else [])
                finish[c.index] = c.finish_reason or finish.get(c.index)
        assert texts == {c.index: c.text for c in whole.choices} and set(texts) == set(range(len(prompts)))
        assert tokens == {c.index: c.logprobs.tokens if c.logprobs else [] for c in whole.choices}
        assert finish == {c.index: "length" for c in whole.choices}


@pytest.mark.parametrize("chat", [False, True])
def test_a_text_event_is_the_event_the_general_path_makes(chat):
    """A sink's token (Completion.text_event, from a template) is the bytes events() and sse()
    make of the same response, and both account it alike; a choice's first, and any under
    tools, take the general path."""
    fast, general = (Completion(str, "cmpl-7", 'a "model"', chat, 1.7e9, None) for _ in range(2))
    texts = ["Hello", " wörld", 'a "quote"\n\t', "\\", "\U0001F600", "\u2028", "", "</script>"]
    for index in (0, 3):
        for i, text in enumerate(texts):
            made = general.events((index, pb.GenerateResponse(text=text)))
            assert fast.text_event(index, text) == b"".join(map(sse, made)), (index, i)
    assert fast.choices == general.choices and fast.choices[3]["text"] == "".join(texts)


def test_the_openai_client_on_a_colocated_server(serve, tiny_llama):
    srv = serve(tiny_llama, {"http_port": 0})
    url, model = srv.server.http.url, srv.server.model_name
    check_the_openai_client_equals_grpc(url, srv.address, model)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    # Parameters carry over: logprobs (both shapes), stop strings, n with a seed, penalties.
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    legacy = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=5, temperature=0, logprobs=2,
                                       extra_body={"ignore_eos": True})
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5 and all(len(t) <= 2 for t in lp.top_logprobs)
    full = legacy.choices[0].text
    stop = full[2:4]
    stopped = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=5, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})
    assert stopped.choices[0].text == full[:full.index(stop)] and stopped.choices[0].finish_reason == "stop"
    many = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=8, temperature=1.0, n=3, seed=9,
                                     presence_penalty=0.5, extra_body={"ignore_eos": True})
    again = client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=8, temperature=1.0, n=3, seed=9,
                                      presence_penalty=0.5, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in many.choices) == [0, 1, 2] and many.usage.completion_tokens == 24
    assert [c.text for c in many.choices] == [c.text for c in again.choices]
    # Tokenization as the server counts it.
    status, tokens = post(url, "/tokenize", {"messages": CHAT})
    assert status == 200 and tokens["count"] == chat.usage.prompt_tokens
    assert post(url, "/detokenize", {"tokens": [5, 6, 7]})[1]["prompt"] == srv.server.core.tokenizer.decode([5, 6, 7])
    assert srv.wait_pool_full()


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "hi", "presence_penalty": 5}, 400, "presence_penalty"),
    ({"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "hi", "stop": [3]}, 400, "stop"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens"),
    ({"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ({"prompt": [1, 2**40]}, 400, "prompt"),
    ({"prompt": "hi", "stop_token_ids": [10**6], "min_tokens": 2}, 400, "stop_token_ids")])
def test_bad_requests_get_openai_errors_naming_the_parameter(serve, tiny_llama, body, status, param):
    srv = serve(tiny_llama, {"http_port": 0})
    got, error = post(srv.server.http.url, "/v1/completions", body)
    assert got == status and error["error"]["param"] == param and error["error"]["code"] == status
    assert error["error"]["message"]


def test_parameters_baton_does_not_implement_are_refused_never_ignored(serve, tiny_llama):
    srv = serve(tiny_llama, {"http_port": 0}, scheduling_policy="priority")
    url = srv.server.http.url
    for path, extra, param in [("/v1/completions", {"echo": True}, "echo"),
                               ("/v1/completions", {"best_of": 3}, "best_of"),
                               ("/v1/completions", {"suffix": "end"}, "suffix"),
                               ("/v1/completions", {"frobnicate": 1}, "frobnicate"),
                               ("/v1/completions", {"tool_choice": "auto"}, "tool_choice"),
                               ("/v1/chat/completions", {"prompt": "hi"}, "prompt"),
                               ("/v1/chat/completions", {"store": True}, "store"),
                               ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
                               ("/v1/completions", {"priority": "high"}, "priority")]:
        body = {"messages": CHAT} if "chat" in path else {"prompt": "hi"}
        status, error = post(url, path, {**body, "max_tokens": 2, **extra})
        assert (status, error["error"]["param"]) == (400, param), (extra, error)
    # What is accepted at its harmless value, and vLLM's priority, are served.
    status, _ = post(url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "echo": False, "best_of": 1,
                                              "user": "u", "priority": -1})
    assert status == 200


def test_a_full_queue_gets_429_and_a_draining_server_503(serve, tiny_llama):
    srv = serve(tiny_llama, {"http_port": 0, "max_waiting_requests": 2}, max_num_seqs=1)
    url = srv.server.http.url
    results = []
    body = {"prompt": [5, 6], "max_tokens": 4}
    threads = [threading.Thread(target=lambda: results.append(post(url, "/v1/completions", body))) for _ in range(2)]
    with srv.core_stopped():  # the two wait; the third finds the queue full
        for t in threads:
            t.start()
            time.sleep(0.3)
        status, error = post(url, "/v1/completions", body)
    for t in threads:
        t.join(30)
    assert (status == 429 and error["error"]["type"] == "RateLimitError"
            and "max_waiting_requests" in error["error"]["message"])
    long = threading.Thread(target=lambda: results.append(post(url, "/v1/completions", {
        "prompt": [5, 6], "max_tokens": 1000, "ignore_eos": True})))  # about a second: it outlives the checks
    long.start()
    time.sleep(0.1)
    # (A grace it cannot outlast on a loaded machine: it is the drain that is checked here.)
    stopping = asyncio.run_coroutine_threadsafe(srv.server.stop(60.0), srv.loop)
    time.sleep(0.2)
    status, error = post(url, "/v1/completions", body)
    assert status == 503 and error["error"]["type"] == "ServiceUnavailableError"
    stopping.result(90)
    long.join(30)
    assert [s for s, _ in results] == [200, 200, 200]  # the one in flight finished during the drain


def test_a_request_that_outlasts_the_grace_is_cut_when_it_ends(serve, tiny_llama):
    """The drain waits the grace, not aiohttp's own minute for a handler still streaming."""
    srv = serve(tiny_llama, {"http_port": 0})
    results = []

    def call():
        try:
            results.append(post(srv.server.http.url, "/v1/completions", {"prompt": [5, 6], "max_tokens": 4})[0])
        except (OSError, http.client.HTTPException) as e:  # the connection closed under it
            results.append(type(e).__name__)

    caller = threading.Thread(target=call)
    with srv.core_stopped():  # no token comes: the request is in flight until its grace ends
        caller.start()
        time.sleep(0.3)
        stopping = asyncio.run_coroutine_threadsafe(srv.server.stop(0.3), srv.loop)
        caller.join(10)
        assert not caller.is_alive() and results and results[0] != 200, results
    stopping.result(30)


def test_a_colocated_server_serves_metrics_on_its_http_port(serve, tiny_llama):
    srv = serve(tiny_llama, {"http_port": 0, "metrics_port": 0})
    status, _ = post(srv.server.http.url, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3,
                                                              "temperature": 0, "ignore_eos": True})
    assert status == 200
    check_metrics_pages_agree(srv.server.http.url + "/metrics", srv.server.metrics_server.url,
                              ("baton:request_success_total", (("finished_reason", "length"),)))
    # The engine's load figures come from the event loop the front runs on: collected off it.
    assert samples(srv.server.http.url + "/metrics")[("baton:num_requests_running", ())] == 0


def test_an_http_front_without_a_metrics_port_serves_metrics(tiny_llama):
    """`baton serve --http-port` alone: metrics exist, on the front's port (printed with it)."""
    router = ServerProcess(tiny_llama, "--role", "router", "--http-port", "0",
                           "--decode", f"127.0.0.1:{free_port('127.0.0.1')}")  # nothing there: no engine needed
    try:
        router.address  # noqa: B018 - waits until it serves (the front's line comes first)
        line = next(ln for ln in router.lines if ln.startswith("OpenAI API on "))
        url = line.split()[-1].removesuffix(")")
        assert url == line.split()[3].removesuffix("/v1") + "/metrics"
        assert not any(ln.startswith("metrics on ") for ln in router.lines)
        kind, names = scrape(url)
        assert kind.startswith("text/plain") and "baton:router_requests_in_flight" in names
    finally:
        router.stop()


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(serve, tiny_llama):
    srv = serve(tiny_llama, {"http_port": 0})
    assert disconnect_mid_stream(srv.server.http.url) == 200
    assert srv.wait_pool_full()


@pytest.fixture(scope="module")
def stack(tiny_llama):
    with pd_stack(tiny_llama, router=("--http-port", "0", "--metrics-port", "0", "--served-model-name", "tiny")) as (
            (prefill,), (decode,), router):
        wait_serving(router.address)
        url = next(line.split()[3].removesuffix("/v1") for line in router.lines if line.startswith("OpenAI API on"))
        yield router, prefill, decode, url


def test_the_openai_client_through_the_router(stack):
    router, prefill, decode, url = stack
    check_the_openai_client_equals_grpc(url, router.address, "tiny")
    with urllib.request.urlopen(url + "/health", timeout=10) as resp:
        assert resp.status == 200
    assert post(url, "/tokenize", {"prompt": "hello"})[1]["count"] > 0
    assert disconnect_mid_stream(url) == 200
    assert pools_full(prefill.address) and pools_full(decode.address)
    prompt = random_prompts([30], seed=501)[0]
    status, body = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                 "ignore_eos": True, "logprobs": 1})
    want, _ = grpc_text(router.address, prompt, max_tokens=6, temperature=0, ignore_eos=True)
    assert status == 200 and body["choices"][0]["text"] == want and len(body["choices"][0]["logprobs"]["tokens"]) == 6
    decode_calls = ("baton:router_backend_requests_total", (("backend", decode.address), ("tier", "decode")))
    check_metrics_pages_agree(url + "/metrics", metrics_url(router), decode_calls)
