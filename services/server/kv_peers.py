"""The KV handshake between tiers: the layout trade both sides answer (`KVPeer/Handshake`),
and the decode side's handshakes with the prefill engines its handles name. Each side's
engine core compares the other's KV format (model, dtype, shapes, block size, attention
backend) and refuses a peer that differs, naming the field, before any block moves."""
from __future__ import annotations

import asyncio
import time

import grpc

from baton.engine.common.core_messages import AddPeer
from baton.engine.front.core_client import CoreClient
from baton.kv_transfer.base import KVFormatMismatch
from baton.services.rpc.errors import abort, failure_of_error
from baton.services.rpc.kv_wire import layout_from_proto, layout_to_proto
from baton.services.rpc.names import token_metadata
from baton.services.rpc.tls import TLSConfig, aio_channel
from baton.services.server.call_checks import CallChecks
from baton.v1 import generate_pb2 as pb
from baton.v1 import internal_pb2, internal_pb2_grpc


class PeerUnusable(Exception):
    """A handle's prefill engine cannot serve its blocks: the status, reason and message for the stream."""

    def __init__(self, code: grpc.StatusCode, reason: int, message: str, field: str | None = None):
        super().__init__(message)
        self.code, self.reason, self.field = code, reason, field


class KVPeerService(internal_pb2_grpc.KVPeerServicer):
    """The side a peer calls: its layout to the core, which refuses another KV format; ours back."""

    def __init__(self, core: CoreClient, checks: CallChecks):
        self.core = core
        self.checks = checks

    async def Handshake(self, theirs: internal_pb2.KVLayout, context: grpc.aio.ServicerContext):
        await self.checks.internal(context)
        try:
            await self.core.call(AddPeer(layout_from_proto(theirs)))
        except KVFormatMismatch as e:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"kv_layout.format.{e}",
                        pb.FAILURE_REASON_KV_FORMAT_MISMATCH, f"kv_layout.format.{e.field}")
        return layout_to_proto(self.core.facts.kv_layout)


class KVPeers:
    """The decode side: meets each prefill engine its handles name (trading layouts) before
    the first pull from it, over `tls` when given, with the stack's `internal_token`."""

    def __init__(self, core: CoreClient, tls: TLSConfig | None, internal_token: str | None):
        self.core = core
        self.tls = tls
        self.internal_token = internal_token
        self.known: set[str] = set()  # prefill engine ids met (the core has their layouts)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._handshakes: dict[str, asyncio.Future] = {}  # prefill engine id -> the handshake under way
        self.num_handshakes = 0  # started by this server

    async def ensure(self, handle: pb.KVHandle, context: grpc.aio.ServicerContext, rt=None) -> None:
        """Trade layouts with the handle's prefill engine unless we know it (a restarted prefill
        has a new engine id, so it is met again). Streams arriving together for an engine we
        have not met share one handshake."""
        if handle.engine_id in self.known:
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
            await abort(context, e.code, str(e), e.reason, e.field)
        if rt is not None:
            rt.end_phase("kv_handshake", time.monotonic())

    def _handshake_done(self, engine_id: str, handshake: asyncio.Future) -> None:
        del self._handshakes[engine_id]  # a failed one is tried again by the next stream
        if not handshake.cancelled():
            handshake.exception()  # retrieved, even when every waiting stream was cancelled

    async def _handshake(self, handle: pb.KVHandle) -> None:
        self.num_handshakes += 1
        channel = self._channels.get(handle.address)
        if channel is None:
            channel = self._channels[handle.address] = aio_channel(handle.address, self.tls)
        try:
            theirs = await internal_pb2_grpc.KVPeerStub(channel).Handshake(
                layout_to_proto(self.core.facts.kv_layout), metadata=token_metadata(self.internal_token),
                timeout=10)
        except grpc.aio.AioRpcError as e:
            failure = failure_of_error(e)
            if failure.reason == pb.FAILURE_REASON_KV_FORMAT_MISMATCH:
                raise PeerUnusable(grpc.StatusCode.FAILED_PRECONDITION, failure.reason,
                                   f"kv_handle: prefill {handle.address} refused this decode: {e.details()}",
                                   failure.field) from e
            raise PeerUnusable(grpc.StatusCode.UNAVAILABLE, pb.FAILURE_REASON_KV_PEER_UNREACHABLE,
                               f"kv_handle: cannot reach prefill {handle.address}: "
                               f"{e.code().name} {e.details()}") from e
        if theirs.engine_id != handle.engine_id:
            raise PeerUnusable(grpc.StatusCode.FAILED_PRECONDITION, pb.FAILURE_REASON_KV_PEER_RESTARTED,
                               f"kv_handle: {handle.address} is now engine {theirs.engine_id}, not "
                               f"{handle.engine_id} (it restarted; its blocks are gone)")
        try:
            await self.core.call(AddPeer(layout_from_proto(theirs)))
        except KVFormatMismatch as e:
            raise PeerUnusable(grpc.StatusCode.FAILED_PRECONDITION, pb.FAILURE_REASON_KV_FORMAT_MISMATCH,
                               f"kv_handle: prefill {handle.address} holds KV of another format: "
                               f"kv_layout.format.{e}", f"kv_layout.format.{e.field}") from e
        self.known.add(handle.engine_id)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
