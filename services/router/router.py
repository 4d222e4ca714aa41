"""The router: the public `Generate` API in front of prefill and decode instances.

For each request it picks a prefill and a decode instance, calls the prefill's internal
`Prefill`, forwards the first token to the client at once, and passes the KV handle on to
the decode's `Generate`, whose tokens it streams back (router_generation.py). A client cannot
tell it from a colocated server.

Backends (backends.py) come from addresses or DNS names, re-resolved periodically,
each watched with the gRPC health protocol; policies (policies.py) pick among them.
Failures before the client saw a token are retried once elsewhere; with no healthy prefill
instance the decode computes the prompt itself; a decode that fails mid-stream hands the
request to another (decode_leg.py), up to max_migrations times. Each request's spans and
metrics: router_telemetry.py. The runtime API beside Generate: router_runtime_api.py. This
module holds the options and puts those units together. Replicas of a router share nothing
but the Abort API: each passes an Abort for a call it does not carry to its `peers`.
"""
from __future__ import annotations

import asyncio
import logging
import os
import uuid
from dataclasses import dataclass, field

from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from baton.services.router.backends import Backend, Tier, split_host_port
from baton.services.router.in_flight import InFlight
from baton.services.router.kv_index import KVEventSubscription, KVIndex
from baton.services.router.policies import POLICIES, make_policy
from baton.services.router.prompt_hashes import HASHING_POLICIES, PromptHasher
from baton.services.router.router_generation import RouterGeneration
from baton.services.router.router_runtime_api import RouterRuntimeApi
from baton.services.router.workers import WorkerSlot, workers_registry
from baton.services.rpc.frames import FramesServer
from baton.services.rpc.generate_streams import GenerateStreams
from baton.services.rpc.names import ROUTER_LIVENESS, SERVICE_NAME, STREAMS_SERVICE_NAME
from baton.services.rpc.serving import add_text_generation, drain, in_background, make_grpc_server, set_health
from baton.services.rpc.tls import TLSConfig
from baton.services.telemetry import tracing
from baton.services.telemetry.metrics import MetricsServer, RouterMetrics, make_registry
from baton.v1 import generate_pb2_grpc, internal_pb2

log = logging.getLogger("baton.router")


@dataclass(slots=True)
class RouterOptions:
    prefill: list[str] = field(default_factory=list)  # HOST:PORT, the host an address or a DNS name
    decode: list[str] = field(default_factory=list)
    encoder: list[str] = field(default_factory=list)  # an encoder tier (E/P/D): image requests go through it first
    peers: list[str] = field(default_factory=list)  # the router's other replicas, for Abort (as prefill)
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
    # A decode instance's requests on one stream, answered in a message per step for all of them
    # (services/rpc/request_streams.py), rather than a Generate call each and a message per token;
    # a prefill instance's too (its Streams), rather than a Prefill call each.
    multiplex: bool = True
    # Those streams over a bare TCP connection (services/rpc/frames.py) where an instance listens
    # for frames, rather than over gRPC: the same messages at a third of the CPU each.
    frames: bool = True
    # The router's own GenerateStreams over frames, for clients that multiplex (services/client.py),
    # on host (0: any free port; a set of workers shares one); None: none. ModelInfo says where.
    frames_port: int | None = 0
    max_in_flight: int | None = 4096  # streams at once; beyond it, RESOURCE_EXHAUSTED at once (None: no bound)
    tls: TLSConfig | None = None  # serve TLS, and call the backends over it
    workers: int = 1  # router processes sharing the port (workers.py); more than 1: `baton serve` starts them
    worker: WorkerSlot | None = None  # set by workers.py in each of them: its own ports and its siblings'

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
        if not (isinstance(self.workers, int) and self.workers >= 1):
            raise ValueError(f"workers: must be an integer >= 1, got {self.workers!r}")
        if not (isinstance(self.max_migrations, int) and self.max_migrations >= 0):
            raise ValueError(f"max_migrations: must be an integer >= 0, got {self.max_migrations!r}")
        for addr in (*self.prefill, *self.decode, *self.encoder, *self.peers):
            split_host_port(addr)


