"""The colocated Baton server: one engine behind the public `Generate` API, with the
standard gRPC health and reflection services and a graceful drain."""
from __future__ import annotations

import asyncio
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
from baton.v1 import generate_pb2 as pb
from baton.v1 import generate_pb2_grpc

log = logging.getLogger("baton.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name
MAX_REQUEST_ID_CHARS = 256
_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                   "abort": pb.FINISH_REASON_ABORT, "error": pb.FINISH_REASON_ERROR}
_OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "min_tokens")
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

    def make_request(self, msg: pb.GenerateRequest) -> tuple[Request, int]:
        """The engine request for a GenerateRequest, and its output mode; raises
        InvalidArgument naming the API field."""
        engine = self.server.engine.engine
        check(msg.output in pb.Output.values(), "output", f"unknown value {msg.output}")
        check(len(msg.request_id) <= MAX_REQUEST_ID_CHARS, "request_id",
              f"is {len(msg.request_id)} characters, more than {MAX_REQUEST_ID_CHARS}")
        params = sampling_params_from_proto(msg.sampling)
        kind = msg.WhichOneof("prompt")
        check(kind is not None, "prompt", "set one of text, token_ids or chat")
        if kind == "chat":
            check(len(msg.chat.messages) > 0, "chat.messages", "must not be empty")
            prompt = engine.apply_chat_template([{"role": m.role, "content": m.content} for m in msg.chat.messages])
        else:
            prompt = msg.text if kind == "text" else list(msg.token_ids.ids)
        try:
            request = engine.make_request(msg.request_id or uuid.uuid4().hex, prompt, params, msg.priority)
        except InvalidArgument as e:
            raise InvalidArgument(_API_FIELD.get(e.field, e.field), e.reason) from None
        limit = engine.config.max_model_len
        check(request.num_prompt_tokens + params.max_tokens <= limit, "sampling.max_tokens",
              f"{params.max_tokens} new tokens after a prompt of {request.num_prompt_tokens} exceed "
              f"max_model_len {limit}")
        return request, msg.output or pb.OUTPUT_TEXT_AND_TOKEN_IDS

    async def Generate(self, msg: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        if not self.server.serving:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is loading or draining")
        try:
            request, output = self.make_request(msg)
        except InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        with_text = output != pb.OUTPUT_TOKEN_IDS
        with_ids = output != pb.OUTPUT_TEXT
        try:
            async for out in self.server.engine.generate(request):
                yield response_from_output(out, with_text, with_ids)
        except DuplicateRequest:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"request_id: {request.request_id!r} is already in flight")
        except QueueFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except InvalidArgument as e:  # raised by the engine on admission
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDead as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))


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
                        ("grpc.max_receive_message_length", o.max_message_bytes)]
        if o.max_concurrent_streams is not None:
            grpc_options.append(("grpc.max_concurrent_streams", o.max_concurrent_streams))
        self.grpc = grpc.aio.server(options=grpc_options)
        generate_pb2_grpc.add_TextGenerationServicer_to_server(GenerationService(self), self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.grpc)
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
        engine = await asyncio.to_thread(LLMEngine, self.config)
        self.engine = AsyncEngine(engine, self.options.max_waiting_requests, on_dead=self._on_engine_dead)
        self.engine.start()
        self.serving = True
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on %s", self.config.model, self.address)

    def _on_engine_dead(self, error: BaseException) -> None:
        self.serving = False
        asyncio.ensure_future(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: report NOT_SERVING, refuse new calls, give in-flight streams the grace period
        to finish, then cancel the rest (which aborts them in the engine)."""
        self.serving = False
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.grpc.stop(self.options.grace_s if grace_s is None else grace_s)
        if self.engine is not None:
            await self.engine.stop()

    async def wait_for_termination(self) -> None:
        await self.grpc.wait_for_termination()
