"""The colocated Baton server: one engine behind the public `Generate` API, with the
standard gRPC health and reflection services and a graceful drain."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from baton.engine.config import EngineConfig
from baton.engine.errors import InvalidArgument, check
from baton.engine.llm_engine import LLMEngine, StepOutput
from baton.engine.request import Request
from baton.engine.sampling_params import SamplingParams
from baton.services.async_engine import AsyncEngine, DuplicateRequest, EngineDead, QueueFull
from baton.services.common import (FINISH_REASONS, SERVICE_NAME, TOKEN_KEY, chat_messages, drain, in_background,
                                   make_grpc_server, set_health, token_metadata)
from baton.kv_transfer.nixl_connector import DEFAULT_HOLD_TIMEOUT_S, KVLayout, make_nixl_connector
from baton.v1 import generate_pb2 as pb
from baton.v1 import generate_pb2_grpc, internal_pb2, internal_pb2_grpc

log = logging.getLogger("baton.server")

ROLES = ("both", "prefill", "decode")
MAX_REQUEST_ID_CHARS = 256
_OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "min_tokens")
_ENGINE_ERRORS = (InvalidArgument, DuplicateRequest, QueueFull, EngineDead)  # raised by AsyncEngine.generate
# Engine field names as the public API spells them.
_API_FIELD = {"prompt_token_ids": "token_ids", "messages": "chat"}


class PeerUnusable(Exception):
    """A handle's prefill engine cannot serve its blocks: the status and message for the stream."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


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

    def __post_init__(self):
        check(self.role in ROLES, "role", f"must be one of {', '.join(ROLES)}, got {self.role!r}")


def sampling_params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    kwargs = {name: getattr(p, name) for name in _OPTIONAL_SAMPLING_FIELDS if p.HasField(name)}
    if p.stop_token_ids:
        kwargs["stop_token_ids"] = list(p.stop_token_ids)
    try:
        return SamplingParams(**kwargs)
    except InvalidArgument as e:
        raise InvalidArgument(f"sampling.{e.field}", e.reason) from None


