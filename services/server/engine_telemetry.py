"""Live spans and per-request metrics of one engine server, made from the engine's plain events
(engine/common/stats.py) as each step reports them, and the SERVER span of each Generate or
Prefill call they hang under.

Under the RPC's SERVER span, each request gets a span per phase, started and ended as the
engine reports it (with the engine's own timestamps):
  queue        arrival -> admitted (to run, or to wait for its KV)
  kv_handshake meeting the handle's prefill engine, the first time             (decode tier)
  kv_wait      parked in WAITING_FOR_REMOTE_KVS until its KV landed          (decode tier)
  kv_transfer  the pull, linked to the prefill's kv_hold span                 (decode tier)
  prefill      first scheduled -> first token; chunks as events               (prefill, colocated)
  decode       first token (decode tier: first scheduled) -> finished; preemptions as events
  kv_hold      finished -> pulled, released or expired; outlives the RPC      (prefill tier)
The same events feed the per-request Prometheus figures (vLLM's definitions of queue,
prefill, decode and inference time). With neither tracing nor metrics on, none of this runs.
"""
from __future__ import annotations

import logging
from itertools import chain, repeat

import grpc

from baton.engine.common.core_messages import CoreRequest
from baton.engine.common.stats import EventType, RequestEvent, RequestStats, StepEvents
from baton.services.rpc.names import SERVICE_NAME
from baton.services.telemetry import tracing
from baton.services.telemetry.metrics import EngineMetrics
from baton.services.telemetry.tracing import carrier_of, end_span, link_to, start_span, wall_ns
from baton.v1 import generate_pb2 as pb
from baton.v1 import internal_pb2

log = logging.getLogger("baton.telemetry")
_PHASES_WITH_EVENTS = ("decode", "prefill")  # where chunks, preemptions and resumptions are noted