class Router:
    """Listens at once (health answers NOT_SERVING until a decode instance is healthy), then
    routes. Its gRPC service is two units given what they need here: Generate
    (router_generation.py) and the runtime API (router_runtime_api.py)."""

    def __init__(self, options: RouterOptions):
        self.options = o = options
        self.prefill = Tier("prefill", o.prefill, o.health_retry_s, self._health_changed, o.tls, o.multiplex, o.frames)
        self.decode = Tier("decode", o.decode, o.health_retry_s, self._health_changed, o.tls, o.multiplex, o.frames)
        self.encoder = Tier("encoder", o.encoder, o.health_retry_s, lambda: None, o.tls)
        slot = o.worker
        peers = [*o.peers, *(slot.peers if slot is not None else ())]
        self.peers = Tier("router", peers, o.health_retry_s, lambda: None, o.tls)  # replicas and workers, for Abort
        # kv_aware: what every instance holds, from their KV events (one index for both tiers).
        self.kv_index = KVIndex(o.block_size) if o.policy == "kv_aware" else None
        self.kv_subscriptions: dict[str, KVEventSubscription] = {}  # backend address -> its stream
        policies = tuple(
            make_policy(o.policy, o.affinity_load_factor, o.affinity_slack, o.affinity_table_size, self.kv_index,
                        (o.kv_overlap_score_weight, o.kv_host_hit_weight, o.kv_active_weight)) for _ in range(2))
        # The checkpoint's tokenizer (loaded on start) and the prompt's hashes for the policy.
        self.prompts = PromptHasher(o.tokenizer_dir, o.block_size,
                                    None if o.policy == "kv_aware" else o.affinity_blocks)
        self.model_name = o.served_model_name or (os.path.basename(os.path.normpath(o.tokenizer_dir))
                                                  if o.tokenizer_dir else "baton")
        self.tracer = tracing.make_tracer("router", f"router-{uuid.uuid4().hex[:12]}", o.otlp_traces_endpoint)
        self.in_flight = InFlight(o.max_in_flight)  # Generate calls: counted, and where they went (for Abort)
        # Metrics exist where they can be read: the metrics port, or the HTTP front's /metrics.
        registry = make_registry() if o.metrics_port is not None or o.http_port is not None else None
        self.metrics = (RouterMetrics(registry, self.model_name, lambda: self.in_flight.count)
                        if registry is not None else None)
        # A worker's own metrics are on loopback, for its set's page (workers.py).
        self.metrics_server = (MetricsServer(registry, "127.0.0.1" if slot is not None else o.host, o.metrics_port)
                               if o.metrics_port is not None else None)
        # What the HTTP front's /metrics shows: this router's, or every worker's in a set.
        self.http_metrics = workers_registry(slot.metrics_ports) if slot and slot.metrics_ports else registry
        self.health = health.aio.HealthServicer()
        self.grpc, self.port = make_grpc_server(o.host, o.port, o.max_message_bytes, tls=o.tls,
                                                reuse_port=slot is not None,
                                                also=(f"127.0.0.1:{slot.grpc_port}",) if slot is not None else ())
        self.address = f"{o.host}:{self.port}"
        self.generation = RouterGeneration(
            self.prefill, self.decode, self.encoder, policies, o.policy,
            self.prompts if o.policy in HASHING_POLICIES else None, self.in_flight, self.tracer, self.metrics,
            self.model_name, o.internal_token, o.max_migrations, lambda: self.serving)
        self.runtime_api = RouterRuntimeApi(self.prefill, self.decode, self.in_flight, self.model_name, self.address,
                                            o.internal_token, self.peers, self.encoder)
        # Generate's responses pass through as the backends serialized them.
        add_text_generation(self.grpc, self.generation.Generate, self.runtime_api, generate_serialized=True)
        streams = GenerateStreams(self.generation.Generate)
        generate_pb2_grpc.add_GenerateStreamsServicer_to_server(streams, self.grpc)
        self.frames = (FramesServer({internal_pb2.FRAMES_SERVICE_GENERATE: streams}, o.max_message_bytes)
                       if o.frames_port is not None else None)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            [SERVICE_NAME, STREAMS_SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME],
            self.grpc)
        self._resolver: asyncio.Task | None = None
        self._reported: bool | None = None  # the health last reported
        self.serving = False  # takes requests (between start and stop)
        self.background: set[asyncio.Task] = set()
        self.http = None  # the OpenAI front, once started

    async def start(self) -> None:
        await self._report(False)
        await self.health.set(ROUTER_LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self.grpc.start()
        o = self.options
        if self.frames is not None:
            self.runtime_api.frames_port = await self.frames.start(o.host, o.frames_port, o.tls,
                                                                   reuse_port=o.worker is not None)
        if o.policy in HASHING_POLICIES or o.http_port is not None:
            await self.prompts.load()
        await self._refresh()
        self._resolver = asyncio.ensure_future(self._resolve_periodically())
        if o.http_port is not None:
            from baton.services.openai.front import OpenAIFront, ServiceCalls
            self.http = OpenAIFront(ServiceCalls.of(self.generation.Generate, self.runtime_api), o.host, o.http_port,
                                    lambda: self.serving, self.prompts.tokenizer, o.tls, self.http_metrics,
                                    reuse_port=o.worker is not None)
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
        await self.encoder.refresh()
        await self.peers.refresh()
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

    def backends(self) -> list[Backend]:
        """Every instance of both tiers, healthy or not."""
        return [b for tier in (self.prefill, self.decode) for b in tier.backends.values()]

    async def stop(self, grace_s: float | None = None) -> None:
        self.serving = False
        await self._report(False)
        await drain(self.grpc, lambda: self.in_flight.count, self.options.grace_s if grace_s is None else grace_s)
        if self.frames is not None:
            self.frames.close()
        if self.http is not None:
            await self.http.stop()
        if self._resolver is not None:
            self._resolver.cancel()
        for subscription in self.kv_subscriptions.values():
            await subscription.close()
        for tier in (self.prefill, self.decode, self.encoder, self.peers):
            await tier.close()
        tracing.shutdown(self.tracer)
        if self.metrics_server is not None:
            self.metrics_server.close()
