"""The router's view of its backends: the instances of a tier, from addresses and DNS names
(a Kubernetes headless service resolves to its pods) re-resolved periodically, each with its
channel, its health (watched with the gRPC health protocol) and its requests in flight."""
from __future__ import annotations

import asyncio
import logging
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.services.rpc.frames import FramesOpener
from baton.services.rpc.names import GENERATE_METHOD, PREFILL_METHOD, PREFILL_STREAMS_METHOD, SERVICE_NAME
from baton.services.rpc.request_streams import RequestStreams
from baton.services.rpc.tls import aio_channel
from baton.v1 import generate_pb2 as pb
from baton.v1 import generate_pb2_grpc, internal_pb2, internal_pb2_grpc

log = logging.getLogger("baton.router")

# Reconnect quickly to a backend that comes back (gRPC's default backoff grows to 2 minutes).
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                    ("grpc.max_reconnect_backoff_ms", 2000)]

def split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"backend address {address!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def addresses(infos, port: int) -> list[str]:
    """HOST:PORT of each getaddrinfo result (IPv6 in brackets)."""
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for *_, (ip, *_rest) in infos]


class Backend:
    """One instance: a channel, its stubs, its health, and the requests it has in flight."""

    def __init__(self, address: str, retry_s: float, on_health_change, tls=None, multiplex: bool = False,
                 frames: bool = False):
        self.address = address
        self.tls = tls
        self.frames = frames and multiplex  # its streams over frames, where it listens for them
        self.channel = aio_channel(address, tls, _CHANNEL_OPTIONS)
        # Responses stay bytes: the router forwards them as they came unless it must change one
        # (Relay.forward keeps them, read for their token ids when needed, and re-encodes only to strip them).
        self.generate = self.channel.unary_stream(GENERATE_METHOD,
                                                  request_serializer=pb.GenerateRequest.SerializeToString,
                                                  response_deserializer=None)
        # Its requests, many on one stream (request_streams.py): a decode's Generate, a prefill's
        # Prefill (read as a call streaming its one response, as bytes); None: a call each.
        self.streams = RequestStreams(self.channel, self.generate) if multiplex else None
        self._prefill = self.channel.unary_stream(
            PREFILL_METHOD, request_serializer=pb.GenerateRequest.SerializeToString, response_deserializer=None)
        self.prefills = RequestStreams(self.channel, self._prefill, PREFILL_STREAMS_METHOD) if multiplex else None
        self.prefill = internal_pb2_grpc.PrefillStub(self.channel)  # (Release)
        self.encoder = internal_pb2_grpc.EncoderStub(self.channel)  # (an encoder tier's)
        self.api = generate_pb2_grpc.TextGenerationStub(self.channel)  # the runtime API
        self.healthy = False
        self.ever_served = False  # reported SERVING at least once: not starting any more
        self.adapters: dict[str, pb.Adapter] = {}  # LoRA adapters loaded there, by name (ListAdapters)
        self.outstanding = 0
        self.num_routed = 0
        # The load kv_aware weighs (Dynamo's router keeps the same ledger of what it sent where):
        self.queued_prefill_blocks = 0  # prompt blocks sent here whose first token has not come back
        self.active_blocks = 0  # prompt blocks of the requests in flight here
        self._charges: dict[str, list[int]] = {}  # request id -> [queued, active] it added
        self._retry_s = retry_s
        self._on_health_change = on_health_change
        self._watch: asyncio.Task | None = None

    def charge(self, request_id: str, charge: tuple[int, int]) -> None:
        """A request went here, adding (blocks to compute, blocks in all) to its load."""
        if charge != (0, 0):
            self.settle(request_id)
            self._charges[request_id] = list(charge)
            self.queued_prefill_blocks += charge[0]
            self.active_blocks += charge[1]

    def prefilled(self, request_id: str) -> None:
        """The request's first token came back: its prompt is computed."""
        c = self._charges.get(request_id)
        if c is not None:
            self.queued_prefill_blocks -= c[0]
            c[0] = 0

    def settle(self, request_id: str) -> None:
        """The request's call here ended."""
        self.prefilled(request_id)
        c = self._charges.pop(request_id, None)
        if c is not None:
            self.active_blocks -= c[1]

    def start(self) -> None:
        self._watch = asyncio.ensure_future(self._watch_health())

    def _set_healthy(self, healthy: bool) -> None:
        if healthy != self.healthy:
            self.healthy = healthy
            self.ever_served = self.ever_served or healthy
            log.info("%s is %s", self.address, "healthy" if healthy else "unhealthy")
            if healthy:  # a new or restarted instance: what it has loaded now (then every resolve interval)
                self._adapters_task = asyncio.ensure_future(self.refresh_adapters())
            self._on_health_change()

    async def refresh_adapters(self) -> None:
        try:
            listed = await self.api.ListAdapters(pb.ListAdaptersRequest(), timeout=2)
        except grpc.aio.AioRpcError:  # unreachable: its health watch takes it out; keep what it had
            return
        self.adapters = {a.name: a for a in listed.adapters}

    def adapter_loaded(self, adapter: pb.Adapter) -> None:
        """The router had it load `adapter` (LoadAdapter): routable there before the next refresh."""
        self.adapters[adapter.name] = adapter

    def adapter_unloaded(self, name: str) -> None:
        self.adapters.pop(name, None)

    async def _use_frames(self) -> None:
        """Where the instance takes streams of requests over frames (its ModelInfo says): the
        streams there go so from their next start (an instance that comes back may listen on
        another port, or on none)."""
        try:
            info = await self.api.GetModelInfo(pb.GetModelInfoRequest(), timeout=2)
        except grpc.aio.AioRpcError as e:
            log.warning("%s: no model info (%s): its streams go over gRPC", self.address, e.details())
            info = pb.ModelInfo()
        host, _ = split_host_port(self.address)
        for streams, service in ((self.streams, internal_pb2.FRAMES_SERVICE_GENERATE),
                                 (self.prefills, internal_pb2.FRAMES_SERVICE_PREFILL)):
            streams.frames = FramesOpener(host, info.frames_port, service, self.tls) if info.frames_port else None

    async def _watch_health(self) -> None:
        stub = health_pb2_grpc.HealthStub(self.channel)
        while True:
            try:
                async for resp in stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME)):
                    serving = resp.status == health_pb2.HealthCheckResponse.SERVING
                    if serving and not self.healthy and self.frames:  # (before a request can go there)
                        await self._use_frames()
                    self._set_healthy(serving)
            except grpc.aio.AioRpcError:
                pass
            self._set_healthy(False)
            await asyncio.sleep(self._retry_s)

    def open_generate(self, msg: pb.GenerateRequest, metadata: tuple, timeout: float | None):
        """The request's Generate here: on the instance's stream of requests, or a call of its own.
        Either is read as a call (decode_leg.py)."""
        if self.streams is not None:
            return self.streams.open(msg, metadata, timeout)
        return self.generate(msg, metadata=metadata, timeout=timeout)

    def open_prefill(self, msg: pb.GenerateRequest, metadata: tuple, timeout: float | None):
        """The request's Prefill here, as open_generate opens a Generate: its one response is a
        serialized PrefillResponse."""
        if self.prefills is not None:
            return self.prefills.open(msg, metadata, timeout)
        return self._prefill(msg, metadata=metadata, timeout=timeout)

    def failed(self) -> None:
        """A call found it unreachable: out at once, back when its health watch says so."""
        self._set_healthy(False)
        if self._watch is not None:
            self._watch.cancel()
            self.start()

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        for streams in (self.streams, self.prefills):
            if streams is not None:
                streams.close()
        await self.channel.close(grace=None)


