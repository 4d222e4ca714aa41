"""Metrics of the whole stack (conftest's traced_stack), read for real: counters equal to a known
workload, the Grafana dashboard querying what the services export, and a real Prometheus
scraping every tier."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import yaml
from helpers import collect, pools_full, random_prompts, stats
from prometheus_client.parser import text_string_to_metric_families
from telemetry_stack import metrics_url, run, samples, scrape

from baton.services.cli.launcher import free_port
from baton.services.client import AsyncClient


def test_metrics_count_a_known_workload(traced_stack, trace_receiver):
    router, prefill, decode = traced_stack
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
    # Its n-gram drafts (one-token matches: some are proposed even in random text): kept ones by
    # position add up, and never outnumber those drafted.
    drafted, kept = (delta(2, f"baton:spec_decode_num_{kind}_tokens_total") for kind in ("draft", "accepted"))
    assert delta(2, "baton:spec_decode_num_drafts_total") > 0 and 0 <= kept <= drafted
    positions = [dict(labels)["position"] for name, labels in after[2]
                 if name == "baton:spec_decode_num_accepted_tokens_per_pos_total"]
    assert kept == sum(delta(2, "baton:spec_decode_num_accepted_tokens_per_pos_total", position=p) for p in positions)
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
    assert trace_receiver.wait_for(lambda spans: any(sp.trace_id == trace_id for sp in spans), 10)


def test_the_grafana_dashboard_is_fresh_and_queries_what_the_services_export(traced_stack):
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "grafana", "dashboard.py")
    spec = importlib.util.spec_from_file_location("dashboard", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.OUT.read_text() == module.render(), "stale: run python deploy/grafana/dashboard.py"
    board = json.loads(module.OUT.read_text())
    exported = set()  # family names (as declared) and sample names, from all three services
    for proc in traced_stack:
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


def test_a_real_prometheus_scrapes_the_stack(traced_stack, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary: .ci/run installs Debian's package where apt-get can run")
    router, prefill, decode = traced_stack
    targets = [metrics_url(p).split("/")[2] for p in traced_stack]
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
