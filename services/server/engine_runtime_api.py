"""An engine server's runtime API beside Generate: GetModelInfo, GetLoad and WatchLoad,
Abort, Tokenize and Detokenize."""
from __future__ import annotations

import asyncio
import os

import grpc

from baton.engine.common.config import read_config
from baton.engine.common.messages import AdapterInfo, LoadAdapter, UnloadAdapter
from baton.engine.common.errors import InvalidArgument
from baton.services.rpc.chat import chat_messages, chat_tools
from baton.services.rpc.errors import abort, abort_invalid
from baton.services.rpc.calls import watch
from baton.services.telemetry.tracing import baton_version
from baton.v1 import generate_pb2 as pb


class EngineRuntime:
    """Mixed into an engine server's TextGeneration servicer (which has `server` and `calls`)."""

    async def _loaded(self, context):
        """The server's engine core client; UNAVAILABLE while the model loads."""
        core = self.server.core
        if core is None or core.facts is None:
            await abort(context, grpc.StatusCode.UNAVAILABLE, "the server is loading",
                        pb.FAILURE_REASON_ENGINE_UNAVAILABLE)
        return core

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
                server.core.abort(ids)
                status = pb.ABORT_STATUS_ABORTED
            elif server.options.role != "decode" and await server.release_hold(request_id):
                status = pb.ABORT_STATUS_ABORTED  # a prefill's blocks, held for a decode that will not come
            else:
                status = self.calls.status(request_id)
            results.append(pb.AbortResult(request_id=request_id, status=status))
        return pb.AbortResponse(results=results)

    async def Tokenize(self, msg: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        core = await self._loaded(context)
        kind = msg.WhichOneof("prompt")
        if kind is None or (kind == "chat" and not msg.chat.messages):
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "prompt: set text or chat (with messages)",
                        field="prompt")
        if kind == "chat" and not core.tokenizer.chat_template:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "chat: this checkpoint has no chat template",
                        field="chat")
        inputs = core.inputs
        encode = ((lambda: inputs.apply_chat_template(chat_messages(msg.chat), chat_tools(msg.chat))) if kind == "chat"
                  else (lambda: inputs.tokenize(msg.text)))
        return pb.TokenizeResponse(token_ids=await asyncio.to_thread(encode), max_model_len=inputs.max_model_len)

    async def Detokenize(self, msg: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        core = await self._loaded(context)
        vocab_size = core.facts.vocab_size
        bad = next((t for t in msg.token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                        f"token_ids: must be in [0, {vocab_size}), got {bad}",
                        field="token_ids")
        skip = msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True
        text = await asyncio.to_thread(core.tokenizer.decode, list(msg.token_ids), skip_special_tokens=skip)
        return pb.DetokenizeResponse(text=text)


    # ---- LoRA adapters ------------------------------------------------------------------------
    async def LoadAdapter(self, msg: pb.LoadAdapterRequest, context) -> pb.Adapter:
        core = await self._loaded(context)
        await self.server.check_token(context)
        info = await self._adapter_call(context, LoadAdapter(msg.lora_name, msg.lora_path))
        core.inputs.adapters[info.name] = info
        return adapter_to_proto(info)

    async def UnloadAdapter(self, msg: pb.UnloadAdapterRequest, context) -> pb.Adapter:
        core = await self._loaded(context)
        await self.server.check_token(context)
        info = await self._adapter_call(context, UnloadAdapter(msg.lora_name))
        core.inputs.adapters.pop(info.name, None)
        return adapter_to_proto(info)

    async def ListAdapters(self, msg: pb.ListAdaptersRequest, context) -> pb.ListAdaptersResponse:
        core = await self._loaded(context)
        return pb.ListAdaptersResponse(adapters=[adapter_to_proto(a) for a in core.inputs.adapters.values()])

    async def _adapter_call(self, context, call: LoadAdapter | UnloadAdapter) -> AdapterInfo:
        try:
            return await self.server.core.call(call)
        except InvalidArgument as e:  # NotFound and InUse too, each with its own status
            await abort_invalid(context, e)


def adapter_to_proto(info: AdapterInfo) -> pb.Adapter:
    return pb.Adapter(name=info.name, path=info.path, rank=info.rank, hash_root=info.hash_root)


def model_info(model_dir: str, facts, tokenizer, model_name: str, role: str) -> pb.ModelInfo:
    """An engine's facts (they do not change once it has loaded)."""
    architectures = read_config(model_dir).get("architectures") or [""]
    return pb.ModelInfo(model_name=model_name, model_path=os.path.abspath(model_dir),
                        architecture=architectures[0], max_model_len=facts.max_model_len,
                        vocab_size=facts.vocab_size, block_size=facts.block_size, dtype=facts.dtype,
                        eos_token_ids=facts.eos_token_ids, has_chat_template=bool(tokenizer.chat_template),
                        baton_version=baton_version(), role=role)
