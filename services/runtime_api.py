"""The runtime API of baton.v1.TextGeneration beside Generate: GetModelInfo, GetLoad and
WatchLoad, Abort, Tokenize and Detokenize; an engine server's answers here, the router's in
RouterRuntime. Torch-free: the router imports it."""
from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from baton.services.common import chat_messages, token_metadata
from baton.services.tracing import baton_version
from baton.v1 import generate_pb2 as pb

RECENT_IDS = 10_000  # finished request ids remembered, so that a late Abort says ALREADY_FINISHED
_DEFAULT_INTERVAL_MS, _MIN_INTERVAL_MS = 500, 50


async def watch(get_load: Callable[[], Awaitable[pb.Load]], msg: pb.GetLoadRequest) -> AsyncIterator[pb.Load]:
    """The load now, then again each time it differs (looked at every interval_ms)."""
    interval = max(msg.interval_ms or _DEFAULT_INTERVAL_MS, _MIN_INTERVAL_MS) / 1000
    last = None
    while True:
        load = await get_load()
        if load != last:
            last = load
            yield load
        await asyncio.sleep(interval)


class CallRegistry:
    """The Generate calls in flight, by the request id the client knows, with the ids of the
    requests they became (one, or n completions), and the ids that finished lately."""

    def __init__(self):
        self.live: dict[str, list[str]] = {}
        self.recent: OrderedDict[str, None] = OrderedDict()

    def started(self, request_id: str, ids: list[str]) -> None:
        self.live[request_id] = ids

    def ended(self, request_id: str) -> None:
        if self.live.pop(request_id, None) is not None:
            self.recent[request_id] = None
            if len(self.recent) > RECENT_IDS:
                self.recent.popitem(last=False)

    def status(self, request_id: str) -> int:
        return pb.ABORT_STATUS_ALREADY_FINISHED if request_id in self.recent else pb.ABORT_STATUS_NOT_FOUND


