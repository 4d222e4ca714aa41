"""A Baton engine server: the front process of one engine, behind the public `Generate` API,
with the standard gRPC health and reflection services and a graceful drain. Its engine core
(scheduler, model, KV cache, NIXL agent) runs in a process of its own (engine/front/core_client.py starts it):
this process tokenizes, detokenizes, serves gRPC and HTTP and turns the core's events into
spans and metrics, and never waits on a step. As a prefill or decode tier it also serves the
internal calls of prefill.py and kv_peers.py. When the core dies the server reports
NOT_SERVING, fails its streams with UNAVAILABLE at once and sets `dead`, on which `baton
serve` exits non-zero for its supervisor to restart the pair."""
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

from baton.engine.common.config import EngineConfig
from baton.engine.common.core_messages import GetSnapshot, GetStats
from baton.engine.common.errors import check
from baton.engine.front.core_client import CoreClient
from baton.kv_transfer.base import DEFAULT_HOLD_TIMEOUT_S
from baton.services.rpc.calls import CallRegistry
from baton.services.rpc.frames import FramesServer
from baton.services.rpc.generate_streams import GenerateStreams
from baton.services.rpc.names import SERVICE_NAME, STREAMS_SERVICE_NAME
from baton.services.rpc.serving import (
    add_text_generation,
    advertised_host,
    drain,
    in_background,
    make_grpc_server,
    set_health,
)
from baton.services.rpc.tls import TLSConfig
from baton.services.server.call_checks import CallChecks
from baton.services.server.encoded_images import ChatImages
from baton.services.server.engine_runtime_api import EngineRuntimeApi
from baton.services.server.engine_telemetry import EngineTelemetry
from baton.services.server.generation import GenerationService
from baton.services.server.kv_event_hub import KVEventHub
from baton.services.server.kv_peers import KVPeers, KVPeerService
from baton.services.server.media import MediaOptions
from baton.services.server.prefill import PrefillService
from baton.services.server.snapshots import stats_to_proto
from baton.services.telemetry import tracing
from baton.services.telemetry.metrics import EngineMetrics, MetricsServer, make_registry, on_loop
from baton.v1 import generate_pb2_grpc, internal_pb2, internal_pb2_grpc

log = logging.getLogger("baton.server")

ROLES = ("both", "prefill", "decode")


