"""A Baton engine server: one engine behind the public `Generate` API, with the standard gRPC
health and reflection services and a graceful drain. As a prefill or decode tier it also
serves the internal calls of kv_peers.py. Spans and metrics come from the engine's
events through telemetry.py."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from baton.engine.config import EngineConfig
from baton.engine.errors import InvalidArgument, check
from baton.engine.llm_engine import LLMEngine
from baton.engine.request import Request
from baton.engine.sampling_params import SamplingParams
from baton.kv_transfer.nixl_connector import DEFAULT_HOLD_TIMEOUT_S, make_nixl_connector
from baton.services.telemetry import tracing
from baton.engine.async_engine import AsyncEngine
from baton.services.rpc.api import SERVICE_NAME, TOKEN_KEY, chat_messages
from baton.services.rpc.serving import advertised_host, drain, in_background, make_grpc_server, set_health
from baton.services.server.responses import ENGINE_ERRORS, abort_for_engine_error, decode_timing, response_from_output
from baton.services.server.telemetry import EngineTelemetry
from baton.services.rpc.fan_out import child_requests, merge, num_completions
from baton.services.server.kv_peers import KVPeers, KVPeerService, PrefillService
from baton.services.telemetry.metrics import EngineMetrics, MetricsServer, make_registry, on_loop
from baton.services.rpc.runtime import CallRegistry
from baton.services.server.runtime import EngineRuntime, load_from_snapshot, model_info
from baton.services.rpc.tls import TLSConfig
from baton.v1 import generate_pb2 as pb
from baton.v1 import generate_pb2_grpc, internal_pb2, internal_pb2_grpc

log = logging.getLogger("baton.server")

ROLES = ("both", "prefill", "decode")
MAX_REQUEST_ID_CHARS = 256
_OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "min_tokens",
                             "include_stop_str_in_output", "repetition_penalty", "presence_penalty",
                             "frequency_penalty", "min_p", "logprobs", "prompt_logprobs", "skip_special_tokens", "n")
# Engine field names as the public API spells them.
_API_FIELD = {"prompt_token_ids": "token_ids", "resumed_output": "resume", "messages": "chat",
              "logit_bias": "sampling.logit_bias", "stop_token_ids": "sampling.stop_token_ids"}


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
    metrics_port: int | None = None  # /metrics over HTTP (0: any free port); None: no metrics
    otlp_traces_endpoint: str | None = None  # default: $OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT; none: no tracing
    http_port: int | None = None  # the OpenAI-compatible HTTP front (0: any free port); None: none
    tls: TLSConfig | None = None  # serve TLS (mTLS with a CA), and call peers over it
    advertise_host: str | None = None  # in KV handles; default: host, or this host's IP when host is a wildcard

    def __post_init__(self):
        check(self.role in ROLES, "role", f"must be one of {', '.join(ROLES)}, got {self.role!r}")
        check(self.http_port is None or self.role == "both", "http_port",
              "the OpenAI front serves on a colocated server or the router, not on one tier")


def sampling_params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    kwargs = {name: getattr(p, name) for name in _OPTIONAL_SAMPLING_FIELDS if p.HasField(name)}
    for name in ("stop_token_ids", "stop"):
        if getattr(p, name):
            kwargs[name] = list(getattr(p, name))
    if p.logit_bias:
        kwargs["logit_bias"] = dict(p.logit_bias)
    try:
        return SamplingParams(**kwargs)
    except InvalidArgument as e:
        raise InvalidArgument(f"sampling.{e.field}", e.reason) from None


class GenerationService(EngineRuntime, generate_pb2_grpc.TextGenerationServicer):
    def __init__(self, server: Server):
        self.server = server
        self.calls = CallRegistry()  # for Abort

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
            min_tokens = params.min_tokens
            params = dataclasses.replace(params, max_tokens=1, min_tokens=min(min_tokens, 1))
            # The request's own min_tokens, past the check that it fits max_tokens: the first
            # token is sampled the same either way, but a stop string in it must not end the
            # request before min_tokens, as it would not colocated.
            params.min_tokens = min_tokens
        elif kv_params is not None or msg.resume.ids:  # the prompt's logprobs went out already
            params = dataclasses.replace(params, prompt_logprobs=None)
        check(not (msg.resume.ids and msg.HasField("kv_handle")), "resume", "cannot come with a kv_handle")
        try:
            request = engine.make_request(msg.request_id or uuid.uuid4().hex, self._prompt(msg), params,
                                          msg.priority, kv_transfer_params=kv_params,
                                          resumed_output=list(msg.resume.ids))
        except InvalidArgument as e:
            raise InvalidArgument(_API_FIELD.get(e.field, e.field), e.reason) from None
        if msg.HasField("kv_handle"):
            h, block_size = msg.kv_handle, engine.config.block_size
            check(h.num_tokens == request.num_prompt_tokens, "kv_handle.num_tokens",
                  f"is {h.num_tokens}, the prompt has {request.num_prompt_tokens} tokens")
            check(len(h.block_ids) == -(-h.num_tokens // block_size), "kv_handle.block_ids",
                  f"has {len(h.block_ids)} ids for {h.num_tokens} tokens in blocks of {block_size}")
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
        server = self.server
        handle = msg.kv_handle if msg.HasField("kv_handle") else None
        with server.server_span(context, msg, "Generate") as span:
            if not server.serving:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is loading or draining")
            if handle is not None:
                await server.check_token(context)
            msg.request_id = msg.request_id or uuid.uuid4().hex
            if msg.request_id in self.calls.live:
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {msg.request_id!r} is already in flight")
            try:
                n = num_completions(msg)
                check(n == 1 or handle is None, "sampling.n", "must be 1 with a kv_handle")
                made = [self.make_request(child) for child in (child_requests(msg, n) if n > 1 else [msg])]
            except InvalidArgument as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            streams = [self._completion(request, output, i, msg.request_id, handle, span, context)
                       for i, (request, output) in enumerate(made)]
            self.calls.started(msg.request_id, [request.request_id for request, _ in made])
            try:
                async for resp in streams[0] if n == 1 else merge(streams):
                    yield resp
            finally:
                self.calls.ended(msg.request_id)

    async def _completion(self, request: Request, output: int, index: int, request_id: str,
                          handle: pb.KVHandle | None, span, context: grpc.aio.ServicerContext):
        """One engine request's responses (one of n completions)."""
        server = self.server
        rt = server.telemetry.track(request, span, dict(handle.trace_context) if handle is not None else None)
        if handle is not None:
            try:
                await server.kv_peers.ensure(handle, context, rt)
            except BaseException as e:  # never reached the engine: nothing else ends its telemetry
                server.telemetry.drop(rt, time.monotonic(), f"no KV peer: {e!r}")
                raise
        try:
            async for out in server.engine.generate(request):
                if handle is not None:  # the router's P/D breakdown needs the decode's side of it
                    await context.send_initial_metadata(decode_timing(request))
                    handle = None
                yield response_from_output(out, output, index, request_id)
        except ENGINE_ERRORS as e:
            server.telemetry.drop(rt, time.monotonic(), str(e))
            await abort_for_engine_error(context, e)