class Lease:
    """One request's claim on one backend, from the router's pick to the end of its call there:
    counted in the backend's requests in flight (and kv_aware's ledger) until `end`, which
    takes effect once however often it is called."""
    __slots__ = ("backend", "request_id", "_ended")

    def __init__(self, backend: Backend, request_id: str, charge: tuple[int, int]):
        self.backend, self.request_id, self._ended = backend, request_id, False
        backend.outstanding += 1
        backend.num_routed += 1
        backend.charge(request_id, charge)

    def prefilled(self) -> None:
        """Its first token came back: its prompt no longer queues there."""
        self.backend.prefilled(self.request_id)

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self.backend.outstanding -= 1
            self.backend.settle(self.request_id)


class Tier:
    """The instances of one role, from addresses and DNS names, kept up to date."""

    def __init__(self, name: str, specs: list[str], health_retry_s: float, on_health_change, tls=None,
                 multiplex: bool = False, frames: bool = False):
        self.name = name
        self.tls = tls
        self.multiplex = multiplex  # Generate requests go on each instance's stream of requests
        self.frames = frames  # ... over frames, where the instance listens for them
        self.specs = [split_host_port(s) for s in specs]
        self.backends: dict[str, Backend] = {}
        self._health_retry_s = health_retry_s
        self._on_health_change = on_health_change

    def healthy(self, exclude: tuple[Backend, ...] = ()) -> list[Backend]:
        return [b for b in self.backends.values() if b.healthy and b not in exclude]

    def why_none(self) -> str:
        """Why no instance of the tier can take a request: still starting (none has served yet),
        or none serving now."""
        ready, known = len(self.healthy()), len(self.backends)
        if known and not any(b.ever_served for b in self.backends.values()):
            return f"{self.name} tier starting: {ready} of {known} ready"
        return f"no healthy {self.name} instance ({known} known, {ready} serving)"

    async def refresh(self) -> None:
        """Resolve every name again: add the new addresses, drop the ones that went away."""
        loop = asyncio.get_running_loop()
        found: list[str] = []
        for host, port in self.specs:
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:  # keep what the name gave before
                log.warning("cannot resolve %s backend %s: %s", self.name, host, e)
                found += [a for a in self.backends if a.endswith(f":{port}")]
                continue
            found += addresses(infos, port)
        wanted = dict.fromkeys(found)
        for address in wanted.keys() - self.backends.keys():
            backend = self.backends[address] = Backend(address, self._health_retry_s,
                                                       self._on_health_change, self.tls, self.multiplex, self.frames)
            backend.start()
        for address in self.backends.keys() - wanted.keys():
            log.info("%s backend %s is gone from DNS", self.name, address)
            await self.backends.pop(address).close()

    async def close(self) -> None:
        for backend in self.backends.values():
            await backend.close()
        self.backends.clear()