@dataclass(slots=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port (Server.port says which)
    max_concurrent_streams: int | None = None  # per connection (HTTP/2 SETTINGS); None: gRPC's default
    max_message_bytes: int = 16 << 20
    max_waiting_requests: int | None = 1024  # beyond it, RESOURCE_EXHAUSTED
    grace_s: float = 10.0  # on stop, in-flight streams get this long to finish before they are aborted
    role: str = "both"  # prefill: also serves Prefill; decode: takes KV handles; both: either
    internal_token: str | None = None  # required in TOKEN_KEY metadata of internal calls when set
    kv_hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S  # prefill: free blocks nobody pulled by then
    engine_id: str | None = None  # the NIXL agent's name; default: role + a random suffix
    served_model_name: str | None = None  # in spans and metric labels; default: the model directory's name
    metrics_port: int | None = None  # /metrics over HTTP (0: any free port); None: none (http_port serves it too)
    otlp_traces_endpoint: str | None = None  # default: $OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT; none: no tracing
    http_port: int | None = None  # the OpenAI-compatible HTTP front, with /metrics (0: any free port); None: none
    tls: TLSConfig | None = None  # serve TLS (mTLS with a CA), and call peers over it
    advertise_host: str | None = None  # in KV handles; default: host, or this host's IP when host is a wildcard
    stream_interval: int = 1  # new tokens a stream's message carries, the first and last aside (CoreClient's)
    frames_port: int | None = 0  # streams of requests over bare TCP (frames.py), on host (0: any free port); None: none
    media: MediaOptions = field(default_factory=MediaOptions)  # where a vision-language model's images come from

    def __post_init__(self):
        check(self.role in ROLES, "role", f"must be one of {', '.join(ROLES)}, got {self.role!r}")
        check(self.http_port is None or self.role == "both", "http_port",
              "the OpenAI front serves on a colocated server or the router, not on one tier")
        check(isinstance(self.stream_interval, int) and self.stream_interval >= 1, "stream_interval",
              f"must be an integer >= 1, got {self.stream_interval!r}")


class AdminService(internal_pb2_grpc.AdminServicer):
    """The stack's own calls: the engine's counters (Stats) and its KV cache events (for a
    router's index)."""

    def __init__(self, core: CoreClient, role: str, checks: CallChecks, kv_events: KVEventHub):
        self.core = core
        self.role = role
        self.checks = checks
        self.kv_events = kv_events

    async def Stats(self, msg: internal_pb2.StatsRequest, context: grpc.aio.ServicerContext):
        await self.checks.internal(context)
        core = self.core
        return stats_to_proto(await core.call(GetStats()), self.role, core.num_in_flight, core.num_requests, core.pid)

    async def SubscribeKVEvents(self, msg: internal_pb2.SubscribeKVEventsRequest, context: grpc.aio.ServicerContext):
        await self.checks.internal(context)
        async for batch in self.kv_events.subscribe():
            yield batch


class Server:
    """Listens at once (health answers NOT_SERVING while the model loads), then serves. Each
    service on its gRPC server is a unit given what it needs here: the engine core's client,
    the checks a call must pass (call_checks.py), the calls in flight, the telemetry."""

    def __init__(self, config: EngineConfig, options: ServerOptions | None = None):
        self.config = config
        self.options = o = options or ServerOptions()
        self.serving = False
        self.dead = asyncio.Event()  # the engine core died: the process should exit
        self.health = health.aio.HealthServicer()
        streams = [("grpc.max_concurrent_streams", o.max_concurrent_streams)] if o.max_concurrent_streams else []
        self.grpc, self.port = make_grpc_server(o.host, o.port, o.max_message_bytes, streams, o.tls)
        self.address = f"{advertised_host(o.host, o.advertise_host)}:{self.port}"  # peers': in its KV handles
        self.engine_id = o.engine_id or f"{o.role}-{uuid.uuid4().hex[:12]}"
        self.model_name = o.served_model_name or os.path.basename(os.path.normpath(config.model))
        self.tracer = tracing.make_tracer(o.role, self.engine_id, o.otlp_traces_endpoint)
        self.telemetry = EngineTelemetry(self.tracer, self.model_name)
        # Metrics exist where they can be read: the metrics port, or the HTTP front's /metrics.
        self.metrics_registry = make_registry() if o.metrics_port is not None or o.http_port is not None else None
        self.metrics_server = (MetricsServer(self.metrics_registry, o.host, o.metrics_port)
                               if o.metrics_port is not None else None)
        self.background: set[asyncio.Task] = set()
        self.kv_events = KVEventHub(self.engine_id, config.block_size)  # for a router's index (kv_event_hub.py)
        # The core's process starts with start(); until it has loaded, calls that need it are refused.
        self.core = CoreClient(config, self.engine_id, o.kv_hold_timeout_s, o.max_waiting_requests,
                               on_dead=self._on_core_dead,
                               on_step=self.telemetry.on_step if self.tracer or self.metrics_registry else None,
                               on_kv_events=self.kv_events.publish, stream_interval=o.stream_interval)
        checks = CallChecks(self.core, o.internal_token, lambda: self.serving)
        calls = CallRegistry()  # Generate and Prefill calls in flight, for Abort
        self.kv_peers = KVPeers(self.core, o.tls, o.internal_token)
        self.images = ChatImages(self.engine_id, o.media)  # a chat's images, or an encoder tier's embeddings of them
        self.generation = GenerationService(self.core, o.role, checks, calls, self.telemetry, self.kv_peers,
                                            self.images)
        self.runtime_api = EngineRuntimeApi(self.core, o.role, checks, calls, config.model, self.model_name,
                                            self.address)
        add_text_generation(self.grpc, self.generation.Generate, self.runtime_api)
        internal_pb2_grpc.add_KVPeerServicer_to_server(KVPeerService(self.core, checks), self.grpc)
        internal_pb2_grpc.add_AdminServicer_to_server(AdminService(self.core, o.role, checks, self.kv_events),
                                                      self.grpc)
        # Generate, many requests on one stream (a router's to this decode, a client's), on the
        # gRPC port and on the frames listener.
        generate_streams = GenerateStreams(self.generation.Generate)
        generate_pb2_grpc.add_GenerateStreamsServicer_to_server(generate_streams, self.grpc)
        frames_services = {internal_pb2.FRAMES_SERVICE_GENERATE: generate_streams}
        services = [SERVICE_NAME, STREAMS_SERVICE_NAME,
                    *(internal_pb2.DESCRIPTOR.services_by_name[n].full_name for n in ("KVPeer", "Admin"))]
        if o.role != "decode":
            prefill = PrefillService(self.core, o.role, checks, calls, self.telemetry, self.address, self.images)
            internal_pb2_grpc.add_PrefillServicer_to_server(prefill, self.grpc)
            frames_services[internal_pb2.FRAMES_SERVICE_PREFILL] = prefill.streams
            services.append(internal_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            [*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], self.grpc)
        self.frames = FramesServer(frames_services, o.max_message_bytes) if o.frames_port is not None else None
        self.http = None  # the OpenAI front, once started

    async def start(self) -> None:
        """Listen, start the engine core (it loads the model), then report SERVING."""
        await set_health(self.health, False)
        await self.grpc.start()
        o = self.options
        if self.frames is not None:
            self.runtime_api.frames_port = await self.frames.start(o.host, o.frames_port, o.tls)
        facts = await self.core.start()
        self.config.max_model_len = facts.max_model_len  # resolved by the core
        metrics = None
        if self.metrics_registry is not None:
            loop = asyncio.get_running_loop()
            metrics = EngineMetrics(self.metrics_registry, self.model_name, o.role, facts.max_model_len,
                                    lambda: self._snapshot(loop))
        self.telemetry.engine_loaded(facts.kv_layout.block_bytes, metrics)
        if o.http_port is not None:
            from baton.services.openai.front import OpenAIFront, ServiceCalls
            self.http = OpenAIFront(ServiceCalls.of(self.generation.Generate, self.runtime_api), o.host, o.http_port,
                                    lambda: self.serving, self.core.tokenizer, o.tls, self.metrics_registry)
            await self.http.start()
        self.serving = True
        await set_health(self.health, True)
        log.info("serving %s on %s (engine core: pid %d, %s)", self.config.model, self.address, facts.pid, facts.device)

    def _snapshot(self, loop: asyncio.AbstractEventLoop):
        """The engine's figures for a scrape (from the HTTP thread), or None when it cannot answer."""
        if not self.serving:
            return None
        try:
            return on_loop(loop, lambda: self.core.call(GetSnapshot()))
        except Exception:  # noqa: BLE001 - a scrape during shutdown, or a dead core: no load figures
            return None

    def _on_core_dead(self, error: BaseException) -> None:
        self.serving = False
        in_background(self.background, set_health(self.health, False))
        self.dead.set()

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: report NOT_SERVING, refuse new calls, give in-flight streams the grace period
        to finish, then cancel the rest (which aborts them in the engine); stop the core."""
        self.serving = False
        await set_health(self.health, False)
        await drain(self.grpc, lambda: self.core.num_in_flight, self.options.grace_s if grace_s is None else grace_s)
        if self.frames is not None:
            self.frames.close()
        if self.http is not None:
            await self.http.stop()
        await self.kv_peers.close()
        self.images.close()
        await self.core.stop()
        self.telemetry.close(time.monotonic())
        tracing.shutdown(self.tracer)
        if self.metrics_server is not None:
            self.metrics_server.close()
