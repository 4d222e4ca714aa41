"""`baton trace`: a small OTLP/gRPC trace receiver on 127.0.0.1 that prints, for each finished
request, a waterfall of where its time went across the tiers, so a new user sees it with
nothing else installed. The tests receive the stack's spans with the same receiver.

    trace 5b8e…  chat smollm2-135m-instruct  412.3 ms
      tier      phase               start       time
      router    request             0.0 ms   412.3 ms  |████████████████████████████████████████|
      prefill   queue               1.1 ms     0.2 ms  |                                        |
      ...
"""
from __future__ import annotations

import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

# Span kinds as OTLP numbers them.
KIND_SERVER, KIND_CLIENT = 2, 3
STATUS_ERROR = 2
# The waterfall's rows: span name -> phase (the prefill tier's "prefill" is its compute).
_PHASES = {"queue": "queue", "prefill": "prefill", "kv_hold": "hold", "kv_handshake": "handshake",
           "kv_transfer": "transfer", "kv_wait": "waiting for KV", "decode": "decode", "encode": "encode"}
_TIERS = {"router": "router", "prefill": "prefill", "decode": "decode", "both": "colocated", "encoder": "encoder"}
_BAR = 40


@dataclass(slots=True)
class SpanRecord:
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    name: str
    kind: int
    start_ns: int
    end_ns: int
    service: str  # resource service.name
    role: str  # resource baton.role ("" when not a Baton service)
    attributes: dict
    events: list[tuple[str, int, dict]] = field(default_factory=list)
    links: list[tuple[str, str, dict]] = field(default_factory=list)
    status_code: int = 0
    status_message: str = ""

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def is_error(self) -> bool:
        return self.status_code == STATUS_ERROR


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attributes(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


def spans_from_request(request: trace_service_pb2.ExportTraceServiceRequest) -> list[SpanRecord]:
    out = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                out.append(SpanRecord(
                    s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name, s.kind,
                    s.start_time_unix_nano, s.end_time_unix_nano, resource.get("service.name", ""),
                    resource.get("baton.role", ""), _attributes(s.attributes),
                    [(e.name, e.time_unix_nano, _attributes(e.attributes)) for e in s.events],
                    [(link.trace_id.hex(), link.span_id.hex(), _attributes(link.attributes)) for link in s.links],
                    s.status.code, s.status.message))
    return out


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC TraceService on host:port (0: a free one), keeping every span it is sent."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.traces: dict[str, list[SpanRecord]] = {}
        self.last_arrival: dict[str, float] = {}  # trace id -> when its last span came
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port} (in use?)")
        self.host = host
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def Export(self, request, context):
        spans = spans_from_request(request)
        now = time.monotonic()
        with self._changed:
            for span in spans:
                self.traces.setdefault(span.trace_id, []).append(span)
                self.last_arrival[span.trace_id] = now
            self._changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[SpanRecord]:
        with self._lock:
            return [s for spans in self.traces.values() for s in spans]

    def wait_for(self, predicate, timeout_s: float = 30.0) -> bool:
        """Until predicate(all spans) holds (bounded)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not predicate([s for spans in self.traces.values() for s in spans]):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.2))
        return True

    def take_finished(self, quiet_s: float) -> list[list[SpanRecord]]:
        """Traces that got no span for quiet_s and hold their top span (one without a parent,
        or the router's under a client's span); any trace quiet ten times as long. Each is
        forgotten once taken. (An engine's spans come before the router's, which end later.)"""
        now, done = time.monotonic(), []
        with self._lock:
            for trace_id, spans in list(self.traces.items()):
                quiet = now - self.last_arrival[trace_id]
                if quiet >= 10 * quiet_s or (quiet >= quiet_s and any(
                        s.parent_id == "" or s.role == "router" for s in roots(spans))):
                    done.append(spans)
                    del self.traces[trace_id], self.last_arrival[trace_id]
        return done

    def stop(self) -> None:
        self.server.stop(0)


def roots(spans: list[SpanRecord]) -> list[SpanRecord]:
    """Spans whose parent is not in the trace (the client's span, or none)."""
    ids = {s.span_id for s in spans}
    return [s for s in spans if s.parent_id not in ids]


def _tier(span: SpanRecord) -> str:
    return _TIERS.get(span.role, span.service or "?")


def waterfall(spans: list[SpanRecord], width: int = _BAR) -> str:
    """One line per phase of the request (and its top span), with offset, duration and a bar."""
    top = min(roots(spans), key=lambda s: s.start_ns)
    rows = [(_tier(top), "request", top)]
    for span in sorted(spans, key=lambda s: s.start_ns):
        if span.name in _PHASES:
            label = "compute" if span.name == "prefill" and span.role == "prefill" else _PHASES[span.name]
            rows.append((_tier(span), label, span))
    t0 = min(s.start_ns for _, _, s in rows)
    total = max(max(s.end_ns for _, _, s in rows) - t0, 1)
    head = top.attributes.get("gen_ai.request.id", "")
    lines = [f"trace {top.trace_id}  {top.name}  {head}  {total / 1e6:.1f} ms" +
             ("  ERROR " + top.status_message if top.is_error else ""),
             f"  {'tier':<10}{'phase':<18}{'start':>10}{'time':>11}"]
    for tier, label, s in rows:
        a = int((s.start_ns - t0) / total * width)
        b = max(a + 1, int((s.end_ns - t0) / total * width + 0.5))
        bar = " " * a + "█" * (min(b, width) - a)
        mark = "  !" if s.is_error else ""
        lines.append(f"  {tier:<10}{label:<18}{(s.start_ns - t0) / 1e6:>7.1f} ms"
                     f"{(s.end_ns - s.start_ns) / 1e6:>8.1f} ms"
                     f"  |{bar:<{width}}|{mark}")
    return "\n".join(lines)


def print_waterfalls(receiver: TraceReceiver, stop: threading.Event, quiet_s: float = 1.0, out=sys.stdout) -> None:
    """Print each finished request's waterfall as it completes, until stop is set."""
    while not stop.wait(0.25):
        for spans in receiver.take_finished(quiet_s):
            print(waterfall(spans) + "\n", file=out, flush=True)


def run(host: str, port: int, quiet_s: float = 1.0, out=sys.stdout) -> None:
    """`baton trace`: receive spans and print waterfalls until Ctrl-C."""
    receiver = TraceReceiver(host, port)
    print(f"receiving OTLP/gRPC traces on {receiver.endpoint}; point services at it with\n"
          f"  OTEL_EXPORTER_OTLP_ENDPOINT={receiver.endpoint}", file=out, flush=True)
    try:
        print_waterfalls(receiver, threading.Event(), quiet_s, out)
    except KeyboardInterrupt:
        pass
    finally:
        receiver.stop()
