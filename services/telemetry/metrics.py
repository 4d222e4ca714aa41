"""Prometheus metrics of every Baton service, and their /metrics page (on `--metrics-port`, and
on the HTTP front's port).

Names, suffixes, labels and bucket boundaries are vLLM's (v0.33, `vllm/v1/metrics/loggers.py`
and the NIXL connector's stats) with the prefix `baton:` for `vllm:`, so dashboards, alerts
and autoscaling queries written for vLLM carry over by a prefix change. The labels are
`model_name` and `role` (vLLM's `engine` label has no use with one engine per process).
What vLLM lacks (transfer outcomes, recomputed tokens, held blocks, per-peer bandwidth, the
router's P/D breakdown) is named in the same style.

Latency histograms carry the trace id of a sampled request as an exemplar; exemplars exist
only in the OpenMetrics format, which the endpoint serves when the scraper asks for it.
prometheus-client 0.26 would write `baton:x` as `baton_x` there (its default "underscores"
escaping checks sample names with the label-name rules), so it is asked for "allow-utf-8",
which leaves every legal Prometheus name, colons included, as it is.
"""
from __future__ import annotations

import asyncio
import bisect
import logging
import math
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

log = logging.getLogger("baton.metrics")
disable_created_metrics()  # no *_created series, as vLLM: they double the output for no use

PREFIX = "baton:"
# vLLM's bucket families (vllm/v1/metrics/buckets.py and the NIXL connector's stats).
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PREEMPTION_BUCKETS = [1, 2, 3, 4, 5, 10, 20]
XFER_TIME_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]
XFER_BYTES_BUCKETS = [2 ** (10 + i) for i in range(1, 25, 2)]
XFER_DESCRIPTOR_BUCKETS = [10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000]
MAX_PEER_LABELS = 32  # distinct peers (backends) with series of their own; the rest share "other"


def request_token_buckets(max_model_len: int) -> list[int]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_model_len:
                return buckets
            buckets.append(value)
        exponent += 1


class _Children:
    """A metric with labels beyond its family's: each child bound once and then looked up by
    its labels (prometheus_client's own labels() costs about 7 µs a call, several a request)."""
    __slots__ = ("metric", "_bound")

    def __init__(self, metric):
        self.metric = metric
        self._bound: dict[tuple, object] = {}

    def labels(self, **values):
        key = tuple(values.items())
        child = self._bound.get(key)
        if child is None:
            child = self._bound[key] = self.metric.labels(**values)
        return child


