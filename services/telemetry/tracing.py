"""OpenTelemetry tracing for every Baton service: the tracer (or none), the W3C trace context
in gRPC metadata and in KV handles, and SERVER/CLIENT spans around RPCs.

A service traces only when an OTLP endpoint is given (`--otlp-traces-endpoint`, vLLM's flag,
or the standard `OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`); otherwise `make_tracer` returns
None, nothing is imported, and every helper here takes None and does nothing. The SDK reads
the other standard variables itself (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES,
OTEL_TRACES_SAMPLER[_ARG], OTEL_BSP_*, OTEL_EXPORTER_OTLP_HEADERS, ...).

Spans are started and ended with explicit contexts and times, never through the "current
span": a streaming handler's context does not survive its yields.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from importlib.metadata import PackageNotFoundError, version

log = logging.getLogger("baton.tracing")

TRACE_KEYS = ("traceparent", "tracestate")  # the W3C trace context, as metadata keys and handle fields
DEFAULT_SERVICE_NAMES = {"router": "baton-router", "prefill": "baton-prefill", "decode": "baton-decode",
                         "both": "baton", "encoder": "baton-encoder"}
_PROTOCOLS = ("grpc", "http/protobuf")

def wall_ns(monotonic: float) -> int:
    """Engine times are time.monotonic(); spans want wall-clock nanoseconds (the offset is taken
    now: a wall clock stepped since start moves every span alike)."""
    return time.time_ns() + int((monotonic - time.monotonic()) * 1e9)


def baton_version() -> str:
    try:
        return version("baton")
    except PackageNotFoundError:
        return "unknown"


def tracing_endpoint(flag: str | None) -> str | None:
    return (flag or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)


def make_tracer(role: str, instance_id: str, endpoint_flag: str | None = None):
    """The service's tracer, or None when no endpoint is configured (tracing off), or when
    OTEL_SDK_DISABLED says so."""
    if tracing_endpoint(endpoint_flag) is None or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc")
    if protocol not in _PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: {protocol!r} is not supported; "
                         f"use {' or '.join(_PROTOCOLS)}")
    endpoint = endpoint_flag
    if endpoint and "://" not in endpoint:  # host:port means plaintext, as a collector on localhost listens
        endpoint = "http://" + endpoint
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        if endpoint and endpoint.count("/") == 2:  # a collector's address: its traces path, as the SDK adds it
            endpoint = endpoint.rstrip("/") + "/v1/traces"
    # Our defaults, under what the environment says (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES).
    defaults = {"service.name": DEFAULT_SERVICE_NAMES[role], "service.instance.id": instance_id,
                "service.version": baton_version(), "baton.role": role}
    resource = Resource.create({**defaults, **OTELResourceDetector().detect().attributes})
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER[_ARG]
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    log.info("tracing to %s over OTLP/%s as %s", endpoint or tracing_endpoint(None), protocol,
             resource.attributes["service.name"])
    return provider.get_tracer("baton", baton_version())


def shutdown(tracer) -> None:
    """Export what is buffered and stop exporting (at a service's stop)."""
    if tracer is not None:
        tracer.span_processor.shutdown()  # the SDK tracer's processors, batch exporter included


# ---- context propagation ----------------------------------------------------------------
def _propagator():
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    return TraceContextTextMapPropagator()


def context_from_metadata(metadata) -> object | None:
    """The caller's trace context from gRPC invocation metadata (None when it sent none)."""
    carrier = {k: v for k, v in metadata or () if k in TRACE_KEYS}
    return _propagator().extract(carrier) if carrier else None


def carrier_of(span) -> dict[str, str]:
    """The W3C fields naming `span` as a parent or a link target."""
    from opentelemetry import trace
    carrier: dict[str, str] = {}
    if span is not None:
        _propagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def link_to(carrier) -> list:
    """A span link to the span a carrier (a KV handle's trace context) names, if valid."""
    if not carrier:
        return []
    from opentelemetry import trace
    span_context = trace.get_current_span(_propagator().extract(dict(carrier))).get_span_context()
    return [trace.Link(span_context, {"baton.link": "kv_hold"})] if span_context.is_valid else []


def replace_trace_metadata(metadata: tuple, span) -> tuple:
    """Forwarded metadata with the caller's trace context replaced by `span`'s."""
    if span is None:
        return metadata
    return (*(kv for kv in metadata if kv[0] not in TRACE_KEYS), *carrier_of(span).items())


# ---- spans around RPCs ------------------------------------------------------------------
def start_span(tracer, name: str, parent=None, kind: str = "INTERNAL", start: float | None = None,
               attributes: dict | None = None, links: list | None = None):
    """A span under `parent` (a span, a context, or None for a new trace); `start` is
    monotonic seconds (default: now)."""
    if tracer is None:
        return None
    from opentelemetry import trace
    context = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
    return tracer.start_span(name, context=context, kind=getattr(trace.SpanKind, kind),
                             attributes=attributes, links=links,
                             start_time=None if start is None else wall_ns(start))


def end_span(span, end: float | None = None, attributes: dict | None = None, error: str | None = None) -> None:
    if span is None or not span.is_recording():
        return
    if attributes:
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
    if error is not None:
        from opentelemetry.trace import Status, StatusCode
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=None if end is None else wall_ns(end))


