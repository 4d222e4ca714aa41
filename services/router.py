"""The router: the public `Generate` API in front of prefill and decode instances.

For each request it picks a prefill and a decode instance, calls the prefill's internal
`Prefill`, forwards the first token to the client at once, and passes the KV handle on to
the decode's `Generate`, whose tokens it streams back. A client cannot tell it from a
colocated server.

Backends come from addresses or DNS names (a Kubernetes headless service resolves to its
pods), re-resolved periodically; each is watched with the gRPC health protocol. Failures
before the client saw a token are retried once elsewhere; with no healthy prefill instance
the decode computes the prompt itself; after the first token a failure is UNAVAILABLE.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from baton.engine.kv_cache_manager import extend_block_hashes
from baton.services.common import (POLICIES, SERVICE_NAME, TOKEN_KEY, chat_messages, drain, in_background,
                                   make_grpc_server, set_health, token_metadata)
from baton.v1 import generate_pb2 as pb
from baton.v1 import internal_pb2_grpc

log = logging.getLogger("baton.router")

GENERATE_METHOD = f"/{SERVICE_NAME}/Generate"
# Reconnect quickly to a backend that comes back (gRPC's default backoff grows to 2 minutes).
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                    ("grpc.max_reconnect_backoff_ms", 2000)]
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
    tokenizer_dir: str | None = None  # prefix_affinity hashes token ids; without it, prompt bytes
    block_size: int = 16  # the engines': affinity hashes whole blocks as their prefix caches do
    affinity_blocks: int = 32  # deepest prefix (in blocks) the affinity table remembers
    affinity_load_factor: float = 1.5  # by affinity, an instance takes at most this × the mean load,
    affinity_slack: int = 4  # or this many more requests than the least loaded one, whichever is more
    affinity_table_size: int = 100_000
    resolve_interval_s: float = 5.0
    health_retry_s: float = 0.5
    max_message_bytes: int = 16 << 20
    grace_s: float = 10.0

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.decode:
            raise ValueError("decode: at least one decode instance is needed")
        for addr in (*self.prefill, *self.decode):
            split_host_port(addr)


def split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"backend address {address!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


class Backend:
    """One instance: a channel, its stubs, its health, and the requests it has in flight."""

    def __init__(self, address: str, retry_s: float, on_health_change):
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        # Responses stay bytes: the router forwards them without parsing them again.
        self.generate = self.channel.unary_stream(GENERATE_METHOD, request_serializer=pb.GenerateRequest.SerializeToString,
                                                  response_deserializer=None)
        self.prefill = internal_pb2_grpc.PrefillStub(self.channel)
        self.healthy = False
        self.outstanding = 0
        self.num_routed = 0
        self._retry_s = retry_s
        self._on_health_change = on_health_change
        self._watch: asyncio.Task | None = None

    def start(self) -> None:
        self._watch = asyncio.ensure_future(self._watch_health())

    def _set_healthy(self, healthy: bool) -> None:
        if healthy != self.healthy:
            self.healthy = healthy
            log.info("%s is %s", self.address, "healthy" if healthy else "unhealthy")
            self._on_health_change()

    async def _watch_health(self) -> None:
        stub = health_pb2_grpc.HealthStub(self.channel)
        while True:
            try:
                async for resp in stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME)):
                    self._set_healthy(resp.status == health_pb2.HealthCheckResponse.SERVING)
            except grpc.aio.AioRpcError:
                pass
            self._set_healthy(False)
            await asyncio.sleep(self._retry_s)

    def failed(self) -> None:
        """A call found it unreachable: out at once, back when its health watch says so."""
        self._set_healthy(False)
        if self._watch is not None:
            self._watch.cancel()
            self.start()

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await self.channel.close(grace=None)


class Tier:
    """The instances of one role, from addresses and DNS names, kept up to date."""

    def __init__(self, name: str, specs: list[str], options: RouterOptions, on_health_change):
        self.name = name
        self.specs = [split_host_port(s) for s in specs]
        self.backends: dict[str, Backend] = {}
        self._options = options
        self._on_health_change = on_health_change

    def healthy(self, exclude: tuple[Backend, ...] = ()) -> list[Backend]:
        return [b for b in self.backends.values() if b.healthy and b not in exclude]

    async def refresh(self) -> None:
        """Resolve every name again: add the new addresses, drop the ones that went away."""
        loop = asyncio.get_running_loop()
        addresses: list[str] = []
        for host, port in self.specs:
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as e:  # keep what the name gave before
                log.warning("cannot resolve %s backend %s: %s", self.name, host, e)
                addresses += [a for a in self.backends if a.endswith(f":{port}")]
                continue
            for *_, sockaddr in infos:
                ip = sockaddr[0]
                addresses.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
        wanted = dict.fromkeys(addresses)
        for address in wanted.keys() - self.backends.keys():
            backend = self.backends[address] = Backend(address, self._options.health_retry_s,
                                                       self._on_health_change)
            backend.start()
        for address in self.backends.keys() - wanted.keys():
            log.info("%s backend %s is gone from DNS", self.name, address)
            await self.backends.pop(address).close()

    async def close(self) -> None:
        for backend in self.backends.values():
            await backend.close()
        self.backends.clear()


class RoundRobin:
    def __init__(self):
        self._counter = itertools.count()

    def choose(self, backends: list[Backend], hashes: list[int]) -> Backend:
        ordered = sorted(backends, key=lambda b: b.address)  # stable under health flaps
        return ordered[next(self._counter) % len(ordered)]


class LeastOutstanding:
    def choose(self, backends: list[Backend], hashes: list[int]) -> Backend:
        return min(backends, key=lambda b: (b.outstanding, b.num_routed))


class PrefixAffinity:
    """The instance that last served the longest matching prefix (so its prefix cache hits),
    unless that would load it beyond `load_factor` × the mean and `slack` above the least
    loaded: then the least loaded, which the prefix then follows."""

    def __init__(self, load_factor: float, slack: int, table_size: int):
        self.load_factor = load_factor
        self.slack = slack
        self.table_size = table_size
        self._table: OrderedDict[int, str] = OrderedDict()  # block hash -> address, LRU order
        self._fallback = LeastOutstanding()

    def choose(self, backends: list[Backend], hashes: list[int]) -> Backend:
        by_address = {b.address: b for b in backends}
        loads = [b.outstanding for b in backends]
        bound = max(self.load_factor * (sum(loads) + 1) / len(backends), min(loads) + self.slack)
        chosen = None
        for h in reversed(hashes):  # deepest match first
            backend = by_address.get(self._table.get(h))
            if backend is not None:
                chosen = backend if backend.outstanding + 1 <= bound else None
                break
        chosen = chosen or self._fallback.choose(backends, hashes)
        for h in hashes:
            self._table[h] = chosen.address
            self._table.move_to_end(h)
        while len(self._table) > self.table_size:
            self._table.popitem(last=False)
        return chosen


def make_policy(options: RouterOptions):
    if options.policy == "round_robin":
        return RoundRobin()
    if options.policy == "least_outstanding":
        return LeastOutstanding()
    return PrefixAffinity(options.affinity_load_factor, options.affinity_slack, options.affinity_table_size)


async def _pass_on_or_take_out(backend: Backend, e: grpc.aio.AioRpcError, context) -> None:
    """An error from a backend call. The request's own (or its prefill's, named `kv_handle`)
    goes to the client as it is; an unreachable backend is taken out, and the caller decides
    between another instance and UNAVAILABLE."""
    if e.code() != grpc.StatusCode.UNAVAILABLE or e.details().startswith("kv_handle"):
        await context.abort(e.code(), e.details())
    backend.failed()


def _end_call(backend: Backend, call) -> None:
    backend.outstanding -= 1
    if not call.done():  # the client went away (cancel, deadline): stop the backend's work too
        call.cancel()


class RouterService:
    """baton.v1.TextGeneration, its responses passed through as serialized bytes."""

    def __init__(self, router: Router):
        self.router = router

    async def Generate(self, msg: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        self.router.num_in_flight += 1
        try:
            async for resp in self._generate(msg, context):
                yield resp
        finally:
            self.router.num_in_flight -= 1

    async def _generate(self, msg: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        r = self.router
        if not r.serving:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the router is starting or draining")
        if not msg.request_id:  # one id across both tiers, for their logs and traces
            msg.request_id = uuid.uuid4().hex
        metadata = r.forwarded_metadata(context)
        # Tokenizing for affinity takes a while on a long prompt: not on the event loop.
        hashes = await asyncio.to_thread(r.prefix_hashes, msg) if r.options.policy == "prefix_affinity" else []
        prefill_tried: list[Backend] = []
        reply = None
        while reply is None and len(prefill_tried) < 2:
            prefill = r.pick(r.prefill, r.prefill_policy, hashes, prefill_tried)
            if prefill is None:
                break  # no prefill instance: the decode computes the prompt itself
            prefill_tried.append(prefill)
            reply = await self._prefill(prefill, msg, metadata, context)
        if reply is None:
            async for resp in self._colocated(msg, hashes, metadata, context):
                yield resp
            return
        if not reply.HasField("handle"):  # the first token ended the request
            yield reply.first.SerializeToString()
            return
        msg.kv_handle.CopyFrom(reply.handle)
        decode = r.pick(r.decode, r.decode_policy, hashes)
        if decode is None:
            await r.release(prefill_tried[-1], reply.handle)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy decode instance")
        call = decode.generate(msg, metadata=metadata, timeout=context.time_remaining())
        pulled = False  # the decode's first response means it has the blocks
        try:
            yield reply.first.SerializeToString()  # the first token goes out while the decode pulls the KV
            async for resp in call:
                pulled = True
                yield resp
        except grpc.aio.AioRpcError as e:
            await _pass_on_or_take_out(decode, e, context)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"decode instance {decode.address} failed after the first token "
                                f"({e.details()}); the request cannot resume: send it again")
        finally:
            _end_call(decode, call)
            if not pulled:  # the blocks may still be held for a reader that will never come
                in_background(r.background, r.release(prefill_tried[-1], reply.handle))

    async def _prefill(self, prefill: Backend, msg, metadata, context):
        """The prefill's reply, or None when the instance is unreachable."""
        # Cancelled, or past the deadline, the prefill may still have answered with blocks held
        # for a reply that never arrives: let go of them by request id (a no-op when nothing is
        # held; the prefill keys its request by the id the router set).
        forget = pb.KVHandle(request_id=msg.request_id)
        try:
            return await prefill.prefill.Prefill(msg, metadata=metadata, timeout=context.time_remaining())
        except asyncio.CancelledError:
            in_background(self.router.background, self.router.release(prefill, forget))
            raise
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                in_background(self.router.background, self.router.release(prefill, forget))
            await _pass_on_or_take_out(prefill, e, context)
            log.warning("prefill %s failed for %s: %s", prefill.address, msg.request_id, e.details())
            return None
        finally:
            prefill.outstanding -= 1

    async def _colocated(self, msg, hashes, metadata, context):
        """The decode instance runs the whole request; one retry elsewhere before a token."""
        r, tried = self.router, []
        while True:
            decode = r.pick(r.decode, r.decode_policy, hashes, tried)
            if decode is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy decode instance" +
                                    (f" (tried {', '.join(b.address for b in tried)})" if tried else ""))
            tried.append(decode)
            call = decode.generate(msg, metadata=metadata, timeout=context.time_remaining())
            started = False
            try:
                async for resp in call:
                    started = True
                    yield resp
                return
            except grpc.aio.AioRpcError as e:
                await _pass_on_or_take_out(decode, e, context)
                if started or len(tried) == 2:
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        f"decode instance {decode.address} failed: {e.details()}")
            finally:
                _end_call(decode, call)


