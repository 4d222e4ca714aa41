"""One request's trace and metrics at the router: the root SERVER span (GenAI naming,
`{operation} {model}`), a span per routing choice, a CLIENT span per backend call, and the
P/D breakdown of the time to first token that the client sees, as span attributes and as
histograms:
  prefill leg        the Prefill call, sent to answered (the first token goes out then)
  handoff            the prefill's answer -> the decode could run the request (its call,
                     handshake, KV pull, wait for a step): the gap to the decode's first
                     response less the decode's own first step, which it reports
  first decode step  the decode's KV landed -> its first token
Without a tracer or metrics every method returns at once.
"""
from __future__ import annotations

import asyncio
import time

import grpc

from baton.services.rpc.names import DECODE_STEP_KEY, FINISH_REASON_NAMES, PREFILL_SERVICE_NAME, SERVICE_NAME
from baton.services.telemetry import tracing
from baton.services.telemetry.metrics import RouterMetrics
from baton.v1 import generate_pb2 as pb


class RouterTrace:
    __slots__ = ("metrics", "tracer", "span", "start", "prefill_answered", "first_sent", "last", "_server")

    def __init__(self, tracer, metrics: RouterMetrics | None, model: str, context, msg: pb.GenerateRequest):
        self.tracer, self.metrics = tracer, metrics
        self.start = time.monotonic()
        self.prefill_answered: float | None = None
        self.first_sent = False
        self.last: bytes | None = None  # the last response passed on: it has the finish reason and usage
        if tracer is None:
            self._server = tracing.ServerSpan(None, context, "", {})
        else:
            operation = tracing.operation_of(msg)
            self._server = tracing.ServerSpan(tracer, context, f"{operation} {model}", {
                **tracing.rpc_attributes(SERVICE_NAME, "Generate"),
                **tracing.genai_request_attributes(operation, model, msg.request_id, msg.sampling)})
        # Children only under a sampled root; an unsampled one still passes its context on.
        self.span = self._server.span if self._server.span is not None and self._server.span.is_recording() else None

    def __enter__(self) -> RouterTrace:
        return self

    def __exit__(self, kind, error, tb) -> bool:
        code, _ = tracing.status_of(error, self._server.context)
        end = time.monotonic()
        finish = self._finish_attributes()
        if self.span is not None and self.span.is_recording():
            self.span.set_attributes({"baton.latency.e2e": end - self.start, **finish})
        self._server.__exit__(kind, error, tb)
        m = self.metrics
        if m is not None:
            exemplar = self._exemplar()
            m.e2e.observe(end - self.start, exemplar)
            if code != grpc.StatusCode.OK:
                m.errors.labels(**m.labels, code=code.name).inc()
            elif "gen_ai.response.finish_reasons" in finish:
                m.request_success.labels(**m.labels, finished_reason=finish["gen_ai.response.finish_reasons"][0]).inc()
        return False

    def _finish_attributes(self) -> dict:
        """Usage and finish reason from the last response (the only one the router parses)."""
        if self.last is None or (self.span is None and self.metrics is None):
            return {}
        last = pb.GenerateResponse.FromString(self.last)
        if last.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            return {}
        return {"gen_ai.usage.input_tokens": last.usage.prompt_tokens,
                "gen_ai.usage.output_tokens": last.usage.completion_tokens,
                "gen_ai.usage.cache_read.input_tokens": last.usage.cached_tokens,
                "gen_ai.response.finish_reasons": [FINISH_REASON_NAMES.get(last.finish_reason, "error")]}

    def _exemplar(self) -> dict | None:
        if self.span is None:
            return None
        context = self.span.get_span_context()
        return {"trace_id": format(context.trace_id, "032x")} if context.trace_flags.sampled else None

    def _set(self, **attributes) -> None:
        if self.span is not None and self.span.is_recording():
            self.span.set_attributes({f"baton.{k}": v for k, v in attributes.items() if v is not None})

    # ---- what the router did ------------------------------------------------------------
    def picked(self, tier: str, policy: str, candidates: list, choice) -> None:
        if self.metrics is not None:
            m = self.metrics
            m.decisions.labels(**m.labels, policy=policy, tier=tier, decision=choice.decision).inc()
        if self.span is not None:
            now = time.monotonic()
            tracing.end_span(tracing.start_span(self.tracer, f"route {tier}", self.span, start=now, attributes={
                "baton.route.tier": tier, "baton.route.policy": policy, "baton.route.decision": choice.decision,
                "baton.route.candidates": [b.address for b in candidates],
                "baton.route.chosen": choice.backend.address,
                "baton.route.expected_prefix_hit_blocks": choice.prefix_hit_blocks,
                # kv_aware's scoring inputs, one value per candidate (in candidates' order)
                **{f"baton.route.kv.{k}": v for k, v in (choice.inputs or {}).items()}}), now)

    def client_call(self, tier: str, backend, method: str, metadata: tuple):
        """A CLIENT span for a call to a backend, and the metadata that carries it."""
        if self.metrics is not None:
            m = self.metrics
            m.backend_requests.labels(**m.labels, tier=tier, backend=m.backend_label(backend.address)).inc()
        if self.span is None:  # not traced, or not sampled: pass the (unsampled) context on as it is
            return None, tracing.replace_trace_metadata(metadata, self._server.span)
        service = SERVICE_NAME if method == "Generate" else PREFILL_SERVICE_NAME
        span = tracing.start_span(self.tracer, f"{service}/{method}", self.span, "CLIENT", attributes={
            **tracing.rpc_attributes(service, method), "server.address": backend.address, "baton.tier": tier})
        return span, tracing.replace_trace_metadata(metadata, span)

    def call_ended(self, span, tier: str, backend, error: BaseException | None = None) -> None:
        code, details = tracing.status_of(error)
        tracing.set_grpc_status(span, code, details)
        tracing.end_span(span)
        ours = isinstance(error, (asyncio.CancelledError, GeneratorExit))  # our client left: not the backend's fault
        if code != grpc.StatusCode.OK and not ours and self.metrics is not None:
            m = self.metrics
            m.backend_errors.labels(**m.labels, tier=tier, backend=m.backend_label(backend.address),
                                    code=code.name).inc()

    def retried(self, tier: str) -> None:
        if self.metrics is not None:
            self.metrics.retries.labels(**self.metrics.labels, tier=tier).inc()

    def migrated(self, backend, num_tokens: int) -> None:
        """backend failed after num_tokens were streamed: the request moves to another instance."""
        if self.span is not None:
            self.span.add_event("migrated", {"baton.migration.from": backend.address,
                                             "baton.migration.streamed_tokens": num_tokens})
        if self.metrics is not None:
            self.metrics.migrations.inc()

    def fallback(self, reason: str) -> None:
        """The decode computes the prompt itself (no prefill tier to use)."""
        self._set(fallback=reason)
        if self.metrics is not None:
            self.metrics.fallbacks.labels(**self.metrics.labels, reason=reason).inc()

    def prefill_answer(self, sent: float) -> None:
        self.prefill_answered = now = time.monotonic()
        self._set(**{"latency.prefill_leg": now - sent})
        if self.metrics is not None:
            self.metrics.prefill_leg.observe(now - sent, self._exemplar())

    def first_token(self) -> None:
        """The client has its first token now."""
        if self.first_sent:
            return
        self.first_sent = True
        ttft = time.monotonic() - self.start
        self._set(**{"latency.ttft": ttft})
        if self.metrics is not None:
            self.metrics.ttft.observe(ttft, self._exemplar())

    def decode_answer(self, initial_metadata) -> None:
        """The decode's first response (after a handoff): split the gap into handoff and step."""
        if self.prefill_answered is None:
            return
        gap = time.monotonic() - self.prefill_answered
        step = next((float(v) for k, v in initial_metadata or () if k == DECODE_STEP_KEY), None)
        handoff = gap - step if step is not None else gap
        self._set(**{"latency.handoff": handoff, "latency.first_decode_step": step})
        if self.metrics is not None:
            exemplar = self._exemplar()
            self.metrics.handoff.observe(handoff, exemplar)
            if step is not None:
                self.metrics.first_decode_step.observe(step, exemplar)