def set_grpc_status(span, code, details: str | None = None) -> None:
    """The RPC's outcome on its span: any code but OK is an error (a bad request included:
    a user reading the trace wants to see it failed)."""
    if span is None or not span.is_recording():
        return
    import grpc
    from opentelemetry.trace import Status, StatusCode
    code = code or grpc.StatusCode.OK
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code != grpc.StatusCode.OK:
        span.set_attribute("error.type", code.name)
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details or ''}".rstrip(": ")))


def status_of(error: BaseException | None, context=None):
    """The gRPC code (and details) a handler ended with."""
    import grpc
    if error is None:
        return grpc.StatusCode.OK, None
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED, "the caller cancelled the call"
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code(), error.details()
    code = context.code() if context is not None else None
    if code is not None:  # the handler aborted with it
        return code, context.details()
    return grpc.StatusCode.UNKNOWN, repr(error)


def rpc_attributes(service: str, method: str) -> dict:
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


def genai_request_attributes(operation: str, model: str, request_id: str, sampling) -> dict:
    """GenAI semantic-convention attributes of a request (sampling: the API's SamplingParams)."""
    attributes = {"gen_ai.operation.name": operation, "gen_ai.request.model": model, "gen_ai.request.id": request_id}
    for name in ("max_tokens", "temperature", "top_p", "seed"):
        if sampling.HasField(name):
            attributes[f"gen_ai.request.{name}"] = getattr(sampling, name)
    return attributes


def operation_of(msg) -> str:
    """The GenAI operation a GenerateRequest is: chat when it carries messages."""
    return "chat" if msg.WhichOneof("prompt") == "chat" else "text_completion"


class ServerSpan:
    """`with ServerSpan(...) as span:` around an RPC handler's body: a SERVER span whose parent
    is the caller's trace context (a new trace when it sent none), ended with the call's gRPC
    status, whether the body returns, aborts, fails or is cancelled. With tracer None, span is
    None and this costs nothing."""

    __slots__ = ("span", "context")

    def __init__(self, tracer, context, name: str, attributes: dict):
        self.context = context
        self.span = None if tracer is None else start_span(
            tracer, name, context_from_metadata(context.invocation_metadata()), "SERVER", attributes=attributes)

    def __enter__(self):
        return self.span

    def __exit__(self, kind, error, tb) -> bool:
        if self.span is not None:
            set_grpc_status(self.span, *status_of(error, self.context))
            end_span(self.span)
        return False