class RequestTelemetry:
    """One request's open spans and the figures its metrics need: what the front knows of it
    (the CoreRequest), what the core said when it finished (stats), and, when the front ended
    it (a stop string), how it ended here (`final`: the core then reports an abort)."""

    __slots__ = ("hub", "request", "span", "remote", "hold_links", "phases", "last_token_time", "num_chunks",
                 "first_token_time", "stats", "final")

    def __init__(self, hub: EngineTelemetry, request: CoreRequest, span, kv_handle_context: dict | None):
        self.hub = hub
        self.request = request
        self.first_token_time: float | None = None  # the first token sampled here, as outputs show it
        self.stats: RequestStats | None = None
        self.final: tuple[str, int, float] | None = None  # finish reason, output tokens, when (the front's)
        # The RPC's SERVER span; None when tracing is off or the trace is not sampled (no phases then).
        self.span = span if span is not None and span.is_recording() else None
        self.remote = kv_handle_context is not None  # a decode request whose prompt KV is a peer's
        self.hold_links = link_to(kv_handle_context) if self.span is not None else []
        self.phases: dict[str, object] = {}
        self.last_token_time: float | None = None
        self.num_chunks = 0
        if self.span is not None:
            self.span.set_attribute("gen_ai.request.id", request.request_id)  # the server's when none was sent
        self.start_phase("queue", request.arrival_time)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    # ---- spans ----------------------------------------------------------------------------
    def start_phase(self, name: str, when: float, attributes: dict | None = None, links: list | None = None) -> None:
        if self.span is not None:
            self.phases[name] = start_span(self.hub.tracer, name, self.span, start=when, attributes=attributes,
                                           links=links)

    def end_phase(self, name: str, when: float, attributes: dict | None = None, error: str | None = None) -> None:
        end_span(self.phases.pop(name, None), when, attributes, error)

    def _note(self, name: str, when: float, attributes: dict | None = None) -> None:
        for phase in _PHASES_WITH_EVENTS:
            span = self.phases.get(phase)
            if span is not None:
                span.add_event(name, attributes, timestamp=wall_ns(when))
                return

    def hold_context(self) -> dict[str, str]:
        """The kv_hold span's W3C context, for the KV handle (empty when not traced)."""
        return carrier_of(self.phases.get("kv_hold"))

    # ---- engine events (one method each; EVENT_HANDLERS maps them) -------------------------
    def _scheduled(self, ev: RequestEvent) -> None:
        self.end_phase("queue", ev.time)
        if "prefill" in self.phases or "decode" in self.phases:
            self._note("resumed", ev.time)
        elif self.remote:
            self.start_phase("decode", ev.time)
        else:
            self.start_phase("prefill", ev.time, {"gen_ai.usage.input_tokens": self.num_prompt_tokens,
                                                  "gen_ai.usage.cache_read.input_tokens": ev.num_tokens})

    def _prefill_chunk(self, ev: RequestEvent) -> None:
        self.num_chunks += 1
        self._note("chunk", ev.time, {"baton.tokens": ev.num_tokens})

    def _preempted(self, ev: RequestEvent) -> None:
        self._note("preempted", ev.time)

    def _kv_wait(self, ev: RequestEvent) -> None:
        self.end_phase("queue", ev.time)
        self.start_phase("kv_wait", ev.time)

    def _grammar_ready(self, ev: RequestEvent) -> None:
        """The wait for its grammar (compiling, or found in the cache), from arrival."""
        self.start_phase("grammar", self.request.arrival_time, {"baton.structured_output.kind": ev.detail})
        self.end_phase("grammar", ev.time)
        m = self.hub.metrics
        if m is not None:
            m.structured_requests.labels(**m.labels, kind=ev.detail).inc()
            m.grammar_wait.observe(ev.time - self.request.arrival_time)

    def _transfer_started(self, ev: RequestEvent) -> None:
        t = ev.transfer
        self.start_phase("kv_transfer", t.start_time, {
            "baton.kv.remote_engine_id": t.remote_engine_id, "baton.kv.blocks": t.num_blocks,
            "baton.kv.bytes": t.num_bytes, "baton.kv.descriptors": t.num_descriptors}, self.hold_links)

    def _first_token(self, finished: bool) -> None:
        """prefill -> decode, at the first token (seen lazily: its time is the engine's)."""
        first = self.first_token_time
        if "prefill" in self.phases and first is not None:
            self.end_phase("prefill", first, {"baton.prefill.chunks": self.num_chunks})
            if not finished:
                self.start_phase("decode", first)

    def _transfer_ended(self, ev: RequestEvent) -> None:
        t, metrics = ev.transfer, self.hub.metrics
        outcome = "ok" if t.ok else "recomputed"
        seconds = t.end_time - t.start_time
        self.end_phase("kv_transfer", t.end_time, {
            "baton.kv.outcome": outcome, "baton.kv.recompute_from_block": t.recompute_from_block,
            "baton.kv.bandwidth_bytes_per_s": t.num_bytes / seconds if t.num_blocks and seconds > 0 else None},
            error=None if t.ok else f"KV pull failed ({t.error}); recomputed from block {t.recompute_from_block}")
        self.end_phase("kv_wait", ev.time)
        if metrics is None:
            return
        metrics.transfer_outcomes.labels(**metrics.labels, outcome=outcome).inc()
        if not t.ok:
            metrics.failed_transfers.inc()
            metrics.recomputed_tokens.inc(ev.num_tokens)
        elif t.num_blocks:  # what moved (all local hits move nothing), as vLLM counts successful transfers only
            metrics.xfer_time.observe(seconds)
            metrics.xfer_bytes.observe(t.num_bytes)
            metrics.xfer_descriptors.observe(t.num_descriptors)
            metrics.observe_transfer(t.remote_engine_id, t.num_bytes, seconds)

    def transfer_failed(self, error: str, when: float) -> None:
        """The handle's peer could not be reached: no pull started, the request fails."""
        self.start_phase("kv_transfer", when, links=self.hold_links)
        self.end_phase("kv_transfer", when, {"baton.kv.outcome": "failed"}, error=error)
        if self.hub.metrics is not None:
            m = self.hub.metrics
            m.failed_transfers.inc()
            m.transfer_outcomes.labels(**m.labels, outcome="failed").inc()

    def _finished(self, ev: RequestEvent) -> None:
        self.stats = stats = ev.stats
        self.first_token_time = self.first_token_time or stats.first_token_time
        reason, num_output_tokens, _ = self.final or (stats.finish_reason, stats.num_output_tokens, None)
        when = ev.time
        self._first_token(finished=True)
        decode = {"gen_ai.usage.output_tokens": num_output_tokens, "gen_ai.response.finish_reasons": [reason]}
        if stats.num_draft_tokens:  # speculative decoding: how its drafts fared
            decode.update({"baton.spec_decode.draft_tokens": stats.num_draft_tokens,
                           "baton.spec_decode.accepted_tokens": stats.num_accepted_tokens,
                           "baton.spec_decode.acceptance_rate": stats.num_accepted_tokens / stats.num_draft_tokens})
        for name in list(self.phases):
            self.end_phase(name, when, decode if name == "decode" else None)
        latencies = self._latencies()
        if self.span is not None and self.span.is_recording():
            self.span.set_attributes({
                "gen_ai.usage.input_tokens": self.num_prompt_tokens, "gen_ai.usage.output_tokens": num_output_tokens,
                "gen_ai.usage.cache_read.input_tokens": stats.num_cached_tokens,
                "gen_ai.response.finish_reasons": [reason], "baton.num_preemptions": stats.num_preemptions,
                **{f"gen_ai.latency.{k}": v for k, v in latencies.items() if v is not None}})
        if self.hub.metrics is not None:
            self.hub.observe_finished(self, reason, num_output_tokens, latencies)
        if self.holds_blocks:  # the blocks wait for a decode to pull them
            blocks = stats.num_held_blocks
            self.start_phase("kv_hold", when,
                             {"baton.kv.blocks": blocks, "baton.kv.bytes": blocks * self.hub.block_bytes})

    @property
    def holds_blocks(self) -> bool:
        """A prefill request that ended with its blocks held (its handle is out)."""
        return not self.remote and self.stats is not None and self.stats.num_held_blocks > 0

    def _latencies(self) -> dict[str, float | None]:
        """vLLM's request figures, named as its spans name them (gen_ai.latency.*)."""
        s, r = self.stats, self.request
        first, scheduled = self.first_token_time, s.scheduled_time
        last = self.final[2] if self.final else s.last_token_time

        def between(a, b):
            return b - a if a is not None and b is not None else None
        return {"time_in_queue": between(r.arrival_time, scheduled),
                "time_to_first_token": between(r.arrival_time, first),
                "e2e": between(r.arrival_time, s.finished_time), "time_in_model_prefill": between(scheduled, first),
                "time_in_model_decode": between(first, last), "time_in_model_inference": between(scheduled, last)}

    def _hold_ended(self, ev: RequestEvent) -> None:
        self.end_phase("kv_hold", ev.time, {"baton.kv.hold.outcome": ev.detail})
        m = self.hub.metrics
        if m is not None:
            m.hold_outcomes.labels(**m.labels, outcome=ev.detail).inc()
            m.hold_time.observe(ev.time - self.stats.finished_time)
            if ev.detail == "expired":
                m.expired_holds.inc()

    def on_output(self, out) -> None:
        """A step gave this request tokens (the lazy prefill -> decode switch)."""
        if out.finished:  # as the front ended it: a stop string ends it here before the core does
            self.final = (out.finish_reason, out.num_output_tokens, out.time)
        self.on_token(out.time)

    def on_token(self, when: float) -> None:
        """A step gave this request a token (as a plain token: nothing else to note)."""
        if self.first_token_time is None and not self.remote:
            self.first_token_time = when
        if "prefill" in self.phases:
            self._first_token(finished=False)

    def close(self, when: float, error: str) -> None:
        """End whatever is open (the request never ran, or the server stops)."""
        for name in list(self.phases):
            self.end_phase(name, when, error=error)

    @property
    def trace_id(self) -> str | None:
        """For exemplars: the trace of a sampled request."""
        if self.span is None:
            return None
        context = self.span.get_span_context()
        return format(context.trace_id, "032x") if context.trace_flags.sampled else None


