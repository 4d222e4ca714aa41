"""An engine server's runtime API beside Generate: GetModelInfo, GetLoad and WatchLoad,
Abort, Tokenize and Detokenize."""
from __future__ import annotations

import asyncio
import os

import grpc

from baton.services.rpc.api import chat_messages
from baton.services.rpc.runtime import watch
from baton.services.telemetry.tracing import baton_version
from baton.v1 import generate_pb2 as pb


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