class EngineRuntime:
    """Mixed into an engine server's TextGeneration servicer (which has `server` and `calls`)."""

    async def _loaded(self, context):
        """The server's LLMEngine; UNAVAILABLE while the model loads."""
        if self.server.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is loading")
        return self.server.engine.engine

    async def GetModelInfo(self, msg: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        await self._loaded(context)
        return self.server.model_info()

    async def GetLoad(self, msg: pb.GetLoadRequest, context) -> pb.Load:
        await self._loaded(context)
        return await self.server.load()

    async def WatchLoad(self, msg: pb.GetLoadRequest, context):
        await self._loaded(context)
        async for load in watch(self.server.load, msg):
            yield load

    async def Abort(self, msg: pb.AbortRequest, context) -> pb.AbortResponse:
        server, results = self.server, []
        await self._loaded(context)
        for request_id in msg.request_ids:
            ids = self.calls.live.get(request_id)
            if ids is not None:
                server.engine.abort(ids)
                status = pb.ABORT_STATUS_ABORTED
            elif server.options.role != "decode" and await server.release_hold(request_id):
                status = pb.ABORT_STATUS_ABORTED  # a prefill's blocks, held for a decode that will not come
            else:
                status = self.calls.status(request_id)
            results.append(pb.AbortResult(request_id=request_id, status=status))
        return pb.AbortResponse(results=results)

    async def Tokenize(self, msg: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        engine = await self._loaded(context)
        kind = msg.WhichOneof("prompt")
        if kind is None or (kind == "chat" and not msg.chat.messages):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: set text or chat (with messages)")
        if kind == "chat" and not engine.tokenizer.chat_template:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "chat: this checkpoint has no chat template")
        encode = ((lambda: engine.apply_chat_template(chat_messages(msg.chat))) if kind == "chat"
                  else (lambda: engine.tokenize(msg.text)))
        return pb.TokenizeResponse(token_ids=await asyncio.to_thread(encode),
                                   max_model_len=engine.config.max_model_len)

    async def Detokenize(self, msg: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        engine = await self._loaded(context)
        bad = next((t for t in msg.token_ids if not 0 <= t < engine.vocab_size), None)
        if bad is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"token_ids: must be in [0, {engine.vocab_size}), got {bad}")
        skip = msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True
        text = await asyncio.to_thread(engine.tokenizer.decode, list(msg.token_ids), skip_special_tokens=skip)
        return pb.DetokenizeResponse(text=text)


def model_info(engine, model_name: str, role: str) -> pb.ModelInfo:
    """An engine's facts (its config and tokenizer do not change: any thread may read them)."""
    from baton.engine.loader import read_config
    config = engine.config
    architectures = read_config(config.model).get("architectures") or [""]
    return pb.ModelInfo(model_name=model_name, model_path=os.path.abspath(config.model),
                        architecture=architectures[0], max_model_len=config.max_model_len,
                        vocab_size=engine.vocab_size, block_size=config.block_size,
                        dtype=str(engine.runner.kv_cache.dtype).removeprefix("torch."),
                        eos_token_ids=sorted(engine.eos_token_ids),
                        has_chat_template=bool(engine.tokenizer.chat_template), baton_version=baton_version(),
                        role=role)


def load_from_snapshot(snapshot, role: str, address: str, num_in_flight: int) -> pb.Load:
    return pb.Load(role=role, address=address, num_running=snapshot.num_running, num_waiting=snapshot.num_waiting,
                   num_waiting_for_remote_kvs=snapshot.num_waiting_for_kvs, kv_cache_usage=snapshot.kv_cache_usage,
                   num_held_blocks=snapshot.num_held_blocks, num_in_flight=num_in_flight)


class RouterRuntime:
    """Mixed into the router's servicer (which has `router`): the load of the router and its
    backends, Abort wherever a call went, the rest answered by a healthy backend."""

    async def GetModelInfo(self, msg: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        info = await self._ask("GetModelInfo", msg, context)
        info.role, info.model_name = "router", self.router.model_name
        return info

    async def GetLoad(self, msg: pb.GetLoadRequest, context) -> pb.Load:
        return await self._load()

    async def WatchLoad(self, msg: pb.GetLoadRequest, context):
        async for load in watch(self._load, msg):
            yield load

    async def Tokenize(self, msg: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        return await self._ask("Tokenize", msg, context)

    async def Detokenize(self, msg: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        return await self._ask("Detokenize", msg, context)

    async def Abort(self, msg: pb.AbortRequest, context) -> pb.AbortResponse:
        """Abort calls through the router at every backend they reached (a prefill lets go of
        what it holds); a call still at its prefill ends with FINISH_REASON_ABORT here."""
        r, results = self.router, []
        for request_id in msg.request_ids:
            ids = r.calls.live.get(request_id)
            if ids is None:
                results.append(pb.AbortResult(request_id=request_id, status=r.calls.status(request_id)))
                continue
            r.aborted.update(ids)
            reached = set().union(*(r.routed.get(i, ()) for i in ids))
            request = pb.AbortRequest(request_ids=ids)
            await asyncio.gather(*(b.api.Abort(request, metadata=token_metadata(r.options.internal_token), timeout=5)
                                   for b in reached), return_exceptions=True)
            results.append(pb.AbortResult(request_id=request_id, status=pb.ABORT_STATUS_ABORTED))
        return pb.AbortResponse(results=results)

    async def _load(self) -> pb.Load:
        """The router's requests in flight, and each backend's own load (when it answers)."""
        r = self.router
        backends = [(tier.name, b) for tier in (r.prefill, r.decode) for b in tier.backends.values()]

        async def ask(backend):
            if not backend.healthy:
                return None
            try:
                return await backend.api.GetLoad(pb.GetLoadRequest(), timeout=1)
            except grpc.aio.AioRpcError:
                return None
        loads = await asyncio.gather(*(ask(b) for _, b in backends))
        return pb.Load(role="router", address=r.address, num_in_flight=r.num_in_flight, backends=[
            pb.BackendLoad(address=b.address, tier=tier, healthy=b.healthy, outstanding=b.outstanding, load=load)
            for (tier, b), load in zip(backends, loads)])

    async def _ask(self, method: str, request, context):
        """A runtime call answered by a healthy backend (the decode tier first: it is always there)."""
        for tier in (self.router.decode, self.router.prefill):
            for backend in tier.healthy():
                try:
                    return await getattr(backend.api, method)(request, timeout=context.time_remaining() or 10)
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.UNAVAILABLE:
                        await context.abort(e.code(), e.details())
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy backend")