class _Family:
    """Metrics of one service under its fixed labels (model_name, role): children bound once,
    so an observation costs no label lookup (with labels of its own: one dict lookup)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]):
        self.registry = registry
        self.labels = labels

    def _bound(self, kind, name: str, doc: str, extra: tuple[str, ...] = (), **kwargs):
        metric = kind(PREFIX + name, doc, [*self.labels, *extra], registry=self.registry, **kwargs)
        return _Children(metric) if extra else metric.labels(**self.labels)

    def histogram(self, name: str, doc: str, buckets, extra: tuple[str, ...] = ()):
        return self._bound(Histogram, name, doc, extra, buckets=buckets)

    def counter(self, name: str, doc: str, extra: tuple[str, ...] = ()):
        return self._bound(Counter, name, doc, extra)

    def gauge(self, name: str, doc: str, extra: tuple[str, ...] = ()):
        return self._bound(Gauge, name, doc, extra)


class EngineMetrics(_Family):
    """An engine server's metrics (colocated, prefill or decode). Per-request figures are
    observed by the engine telemetry as requests end; load and running totals are read from
    the engine when scraped (`snapshot`)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, role: str, max_model_len: int,
                 snapshot: Callable[[], object | None]):
        super().__init__(registry, {"model_name": model_name, "role": role})
        tokens = request_token_buckets(max_model_len)
        h, c = self.histogram, self.counter
        self.request_success = c("request_success", "Count of successfully processed requests.", ("finished_reason",))
        self.prompt_tokens_hist = h("request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_tokens_hist = h("request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.max_tokens_param = h("request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                  tokens)
        self.preemptions_hist = h("request_num_preemptions",
                                  "Histogram of the number of times a request was preempted.", PREEMPTION_BUCKETS)
        self.iteration_tokens = h("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                  ITERATION_TOKEN_BUCKETS)
        self.ttft = h("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = TokenHistogram(registry, "inter_token_latency_seconds",
                                  "Histogram of inter-token latency in seconds.", ITL_BUCKETS, self.labels)
        self.tpot = h("request_time_per_output_token_seconds",
                      "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                     REQUEST_LATENCY_BUCKETS)
        self.queue_time = h("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                            REQUEST_LATENCY_BUCKETS)
        self.inference_time = h("request_inference_time_seconds",
                                "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = h("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                              REQUEST_LATENCY_BUCKETS)
        self.decode_time = h("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                             REQUEST_LATENCY_BUCKETS)
        # The KV transfer: vLLM's NIXL names, then what vLLM does not count.
        self.xfer_time = h("nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.",
                           XFER_TIME_BUCKETS)
        self.xfer_bytes = h("nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache transfers.",
                            XFER_BYTES_BUCKETS)
        self.xfer_descriptors = h("nixl_num_descriptors",
                                  "Histogram of number of descriptors per NIXL KV Cache transfers.",
                                  XFER_DESCRIPTOR_BUCKETS)
        self.failed_transfers = c("nixl_num_failed_transfers",
                                  "Number of failed NIXL KV Cache transfers, including handshake failures.")
        self.expired_holds = c("nixl_num_kv_expired_reqs",
                               "Number of requests that had their KV expire (prefill side: never pulled).")
        self.structured_requests = c("structured_output_requests", "Requests under a structured output constraint, "
                                     "by its kind (json_schema, json_object, regex, choice, grammar).", ("kind",))
        self.grammar_wait = h("grammar_wait_seconds", "Histogram of seconds from a constrained request's arrival until "
                              "its grammar was ready (compiled, or found compiled).", TTFT_BUCKETS)
        self.transfer_outcomes = c("kv_transfer_outcomes", "KV pulls by outcome: ok (every block arrived), "
                                   "recomputed (a failed read; the decode recomputes from the first bad block), "
                                   "failed (the peer could not be reached; the request failed).", ("outcome",))
        self.recomputed_tokens = c("kv_recomputed_tokens", "Prompt tokens recomputed because their KV pull failed.")
        self.hold_outcomes = c("kv_hold_outcomes", "Prefill-side holds of KV blocks by how they ended: pulled, "
                               "released (nobody would pull them), expired.", ("outcome",))
        self.hold_time = h("kv_hold_time_seconds", "Histogram of how long a prefill held a request's KV blocks.",
                           TTFT_BUCKETS)
        self._peer_bytes = c("kv_transfer_peer_bytes", "Bytes pulled from each prefill peer (bandwidth: its rate "
                             "over the rate of kv_transfer_peer_seconds).", ("peer",))
        self._peer_seconds = c("kv_transfer_peer_seconds", "Seconds spent pulling from each prefill peer.",
                               ("peer",))
        self._peers: dict[str, tuple] = {}
        registry.register(_EngineLoadCollector(snapshot, self.labels))

    def observe_transfer(self, peer: str, num_bytes: int, seconds: float) -> None:
        children = self._peers.get(peer)
        if children is None:
            label = bounded_label(peer, self._peers)
            children = (self._peer_bytes.labels(**self.labels, peer=label),
                        self._peer_seconds.labels(**self.labels, peer=label))
            if label != "other":
                self._peers[peer] = children
        children[0].inc(num_bytes)
        children[1].inc(seconds)


def bounded_label(value: str, seen) -> str:
    """`value` as a label while fewer than MAX_PEER_LABELS are in `seen`, else "other": peers and
    backends come and go (restarts, pods), and every label value is a series kept forever."""
    return value if value in seen or len(seen) < MAX_PEER_LABELS else "other"


class TokenHistogram:
    """A histogram observed once per token, where prometheus-client's costs ~2 µs a time:
    `observe(value, n)` counts n equal observations at once (the tokens of one step mostly
    share their gap). Observed from the event loop only; read when scraped."""

    def __init__(self, registry: CollectorRegistry, name: str, doc: str, buckets: list[float], labels: dict):
        self.name, self.doc, self.labels = PREFIX + name, doc, labels
        self.bounds = [*buckets, math.inf]
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n  # buckets are `le`: inclusive
        self.sum += value * n

    def describe(self):
        return [HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))]

    def collect(self):
        counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, count in zip(self.bounds, counts):
            cumulative += count
            buckets.append(("+Inf" if bound == math.inf else str(bound), cumulative))
        family = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), buckets, total)
        yield family


class _EngineLoadCollector:
    """Gauges and running totals read from the engine at scrape time (no per-step cost)."""

    def __init__(self, snapshot: Callable[[], object | None], labels: dict[str, str]):
        self.snapshot = snapshot
        self.labels = labels

    def describe(self):
        return []  # collected only when scraped

    def collect(self):
        s = self.snapshot()
        if s is None:  # loading, or stopped
            return
        names, values = list(self.labels), list(self.labels.values())

        def family(kind, name: str, doc: str, value=None, by: dict | None = None, label: str = ""):
            """One value, or (`by`) one per `label` value; an empty `by` declares the family only."""
            metric = kind(PREFIX + name, doc, labels=names + ([label] if by is not None else []))
            for key, v in (by.items() if by is not None else [(None, value)]):
                metric.add_metric(values + ([key] if by is not None else []), v)
            return metric

        g, c = GaugeMetricFamily, CounterMetricFamily
        yield family(g, "num_requests_running", "Number of requests in model execution batches.", s.num_running)
        yield family(g, "num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting)
        yield family(g, "num_requests_waiting_by_reason", "Number of waiting requests by reason: capacity (room in "
                     "the batch or the KV pool), remote_kvs (WAITING_FOR_REMOTE_KVS: their KV is being pulled).",
                     by={"capacity": s.num_waiting - s.num_waiting_for_kvs, "remote_kvs": s.num_waiting_for_kvs},
                     label="reason")
        yield family(g, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage)
        yield family(g, "kv_held_blocks", "KV blocks held for a transfer (prefill: for a decode to pull).",
                     s.num_held_blocks)
        yield family(g, "kv_held_requests", "Finished requests whose KV blocks are held for a transfer.",
                     s.num_held_requests)
        yield family(c, "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                     s.prefix_cache_queries)
        yield family(c, "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                     s.prefix_cache_hits)
        yield family(c, "num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions)
        yield family(c, "num_swap_preemptions", "Preemptions that swapped the request's KV blocks to the host tier "
                     "(the rest recompute).", s.num_swap_preemptions)
        yield family(c, "kv_host_hand_offs", "Blocks held for a decode peer that were moved to the host KV tier "
                     "before their handle went out (the device pool was short), by request.", s.num_host_hand_offs)
        yield family(g, "num_requests_swapped", "Number of requests swapped to the host KV tier.", s.num_swapped)
        yield family(g, "host_kv_cache_blocks", "Blocks in the host KV tier (kv_offloading_size).",
                     s.num_host_kv_blocks)
        yield family(g, "host_kv_cache_usage_perc", "Host KV tier usage (blocks holding a copy, a swapped or an "
                     "in-flight block). 1 means 100 percent usage.", s.host_kv_cache_usage)
        yield family(c, "host_kv_cache_hits", "Prompt tokens found in the host KV tier beyond the device's prefix "
                     "cache hits (they were loaded, not recomputed).", s.host_kv_cache_hits)
        yield family(c, "host_kv_transferred_blocks", "KV blocks copied between the device pool and the host tier, "
                     "by direction.", label="direction",
                     by={"to_host": s.num_host_kv_stored_blocks, "to_device": s.num_host_kv_loaded_blocks})
        yield family(g, "lora_adapters", "LoRA adapters: loaded, and running (distinct among running requests, at "
                     "most max_loras).", label="state", by={"loaded": s.num_loras, "running": s.num_running_loras})
        yield family(c, "lora_device_loads", "LoRA adapters put on the device (its slots held others).",
                     s.num_lora_device_loads)
        yield family(c, "prompt_tokens", "Number of prefill tokens processed.", s.num_prompt_tokens)
        computed = s.num_prompt_tokens - s.num_prompt_tokens_cached - s.num_prompt_tokens_external
        yield family(c, "prompt_tokens_by_source", "Number of prompt tokens by source.", label="source",
                     by={"local_compute": computed, "local_cache_hit": s.num_prompt_tokens_cached,
                         "external_kv_transfer": s.num_prompt_tokens_external})
        yield family(c, "generation_tokens", "Number of generation tokens processed.", s.num_generation_tokens)
        yield family(c, "spec_decode_num_drafts", "Number of spec decoding drafts (a request's drafts verified in "
                     "one step).", s.num_spec_drafts)
        yield family(c, "spec_decode_num_draft_tokens", "Number of draft tokens.", s.num_spec_draft_tokens)
        yield family(c, "spec_decode_num_accepted_tokens", "Number of accepted tokens.", s.num_spec_accepted_tokens)
        yield family(c, "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                     label="position", by={str(i): n for i, n in enumerate(s.spec_accepted_per_pos)})


class RouterMetrics(_Family):
    """The router's: its requests by backend and tier, what went wrong, and the P/D breakdown
    of the time to first token that the client sees."""

    def __init__(self, registry: CollectorRegistry, model_name: str, in_flight: Callable[[], int]):
        super().__init__(registry, {"model_name": model_name, "role": "router"})
        h, c = self.histogram, self.counter
        self.backend_requests = c("router_backend_requests", "Calls to a backend, by tier and instance.",
                                  ("tier", "backend"))
        self.backend_errors = c("router_backend_errors", "Backend calls that failed, by tier, instance and gRPC "
                                "code.", ("tier", "backend", "code"))
        self.retries = c("router_retries", "Requests tried again on another instance, by tier.", ("tier",))
        self.migrations = c("router_migrations", "Requests moved mid-stream to another decode instance after theirs "
                            "failed (resumed from the tokens already streamed).")
        self.fallbacks = c("router_colocated_fallbacks", "Requests a decode instance computed whole (no prefill), "
                           "by reason: no_prefill (none healthy), prefill_failed.", ("reason",))
        self.decisions = c("router_policy_decisions", "Instances chosen, by policy, tier and why: affinity "
                           "(a cached prefix), load_bound (affinity overruled by load), least_loaded, round_robin.",
                           ("policy", "tier", "decision"))
        self.request_success = c("request_success", "Count of successfully processed requests.", ("finished_reason",))
        self.errors = c("router_request_errors", "Requests that ended with an error, by gRPC code.", ("code",))
        self.gauge("router_requests_in_flight", "Requests streaming through the router.").set_function(in_flight)
        self.ttft = h("time_to_first_token_seconds", "Histogram of time to first token in seconds, as the client "
                      "saw it.", TTFT_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                     REQUEST_LATENCY_BUCKETS)
        self.prefill_leg = h("router_prefill_leg_seconds", "P/D breakdown: the Prefill call, from sending it to its "
                             "reply (the first token).", TTFT_BUCKETS)
        self.handoff = h("router_handoff_seconds", "P/D breakdown: from the prefill's reply until the decode could "
                         "run the request (its call, handshake, KV pull, wait for a step).", TTFT_BUCKETS)
        self.first_decode_step = h("router_first_decode_step_seconds", "P/D breakdown: the decode's first step, "
                                   "from its KV landing to its first token.", TTFT_BUCKETS)
        self._backends: set[str] = set()

    def backend_label(self, address: str) -> str:
        label = bounded_label(address, self._backends)
        self._backends.add(label)
        return label


def make_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)  # process_resident_memory_bytes and friends
    return registry


def openmetrics_text(registry: CollectorRegistry) -> bytes:
    return openmetrics.generate_latest(registry, escaping=openmetrics.ALLOWUTF8)


def exposition(registry: CollectorRegistry, accept: str) -> tuple[bytes, str]:
    """A scrape's body and Content-Type, for the request's Accept header: OpenMetrics (with
    exemplars) when it asks for it, else the Prometheus text format. Both /metrics endpoints
    (the metrics port's and the HTTP front's) answer with it. It may wait on the service's
    event loop (an engine's load figures: `on_loop`), so call it from another thread."""
    if "application/openmetrics-text" in accept:
        return openmetrics_text(registry), openmetrics.CONTENT_TYPE_LATEST
    return generate_latest(registry), CONTENT_TYPE_PLAIN_0_0_4


class MetricsServer:
    """/metrics over HTTP on its own thread (`--metrics-port`): the Prometheus text format, or
    OpenMetrics (with exemplars) when the scraper's Accept header asks for it. A service with
    an HTTP front serves the same page on its port too (openai/front.py)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                body, kind = exposition(registry, self.headers.get("Accept", ""))
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # scrapes every few seconds would flood the log
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, name="metrics-http", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def on_loop(loop: asyncio.AbstractEventLoop, make_coro, timeout_s: float = 5.0):
    """From the HTTP thread: run a coroutine on the service's event loop and wait for it."""
    return asyncio.run_coroutine_threadsafe(make_coro(), loop).result(timeout_s)
