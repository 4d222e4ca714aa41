"""An engine server's runtime API beside Generate: GetModelInfo, GetLoad and WatchLoad,
Abort, Tokenize and Detokenize, and the LoRA adapters' LoadAdapter, UnloadAdapter and
ListAdapters. A unit of its own, served under the same gRPC service as Generate
(services/rpc/serving.py's add_text_generation)."""
from __future__ import annotations

import asyncio
import os

import grpc

from baton.engine.common.config import read_config
from baton.engine.common.core_messages import AdapterInfo, GetSnapshot, LoadAdapter, ReleaseHold, UnloadAdapter
from baton.engine.common.errors import InvalidArgument
from baton.engine.front.core_client import CoreClient
from baton.services.rpc.calls import CallRegistry, watch
from baton.services.rpc.chat import chat_messages, chat_tools
from baton.services.rpc.errors import abort, abort_invalid
from baton.services.server.call_checks import CallChecks
from baton.services.server.snapshots import load_to_proto
from baton.services.telemetry.tracing import baton_version
from baton.v1 import generate_pb2 as pb


class EngineRuntimeApi:
    """Served under baton.v1.TextGeneration beside Generate (generation.py). `calls`: the
    server's Generate and Prefill calls in flight, by the client's request id; `model_dir`,
    `model_name`, `role` and `address` are what GetModelInfo and GetLoad say of this server."""

    def __init__(self, core: CoreClient, role: str, checks: CallChecks, calls: CallRegistry, model_dir: str,
                 model_name: str, address: str):
        self.core = core
        self.role = role
        self.checks = checks
        self.calls = calls
        self.model_dir = model_dir
        self.model_name = model_name
        self.address = address
        self.frames_port = 0  # the server's frames listener, once it listens (0: none)

    async def GetModelInfo(self, msg: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        await self.checks.loaded(context)
        info = model_info(self.model_dir, self.core.facts, self.core.tokenizer, self.model_name, self.role)
        info.frames_port = self.frames_port
        return info

    async def GetLoad(self, msg: pb.GetLoadRequest, context) -> pb.Load:
        await self.checks.loaded(context)
        return await self._load()

    async def WatchLoad(self, msg: pb.GetLoadRequest, context):
        await self.checks.loaded(context)
        async for load in watch(self._load, msg):
            yield load

    async def _load(self) -> pb.Load:
        snapshot = await self.core.call(GetSnapshot())
        return load_to_proto(snapshot, self.role, self.address, self.core.num_in_flight)

    async def Abort(self, msg: pb.AbortRequest, context) -> pb.AbortResponse:
        results = []
        await self.checks.loaded(context)
        for request_id in msg.request_ids:
            ids = self.calls.live.get(request_id)
            if ids is not None:
                self.core.abort(ids)
                status = pb.ABORT_STATUS_ABORTED
            elif self.role != "decode" and await self.core.call(ReleaseHold(request_id)):
                status = pb.ABORT_STATUS_ABORTED  # a prefill's blocks, held for a decode that will not come
            else:
                status = self.calls.status(request_id)
            results.append(pb.AbortResult(request_id=request_id, status=status))
        return pb.AbortResponse(results=results)

    async def Tokenize(self, msg: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        core = self.core
        await self.checks.loaded(context)
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
        core = self.core
        await self.checks.loaded(context)
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
        await self.checks.loaded(context)
        await self.checks.from_stack(context)
        info = await self._adapter_call(context, LoadAdapter(msg.lora_name, msg.lora_path))
        self.core.inputs.adapter_loaded(info)
        return adapter_to_proto(info)

    async def UnloadAdapter(self, msg: pb.UnloadAdapterRequest, context) -> pb.Adapter:
        await self.checks.loaded(context)
        await self.checks.from_stack(context)
        info = await self._adapter_call(context, UnloadAdapter(msg.lora_name))
        self.core.inputs.adapter_unloaded(info.name)
        return adapter_to_proto(info)

    async def ListAdapters(self, msg: pb.ListAdaptersRequest, context) -> pb.ListAdaptersResponse:
        await self.checks.loaded(context)
        return pb.ListAdaptersResponse(adapters=[adapter_to_proto(a) for a in self.core.inputs.loaded_adapters()])

    async def _adapter_call(self, context, call: LoadAdapter | UnloadAdapter) -> AdapterInfo:
        try:
            return await self.core.call(call)
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
                        baton_version=baton_version(), role=role, kv_cache_dtype=facts.kv_cache_dtype or facts.dtype,
                        kv_scales=facts.kv_scales)
