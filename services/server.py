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
from baton.kv_transfer.nixl_connector import DEFAULT_HOLD_TIMEOUT_S, KVLayout, make_nixl_connector
from baton.v1 import generate_pb2 as pb
from baton.v1 import generate_pb2_grpc, internal_pb2, internal_pb2_grpc

log = logging.getLogger("baton.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name
ROLES = ("both", "prefill", "decode")
TOKEN_KEY = "x-baton-token"  # the stack's shared secret, in the metadata of internal calls
MAX_REQUEST_ID_CHARS = 256
_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                   "abort": pb.FINISH_REASON_ABORT, "error": pb.FINISH_REASON_ERROR}
_OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "min_tokens")
_ENGINE_ERRORS = {DuplicateRequest: grpc.StatusCode.ALREADY_EXISTS, QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
                  EngineDead: grpc.StatusCode.INTERNAL}
# Engine field names as the public API spells them.
_API_FIELD = {"prompt_token_ids": "token_ids", "messages": "chat"}


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
            return self.server.engine.engine.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in msg.chat.messages])
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
        with_text = output != pb.OUTPUT_TOKEN_IDS
        with_ids = output != pb.OUTPUT_TEXT
        try:
            async for out in self.server.engine.generate(request):
                yield response_from_output(out, with_text, with_ids)
        except DuplicateRequest:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request_id: {request.request_id!r} is already in flight")
        except InvalidArgument as e:  # raised by the engine on admission
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (QueueFull, EngineDead) as e:
            await context.abort(_ENGINE_ERRORS[type(e)], str(e))


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
        last = None
        try:
            async for last in self.server.engine.generate(request):
                pass
        except InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (DuplicateRequest, QueueFull, EngineDead) as e:
            await context.abort(_ENGINE_ERRORS[type(e)], str(e))
        if last is None or last.finish_reason not in ("stop", "length"):
            await context.abort(grpc.StatusCode.ABORTED, f"request {request.request_id} ended without its first token")
        first = response_from_output(last, output != pb.OUTPUT_TOKEN_IDS, output != pb.OUTPUT_TEXT)
        handle = last.kv_transfer_params
        if handle is None:  # the first token ended the request (a stop token, or max_tokens 1)
            return internal_pb2.PrefillResponse(first=first)
        first.ClearField("finish_reason")  # the request goes on at the decode side
        first.ClearField("usage")
        # A caller gone before the handle reached it leaves nobody to pull the blocks.
        context.add_done_callback(lambda ctx: ctx.cancelled() and in_background(
            self.server.background, self.server.release_hold(handle["remote_request_id"])))
        return internal_pb2.PrefillResponse(
            first=first,
            handle=pb.KVHandle(engine_id=handle["remote_engine_id"], address=self.server.address,
                               request_id=handle["remote_request_id"], block_ids=handle["remote_block_ids"],
                               num_tokens=handle["num_tokens"], first_token=handle["first_token"]))

    async def Release(self, handle: pb.KVHandle, context: grpc.aio.ServicerContext):
        await self.server.check_token(context)
        if self.server.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is loading")
        return internal_pb2.ReleaseResponse(released=await self.server.release_hold(handle.request_id))


class KVPeerService(internal_pb2_grpc.KVPeerServicer):
    def __init__(self, server: Server):
        self.server = server

    async def Handshake(self, theirs: internal_pb2.KVLayout, context: grpc.aio.ServicerContext):
        await self.server.check_token(context)
        if self.server.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is loading")
        try:
            await self.server.engine.call(self.server.kv_worker.add_peer, layout_from_proto(theirs))
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return layout_to_proto(self.server.kv_worker.layout)


class AdminService(internal_pb2_grpc.AdminServicer):
    def __init__(self, server: Server):
        self.server = server

    async def Stats(self, msg: internal_pb2.StatsRequest, context: grpc.aio.ServicerContext):
        await self.server.check_token(context)
        if self.server.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is loading")
        return await self.server.engine.call(self.server.stats)


def layout_to_proto(layout: KVLayout) -> internal_pb2.KVLayout:
    return internal_pb2.KVLayout(engine_id=layout.engine_id, agent_metadata=layout.agent_metadata,
                                 base_addr=layout.base_addr, block_bytes=layout.block_bytes,
                                 num_blocks=layout.num_blocks, mem_type=layout.mem_type, dev_id=layout.dev_id)


def layout_from_proto(msg: internal_pb2.KVLayout) -> KVLayout:
    return KVLayout(msg.engine_id, msg.agent_metadata, msg.base_addr, msg.block_bytes, msg.num_blocks,
                    msg.mem_type, msg.dev_id)


