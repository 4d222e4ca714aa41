"""The public Generate of an engine server: a GenerateRequest made into the engine's request
(core_requests.py), streamed from the engine core, its outputs as the API's responses; n
completions fanned out. At a decode, a request with a KV handle meets the handle's prefill
engine first (kv_peers.py). A request alone on its call hands its responses after the first
straight to where the call takes them (CoreClient.sink; stand_in_context.Responses: a gRPC
call's, a stream of requests', an HTTP event stream's)."""
from __future__ import annotations

import time
import uuid

import grpc

from baton.engine.common.errors import InvalidArgument, check
from baton.engine.front.core_client import CoreClient
from baton.engine.front.output_processor import StepOutput
from baton.services.rpc.calls import CallRegistry
from baton.services.rpc.errors import abort, abort_invalid
from baton.services.rpc.fan_out import child_requests, merge, num_completions
from baton.services.rpc.kv_wire import image_spans_from_proto
from baton.services.rpc.stand_in_context import Responses, responses_of
from baton.services.server.call_checks import CallChecks
from baton.services.server.core_requests import MadeRequest, core_request_from_proto
from baton.services.server.encoded_images import ChatImages
from baton.services.server.engine_telemetry import EngineTelemetry
from baton.services.server.kv_peers import KVPeers
from baton.services.server.responses import (
    ENGINE_ERRORS,
    abort_for_engine_error,
    decode_timing,
    output_parts,
    response_from_output,
)
from baton.v1 import generate_pb2 as pb


class GenerationService:
    """baton.v1.TextGeneration/Generate (the service's other methods are the runtime API's,
    engine_runtime_api.py). `calls`: the Generate calls in flight, which Abort looks up."""

    def __init__(self, core: CoreClient, role: str, checks: CallChecks, calls: CallRegistry,
                 telemetry: EngineTelemetry, kv_peers: KVPeers, images: ChatImages):
        self.core = core
        self.images = images
        self.role = role
        self.checks = checks
        self.calls = calls
        self.telemetry = telemetry
        self.kv_peers = kv_peers

    async def Generate(self, msg: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                       responses: Responses | None = None):
        handle = msg.kv_handle if msg.HasField("kv_handle") else None
        with self.telemetry.server_span(context, msg, "Generate") as span:
            await self.checks.serving(context)
            if handle is not None or msg.HasField("encoded_images"):  # the stack's to set
                await self.checks.from_stack(context)
            msg.request_id = msg.request_id or uuid.uuid4().hex
            if msg.request_id in self.calls.live:
                await abort(context, grpc.StatusCode.ALREADY_EXISTS, f"request_id: {msg.request_id!r} is already "
                                                                     f"in flight", field="request_id")
            try:
                n = num_completions(msg)
                check(n == 1 or handle is None, "sampling.n", "must be 1 with a kv_handle")
                # A prefill's handle names the images' spans: the decode reads none of them (errors.ImagesNotSent).
                images = (image_spans_from_proto(handle) if handle is not None and handle.images else
                          await self.images.of(msg, self.core.inputs.images))
                made = [core_request_from_proto(child, self.core, self.role, images=images)
                        for child in (child_requests(msg, n) if n > 1 else [msg])]
            except InvalidArgument as e:
                await abort_invalid(context, e)
            # A request alone on its call (n of 1: n's merge reorders) skips its generator once it
            # can: its outputs go from the step's fan-out straight to where the call takes them
            # (CoreClient.sink): the call's next message, a stream's, an HTTP stream's next write.
            stream = responses_of(context, responses) if n == 1 else None
            streams = [self._completion(m, i, msg.request_id, handle, span, context, stream)
                       for i, m in enumerate(made)]
            self.calls.started(msg.request_id, [m.request.request_id for m in made])
            try:
                async for resp in streams[0] if n == 1 else merge(streams):
                    yield resp
            finally:
                self.calls.ended(msg.request_id)

    async def _completion(self, made: MadeRequest, index: int, request_id: str, handle: pb.KVHandle | None, span,
                          context: grpc.aio.ServicerContext, stream: Responses | None = None):
        """One engine request's responses (one of n completions); with `stream` (the request is
        alone on a context that takes them straight), those after the first but the last go to it
        instead, once the core client can sink them."""
        telemetry = self.telemetry
        rt = telemetry.track(made.request, span, dict(handle.trace_context) if handle is not None else None)
        if handle is not None:
            try:
                await self.kv_peers.ensure(handle, context, rt)
            except BaseException as e:  # never reached the engine: nothing else ends its telemetry
                telemetry.drop(rt, time.monotonic(), f"no KV peer: {e!r}")
                raise
        try:
            # Token ids only and no stop strings: nothing to detokenize.
            async for out in self.core.generate(made.request, detokenize=made.output != pb.OUTPUT_TOKEN_IDS):
                if handle is not None:  # the router's P/D breakdown needs the decode's side of it
                    await context.send_initial_metadata(decode_timing(out))
                    handle = None
                yield response_from_output(out, made.output, index, request_id)
                if stream is not None:
                    sink = _StreamSink(stream, made.output, request_id)
                    if self.core.sink(made.request, sink.output, sink.token):
                        stream = None  # (sunk: nothing but the last comes here now)
        except ENGINE_ERRORS as e:
            telemetry.drop(rt, time.monotonic(), str(e))
            await abort_for_engine_error(context, e)


class _StreamSink:
    """A request's responses but its last, straight to its context (CoreClient.sink)."""
    __slots__ = ("stream", "mode", "request_id", "with_ids", "with_text")

    def __init__(self, stream: Responses, output: int, request_id: str):
        self.stream, self.mode, self.request_id = stream, output, request_id
        self.with_ids, self.with_text = output != pb.OUTPUT_TEXT, output != pb.OUTPUT_TOKEN_IDS  # (output_parts')

    def output(self, out: StepOutput) -> None:
        if out.logprobs is None and out.prompt_logprobs is None:
            self.stream.respond_tokens(self.request_id, *output_parts(out, self.mode))
        else:
            self.stream.respond(response_from_output(out, self.mode, 0, self.request_id))

    def token(self, token_id: int, text: str) -> None:
        self.stream.respond_tokens(self.request_id, [token_id] if self.with_ids else [],
                                   text if self.with_text else "")