class GenerationService(generate_pb2_grpc.TextGenerationServicer):
    def __init__(self, server: Server):
        self.server = server

    def make_request(self, msg: pb.GenerateRequest, for_prefill: bool = False) -> tuple[Request, int]:
        """The engine request for a GenerateRequest, and its output mode; raises
        InvalidArgument naming the API field. `for_prefill`: only the first token, with the
        blocks held for a decode peer."""
        engine = self.server.engine.engine
        check(msg.output in pb.Output.values(), "output", f"unknown value {msg.output}")
        check(len(msg.request_id) <= MAX_REQUEST_ID_CHARS, "request_id",
              f"is {len(msg.request_id)} characters, more than {MAX_REQUEST_ID_CHARS}")
        params = sampling_params_from_proto(msg.sampling)
        kv_params = self._kv_params(msg, params, for_prefill)
        if for_prefill:
            params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        try:
            request = engine.make_request(msg.request_id or uuid.uuid4().hex, self._prompt(msg), params,
                                          msg.priority, kv_transfer_params=kv_params)
        except InvalidArgument as e:
            raise InvalidArgument(_API_FIELD.get(e.field, e.field), e.reason) from None
        if msg.HasField("kv_handle"):
            check(msg.kv_handle.num_tokens == request.num_prompt_tokens, "kv_handle.num_tokens",
                  f"is {msg.kv_handle.num_tokens}, the prompt has {request.num_prompt_tokens} tokens")
        limit = engine.config.max_model_len
        check(request.num_prompt_tokens + params.max_tokens <= limit, "sampling.max_tokens",
              f"{params.max_tokens} new tokens after a prompt of {request.num_prompt_tokens} exceed "
              f"max_model_len {limit}")
        return request, msg.output or pb.OUTPUT_TEXT_AND_TOKEN_IDS

    def _prompt(self, msg: pb.GenerateRequest) -> str | list[int]:
        kind = msg.WhichOneof("prompt")
        check(kind is not None, "prompt", "set one of text, token_ids or chat")
        if kind == "chat":
            check(len(msg.chat.messages) > 0, "chat.messages", "must not be empty")
            return self.server.engine.engine.apply_chat_template(chat_messages(msg.chat))
        return msg.text if kind == "text" else list(msg.token_ids.ids)

    def _kv_params(self, msg: pb.GenerateRequest, params: SamplingParams, for_prefill: bool) -> dict | None:
        """The connector's view of the request: hold the blocks (prefill), or pull them (a
        decode given a handle)."""
        if for_prefill:  # one token wanted in all: nothing to hand over
            return {"do_remote_decode": True} if params.max_tokens > 1 else None
        if not msg.HasField("kv_handle"):
            return None
        check(self.server.options.role != "prefill", "kv_handle", "this server runs the prefill role only")
        check(params.max_tokens >= 2, "sampling.max_tokens",
              "must be >= 2 with a kv_handle: the first token came from the prefill")
        h = msg.kv_handle
        return {"remote_engine_id": h.engine_id, "remote_request_id": h.request_id,
                "remote_block_ids": list(h.block_ids), "num_tokens": h.num_tokens, "first_token": h.first_token}

    async def Generate(self, msg: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        if not self.server.serving:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is loading or draining")
        if msg.HasField("kv_handle"):
            await self.server.check_token(context)
        try:
            request, output = self.make_request(msg)
        except InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if msg.HasField("kv_handle"):
            await self.server.ensure_peer(msg.kv_handle, context)
        try:
            async for out in self.server.engine.generate(request):
                yield response_from_output(out, output)
        except _ENGINE_ERRORS as e:
            await abort_for_engine_error(context, e)


class PrefillService(internal_pb2_grpc.PrefillServicer):
    def __init__(self, server: Server, generation: GenerationService):
        self.server = server
        self.generation = generation

    async def Prefill(self, msg: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        await self.server.check_token(context)
        if not self.server.serving:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is loading or draining")
        try:
            request, output = self.generation.make_request(msg, for_prefill=True)
        except InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # A caller gone before the handle reached it leaves nobody to pull the blocks: also
        # when the request had finished (and its blocks were held) just as the call was
        # cancelled, where the engine's abort comes too late. Releasing a request that is
        # not held does nothing.
        context.add_done_callback(lambda ctx: ctx.cancelled() and in_background(
            self.server.background, self.server.release_hold(request.request_id)))
        last = None
        try:
            async for last in self.server.engine.generate(request):
                pass
        except _ENGINE_ERRORS as e:
            await abort_for_engine_error(context, e)
        if last is None or last.finish_reason not in ("stop", "length"):
            await context.abort(grpc.StatusCode.ABORTED, f"request {request.request_id} ended without its first token")
        first = response_from_output(last, output)
        handle = last.kv_transfer_params
        if handle is None:  # the first token ended the request (a stop token, or max_tokens 1)
            return internal_pb2.PrefillResponse(first=first)
        first.ClearField("finish_reason")  # the request goes on at the decode side
        first.ClearField("usage")
        return internal_pb2.PrefillResponse(
            first=first,
            handle=pb.KVHandle(engine_id=handle["remote_engine_id"], address=self.server.address,
                               request_id=handle["remote_request_id"], block_ids=handle["remote_block_ids"],
                               num_tokens=handle["num_tokens"], first_token=handle["first_token"]))

    async def Release(self, handle: pb.KVHandle, context: grpc.aio.ServicerContext):
        await self.server.check_internal(context)
        return internal_pb2.ReleaseResponse(released=await self.server.release_hold(handle.request_id))


class KVPeerService(internal_pb2_grpc.KVPeerServicer):
    def __init__(self, server: Server):
        self.server = server

    async def Handshake(self, theirs: internal_pb2.KVLayout, context: grpc.aio.ServicerContext):
        await self.server.check_internal(context)
        try:
            await self.server.engine.call(self.server.kv_worker.add_peer, layout_from_proto(theirs))
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return layout_to_proto(self.server.kv_worker.layout)


class AdminService(internal_pb2_grpc.AdminServicer):
    def __init__(self, server: Server):
        self.server = server

    async def Stats(self, msg: internal_pb2.StatsRequest, context: grpc.aio.ServicerContext):
        await self.server.check_internal(context)
        return await self.server.engine.call(self.server.stats)


def layout_to_proto(layout: KVLayout) -> internal_pb2.KVLayout:
    return internal_pb2.KVLayout(engine_id=layout.engine_id, agent_metadata=layout.agent_metadata,
                                 base_addr=layout.base_addr, block_bytes=layout.block_bytes,
                                 num_blocks=layout.num_blocks, mem_type=layout.mem_type, dev_id=layout.dev_id)


def layout_from_proto(msg: internal_pb2.KVLayout) -> KVLayout:
    return KVLayout(msg.engine_id, msg.agent_metadata, msg.base_addr, msg.block_bytes, msg.num_blocks,
                    msg.mem_type, msg.dev_id)


async def abort_for_engine_error(context: grpc.aio.ServicerContext, e: Exception) -> None:
    if isinstance(e, DuplicateRequest):
        await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {e.args[0]!r} is already in flight")
    code = {InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,  # raised by the engine on admission
            QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED, EngineDead: grpc.StatusCode.INTERNAL}[type(e)]
    await context.abort(code, str(e))


def response_from_output(out: StepOutput, output: int) -> pb.GenerateResponse:
    """The API's message for an engine output, with text, token ids or both (`output`)."""
    resp = pb.GenerateResponse(request_id=out.request_id)
    if output != pb.OUTPUT_TEXT:
        resp.token_ids.extend(out.new_token_ids)
    if output != pb.OUTPUT_TOKEN_IDS:
        resp.text = out.text
    if out.finished:
        resp.finish_reason = FINISH_REASONS.get(out.finish_reason, pb.FINISH_REASON_ERROR)
        resp.usage.prompt_tokens = out.num_prompt_tokens
        resp.usage.completion_tokens = out.num_output_tokens
        resp.usage.cached_tokens = out.num_cached_tokens
    return resp


class Server:
    """Listens at once (health answers NOT_SERVING while the model loads), then serves."""

    def __init__(self, config: EngineConfig, options: ServerOptions | None = None):
        self.config = config
        self.options = options or ServerOptions()
        self.engine: AsyncEngine | None = None
        self.serving = False
        self.health = health.aio.HealthServicer()
        o = self.options
        streams = [("grpc.max_concurrent_streams", o.max_concurrent_streams)] if o.max_concurrent_streams else []
        self.grpc, self.port = make_grpc_server(o.host, o.port, o.max_message_bytes, streams)
        generation = GenerationService(self)
        generate_pb2_grpc.add_TextGenerationServicer_to_server(generation, self.grpc)
        internal_pb2_grpc.add_KVPeerServicer_to_server(KVPeerService(self), self.grpc)
        internal_pb2_grpc.add_AdminServicer_to_server(AdminService(self), self.grpc)
        services = [SERVICE_NAME, *(internal_pb2.DESCRIPTOR.services_by_name[n].full_name for n in ("KVPeer", "Admin"))]
        if o.role != "decode":
            internal_pb2_grpc.add_PrefillServicer_to_server(PrefillService(self, generation), self.grpc)
            services.append(internal_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            [*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], self.grpc)
        self.kv_worker = None
        self.background: set[asyncio.Task] = set()
        self._peer_channels: dict[str, grpc.aio.Channel] = {}
        self._handshakes: dict[str, asyncio.Future] = {}  # prefill engine id -> the handshake under way
        self.num_handshakes = 0  # started by this (decode) server

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    async def start(self) -> None:
        """Listen, load the model, then report SERVING."""
        await set_health(self.health, False)
        await self.grpc.start()
        o = self.options
        connector = make_nixl_connector(o.engine_id or f"{o.role}-{uuid.uuid4().hex[:12]}", self.config.block_size,
                                        o.kv_hold_timeout_s)
        engine = await asyncio.to_thread(LLMEngine, self.config, connector)
        self.kv_worker = engine.runner.connector
        self.engine = AsyncEngine(engine, self.options.max_waiting_requests, on_dead=self._on_engine_dead)
        self.engine.start()
        self.serving = True
        await set_health(self.health, True)
        log.info("serving %s on %s", self.config.model, self.address)

    async def check_token(self, context: grpc.aio.ServicerContext) -> None:
        """Internal calls must come from the stack: the shared token, when one is configured."""
        token = self.options.internal_token
        if token is not None and dict(context.invocation_metadata() or ()).get(TOKEN_KEY) != token:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"internal call without the stack's {TOKEN_KEY}")

    async def check_internal(self, context: grpc.aio.ServicerContext) -> None:
        """An internal call that needs the engine: from the stack, and once it has loaded."""
        await self.check_token(context)
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is loading")

    async def ensure_peer(self, handle: pb.KVHandle, context: grpc.aio.ServicerContext) -> None:
        """Trade layouts with the handle's prefill engine unless we know it (a restarted prefill
        has a new engine id, so it is met again). Streams arriving together for an engine we
        have not met share one handshake."""
        if handle.engine_id in self.kv_worker.peers:
            return
        pending = self._handshakes.get(handle.engine_id)
        if pending is None:
            pending = self._handshakes[handle.engine_id] = asyncio.ensure_future(self._handshake(handle))
            pending.add_done_callback(lambda f: self._handshake_done(handle.engine_id, f))
        try:
            await asyncio.shield(pending)  # a cancelled stream leaves the handshake to the others
        except PeerUnusable as e:
            await context.abort(e.code, str(e))

    def _handshake_done(self, engine_id: str, handshake: asyncio.Future) -> None:
        del self._handshakes[engine_id]  # a failed one is tried again by the next stream
        if not handshake.cancelled():
            handshake.exception()  # retrieved, even when every waiting stream was cancelled

    async def _handshake(self, handle: pb.KVHandle) -> None:
        self.num_handshakes += 1
        channel = self._peer_channels.get(handle.address)
        if channel is None:
            channel = self._peer_channels[handle.address] = grpc.aio.insecure_channel(handle.address)
        try:
            theirs = await internal_pb2_grpc.KVPeerStub(channel).Handshake(
                layout_to_proto(self.kv_worker.layout), metadata=token_metadata(self.options.internal_token), timeout=10)
        except grpc.aio.AioRpcError as e:
            raise PeerUnusable(grpc.StatusCode.UNAVAILABLE, f"kv_handle: cannot reach prefill {handle.address}: "
                                                            f"{e.code().name} {e.details()}") from e
        if theirs.engine_id != handle.engine_id:
            raise PeerUnusable(grpc.StatusCode.FAILED_PRECONDITION,
                               f"kv_handle: {handle.address} is now engine {theirs.engine_id}, not "
                               f"{handle.engine_id} (it restarted; its blocks are gone)")
        await self.engine.call(self.kv_worker.add_peer, layout_from_proto(theirs))

    async def release_hold(self, request_id: str) -> bool:
        def release() -> bool:  # on the step-loop thread, between steps
            if request_id not in self.engine.engine.scheduler.held:
                return False
            self.kv_worker.release(request_id)
            return True
        return await self.engine.call(release)

    def stats(self) -> internal_pb2.EngineStats:
        """Runs on the step-loop thread (AsyncEngine.call): a consistent snapshot."""
        engine, worker = self.engine.engine, self.kv_worker
        sched = engine.scheduler
        return internal_pb2.EngineStats(
            engine_id=worker.engine_id, role=self.options.role, num_kv_blocks=engine.num_kv_blocks,
            num_free_kv_blocks=engine.kv.num_free_blocks, num_running=len(sched.running),
            num_waiting=len(sched.waiting), num_held=engine.num_held_requests,
            num_in_flight_streams=self.engine.num_in_flight, num_prefix_hit_tokens=engine.kv.prefix_hits,
            num_expired_holds=worker.num_expired_holds, num_failed_loads=sched.num_failed_loads,
            num_blocks_pulled=worker.num_blocks_pulled, num_requests=self.engine.num_requests)

    def _on_engine_dead(self, error: BaseException) -> None:
        self.serving = False
        in_background(self.background, set_health(self.health, False))

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: report NOT_SERVING, refuse new calls, give in-flight streams the grace period
        to finish, then cancel the rest (which aborts them in the engine)."""
        self.serving = False
        await set_health(self.health, False)
        await drain(self.grpc, lambda: self.engine.num_in_flight if self.engine else 0,
                    self.options.grace_s if grace_s is None else grace_s)
        for channel in self._peer_channels.values():
            await channel.close()
        if self.engine is not None:
            await self.engine.stop()
            self.kv_worker.close()
