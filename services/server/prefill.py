"""The prefill tier's internal calls: `Prefill`, which computes a prompt, samples its first
token and holds its blocks for a decode peer, returning their handle; `Streams`, many Prefill
calls on one stream (a GenerateStreams whose requests each answer one PrefillResponse); and
`Release`, which lets go of a handle's blocks that no decode will pull."""
from __future__ import annotations

import asyncio
import time

import grpc

from baton.engine.common.core_messages import ReleaseHold
from baton.engine.common.errors import InvalidArgument, check
from baton.engine.front.core_client import CoreClient
from baton.engine.front.output_processor import StepOutput
from baton.services.rpc.calls import CallRegistry
from baton.services.rpc.errors import abort, abort_invalid
from baton.services.rpc.fan_out import num_completions
from baton.services.rpc.generate_streams import GenerateStreams, StreamContext
from baton.services.rpc.kv_wire import handle_to_proto
from baton.services.rpc.serving import in_background
from baton.services.server.call_checks import CallChecks
from baton.services.server.core_requests import MadeRequest, core_request_from_proto
from baton.services.server.encoded_images import ChatImages
from baton.services.server.engine_telemetry import EngineTelemetry
from baton.services.server.responses import ENGINE_ERRORS, abort_for_engine_error, response_from_output
from baton.v1 import generate_pb2 as pb
from baton.v1 import internal_pb2, internal_pb2_grpc


class PrefillService(internal_pb2_grpc.PrefillServicer):
    """`calls`: the server's calls in flight (Generate's too), which Abort looks up; `address`:
    where decodes reach this server, in the handles it gives out."""

    def __init__(self, core: CoreClient, role: str, checks: CallChecks, calls: CallRegistry,
                 telemetry: EngineTelemetry, address: str, images: ChatImages):
        self.core = core
        self.images = images
        self.role = role
        self.checks = checks
        self.calls = calls
        self.telemetry = telemetry
        self.address = address
        self._background: set[asyncio.Task] = set()  # releases of holds whose caller went away
        self.streams = GenerateStreams(self._answer)  # (served over frames too)

    async def Streams(self, commands, context: grpc.aio.ServicerContext):
        async for batch in self.streams.Generate(commands, context):
            yield batch

    async def _answer(self, msg: pb.GenerateRequest, context: StreamContext):
        """A request of Streams: its Prefill's one response."""
        yield await self.Prefill(msg, context)

    async def Prefill(self, msg: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        telemetry = self.telemetry
        with telemetry.server_span(context, msg, "Prefill") as span:
            await self.checks.from_stack(context)
            await self.checks.serving(context)
            try:
                check(num_completions(msg) == 1, "sampling.n", "must be 1 at a prefill (the router fans n out)")
                images = await self.images.of(msg, self.core.inputs.images)
                made = core_request_from_proto(msg, self.core, self.role, for_prefill=True, images=images)
            except InvalidArgument as e:
                await abort_invalid(context, e)
            request = made.request
            # A caller gone before the handle reached it leaves nobody to pull the blocks: also
            # when the request had finished (and its blocks were held) just as the call was
            # cancelled, where the stream's own abort comes too late. Releasing a request that
            # is not held does nothing.
            context.add_done_callback(lambda ctx: ctx.cancelled() and in_background(
                self._background, self._release_hold(request.request_id)))
            rt = telemetry.track(request, span)
            last, calls = None, self.calls
            calls.started(request.request_id, [request.request_id])
            try:
                async for last in self.core.generate(request, min_tokens=made.min_tokens):  # noqa: B007 - the last one
                    pass
            except ENGINE_ERRORS as e:
                telemetry.drop(rt, time.monotonic(), str(e))
                await abort_for_engine_error(context, e)
            finally:
                calls.ended(request.request_id)
            if last is None or last.finish_reason not in ("stop", "length"):
                await abort(context, grpc.StatusCode.ABORTED, f"request {request.request_id} ended without its "
                                                              f"first token")
            return self._reply(last, made, rt)

    def _reply(self, last: StepOutput, made: MadeRequest, rt) -> internal_pb2.PrefillResponse:
        first = response_from_output(last, made.output)
        handle = last.kv_handle
        if handle is None:  # the first token ended the request (a stop token or string, or max_tokens 1)
            return internal_pb2.PrefillResponse(first=first)
        first.ClearField("finish_reason")  # the request goes on at the decode side
        first.ClearField("usage")
        return internal_pb2.PrefillResponse(first=first, handle=handle_to_proto(
            handle, self.address, rt.hold_context() if rt is not None else {}, made.request.images))

    async def Release(self, handle: pb.KVHandle, context: grpc.aio.ServicerContext):
        await self.checks.internal(context)
        return internal_pb2.ReleaseResponse(released=await self._release_hold(handle.request_id))

    async def _release_hold(self, request_id: str) -> bool:
        """Let go of blocks held for a decode that will not pull them; false when none are held."""
        return await self.core.call(ReleaseHold(request_id))
