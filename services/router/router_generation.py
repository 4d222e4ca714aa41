"""The router's Generate: for each request it picks a prefill instance by the policy, calls
its internal `Prefill`, forwards the first token to the client at once, and passes the KV
handle on to a decode's `Generate` (decode_leg.py), whose tokens it streams back; responses
pass through as the backends serialized them. A prefill that fails before the client saw a
token is retried once elsewhere; with no prefill instance to use, the decode computes the
prompt itself. Each instance a request is sent to is a Lease (backends.py), counted until its
call there ends."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

import grpc

from baton.engine.common.block_hashes import ROOT_HASH
from baton.engine.common.errors import InvalidArgument
from baton.services.router.backends import Backend, Lease, Tier
from baton.services.router.decode_leg import (
    DecodeRoute,
    Relay,
    aborted_response,
    decode_leg,
    end_call,
    instance_failed,
    pass_on_or_take_out,
)
from baton.services.router.in_flight import InFlight
from baton.services.router.policies import LeastOutstanding, Policy
from baton.services.router.prompt_hashes import PromptHasher
from baton.services.router.router_telemetry import RouterTrace
from baton.services.rpc.chat import has_images
from baton.services.rpc.errors import abort_invalid, pass_on
from baton.services.rpc.fan_out import child_requests, merge, num_completions, retag
from baton.services.rpc.names import TOKEN_KEY, token_metadata
from baton.services.rpc.serving import in_background
from baton.services.rpc.stand_in_context import Responses, responses_of
from baton.services.telemetry.metrics import RouterMetrics
from baton.v1 import generate_pb2 as pb
from baton.v1 import internal_pb2

log = logging.getLogger("baton.router")
_ABORTED = object()  # a prefill call ended by the Abort API

# Client metadata that is the transport's own, not the application's, and is not forwarded.
_HOP_BY_HOP = ("user-agent", TOKEN_KEY)


class RouterGeneration:
    """baton.v1.TextGeneration/Generate at the router (the service's other methods are the
    runtime API's, router_runtime_api.py). `policies`: the prefill tier's and the decode tier's,
    both of the kind `policy` names; `hasher`: the prompt's block hashes for the policy (None:
    it needs none); `encoder`: an encoder tier (E/P/D), which a chat's images go through first
    (none configured: the prefill encodes them); the tracer, metrics and model name make each
    request's RouterTrace; `is_serving`: whether the router takes requests now."""

    def __init__(self, prefill: Tier, decode: Tier, encoder: Tier, policies: tuple[Policy, Policy], policy: str,
                 hasher: PromptHasher | None, in_flight: InFlight, tracer, metrics: RouterMetrics | None,
                 model_name: str, internal_token: str | None, max_migrations: int, is_serving: Callable[[], bool]):
        self.prefill, self.decode, self.encoder = prefill, decode, encoder
        self.encoder_policy = LeastOutstanding()  # (an image's cost is its own: no affinity to keep)
        self.prefill_policy, self.decode_policy = policies
        self.policy = policy
        self.hasher = hasher
        self.in_flight = in_flight
        self.tracer, self.metrics, self.model_name = tracer, metrics, model_name
        self.internal_token = internal_token
        self.max_migrations = max_migrations
        self.is_serving = is_serving
        self._background: set[asyncio.Task] = set()  # releases of blocks nobody will pull

    async def Generate(self, msg: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                       responses: Responses | None = None):
        in_flight = self.in_flight
        if not msg.request_id:  # one id across both tiers, for their logs and traces
            msg.request_id = os.urandom(16).hex()  # (as random as uuid4().hex, at a seventh of its cost)
        # The router's to set: a client's handle would reach a decode with the stack's token.
        msg.ClearField("kv_handle")
        msg.ClearField("resume")
        msg.ClearField("encoded_images")
        if in_flight.is_live(msg.request_id):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {msg.request_id!r} is already in flight")
        if in_flight.full():  # shed now, rather than queue past every deadline
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{in_flight.count} requests are in flight, "
                                                                    f"the bound (max_in_flight) is {in_flight.bound}")
        in_flight.entered()
        ids = [msg.request_id]
        try:
            with RouterTrace(self.tracer, self.metrics, self.model_name, context, msg) as trace:
                try:
                    n = num_completions(msg)
                except InvalidArgument as e:
                    await abort_invalid(context, e)
                children = child_requests(msg, n) if n > 1 else [msg]
                ids = [child.request_id for child in children]
                in_flight.started(msg.request_id, ids)
                # A request alone on its call (n's merge reorders) skips the coroutines per token
                # once it can: the decode's responses go straight to where the call takes them
                # (its gRPC call's, a client's stream of requests, an HTTP event stream) as they
                # are read (decode_leg's `stream`).
                own = responses_of(context, responses) if n == 1 else None
                stream = self._generate(msg, context, trace, own) if n == 1 else merge(
                    [self._completion(child, i, msg.request_id, context, trace) for i, child in enumerate(children)])
                async for resp in stream:
                    trace.last = resp
                    yield resp
        finally:
            in_flight.left(msg.request_id, ids)

    async def _completion(self, child: pb.GenerateRequest, index: int, request_id: str, context, trace):
        """One of n completions, each routed as a request of its own."""
        async for resp in self._generate(child, context, trace):
            yield retag(resp, request_id, index)

    async def _generate(self, msg: pb.GenerateRequest, context: grpc.aio.ServicerContext, trace: RouterTrace,
                        stream: Responses | None = None):
        if not self.is_serving():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the router is starting or draining")
        metadata = self._forwarded_metadata(context)
        # Tokenizing for affinity takes a while on a long prompt: not on the event loop.
        hashes = (await asyncio.to_thread(self.hasher.hashes, msg, self._hash_root(msg.adapter))
                  if self.hasher is not None else [])
        images = has_images(msg.chat)
        if images:
            await self._encode(msg, metadata, context, trace)
        relay = Relay(msg)  # before the prefill call: its first token is the client's too
        prefill_tried: list[Backend] = []
        reply = None
        while reply is None and len(prefill_tried) < 2:
            lease = self._pick(self.prefill, self.prefill_policy, hashes, trace, msg.request_id, prefill_tried,
                               msg.adapter)
            if lease is None:
                break  # no prefill instance: the decode computes the prompt itself
            if prefill_tried:
                trace.retried("prefill")
            prefill_tried.append(lease.backend)
            reply = await self._prefill(lease, msg, metadata, context, trace)
        route = self._decode_route(msg, hashes, metadata, context, trace, images)
        if reply is None:
            trace.fallback("prefill_failed" if prefill_tried else "no_prefill")
            async for resp in decode_leg(route, msg, metadata, context, trace, relay, stream=stream):
                yield resp
            return
        if reply is _ABORTED or msg.request_id in self.in_flight.aborted:  # by the Abort API, before the decode
            if reply is not _ABORTED and reply.HasField("handle"):
                in_background(self._background, self._release(prefill_tried[-1], reply.handle))
            yield aborted_response(msg)
            return
        trace.first_token()
        first = relay.forward(reply.first)  # it goes out now, while the decode pulls the KV
        if not reply.HasField("handle"):  # the first token ended the request
            yield first
            return
        msg.kv_handle.CopyFrom(reply.handle)

        def let_go() -> None:  # no decode will pull the prefill's blocks: tell it (best effort)
            in_background(self._background, self._release(prefill_tried[-1], reply.handle))
        try:
            yield first
        except BaseException:  # the client went away
            let_go()
            raise
        async for resp in decode_leg(route, msg, metadata, context, trace, relay, let_go, stream):
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
        call = prefill.open_prefill(msg, metadata, context.time_remaining())
        try:
            reply = None
            async for raw in call:  # (its one response)
                reply = internal_pb2.PrefillResponse.FromString(raw)
            trace.prefill_answer(sent)
            return reply
        except asyncio.CancelledError as e:
            error = e
            in_background(self._background, self._release(prefill, forget))
            raise
        except grpc.aio.AioRpcError as e:
            error = e
            if e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                in_background(self._background, self._release(prefill, forget))
            if e.code() == grpc.StatusCode.ABORTED and msg.request_id in self.in_flight.aborted:
                return _ABORTED
            await pass_on_or_take_out(prefill, e, context)
            log.warning("prefill %s failed for %s: %s", prefill.address, msg.request_id, e.details())
            return None
        finally:
            end_call(lease, call)
            trace.call_ended(span, "prefill", prefill, error)

    async def _encode(self, msg: pb.GenerateRequest, metadata, context, trace: RouterTrace) -> None:
        """A chat's images through an encoder tier, where one is healthy: their embeddings' handle
        set on msg for the prefill (or the decode) to read. An error of the request's own (an image
        that does not decode, a URL not allowed) goes to the client; any other leaves the images
        to the prefill."""
        backends = self.encoder.healthy()
        if not backends:
            return
        choice = self.encoder_policy.choose(backends, [])
        trace.picked("encoder", "least_outstanding", backends, choice)
        lease, encoder = Lease(choice.backend, msg.request_id, choice.charge), choice.backend
        span, metadata = trace.client_call("encoder", encoder, "Encode", metadata)
        error = None
        try:
            msg.encoded_images.CopyFrom(await encoder.encoder.Encode(msg, metadata=metadata,
                                                                     timeout=context.time_remaining()))
        except grpc.aio.AioRpcError as e:
            error = e
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                await pass_on(context, e)
            if instance_failed(e):
                encoder.failed()
            log.warning("encoder %s failed for %s: %s; the prefill reads the images", encoder.address,
                        msg.request_id, e.details())
        finally:
            lease.end()
            trace.call_ended(span, "encoder", encoder, error)

    def _pick(self, tier: Tier, policy: Policy, hashes: list[int], trace: RouterTrace, request_id: str,
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
        trace.picked(tier.name, self.policy, backends, choice)
        self.in_flight.sent(request_id, choice.backend)  # where an Abort must go
        return Lease(choice.backend, request_id, choice.charge)

    def _decode_route(self, msg: pb.GenerateRequest, hashes: list[int], metadata, context,
                      trace: RouterTrace, images: bool) -> DecodeRoute:
        """What the decode leg needs of the router for this request. A chat with images that
        moves to another decode has its prompt computed again at a prefill, so that the next
        decode, too, reads none of its images."""
        return DecodeRoute(
            lambda tried: self._pick(self.decode, self.decode_policy, hashes, trace, msg.request_id, tried,
                                     msg.adapter),
            self.decode.why_none, self.max_migrations, self.in_flight.aborted,
            (lambda moving: self._reprefill(moving, hashes, metadata, context, trace)) if images else None,
            self._let_go)

    async def _reprefill(self, moving: pb.GenerateRequest, hashes: list[int], metadata, context,
                         trace: RouterTrace) -> pb.KVHandle | None:
        """A moving request's prompt computed again at a prefill: the handle of its blocks (None:
        no prefill could, and the next decode computes the prompt itself). The prefill's first
        token is dropped: the client has it, and the request resumes from what it was sent."""
        msg = pb.GenerateRequest()
        msg.CopyFrom(moving)
        msg.ClearField("resume")
        msg.ClearField("kv_handle")
        lease = self._pick(self.prefill, self.prefill_policy, hashes, trace, msg.request_id, (), msg.adapter)
        if lease is None:
            return None
        reply = await self._prefill(lease, msg, metadata, context, trace)
        if reply is None or reply is _ABORTED or not reply.HasField("handle"):
            return None
        return reply.handle

    def _let_go(self, handle: pb.KVHandle) -> None:
        """Blocks a prefill holds for a decode that will not pull them: released (best effort)."""
        prefill = self.prefill.backends.get(handle.address)
        if prefill is not None:
            in_background(self._background, self._release(prefill, handle))

    def _hash_root(self, adapter: str) -> int:
        """Where the engines start a prompt's block-hash chain: a LoRA adapter's own root (as an
        instance that has it loaded says), else the base model's."""
        if adapter:
            for tier in (self.prefill, self.decode):
                for b in tier.backends.values():
                    if adapter in b.adapters:
                        return b.adapters[adapter].hash_root
        return ROOT_HASH

    def _forwarded_metadata(self, context: grpc.aio.ServicerContext) -> tuple:
        md = [(k, v) for k, v in (context.invocation_metadata() or ())
              if not k.startswith((":", "grpc-")) and k not in _HOP_BY_HOP]
        return (*md, *token_metadata(self.internal_token))

    async def _release(self, prefill: Backend, handle: pb.KVHandle) -> None:
        """Tell a prefill to let go of blocks nobody will pull (best effort: it frees them at
        its hold timeout anyway)."""
        try:
            await prefill.prefill.Release(handle, metadata=token_metadata(self.internal_token), timeout=5)
        except grpc.aio.AioRpcError as e:
            log.warning("could not release %s on %s: %s", handle.request_id, prefill.address, e.details())