EVENT_HANDLERS = {
    EventType.SCHEDULED: RequestTelemetry._scheduled, EventType.PREFILL_CHUNK: RequestTelemetry._prefill_chunk,
    EventType.PREEMPTED: RequestTelemetry._preempted, EventType.KV_WAIT: RequestTelemetry._kv_wait,
    EventType.KV_LOAD_START: RequestTelemetry._transfer_started,
    EventType.KV_LOAD_END: RequestTelemetry._transfer_ended,
    EventType.FINISHED: RequestTelemetry._finished, EventType.HOLD_END: RequestTelemetry._hold_ended,
    EventType.GRAMMAR_READY: RequestTelemetry._grammar_ready}


class EngineTelemetry:
    """Routes each step's events to the requests' telemetry (on the event loop, before the
    step's outputs reach their streams, so a finished prefill's hold span exists by the time
    its handle is built). `tracer`: None when tracing is off; the metrics come once the engine
    has loaded (`engine_loaded`), when the server keeps any."""

    def __init__(self, tracer, model_name: str):
        self.tracer = tracer
        self.model_name = model_name  # in span names and attributes
        self.metrics: EngineMetrics | None = None
        self.block_bytes = 0  # of one KV block, once the KV cache exists
        # By the request's key, as events and outputs name it: an id can be reused once its request ended.
        self.active: dict[int, RequestTelemetry] = {}  # in the engine
        self.holding: dict[int, RequestTelemetry] = {}  # finished; blocks held for a decode

    def engine_loaded(self, block_bytes: int, metrics: EngineMetrics | None) -> None:
        """The engine core has loaded: its KV blocks' size, and the metrics that need its figures."""
        self.block_bytes = block_bytes
        self.metrics = metrics

    @property
    def enabled(self) -> bool:
        return self.tracer is not None or self.metrics is not None

    def server_span(self, context: grpc.aio.ServicerContext, msg: pb.GenerateRequest,
                    method: str) -> tracing.ServerSpan:
        """The SERVER span of a Generate or Prefill call (GenAI naming: `{operation} {model}`)."""
        if self.tracer is None:
            return tracing.ServerSpan(None, context, "", {})
        operation = tracing.operation_of(msg)
        service = SERVICE_NAME if method == "Generate" else internal_pb2.DESCRIPTOR.services_by_name[method].full_name
        return tracing.ServerSpan(self.tracer, context, f"{operation} {self.model_name}", {
            **tracing.rpc_attributes(service, method),
            **tracing.genai_request_attributes(operation, self.model_name, msg.request_id, msg.sampling)})

    def track(self, request: CoreRequest, span, kv_handle_context: dict | None = None) -> RequestTelemetry | None:
        if not self.enabled:
            return None
        rt = self.active[request.key] = RequestTelemetry(self, request, span, kv_handle_context)
        return rt

    def drop(self, rt: RequestTelemetry | None, when: float, error: str) -> None:
        """A request that never ran to its end in the engine (refused, failed before admission)."""
        if rt is not None:
            rt.close(when, error)
            self._forget(rt)

    def _forget(self, rt: RequestTelemetry) -> None:
        self.active.pop(rt.request.key, None)

    def on_step(self, step: StepEvents, outputs, token_keys) -> None:
        done = []
        try:
            for ev in step.events:
                rt = (self.holding.pop(ev.key, None) if ev.type is EventType.HOLD_END
                      else self.active.get(ev.key))
                if rt is None:
                    continue
                if ev.type is EventType.FINISHED:
                    done.append(rt)
                try:
                    EVENT_HANDLERS[ev.type](rt, ev)
                except Exception:  # one request's telemetry must not cost the others'
                    log.exception("telemetry failed on %s of %s", ev.type.value, ev.request_id)
            self._tokens(step.time, outputs, token_keys)
            if self.metrics is not None:
                for n in step.step_tokens:
                    self.metrics.iteration_tokens.observe(n)
        finally:
            for rt in done:
                self._forget(rt)
                if rt.holds_blocks:
                    self.holding[rt.request.key] = rt

    def _tokens(self, now: float, outputs, token_keys) -> None:
        """Inter-token gaps, counted per step (most of a step's tokens share theirs); `token_keys`:
        the requests of the step's plain tokens."""
        gaps: dict[float, int] = {}  # the previous token's time -> tokens since
        active = self.active
        for key, out in chain(((out.key, out) for out in outputs), zip(token_keys, repeat(None))):
            rt = active.get(key)
            if rt is not None:
                if rt.last_token_time is not None:
                    gaps[rt.last_token_time] = gaps.get(rt.last_token_time, 0) + 1
                rt.last_token_time = now
                if out is None:
                    rt.on_token(now)
                else:
                    rt.on_output(out)
        if self.metrics is not None:
            for last, n in gaps.items():
                self.metrics.itl.observe(now - last, n)

    def observe_finished(self, rt: RequestTelemetry, reason: str, num_output_tokens: int, latencies: dict) -> None:
        m = self.metrics
        exemplar = {"trace_id": rt.trace_id} if rt.trace_id else None
        m.request_success.labels(**m.labels, finished_reason=reason).inc()
        m.prompt_tokens_hist.observe(rt.num_prompt_tokens)
        m.generation_tokens_hist.observe(num_output_tokens)
        m.max_tokens_param.observe(rt.request.sampling_params.max_tokens)
        m.preemptions_hist.observe(rt.stats.num_preemptions)
        for name, histogram in (("time_to_first_token", m.ttft), ("e2e", m.e2e), ("time_in_queue", m.queue_time),
                                ("time_in_model_prefill", m.prefill_time), ("time_in_model_decode", m.decode_time),
                                ("time_in_model_inference", m.inference_time)):
            if latencies[name] is not None:
                histogram.observe(latencies[name], exemplar)
        n = num_output_tokens - (1 if rt.remote else 0)  # tokens this engine sampled
        if n > 1 and latencies["time_in_model_decode"] is not None:
            m.tpot.observe(latencies["time_in_model_decode"] / (n - 1), exemplar)

    def close(self, when: float) -> None:
        for rt in [*self.active.values(), *self.holding.values()]:
            rt.close(when, "the server stopped")
        self.active.clear()
        self.holding.clear()
