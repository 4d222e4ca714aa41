"""The router's runtime API beside Generate: its load and its backends', Abort wherever a call
went, LoRA adapters loaded and unloaded on every instance, the rest answered by a healthy
backend. A unit of its own, served under the same gRPC service as Generate
(services/rpc/serving.py's add_text_generation)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from baton.services.router.backends import Backend, Tier
from baton.services.router.in_flight import InFlight
from baton.services.rpc.calls import watch
from baton.services.rpc.errors import pass_on
from baton.services.rpc.names import ABORT_FORWARDED_KEY, token_metadata
from baton.v1 import generate_pb2 as pb


class RouterRuntimeApi:
    """Over the router's two tiers and its Generate calls in flight; `model_name` and `address`
    are what GetModelInfo and GetLoad say of the router; `internal_token` goes with the calls
    it makes to backends on the stack's behalf; `peers`: the router's other replicas."""

    def __init__(self, prefill: Tier, decode: Tier, in_flight: InFlight, model_name: str, address: str,
                 internal_token: str | None, peers: Tier, encoder: Tier):
        self.prefill, self.decode, self.encoder = prefill, decode, encoder  # (an encoder answers no runtime API)
        self.peers = peers  # this router's other replicas: the calls they carry are theirs to abort
        self.in_flight = in_flight
        self.model_name = model_name
        self.address = address
        self.internal_token = internal_token
        self.frames_port = 0  # the router's frames listener, once it listens (0: none)

    def _backends(self) -> list[Backend]:
        """Every instance of both tiers, healthy or not."""
        return [b for tier in (self.prefill, self.decode) for b in tier.backends.values()]

    async def GetModelInfo(self, msg: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        info = await self._ask(lambda api: api.GetModelInfo, msg, context)
        info.role, info.model_name = "router", self.model_name
        info.frames_port = self.frames_port  # the router's own (the instance's is for the router)
        return info

    async def GetLoad(self, msg: pb.GetLoadRequest, context) -> pb.Load:
        return await self._load()

    async def WatchLoad(self, msg: pb.GetLoadRequest, context):
        async for load in watch(self._load, msg):
            yield load

    async def Tokenize(self, msg: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        return await self._ask(lambda api: api.Tokenize, msg, context)

    async def Detokenize(self, msg: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        return await self._ask(lambda api: api.Detokenize, msg, context)

    async def Abort(self, msg: pb.AbortRequest, context) -> pb.AbortResponse:
        """Abort calls through the router at every backend they reached (a prefill lets go of
        what it holds); a call still at its prefill ends with FINISH_REASON_ABORT here. A call
        this replica does not carry is passed on to its peers (a client's connection may reach
        any replica), unless a peer passed it here."""
        results = []
        for request_id in msg.request_ids:
            aborted = self.in_flight.abort(request_id)
            if aborted is None:
                results.append(pb.AbortResult(request_id=request_id, status=self.in_flight.status(request_id)))
                continue
            ids, reached = aborted
            request = pb.AbortRequest(request_ids=ids)
            await asyncio.gather(*(b.api.Abort(request, metadata=token_metadata(self.internal_token), timeout=5)
                                   for b in reached), return_exceptions=True)
            results.append(pb.AbortResult(request_id=request_id, status=pb.ABORT_STATUS_ABORTED))
        unknown = [r for r in results if r.status == pb.ABORT_STATUS_NOT_FOUND]
        forwarded = any(k == ABORT_FORWARDED_KEY for k, _ in context.invocation_metadata() or ())
        if unknown and not forwarded:
            found = await self._abort_at_peers([r.request_id for r in unknown])
            for r in unknown:
                r.status = found.get(r.request_id, r.status)
        return pb.AbortResponse(results=results)

    async def _abort_at_peers(self, request_ids: list[str]) -> dict[str, int]:
        """What the peers answer for calls not known here: aborted or finished where one carries
        it (the first such answer per id); peers that do not answer count as not knowing it. A
        peer whose channel is reconnecting (replicas start in any order, and one restarts) gets
        the call's deadline to come back, not an immediate UNAVAILABLE."""
        request = pb.AbortRequest(request_ids=request_ids)
        metadata = ((ABORT_FORWARDED_KEY, "1"), *token_metadata(self.internal_token))
        answers = await asyncio.gather(*(p.api.Abort(request, metadata=metadata, timeout=5, wait_for_ready=True)
                                         for p in self.peers.backends.values()), return_exceptions=True)
        found = {}
        for answer in answers:
            for r in () if isinstance(answer, BaseException) else answer.results:
                if r.status != pb.ABORT_STATUS_NOT_FOUND:
                    found.setdefault(r.request_id, r.status)
        return found

    # ---- LoRA adapters: every instance loads and unloads alike --------------------------------
    async def LoadAdapter(self, msg: pb.LoadAdapterRequest, context) -> pb.Adapter:
        return await self._everywhere(msg, context)

    async def UnloadAdapter(self, msg: pb.UnloadAdapterRequest, context) -> pb.Adapter:
        return await self._everywhere(msg, context)

    async def ListAdapters(self, msg: pb.ListAdaptersRequest, context) -> pb.ListAdaptersResponse:
        """Each adapter the instances have loaded (as of their last refresh), with where."""
        merged: dict[str, pb.Adapter] = {}
        for b in self._backends():
            for name, adapter in b.adapters.items():
                merged.setdefault(name, _where(adapter)).instances.append(b.address)
        return pb.ListAdaptersResponse(adapters=list(merged.values()))

    async def _everywhere(self, msg: pb.LoadAdapterRequest | pb.UnloadAdapterRequest, context) -> pb.Adapter:
        """Load or unload (by the message's type) on every healthy instance of both tiers; the
        instances that did it are the answer's. An instance's refusal (a bad adapter, one in
        use) is the answer when no instance did it; instances that lack an adapter being
        unloaded are skipped."""
        loading = isinstance(msg, pb.LoadAdapterRequest)
        backends = [b for b in self._backends() if b.healthy]
        md = token_metadata(self.internal_token)
        results = await asyncio.gather(*((b.api.LoadAdapter if loading else b.api.UnloadAdapter)(
            msg, metadata=md, timeout=30) for b in backends), return_exceptions=True)
        done, refusal = None, None
        for backend, result in zip(backends, results):
            if isinstance(result, pb.Adapter):
                done = done or _where(result)
                done.instances.append(backend.address)
                if loading:
                    backend.adapter_loaded(result)
                else:
                    backend.adapter_unloaded(result.name)
            elif isinstance(result, grpc.aio.AioRpcError):
                not_lacking = loading or result.code() != grpc.StatusCode.NOT_FOUND
                if refusal is None or (not_lacking and refusal.code() == grpc.StatusCode.NOT_FOUND):
                    refusal = result
            else:
                raise result
        if refusal is not None and (done is None or refusal.code() != grpc.StatusCode.NOT_FOUND):
            await pass_on(context, refusal)
        if done is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy instance")
        return done

    async def _load(self) -> pb.Load:
        """The router's requests in flight, and each backend's own load (when it answers)."""
        backends = [(tier.name, b) for tier in (self.prefill, self.decode, self.encoder)
                    for b in tier.backends.values()]

        async def ask(tier: str, backend):
            if not backend.healthy or tier == self.encoder.name:
                return None
            try:
                return await backend.api.GetLoad(pb.GetLoadRequest(), timeout=1)
            except grpc.aio.AioRpcError:
                return None
        loads = await asyncio.gather(*(ask(tier, b) for tier, b in backends))
        return pb.Load(role="router", address=self.address, num_in_flight=self.in_flight.count, backends=[
            pb.BackendLoad(address=b.address, tier=tier, healthy=b.healthy, outstanding=b.outstanding, load=load)
            for (tier, b), load in zip(backends, loads)])

    async def _ask(self, rpc: Callable, request, context):
        """A runtime call answered by a healthy backend (the decode tier first: it is always
        there); `rpc` picks the stub's method, e.g. `lambda api: api.Tokenize`."""
        tried = []
        for tier in (self.decode, self.prefill):
            for backend in tier.healthy():
                try:
                    return await rpc(backend.api)(request, timeout=context.time_remaining() or 10)
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.UNAVAILABLE:
                        await pass_on(context, e)
                    tried.append(backend.address)
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"no backend answered (tried {', '.join(tried)})" if tried
                            else self.decode.why_none())


def _where(adapter: pb.Adapter) -> pb.Adapter:
    """An instance's adapter as the router lists it: the same, its instances to be filled in."""
    out = pb.Adapter()
    out.CopyFrom(adapter)
    out.ClearField("instances")
    return out
