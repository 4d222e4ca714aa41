"""The OpenAI-compatible HTTP front of a colocated server or the router: /v1/completions and
/v1/chat/completions (server-sent events or whole), /v1/models, /health, /tokenize and
/detokenize, on aiohttp in the gRPC server's own event loop; and the service's Prometheus
/metrics, the page its metrics port serves, where vLLM serves it (on the API's port).

A streamed completion of one prompt takes its tokens after the first as the step reads them:
the service hands them straight to the call's context (a DirectContext), which makes each
event's bytes at once (Completion.text_event), and the handler writes all that came since its
last write, woken once for them, not once per token through the generators.

A request takes the same path as a gRPC call, not an extra hop: its JSON becomes a
GenerateRequest (one request id across both) handed to the service's own Generate (bound
methods, ServiceCalls) with a stand-in for the gRPC context, whose aborts become OpenAI error
bodies with the HTTP status that fits (400 naming the parameter, 404, 429, 503). A client
that goes away cancels the handler, which aborts the request and frees its blocks.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from baton.services.openai.protocol import (
    DONE_EVENT,
    ApiError,
    Completion,
    chat_messages_from_body,
    check_parameters,
    error_for_status,
    image_error,
    in_range,
    int_list,
    prompts_from_body,
    sampling_from_body,
    sse,
    typed,
)
from baton.services.openai.tools import constrain_to_tools, plan_from_body
from baton.services.rpc.call_responses import Pending, feeding
from baton.services.rpc.errors import failure_of
from baton.services.rpc.fan_out import merge
from baton.services.rpc.serving import RuntimeApi
from baton.services.rpc.stand_in_context import Aborted, DirectContext, StandInContext
from baton.services.telemetry.metrics import exposition
from baton.v1 import generate_pb2 as pb


class CallContext(StandInContext):
    """The context of a call that came over HTTP: its trace context from the headers."""

    def __init__(self, headers):
        super().__init__(tuple((k.lower(), v) for k, v in headers.items()
                               if k.lower() in ("traceparent", "tracestate")))

    def error(self) -> ApiError:
        return error_for_status(self.code(), self.details(), failure_of(self.trailing_metadata).field)


class EventStream:
    """A streamed completion's server-sent events as they are made, for its handler to write:
    those of its Generate's responses (`add`) and those its service hands straight to the call
    (StreamedCallContext), in the order they came; the handler is woken once for all that came
    since its last write."""

    def __init__(self, shape: Completion):
        self.shape = shape
        self._pending = Pending()

    def add(self, index: int, resp: pb.GenerateResponse) -> None:
        for event in self.shape.events((index, resp)):
            self._pending.push(sse(event))

    def add_text(self, index: int, text: str) -> None:
        """A response with nothing but this text (a sink's), its choice's `index`."""
        if text:
            self._pending.push(self.shape.text_event(index, text))

    def push(self, data: bytes) -> None:
        self._pending.push(data)

    def end(self) -> None:
        self._pending.end()

    async def take(self) -> bytes | None:
        """The bytes of all that came since the last take (Pending.take)."""
        data = await self._pending.take()
        return b"".join(data) if data is not None else None


class StreamedCallContext(CallContext, DirectContext):
    """The context of an HTTP call streamed as events: the responses its service hands it
    straight go into the stream as its choice numbered `index`."""

    def __init__(self, headers, events: EventStream, index: int):
        super().__init__(headers)
        self._events, self._index = events, index

    def respond(self, resp: pb.GenerateResponse | bytes) -> None:
        resp = pb.GenerateResponse.FromString(resp) if isinstance(resp, bytes) else resp
        self._events.add(self._index + resp.index, resp)

    def respond_tokens(self, request_id: str, token_ids: list[int], text: str) -> None:
        self._events.add_text(self._index, text)


@dataclass(frozen=True, slots=True)
class ServiceCalls:
    """The baton.v1.TextGeneration methods the HTTP front calls, bound to the units that serve
    them (an engine server's or the router's): each takes the request and a context."""
    generate: Callable[..., AsyncIterator]  # responses as messages, or as bytes (the router's)
    get_model_info: Callable[..., Awaitable]
    list_adapters: Callable[..., Awaitable]
    load_adapter: Callable[..., Awaitable]
    unload_adapter: Callable[..., Awaitable]
    tokenize: Callable[..., Awaitable]
    detokenize: Callable[..., Awaitable]

    @classmethod
    def of(cls, generate: Callable[..., AsyncIterator], runtime: RuntimeApi) -> ServiceCalls:
        """Generate, and the runtime API's methods the front calls."""
        return cls(generate, runtime.GetModelInfo, runtime.ListAdapters, runtime.LoadAdapter, runtime.UnloadAdapter,
                   runtime.Tokenize, runtime.Detokenize)


class OpenAIFront:
    """The HTTP front over `calls`, baton.v1.TextGeneration's methods as the service answers
    them. With a `metrics_registry` (the service's), GET /metrics serves it."""

    def __init__(self, calls: ServiceCalls, host: str, port: int, is_serving, tokenizer=None, tls=None,
                 metrics_registry=None, reuse_port: bool = False):
        self.calls, self.host, self.port = calls, host, port
        self.ssl_context = tls.server_context() if tls is not None else None
        self.is_serving = is_serving
        self.reuse_port = reuse_port  # a router worker's: the port is its set's
        self.tokenizer = tokenizer  # token strings of logprobs; without one, "token_id:N" (vLLM's spelling)
        self.app = web.Application(client_max_size=16 << 20)
        self.app.add_routes([web.post("/v1/completions", self.completions),
                             web.post("/v1/chat/completions", self.chat_completions),
                             web.get("/v1/models", self.models), web.get("/health", self.health),
                             web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize),
                             web.post("/v1/load_lora_adapter", self.load_lora_adapter),
                             web.post("/v1/unload_lora_adapter", self.unload_lora_adapter)])
        self.metrics_registry = metrics_registry
        if metrics_registry is not None:
            self.app.add_routes([web.get("/metrics", self.metrics)])
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        self._model_info: pb.ModelInfo | None = None

    async def start(self) -> None:
        await self.runner.setup()
        # SO_REUSEADDR: a restarted server binds its port again at once (a port with a live
        # listener stays an error on Linux; SO_REUSEPORT, which would share it, only for router workers).
        # The server's drain gave requests in flight their grace before it stops this front: what
        # is left then is cancelled (and aborted in the engine) at once, not waited on for
        # aiohttp's default minute.
        site = web.TCPSite(self.runner, self.host, self.port, reuse_address=True, reuse_port=self.reuse_port,
                           ssl_context=self.ssl_context, shutdown_timeout=0.5)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://{self.host}:{self.port}"

    async def stop(self) -> None:
        await self.runner.cleanup()

    # ---- what the service knows -----------------------------------------------------------
    async def _call(self, call: Callable[..., Awaitable], msg, request: web.Request):
        """One of `calls`' unary methods, its aborts as ApiErrors."""
        context = CallContext(request.headers)
        try:
            return await call(msg, context)
        except Aborted:
            raise context.error() from None

    async def model_info(self, request: web.Request) -> pb.ModelInfo:
        if self._model_info is None:
            self._model_info = await self._call(self.calls.get_model_info, pb.GetModelInfoRequest(), request)
        return self._model_info

    async def _check_model(self, body: dict, request: web.Request) -> tuple[str, str]:
        """The model asked for and the LoRA adapter it names ("": the base model)."""
        name, asked = (await self.model_info(request)).model_name, body.get("model")
        if asked in (None, name):
            return name, ""
        adapters = await self._call(self.calls.list_adapters, pb.ListAdaptersRequest(), request)
        if any(a.name == asked for a in adapters.adapters):
            return asked, asked
        served = ", ".join([name] + [a.name for a in adapters.adapters])
        raise ApiError(404, f"The model `{asked}` does not exist (this server serves {served})", "model",
                       "NotFoundError")

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"

    # ---- endpoints ----------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.is_serving() else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        """What the metrics port answers (metrics.exposition: the same negotiation and names).
        Collected on a thread: an engine's load figures are asked of this event loop, which
        would otherwise wait on itself."""
        body, kind = await asyncio.to_thread(exposition, self.metrics_registry, request.headers.get("Accept", ""))
        return web.Response(body=body, headers={"Content-Type": kind})

    async def models(self, request: web.Request) -> web.Response:
        return await _answer(self._models(request))

    async def _models(self, request):
        info = await self.model_info(request)
        adapters = await self._call(self.calls.list_adapters, pb.ListAdaptersRequest(), request)
        base = {"id": info.model_name, "object": "model", "created": 0, "owned_by": "baton", "root": info.model_path,
                "parent": None, "max_model_len": info.max_model_len}
        return {"object": "list", "data": [base] + [
            dict(base, id=a.name, root=a.path, parent=info.model_name) for a in adapters.adapters]}

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        return await self._adapter_call(request, load=True)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        return await self._adapter_call(request, load=False)

    async def _adapter_call(self, request: web.Request, load: bool) -> web.Response:
        """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: a JSON body with lora_name
        (and lora_path), a line of text on success."""
        try:
            body = await _json(request)
            for name in ("lora_name", "lora_path") if load else ("lora_name",):
                if not isinstance(body.get(name), str) or not body[name]:
                    raise ApiError(400, f"{name}: must be a non-empty string", name)
            if load:
                await self._call(self.calls.load_adapter, pb.LoadAdapterRequest(
                    lora_name=body["lora_name"], lora_path=body["lora_path"]), request)
            else:
                await self._call(self.calls.unload_adapter, pb.UnloadAdapterRequest(lora_name=body["lora_name"]),
                                 request)
        except ApiError as e:
            return _error_response(e)
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' {'added' if load else 'removed'} "
                                 "successfully.")

    async def tokenize(self, request: web.Request) -> web.Response:
        return await _answer(self._tokenize(request))

    async def _tokenize(self, request):
        body = await _json(request)
        msg = pb.TokenizeRequest()
        if "messages" in body:
            msg.chat.messages.extend(chat_messages_from_body(body))
        elif isinstance(body.get("prompt"), str):
            msg.text = body["prompt"]
        else:
            raise ApiError(400, "prompt: give a text prompt, or messages", "prompt")
        out = await self._call(self.calls.tokenize, msg, request)
        return {"tokens": list(out.token_ids), "count": len(out.token_ids), "max_model_len": out.max_model_len}

    async def detokenize(self, request: web.Request) -> web.Response:
        return await _answer(self._detokenize(request))

    async def _detokenize(self, request):
        body = await _json(request)
        out = await self._call(self.calls.detokenize, pb.DetokenizeRequest(token_ids=int_list(body, "tokens")
                                                                  if "tokens" in body else []), request)
        return {"prompt": out.text}

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def _complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = {}
        try:
            body = await _json(request)
            check_parameters(body, chat)
            model, adapter = await self._check_model(body, request)
            sampling = sampling_from_body(body, chat)
            tools = plan_from_body(body) if chat else None
            if tools is not None:
                constrain_to_tools(tools, sampling)
            if chat:
                msg = pb.GenerateRequest(sampling=sampling)
                msg.chat.messages.extend(chat_messages_from_body(body))
                if tools is not None:
                    msg.chat.tools_json = json.dumps([{"type": "function", "function": f} for f in tools.tools])
                if not sampling.HasField("max_tokens"):  # as vLLM: up to the context length
                    tokens = await self._call(self.calls.tokenize, pb.TokenizeRequest(chat=msg.chat), request)
                    msg.sampling.max_tokens = max(1, tokens.max_model_len - len(tokens.token_ids))
                requests = [msg]
            else:
                requests = prompts_from_body(body)
                for msg in requests:
                    msg.sampling.CopyFrom(sampling)
            # vLLM's extra: lower runs first under the priority policy.
            priority = typed(body, "priority", int) if body.get("priority") is not None else 0
            request_id = request.headers.get("x-request-id") or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            for i, msg in enumerate(requests):
                msg.request_id = request_id if len(requests) == 1 else f"{request_id}-{i}"
                msg.adapter = adapter
                in_range("priority", lambda: setattr(msg, "priority", priority))  # noqa: B023 - called at once
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            shape = Completion(self.token_text, request_id, model, chat, time.time(), tools)
            events = EventStream(shape) if body.get("stream") is True else None
            responses = self._responses(requests, request, max(sampling.n, 1), events)
            first = await anext(responses, None)  # errors before any token still get their HTTP status
        except ApiError as e:
            return _error_response(image_error(e, body) if chat else e)
        try:
            return await (self._stream(request, events, first, responses, include_usage) if events is not None
                          else self._whole(shape, first, responses))
        finally:
            # Now, not whenever the collector finds the generator: its requests end with it.
            await responses.aclose()

    @staticmethod
    async def _whole(shape: Completion, first, responses) -> web.Response:
        try:
            if first is not None:
                shape.add(first)
            async for resp in responses:
                shape.add(resp)
        except ApiError as e:
            return _error_response(e)
        return web.json_response(shape.whole())

    @staticmethod
    async def _stream(request: web.Request, events: EventStream, first, responses,
                      include_usage: bool) -> web.StreamResponse:
        """The events, as a task makes them from the responses (_feed) and the service hands
        them to the call, written as they come."""
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        try:
            async with feeding(_feed(events, first, responses, include_usage)):
                while (data := await events.take()) is not None:
                    await out.write(data)
        except ConnectionResetError:  # the client left between two writes; _complete's finally ends its requests
            pass
        return out

    async def _responses(self, requests: list[pb.GenerateRequest], request: web.Request, n: int,
                         events: EventStream | None) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
        """(choice index, response) of every prompt's Generate; a prompt's n completions are
        choices i * n + index. With `events` and one prompt, the service may hand its responses
        after the first to the call's context instead (several prompts' merge reads ahead of
        what the stream has taken: theirs all come here)."""
        async def one(i: int, msg: pb.GenerateRequest):
            context = (StreamedCallContext(request.headers, events, i * n) if events is not None and len(requests) == 1
                       else CallContext(request.headers))
            try:
                async for resp in self.calls.generate(msg, context):
                    resp = pb.GenerateResponse.FromString(resp) if isinstance(resp, bytes) else resp
                    yield i * n + resp.index, resp
            except Aborted:
                raise context.error() from None
        streams = [one(i, msg) for i, msg in enumerate(requests)]
        async for item in (streams[0] if len(streams) == 1 else merge(streams)):
            yield item


async def _feed(events: EventStream, first, responses, include_usage: bool) -> None:
    """The stream's events of its responses (`first` read already), then its usage and [DONE];
    an error after the first byte is an event (the status is sent)."""
    try:
        try:
            if first is not None:
                events.add(*first)
            async for index, resp in responses:
                events.add(index, resp)
            if include_usage:
                events.push(sse(events.shape.usage_event()))
        except ApiError as e:
            events.push(sse(e.body()))
        events.push(DONE_EVENT)
    finally:
        events.end()


async def _json(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


async def _answer(work) -> web.Response:
    try:
        return web.json_response(await work)
    except ApiError as e:
        return _error_response(e)


def _error_response(e: ApiError) -> web.Response:
    return web.json_response(e.body(), status=e.status)