def response_from_output(out: StepOutput, with_text: bool, with_ids: bool) -> pb.GenerateResponse:
    resp = pb.GenerateResponse(request_id=out.request_id)
    if with_ids:
        resp.token_ids.extend(out.new_token_ids)
    if with_text:
        resp.text = out.text
    if out.finished:
        resp.finish_reason = _FINISH_REASONS.get(out.finish_reason, pb.FINISH_REASON_ERROR)
        resp.usage.prompt_tokens = out.num_prompt_tokens
        resp.usage.completion_tokens = out.num_output_tokens
        resp.usage.cached_tokens = out.num_cached_tokens
    return resp


def in_background(tasks: set[asyncio.Task], coro) -> None:
    """Run coro as a task that stays referenced until done (asyncio keeps only weak ones)."""
    task = asyncio.ensure_future(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def drain(server: grpc.aio.Server, num_in_flight, grace_s: float) -> None:
    """Give in-flight requests up to grace_s to finish, then stop the server, cancelling what
    is left. grpc's own grace would also wait for long-lived calls that never end by
    themselves (a router's health Watch), so the wait counts requests instead."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while num_in_flight() and loop.time() < deadline:
        await asyncio.sleep(0.05)
    await server.stop(0)


class Server:
    """Listens at once (health answers NOT_SERVING while the model loads), then serves."""

    def __init__(self, config: EngineConfig, options: ServerOptions | None = None):
        self.config = config
        self.options = options or ServerOptions()
        self.engine: AsyncEngine | None = None
        self.serving = False
        self.health = health.aio.HealthServicer()
        o = self.options
        grpc_options = [("grpc.max_send_message_length", o.max_message_bytes),
                        ("grpc.max_receive_message_length", o.max_message_bytes),
                        ("grpc.so_reuseport", 0)]  # a taken port is an error, not a shared one
        if o.max_concurrent_streams is not None:
            grpc_options.append(("grpc.max_concurrent_streams", o.max_concurrent_streams))
        self.grpc = grpc.aio.server(options=grpc_options)
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
        self.port = self.grpc.add_insecure_port(f"{o.host}:{o.port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {o.host}:{o.port} (in use?)")

    @property
    def address(self) -> str:
        return f"{self.options.host}:{self.port}"

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def start(self) -> None:
        """Listen, load the model, then report SERVING."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.grpc.start()
        o = self.options
        connector = make_nixl_connector(o.engine_id or f"{o.role}-{uuid.uuid4().hex[:12]}", self.config.block_size,
                                        o.kv_hold_timeout_s)
        engine = await asyncio.to_thread(LLMEngine, self.config, connector)
        self.kv_worker = engine.runner.connector
        self.engine = AsyncEngine(engine, self.options.max_waiting_requests, on_dead=self._on_engine_dead)
        self.engine.start()
        self.serving = True
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on %s", self.config.model, self.address)

    async def check_token(self, context: grpc.aio.ServicerContext) -> None:
        """Internal calls must come from the stack: the shared token, when one is configured."""
        token = self.options.internal_token
        if token is not None and dict(context.invocation_metadata() or ()).get(TOKEN_KEY) != token:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"internal call without the stack's {TOKEN_KEY}")

    def token_metadata(self) -> tuple:
        token = self.options.internal_token
        return ((TOKEN_KEY, token),) if token is not None else ()

    async def ensure_peer(self, handle: pb.KVHandle, context: grpc.aio.ServicerContext) -> None:
        """Trade layouts with the handle's prefill engine unless we know it (a restarted prefill
        has a new engine id, so it is met again)."""
        if handle.engine_id in self.kv_worker.peers:
            return
        channel = self._peer_channels.get(handle.address)
        if channel is None:
            channel = self._peer_channels[handle.address] = grpc.aio.insecure_channel(handle.address)
        try:
            theirs = await internal_pb2_grpc.KVPeerStub(channel).Handshake(
                layout_to_proto(self.kv_worker.layout), metadata=self.token_metadata(), timeout=10)
        except grpc.aio.AioRpcError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"kv_handle: cannot reach prefill {handle.address}: {e.code().name} {e.details()}")
        if theirs.engine_id != handle.engine_id:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
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
        asyncio.ensure_future(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: report NOT_SERVING, refuse new calls, give in-flight streams the grace period
        to finish, then cancel the rest (which aborts them in the engine)."""
        self.serving = False
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await drain(self.grpc, lambda: self.engine.num_in_flight if self.engine else 0,
                    self.options.grace_s if grace_s is None else grace_s)
        for channel in self._peer_channels.values():
            await channel.close()
        if self.engine is not None:
            await self.engine.stop()
            self.kv_worker.close()

    async def wait_for_termination(self) -> None:
        await self.grpc.wait_for_termination()