class AdminService(internal_pb2_grpc.AdminServicer):
    def __init__(self, server: Server):
        self.server = server

    async def Stats(self, msg: internal_pb2.StatsRequest, context: grpc.aio.ServicerContext):
        await self.server.check_internal(context)
        return await self.server.engine.call(self.server.stats)


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
        self.grpc, self.port = make_grpc_server(o.host, o.port, o.max_message_bytes, streams, o.tls)
        self.advertised_host = advertised_host(o.host, o.advertise_host)
        generation = self.generation = GenerationService(self)
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
        self.engine_id = o.engine_id or f"{o.role}-{uuid.uuid4().hex[:12]}"
        self.model_name = o.served_model_name or os.path.basename(os.path.normpath(config.model))
        self.tracer = tracing.make_tracer(o.role, self.engine_id, o.otlp_traces_endpoint)
        self.telemetry = EngineTelemetry(self.tracer, None)
        self.metrics_registry = make_registry() if o.metrics_port is not None else None
        self.metrics_server = (MetricsServer(self.metrics_registry, o.host, o.metrics_port)
                               if self.metrics_registry is not None else None)
        self.background: set[asyncio.Task] = set()
        self.kv_peers = KVPeers(self)
        self.http = None  # the OpenAI front, once started

    @property
    def address(self) -> str:
        """Where peers reach this server (the address in its KV handles)."""
        return f"{self.advertised_host}:{self.port}"

    async def start(self) -> None:
        """Listen, load the model, then report SERVING."""
        await set_health(self.health, False)
        await self.grpc.start()
        o = self.options
        connector = make_nixl_connector(self.engine_id, self.config.block_size, o.kv_hold_timeout_s)
        engine = await asyncio.to_thread(LLMEngine, self.config, connector)
        self.kv_worker = engine.runner.connector
        self.telemetry.block_bytes = self.kv_worker.layout.block_bytes
        if self.metrics_registry is not None:
            loop = asyncio.get_running_loop()
            self.telemetry.metrics = EngineMetrics(self.metrics_registry, self.model_name, o.role,
                                                   self.config.max_model_len, lambda: self._snapshot(loop))
        self.engine = AsyncEngine(engine, self.options.max_waiting_requests, on_dead=self._on_engine_dead,
                                  on_step=self.telemetry.on_step if self.telemetry.enabled else None)
        self.engine.start()
        if o.http_port is not None:
            from baton.services.openai.front import OpenAIFront
            self.http = OpenAIFront(self.generation, o.host, o.http_port, lambda: self.serving, engine.tokenizer,
                                    o.tls)
            await self.http.start()
        self.serving = True
        await set_health(self.health, True)
        log.info("serving %s on %s", self.config.model, self.address)

    def server_span(self, context: grpc.aio.ServicerContext, msg: pb.GenerateRequest, method: str) -> tracing.ServerSpan:
        """The SERVER span of a Generate or Prefill call (GenAI naming: `{operation} {model}`)."""
        if self.tracer is None:
            return tracing.ServerSpan(None, context, "", {})
        operation = tracing.operation_of(msg)
        service = SERVICE_NAME if method == "Generate" else internal_pb2.DESCRIPTOR.services_by_name[method].full_name
        return tracing.ServerSpan(self.tracer, context, f"{operation} {self.model_name}", {
            **tracing.rpc_attributes(service, method),
            **tracing.genai_request_attributes(operation, self.model_name, msg.request_id, msg.sampling)})

    def model_info(self) -> pb.ModelInfo:
        return model_info(self.engine.engine, self.model_name, self.options.role)

    async def load(self) -> pb.Load:
        snapshot = await self.engine.call(self.engine.engine.snapshot)
        return load_from_snapshot(snapshot, self.options.role, self.address, self.engine.num_in_flight)

    async def release_hold(self, request_id: str) -> bool:
        """Let go of blocks held for a decode that will not pull them; false when none are held."""
        engine, worker = self.engine, self.kv_worker

        def release() -> bool:  # on the step-loop thread, between steps
            if request_id not in engine.engine.scheduler.held:
                return False
            worker.release(request_id)
            return True
        return await engine.call(release)

    def _snapshot(self, loop: asyncio.AbstractEventLoop):
        """The engine's figures for a scrape (from the HTTP thread), or None when it cannot answer."""
        if self.engine is None or not self.serving:
            return None
        try:
            return on_loop(loop, lambda: self.engine.call(self.engine.engine.snapshot))
        except Exception:  # noqa: BLE001 - a scrape during shutdown, or a dead engine: no load figures
            return None

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

    def stats(self) -> internal_pb2.EngineStats:
        """Runs on the step-loop thread (AsyncEngine.call): a consistent snapshot."""
        s, worker = self.engine.engine.snapshot(), self.kv_worker
        return internal_pb2.EngineStats(
            engine_id=worker.engine_id, role=self.options.role, num_kv_blocks=s.num_kv_blocks,
            num_free_kv_blocks=s.num_free_kv_blocks, num_running=s.num_running, num_waiting=s.num_waiting,
            num_held=s.num_held_requests, num_in_flight_streams=self.engine.num_in_flight,
            num_prefix_hit_tokens=s.prefix_cache_hits, num_expired_holds=worker.num_expired_holds,
            num_failed_loads=s.num_failed_loads, num_blocks_pulled=worker.num_blocks_pulled,
            num_requests=self.engine.num_requests)

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
        if self.http is not None:
            await self.http.stop()
        await self.kv_peers.close()
        if self.engine is not None:
            await self.engine.stop()
            self.kv_worker.close()
        self.telemetry.close(time.monotonic())
        tracing.shutdown(self.tracer)
        if self.metrics_server is not None:
            self.metrics_server.close()