class Router:
    def __init__(self, options: RouterOptions):
        self.options = o = options
        self.prefill = Tier("prefill", o.prefill, o, self._health_changed)
        self.decode = Tier("decode", o.decode, o, self._health_changed)
        self.prefill_policy, self.decode_policy = make_policy(o), make_policy(o)
        self.tokenizer = None
        self.health = health.aio.HealthServicer()
        self.grpc, self.port = make_grpc_server(o.host, o.port, o.max_message_bytes)
        service = RouterService(self)
        self.grpc.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                service.Generate, request_deserializer=pb.GenerateRequest.FromString, response_serializer=None)})])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.grpc)
        self._resolver: asyncio.Task | None = None
        self._reported: bool | None = None  # the health last reported
        self.serving = False  # takes requests (between start and stop)
        self.num_in_flight = 0
        self.background: set[asyncio.Task] = set()

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    async def start(self) -> None:
        await self._report(False)
        await self.grpc.start()
        if self.options.tokenizer_dir and self.options.policy == "prefix_affinity":
            from baton.engine.tokenizer import load_tokenizer
            self.tokenizer = await asyncio.to_thread(load_tokenizer, self.options.tokenizer_dir)
        for tier in (self.prefill, self.decode):
            await tier.refresh()
        self._resolver = asyncio.ensure_future(self._resolve_periodically())
        self.serving = True
        self._health_changed()

    async def _resolve_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.options.resolve_interval_s)
            for tier in (self.prefill, self.decode):
                await tier.refresh()

    async def _report(self, serving: bool) -> None:
        if serving != self._reported:
            self._reported = serving
            await set_health(self.health, serving)

    def _health_changed(self) -> None:
        """The router serves while any decode instance does (it can then answer, colocated
        at worst)."""
        in_background(self.background, self._report(self.serving and bool(self.decode.healthy())))

    def pick(self, tier: Tier, policy, hashes: list[int], exclude=()) -> Backend | None:
        backends = tier.healthy(tuple(exclude))
        if not backends:
            return None
        backend = policy.choose(backends, hashes)
        backend.outstanding += 1
        backend.num_routed += 1
        return backend

    def prefix_hashes(self, msg: pb.GenerateRequest) -> list[int]:
        """Block hashes of the prompt's start, for prefix affinity: of its token ids as the
        engines hash them when the router has the tokenizer, else of its UTF-8 bytes."""
        o = self.options
        kind = msg.WhichOneof("prompt")
        if kind == "token_ids":
            units = list(msg.token_ids.ids)
        elif kind == "text":
            units = self.tokenizer.encode(msg.text) if self.tokenizer else list(msg.text.encode())
        elif kind == "chat":
            messages = chat_messages(msg.chat)
            if self.tokenizer is not None and self.tokenizer.chat_template and messages:
                from baton.engine.tokenizer import apply_chat_template  # loaded with the tokenizer
                units = apply_chat_template(self.tokenizer, messages)
            else:
                units = list("\n".join(f"{m['role']}: {m['content']}" for m in messages).encode())
        else:
            return []
        return extend_block_hashes([], units, o.block_size, o.affinity_blocks)

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
        if self._resolver is not None:
            self._resolver.cancel()
        for tier in (self.prefill, self.decode):
            await tier.close()
