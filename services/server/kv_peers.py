"""What an engine server does as a peer of the other tier: the prefill side's internal calls
(`Prefill`, which holds a prompt's blocks and returns their handle, and `Release`), the
layout handshake both sides answer (`KVPeer/Handshake`), and the decode side's handshakes
with the prefill engines its handles name."""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import grpc

from baton.engine.errors import InvalidArgument, check
from baton.engine.llm_engine import StepOutput
from baton.kv_transfer.nixl_connector import KVLayout
from baton.services.rpc.tls import aio_channel
from baton.services.rpc.api import token_metadata
from baton.services.rpc.serving import in_background
from baton.services.server.responses import ENGINE_ERRORS, abort_for_engine_error, response_from_output
from baton.services.rpc.fan_out import num_completions
from baton.v1 import generate_pb2 as pb
from baton.v1 import internal_pb2, internal_pb2_grpc

if TYPE_CHECKING:
    from baton.services.server.server import GenerationService, Server


class PeerUnusable(Exception):
    """A handle's prefill engine cannot serve its blocks: the status and message for the stream."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def layout_to_proto(layout: KVLayout) -> internal_pb2.KVLayout:
    return internal_pb2.KVLayout(engine_id=layout.engine_id, agent_metadata=layout.agent_metadata,
                                 base_addr=layout.base_addr, block_bytes=layout.block_bytes,
                                 num_blocks=layout.num_blocks, mem_type=layout.mem_type, dev_id=layout.dev_id)


def layout_from_proto(msg: internal_pb2.KVLayout) -> KVLayout:
    return KVLayout(msg.engine_id, msg.agent_metadata, msg.base_addr, msg.block_bytes, msg.num_blocks,
                    msg.mem_type, msg.dev_id)


class PrefillService(internal_pb2_grpc.PrefillServicer):
    def __init__(self, server: Server, generation: GenerationService):
        self.server = server
        self.generation = generation

    async def Prefill(self, msg: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        server = self.server
        with server.server_span(context, msg, "Prefill") as span:
            await server.check_token(context)
            if not server.serving:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is loading or draining")
            try:
                check(num_completions(msg) == 1, "sampling.n", "must be 1 at a prefill (the router fans n out)")
                request, output = self.generation.make_request(msg, for_prefill=True)
            except InvalidArgument as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            # A caller gone before the handle reached it leaves nobody to pull the blocks: also
            # when the request had finished (and its blocks were held) just as the call was
            # cancelled, where the engine's abort comes too late. Releasing a request that is
            # not held does nothing.
            context.add_done_callback(lambda ctx: ctx.cancelled() and in_background(
                server.background, server.release_hold(request.request_id)))
            rt = server.telemetry.track(request, span)
            last, calls = None, self.generation.calls
            calls.started(request.request_id, [request.request_id])
            try:
                async for last in server.engine.generate(request):
                    pass
            except ENGINE_ERRORS as e:
                server.telemetry.drop(rt, time.monotonic(), str(e))
                await abort_for_engine_error(context, e)
            finally:
                calls.ended(request.request_id)
            if last is None or last.finish_reason not in ("stop", "length"):
                await context.abort(grpc.StatusCode.ABORTED, f"request {request.request_id} ended without its first token")
            return self._reply(last, output, rt)

    def _reply(self, last: StepOutput, output: int, rt) -> internal_pb2.PrefillResponse:
        first = response_from_output(last, output)
        handle = last.kv_transfer_params
        if handle is None:  # the first token ended the request (a stop token, or max_tokens 1)
            return internal_pb2.PrefillResponse(first=first)
        first.ClearField("finish_reason")  # the request goes on at the decode side
        first.ClearField("usage")
        return internal_pb2.PrefillResponse(
            first=first,
            handle=pb.KVHandle(engine_id=handle["remote_engine_id"], address=self.server.address,
                               request_id=handle["remote_request_id"], block_ids=handle["remote_block_ids"],
                               num_tokens=handle["num_tokens"], first_token=handle["first_token"],
                               trace_context=rt.hold_context() if rt is not None else {}))

    async def Release(self, handle: pb.KVHandle, context: grpc.aio.ServicerContext):
        await self.server.check_internal(context)
        return internal_pb2.ReleaseResponse(released=await self.server.release_hold(handle.request_id))


class KVPeerService(internal_pb2_grpc.KVPeerServicer):
    def __init__(self, server: Server):
        self.server = server

    async def Handshake(self, theirs: internal_pb2.KVLayout, context: grpc.aio.ServicerContext):
        await self.server.check_internal(context)
        try:
            await self.server.engine.call(self.server.kv_worker.add_peer, layout_from_proto(theirs))
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return layout_to_proto(self.server.kv_worker.layout)


class KVPeers:
    """The decode side: meets each prefill engine its handles name (trading layouts) before
    the first pull from it."""

    def __init__(self, server: Server):
        self.server = server
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._handshakes: dict[str, asyncio.Future] = {}  # prefill engine id -> the handshake under way
        self.num_handshakes = 0  # started by this server

    async def ensure(self, handle: pb.KVHandle, context: grpc.aio.ServicerContext, rt=None) -> None:
        """Trade layouts with the handle's prefill engine unless we know it (a restarted prefill
        has a new engine id, so it is met again). Streams arriving together for an engine we
        have not met share one handshake."""
        if handle.engine_id in self.server.kv_worker.peers:
            return
        pending = self._handshakes.get(handle.engine_id)
        if pending is None:
            pending = self._handshakes[handle.engine_id] = asyncio.ensure_future(self._handshake(handle))
            pending.add_done_callback(lambda f: self._handshake_done(handle.engine_id, f))
        if rt is not None:
            rt.start_phase("kv_handshake", time.monotonic(), {"baton.kv.remote_engine_id": handle.engine_id,
                                                              "server.address": handle.address})
        try:
            await asyncio.shield(pending)  # a cancelled stream leaves the handshake to the others
        except PeerUnusable as e:
            if rt is not None:  # the trace shows the pull that could not happen
                rt.end_phase("kv_handshake", time.monotonic(), error=str(e))
                rt.transfer_failed(str(e), time.monotonic())
            await context.abort(e.code, str(e))
        if rt is not None:
            rt.end_phase("kv_handshake", time.monotonic())

    def _handshake_done(self, engine_id: str, handshake: asyncio.Future) -> None:
        del self._handshakes[engine_id]  # a failed one is tried again by the next stream
        if not handshake.cancelled():
            handshake.exception()  # retrieved, even when every waiting stream was cancelled

    async def _handshake(self, handle: pb.KVHandle) -> None:
        server = self.server
        self.num_handshakes += 1
        channel = self._channels.get(handle.address)
        if channel is None:
            channel = self._channels[handle.address] = aio_channel(handle.address, server.options.tls)
        try:
            theirs = await internal_pb2_grpc.KVPeerStub(channel).Handshake(
                layout_to_proto(server.kv_worker.layout), metadata=token_metadata(server.options.internal_token),
                timeout=10)
        except grpc.aio.AioRpcError as e:
            raise PeerUnusable(grpc.StatusCode.UNAVAILABLE, f"kv_handle: cannot reach prefill {handle.address}: "
                                                            f"{e.code().name} {e.details()}") from e
        if theirs.engine_id != handle.engine_id:
            raise PeerUnusable(grpc.StatusCode.FAILED_PRECONDITION,
                               f"kv_handle: {handle.address} is now engine {theirs.engine_id}, not "
                               f"{handle.engine_id} (it restarted; its blocks are gone)")
        await server.engine.call(server.kv_worker.add_peer, layout_from_proto(theirs))

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
