"""The router: the public `Generate` API in front of prefill and decode instances.

For each request it picks a prefill and a decode instance, calls the prefill's internal
`Prefill`, forwards the first token to the client at once, and passes the KV handle on to
the decode's `Generate`, whose tokens it streams back. A client cannot tell it from a
colocated server.

Backends (backends.py) come from addresses or DNS names, re-resolved periodically,
each watched with the gRPC health protocol; policies (policies.py) pick among them.
Failures before the client saw a token are retried once elsewhere; with no healthy prefill
instance the decode computes the prompt itself; a decode that fails mid-stream hands the
request to another (decode_leg.py), up to max_migrations times. Each instance a request is
sent to is a Lease (backends.py), counted until its call there ends. Each request's spans and
metrics: router_telemetry.py.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from baton.engine.common.errors import InvalidArgument
from baton.engine.common.block_hashes import ROOT_HASH, extend_block_hashes
from baton.services.router.backends import Backend, Lease, Tier, split_host_port
from baton.services.router.decode_leg import DecodeRoute, Relay, aborted_response, decode_leg, pass_on_or_take_out
from baton.services.router.kv_index import KVEventSubscription, KVIndex
from baton.services.router.policies import POLICIES, make_policy
from baton.services.router.router_runtime_api import RouterRuntime
from baton.services.router.router_telemetry import RouterTrace
from baton.services.rpc.names import ROUTER_LIVENESS, SERVICE_NAME, TOKEN_KEY, token_metadata
from baton.services.rpc.chat import chat_messages, chat_tools
from baton.services.rpc.errors import abort_invalid
from baton.services.rpc.fan_out import child_requests, merge, num_completions, retag
from baton.services.rpc.calls import CallRegistry
from baton.services.rpc.serving import drain, in_background, make_grpc_server, set_health
from baton.services.rpc.tls import TLSConfig
from baton.services.telemetry import tracing
from baton.services.telemetry.metrics import MetricsServer, RouterMetrics, make_registry
from baton.v1 import generate_pb2 as pb

log = logging.getLogger("baton.router")
_ABORTED = object()  # a prefill call ended by the Abort API

HASHING_POLICIES = ("prefix_affinity", "kv_aware")  # they hash the prompt's blocks as the engines do

# Client metadata that is the transport's own, not the application's, and is not forwarded.
_HOP_BY_HOP = ("user-agent", TOKEN_KEY)


@dataclass(slots=True)
class RouterOptions:
    prefill: list[str] = field(default_factory=list)  # HOST:PORT, the host an address or a DNS name
    decode: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 50051
    policy: str = "round_robin"
    internal_token: str | None = None
    tokenizer_dir: str | None = None  # prefix_affinity hashes token ids (without it, prompt bytes); kv_aware needs it
    block_size: int = 16  # the engines': affinity and kv_aware hash whole blocks as their prefix caches do
    affinity_blocks: int = 32  # deepest prefix (in blocks) the affinity table remembers
    affinity_load_factor: float = 1.5  # by affinity (or kv_aware), an instance takes at most this × the mean load,
    affinity_slack: int = 4  # or this many more requests than the least loaded one, whichever is more
    affinity_table_size: int = 100_000
    # kv_aware's weights (kv_aware.py): of a block held, of one held in host memory only (times the
    # first), and of a block in use by a request in flight (against 1 for a block queued for prefill).
    kv_overlap_score_weight: float = 8.0
    kv_host_hit_weight: float = 0.5
    kv_active_weight: float = 0.25
    resolve_interval_s: float = 5.0
    health_retry_s: float = 0.5
    max_message_bytes: int = 16 << 20
    grace_s: float = 10.0
    served_model_name: str | None = None  # in spans and metric labels; default: the tokenizer directory's name
    metrics_port: int | None = None  # /metrics over HTTP (0: any free port); None: none (http_port serves it too)
    otlp_traces_endpoint: str | None = None  # default: $OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT; none: no tracing
    http_port: int | None = None  # the OpenAI-compatible HTTP front, with /metrics (0: any free port); None: none
    max_migrations: int = 2  # moves of a request to another decode instance after failures
    max_in_flight: int | None = 4096  # streams at once; beyond it, RESOURCE_EXHAUSTED at once (None: no bound)
    tls: TLSConfig | None = None  # serve TLS, and call the backends over it

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.decode:
            raise ValueError("decode: at least one decode instance is needed")
        if self.policy == "kv_aware" and not self.tokenizer_dir:
            raise ValueError("tokenizer_dir: kv_aware hashes the prompt's token ids as the engines do; give the "
                             "checkpoint's directory (--model)")
        for name, low, high in (("kv_overlap_score_weight", 0, None), ("kv_host_hit_weight", 0, 1),
                                ("kv_active_weight", 0, None)):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and low <= value and (high is None or value <= high)):
                raise ValueError(f"{name}: must be a number >= {low}{f' and <= {high}' if high else ''}, got {value!r}")
        if self.max_in_flight is not None and not (isinstance(self.max_in_flight, int) and self.max_in_flight >= 1):
            raise ValueError(f"max_in_flight: must be an integer >= 1, got {self.max_in_flight!r}")
        if not (isinstance(self.max_migrations, int) and self.max_migrations >= 0):
            raise ValueError(f"max_migrations: must be an integer >= 0, got {self.max_migrations!r}")
        for addr in (*self.prefill, *self.decode):
            split_host_port(addr)


class RouterService(RouterRuntime):
    """baton.v1.TextGeneration: Generate's responses passed through as serialized bytes, and
    the runtime API (router_runtime_api.py)."""

    def __init__(self, router: Router):
        self.router = router

    async def Generate(self, msg: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        r = self.router
        if not msg.request_id:  # one id across both tiers, for their logs and traces
            msg.request_id = uuid.uuid4().hex
        # The router's to set: a client's handle would reach a decode with the stack's token.
        msg.ClearField("kv_handle")
        msg.ClearField("resume")
        if msg.request_id in r.calls.live:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {msg.request_id!r} is already in flight")
        bound = r.options.max_in_flight
        if bound is not None and r.num_in_flight >= bound:  # shed now, rather than queue past every deadline
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{r.num_in_flight} requests are in flight, the bound (max_in_flight) is {bound}")
        r.num_in_flight += 1
        ids = [msg.request_id]
        try:
            with RouterTrace(r.tracer, r.metrics, r.model_name, context, msg) as trace:
                try:
                    n = num_completions(msg)
                except InvalidArgument as e:
                    await abort_invalid(context, e)
                children = child_requests(msg, n) if n > 1 else [msg]
                ids = [child.request_id for child in children]
                r.calls.started(msg.request_id, ids)
                stream = self._generate(msg, context, trace) if n == 1 else merge(
                    [self._completion(child, i, msg.request_id, context, trace) for i, child in enumerate(children)])
                async for resp in stream:
                    trace.last = resp
                    yield resp
        finally:
            r.num_in_flight -= 1
            r.calls.ended(msg.request_id)
            for request_id in ids:
                r.routed.pop(request_id, None)
                r.aborted.discard(request_id)

    async def _completion(self, child: pb.GenerateRequest, index: int, request_id: str, context, trace):
        """One of n completions, each routed as a request of its own."""
        async for resp in self._generate(child, context, trace):
            yield retag(resp, request_id, index)

    async def _generate(self, msg: pb.GenerateRequest, context: grpc.aio.ServicerContext, trace: RouterTrace):
        r = self.router
        if not r.serving:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the router is starting or draining")
        metadata = r.forwarded_metadata(context)
        # Tokenizing for affinity takes a while on a long prompt: not on the event loop.
        hashes = await asyncio.to_thread(r.prefix_hashes, msg) if r.options.policy in HASHING_POLICIES else []
        relay = Relay(msg)  # before the prefill call: its first token is the client's too
        prefill_tried: list[Backend] = []
        reply = None
        while reply is None and len(prefill_tried) < 2:
            lease = r.pick(r.prefill, r.prefill_policy, hashes, trace, msg.request_id, prefill_tried, msg.adapter)
            if lease is None:
                break  # no prefill instance: the decode computes the prompt itself
            if prefill_tried:
                trace.retried("prefill")
            prefill_tried.append(lease.backend)
            reply = await self._prefill(lease, msg, metadata, context, trace)
        route = r.decode_route(msg, hashes, trace)
        if reply is None:
            trace.fallback("prefill_failed" if prefill_tried else "no_prefill")
            async for resp in decode_leg(route, msg, metadata, context, trace, relay):
                yield resp
            return
        if reply is _ABORTED or msg.request_id in r.aborted:  # by the Abort API, before the decode
            if reply is not _ABORTED and reply.HasField("handle"):
                in_background(r.background, r.release(prefill_tried[-1], reply.handle))
            yield aborted_response(msg)
            return
        trace.first_token()
        first = relay.forward(reply.first)  # it goes out now, while the decode pulls the KV
        if not reply.HasField("handle"):  # the first token ended the request
            yield first
            return
        msg.kv_handle.CopyFrom(reply.handle)

        def let_go() -> None:  # no decode will pull the prefill's blocks: tell it (best effort)
            in_background(r.background, r.release(prefill_tried[-1], reply.handle))
        try:
            yield first
        except BaseException:  # the client went away
            let_go()
            raise
        async for resp in decode_leg(route, msg, metadata, context, trace, relay, let_go):
            yield resp

    async def _prefill(self, lease: Lease, msg, metadata, context, trace: RouterTrace):
        """The prefill's reply, or None when the instance is unreachable."""
        prefill = lease.backend
        # Cancelled, or past the deadline, the prefill may still have answered with blocks held
        # for a reply that never arrives: let go of them by request id (a no-op when nothing is
        # held; the prefill keys its request by the id the router set).
        forget = pb.KVHandle(request_id=msg.request_id)
        span, metadata = trace.client_call("prefill", prefill, "Prefill", metadata)
        sent, error = time.monotonic(), None
        try:
            reply = await prefill.prefill.Prefill(msg, metadata=metadata, timeout=context.time_remaining())
            trace.prefill_answer(sent)
            return reply
        except asyncio.CancelledError as e:
            error = e
            in_background(self.router.background, self.router.release(prefill, forget))
            raise
        except grpc.aio.AioRpcError as e:
            error = e
            if e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                in_background(self.router.background, self.router.release(prefill, forget))
            if e.code() == grpc.StatusCode.ABORTED and msg.request_id in self.router.aborted:
                return _ABORTED
            await pass_on_or_take_out(prefill, e, context)
            log.warning("prefill %s failed for %s: %s", prefill.address, msg.request_id, e.details())
            return None
        finally:
            lease.end()
            trace.call_ended(span, "prefill", prefill, error)


