"""Python clients for the public API, sync and asyncio: tokens and text as they arrive.

    with Client("127.0.0.1:50051") as client:
        for chunk in client.generate("The capital of France is", max_tokens=16, temperature=0):
            print(chunk.text, end="", flush=True)
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc

from baton.services.rpc.frames import FramesOpener
from baton.services.rpc.names import FINISH_REASON_NAMES, GENERATE_METHOD
from baton.services.rpc.request_streams import RequestStreams, StreamedCall, StreamedTokens
from baton.services.rpc.tls import TLSConfig, aio_channel, sync_channel
from baton.v1 import generate_pb2 as pb
from baton.v1 import generate_pb2_grpc, internal_pb2

_OUTPUTS = {"text": pb.OUTPUT_TEXT, "token_ids": pb.OUTPUT_TOKEN_IDS, "both": pb.OUTPUT_TEXT_AND_TOKEN_IDS}


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(slots=True)
class Chunk:
    """One streamed response: the tokens since the last one, the text they completed, and
    on the last chunk (of each completion, with n > 1) the finish reason and usage.
    `logprobs`/`prompt_logprobs` hold TokenLogprobs messages (token_id, logprob, rank,
    top_token_ids, top_logprobs), when asked for."""
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    index: int = 0
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    stop_reason: str | int | None = None


def build_request(prompt: str | list[int] | list[dict], *, request_id: str = "", priority: int = 0,
                  output: str = "both", adapter: str = "", **sampling) -> pb.GenerateRequest:
    """prompt: text, token ids, or chat messages ({"role", "content"} dicts); `sampling`:
    the SamplingParams fields (max_tokens, temperature, top_p, top_k, min_p, seed, stop,
    stop_token_ids, include_stop_str_in_output, ignore_eos, min_tokens, repetition_penalty,
    presence_penalty, frequency_penalty, logit_bias, logprobs, prompt_logprobs,
    skip_special_tokens, n). `adapter`: a LoRA adapter the server has loaded ("": the base model)."""
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = [sampling["stop"]]
    msg = pb.GenerateRequest(request_id=request_id, priority=priority, output=_OUTPUTS[output], adapter=adapter,
                             sampling=pb.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}))
    if isinstance(prompt, str):
        msg.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        msg.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    else:
        msg.token_ids.ids.extend(prompt)
    return msg


def chunk_from_response(resp: pb.GenerateResponse) -> Chunk:
    chunk = Chunk(resp.request_id, list(resp.token_ids), resp.text, index=resp.index,
                  logprobs=list(resp.logprobs) or None, prompt_logprobs=list(resp.prompt_logprobs) or None)
    stop = resp.WhichOneof("stop_reason")
    if stop is not None:
        chunk.stop_reason = getattr(resp, stop)
    if resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
        chunk.finish_reason = FINISH_REASON_NAMES[resp.finish_reason]
        u = resp.usage
        chunk.usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
    return chunk


class Client:
    def __init__(self, target: str, options: list[tuple] | None = None, tls: TLSConfig | None = None):
        self.channel = sync_channel(target, tls, options or [])
        self.stub = generate_pb2_grpc.TextGenerationStub(self.channel)

    def generate(self, prompt, *, timeout: float | None = None, metadata=None, **kwargs) -> Iterator[Chunk]:
        """Stream one completion. Breaking out of the loop cancels the call (and the request)."""
        call = self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout, metadata=metadata)
        try:
            for resp in call:
                yield chunk_from_response(resp)
        finally:
            call.cancel()  # a no-op once the stream has ended

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _host_of(target: str) -> str | None:
    """HOST of a HOST:PORT target (None for another form, e.g. dns:///name:port)."""
    host, sep, port = target.rpartition(":")
    return host.strip("[]") if sep and host and port.isdigit() and "/" not in host else None


class AsyncClient:
    """`multiplex`: the completions streaming at once share one gRPC stream (GenerateStreams), a
    message per engine step for all of them instead of a call each and a message per token: for
    a client that carries many requests (a gateway, a batch job). Each still reads as its own
    call: its chunks, its status, its deadline; leaving the loop cancels it alone. `frames`
    (with multiplex): that stream goes over a bare TCP connection (services/rpc/frames.py) where
    the server listens for one (its ModelInfo says where, asked before the first completion), at
    a fraction of gRPC's CPU per message on both ends; where the port cannot be reached, over
    gRPC, no completion lost."""

    def __init__(self, target: str, options: list[tuple] | None = None, tls: TLSConfig | None = None,
                 multiplex: bool = False, frames: bool = True):
        self.channel = aio_channel(target, tls, options or [])
        self.stub = generate_pb2_grpc.TextGenerationStub(self.channel)
        # (responses as bytes, read as a stream's are)
        self._generate = self.channel.unary_stream(GENERATE_METHOD,
                                                   request_serializer=pb.GenerateRequest.SerializeToString)
        self.streams = RequestStreams(self.channel, self._generate) if multiplex else None
        self._tls = tls
        self._frames_host = _host_of(target) if multiplex and frames else None  # None: frames not (or no more) sought
        self._frames_lookup: asyncio.Future | None = None

    async def _look_up_frames(self) -> None:
        try:
            info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        except grpc.aio.AioRpcError:  # (a server not ready yet) asked again before the next completion
            self._frames_lookup = None
            return
        if info.frames_port:
            self.streams.frames = FramesOpener(self._frames_host, info.frames_port,
                                               internal_pb2.FRAMES_SERVICE_GENERATE, self._tls)
        self._frames_host = None

    async def generate(self, prompt, *, timeout: float | None = None, metadata=None,
                       **kwargs) -> AsyncIterator[Chunk]:
        msg = build_request(prompt, **kwargs)
        if self._frames_host is not None:
            if self._frames_lookup is None:
                self._frames_lookup = asyncio.ensure_future(self._look_up_frames())
            await asyncio.shield(self._frames_lookup)  # (shared: one completion's cancel is not the others')
        call = (self.streams.open(msg, metadata, timeout) if self.streams is not None
                else self._generate(msg, timeout=timeout, metadata=metadata))
        try:  # (a response with nothing but tokens, read off a stream, is never serialized)
            async for resp in (call.responses(tokens=True) if isinstance(call, StreamedCall) else call):
                yield (Chunk(*resp) if isinstance(resp, StreamedTokens) else
                       chunk_from_response(pb.GenerateResponse.FromString(resp)))
        finally:
            call.cancel()

    async def close(self) -> None:
        if self.streams is not None:
            self.streams.close()
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