def _handlers(service: RouterService) -> dict:
    """The service's methods; Generate's responses are bytes already."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["TextGeneration"].methods:
        request, response = getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(getattr(service, method.name), request_deserializer=request.FromString,
                                     response_serializer=(None if method.name == "Generate"
                                                          else response.SerializeToString))
    return handlers


class Router:
    def __init__(self, options: RouterOptions):
        self.options = o = options
        self.prefill = Tier("prefill", o.prefill, o.health_retry_s, self._health_changed, o.tls)
        self.decode = Tier("decode", o.decode, o.health_retry_s, self._health_changed, o.tls)
        # kv_aware: what every instance holds, from their KV events (one index for both tiers).
        self.kv_index = KVIndex(o.block_size) if o.policy == "kv_aware" else None
        self.kv_subscriptions: dict[str, KVEventSubscription] = {}  # backend address -> its stream
        self.prefill_policy, self.decode_policy = (
            make_policy(o.policy, o.affinity_load_factor, o.affinity_slack, o.affinity_table_size, self.kv_index,
                        (o.kv_overlap_score_weight, o.kv_host_hit_weight, o.kv_active_weight)) for _ in range(2))
        self.tokenizer = None
        self.model_name = o.served_model_name or (os.path.basename(os.path.normpath(o.tokenizer_dir))
                                                  if o.tokenizer_dir else "baton")
        self.tracer = tracing.make_tracer("router", f"router-{uuid.uuid4().hex[:12]}", o.otlp_traces_endpoint)
        # Metrics exist where they can be read: the metrics port, or the HTTP front's /metrics.
        registry = make_registry() if o.metrics_port is not None or o.http_port is not None else None
        self.metrics = (RouterMetrics(registry, self.model_name, lambda: self.num_in_flight)
                        if registry is not None else None)
        self.metrics_server = MetricsServer(registry, o.host, o.metrics_port) if o.metrics_port is not None else None
        self.health = health.aio.HealthServicer()
        self.grpc, self.port = make_grpc_server(o.host, o.port, o.max_message_bytes, tls=o.tls)
        service = self.service = RouterService(self)
        self.grpc.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE_NAME, _handlers(service))])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.grpc)
        self._resolver: asyncio.Task | None = None
        self._reported: bool | None = None  # the health last reported
        self.serving = False  # takes requests (between start and stop)
        self.num_in_flight = 0
        self.background: set[asyncio.Task] = set()
        self.http = None  # the OpenAI front, once started
        self.calls = CallRegistry()  # Generate calls in flight (by the client's id), for Abort
        self.routed: dict[str, set[Backend]] = {}  # a request id sent to backends -> where it went
        self.aborted: set[str] = set()  # ids of requests in flight that the Abort API ended

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    async def start(self) -> None:
        await self._report(False)
        await self.health.set(ROUTER_LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self.grpc.start()
        o = self.options
        if o.tokenizer_dir and (o.policy in HASHING_POLICIES or o.http_port is not None):
            from baton.engine.common.tokenizer import load_tokenizer
            self.tokenizer = await asyncio.to_thread(load_tokenizer, o.tokenizer_dir)
        await self._refresh()
        self._resolver = asyncio.ensure_future(self._resolve_periodically())
        if o.http_port is not None:
            from baton.services.openai.front import OpenAIFront
            self.http = OpenAIFront(self.service, o.host, o.http_port, lambda: self.serving, self.tokenizer, o.tls,
                                    self.metrics.registry if self.metrics is not None else None)
            await self.http.start()
        self.serving = True
        self._health_changed()

    async def _resolve_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.options.resolve_interval_s)
            await self._refresh()

    async def _refresh(self) -> None:
        """Resolve the tiers' names again; kv_aware: follow the KV events of each instance there is."""
        for tier in (self.prefill, self.decode):
            await tier.refresh()
            await asyncio.gather(*(b.refresh_adapters() for b in tier.healthy()))
        if self.kv_index is None:
            return
        backends = {b.address: b for b in self.backends()}
        for address in self.kv_subscriptions.keys() - backends.keys():
            await self.kv_subscriptions.pop(address).close()
        for address in backends.keys() - self.kv_subscriptions.keys():
            self.kv_subscriptions[address] = KVEventSubscription(self.kv_index, backends[address],
                                                                 self.options.internal_token)

    async def _report(self, serving: bool) -> None:
        if serving != self._reported:
            self._reported = serving
            await set_health(self.health, serving)

    def _health_changed(self) -> None:
        """The router serves while any decode instance does (it can then answer, colocated
        at worst)."""
        in_background(self.background, self._report(self.serving and bool(self.decode.healthy())))

    def pick(self, tier: Tier, policy, hashes: list[int], trace: RouterTrace, request_id: str,
             exclude=(), adapter: str = "") -> Lease | None:
        """A lease on a healthy instance of the tier, by the policy (None: there is none); for a
        LoRA adapter's request, among those that have it loaded (a prefill must: its KV is the
        adapter's; with no decode that has it, any decode, which answers NOT_FOUND naming the
        adapter)."""
        backends = tier.healthy(tuple(exclude))
        if adapter:
            having = [b for b in backends if adapter in b.adapters]
            backends = having if having or tier is self.prefill else backends
        if not backends:
            return None
        choice = policy.choose(backends, hashes)
        trace.picked(tier.name, self.options.policy, backends, choice)
        self.routed.setdefault(request_id, set()).add(choice.backend)  # where an Abort must go
        return Lease(choice.backend, request_id, choice.charge)

    def decode_route(self, msg: pb.GenerateRequest, hashes: list[int], trace: RouterTrace) -> DecodeRoute:
        """What the decode leg needs of the router for this request."""
        return DecodeRoute(
            lambda tried: self.pick(self.decode, self.decode_policy, hashes, trace, msg.request_id, tried, msg.adapter),
            self.decode.why_none, self.options.max_migrations, self.aborted)

    def prefix_hashes(self, msg: pb.GenerateRequest) -> list[int]:
        """Block hashes of the prompt's start (prefix affinity) or of all of it (kv_aware): of its
        token ids as the engines hash them when the router has the tokenizer, else of its UTF-8
        bytes."""
        o = self.options
        kind = msg.WhichOneof("prompt")
        if kind == "token_ids":
            units = list(msg.token_ids.ids)
        elif kind == "text":
            units = self.tokenizer.encode(msg.text) if self.tokenizer else list(msg.text.encode())
        elif kind == "chat":
            try:
                messages = chat_messages(msg.chat)
                if self.tokenizer is not None and self.tokenizer.chat_template and messages:
                    from baton.engine.common.tokenizer import apply_chat_template  # loaded with the tokenizer
                    units = apply_chat_template(self.tokenizer, messages, chat_tools(msg.chat))
                else:
                    units = list("\n".join(f"{m['role']}: {m['content']}" for m in messages).encode())
            except InvalidArgument:  # the engine refuses it, naming the field
                return []
        else:
            return []
        return extend_block_hashes([], units, o.block_size, None if o.policy == "kv_aware" else o.affinity_blocks,
                                   self.hash_root(msg.adapter))

    def backends(self) -> list[Backend]:
        """Every instance of both tiers, healthy or not."""
        return [b for tier in (self.prefill, self.decode) for b in tier.backends.values()]

    def hash_root(self, adapter: str) -> int:
        """Where the engines start a prompt's block-hash chain: a LoRA adapter's own root (as an
        instance that has it loaded says), else the base model's."""
        if adapter:
            for b in self.backends():
                if adapter in b.adapters:
                    return b.adapters[adapter].hash_root
        return ROOT_HASH

    def forwarded_metadata(self, context: grpc.aio.ServicerContext) -> tuple:
        md = [(k, v) for k, v in (context.invocation_metadata() or ())
              if not k.startswith((":", "grpc-")) and k not in _HOP_BY_HOP]
        return (*md, *token_metadata(self.options.internal_token))

    async def release(self, prefill: Backend, handle: pb.KVHandle) -> None:
        """Tell a prefill to let go of blocks nobody will pull (best effort: it frees them at
        its hold timeout anyway)."""
        try:
            await prefill.prefill.Release(handle, metadata=token_metadata(self.options.internal_token), timeout=5)
        except grpc.aio.AioRpcError as e:
            log.warning("could not release %s on %s: %s", handle.request_id, prefill.address, e.details())

    async def stop(self, grace_s: float | None = None) -> None:
        self.serving = False
        await self._report(False)
        await drain(self.grpc, lambda: self.num_in_flight, self.options.grace_s if grace_s is None else grace_s)
        if self.http is not None:
            await self.http.stop()
        if self._resolver is not None:
            self._resolver.cancel()
        for subscription in self.kv_subscriptions.values():
            await subscription.close()
        for tier in (self.prefill, self.decode):
            await tier.close()
        tracing.shutdown(self.tracer)
        if self.metrics_server is not None:
            self.metrics_server.close()
