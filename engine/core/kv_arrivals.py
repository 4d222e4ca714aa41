"""Where a request's wait for KV outside the scheduler's own steps ends (docs/architecture.md,
"The KV hand-off, state by state"): a decode's pull from a prefill peer (landed; failed, its bad
blocks computed again; a LongRoPE prompt's that came short), blocks loaded back from the host KV
tier, and a finished request's blocks held until a transfer ends (a prefill's, for its decode's
read, moved to the host tier when the device is short; a decode's aborted mid-load, until its
load ended).

`RemoteKVArrivals` keeps the held requests and the hand-offs under way; the scheduler owns one,
tells it when a request ends held and passes on what the connector and the host tier report.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import msgspec

from baton.engine.common.stats import EventType
from baton.engine.core.host_kv_tier import HostKVTier
from baton.engine.core.kv_cache_manager import KVCacheManager
from baton.engine.core.request import Request, RequestStatus, RequestUpdate
from baton.kv_transfer.base import KVConnectorOutput, KVTier


class Record(Protocol):
    """Records a request's telemetry event (dropped for None, or while nobody records)."""

    def __call__(self, request: Request | None, kind: EventType, when: float, **fields: object) -> None: ...


class RemoteKVArrivals:
    def __init__(self, kv: KVCacheManager, host: HostKVTier | None, record: Record, free: Callable[[Request], None]):
        """`host`: the host KV tier, when there is one; `free`: lets go of a finished request's
        blocks (written back to the host tier first, where there is one)."""
        self.kv, self.host, self.record, self.free = kv, host, record, free
        # Finished, but their blocks wait for a transfer: a remote reader (prefill side), or a
        # load still landing in them (a decode request aborted in WAITING_FOR_REMOTE_KVS).
        self.held: dict[str, Request] = {}
        # Held prefill requests whose blocks are being copied to the host tier (request id -> the
        # request and the host block ids): their outputs, which carry the handle, wait for the copy.
        self.handing_off: dict[str, tuple[Request, list[int]]] = {}
        self.num_failed_loads = 0

    # ---- the prefill side: held, handing off, handed off, freed ---------------------------------
    def hold(self, request: Request, needing: Iterable[Request]) -> None:
        """A finished request's blocks stay until a transfer ends. A prefill's hold moves to the
        host tier (handing off) where the device lacks the blocks that `needing` (the running and
        waiting requests) still need for their tokens: held there, it would keep their prompts waiting."""
        self.held[request.request_id] = request
        if self.host is not None and request.kv_handle is not None and self._device_short(needing):
            host_ids = self.host.hand_off(request, len(request.kv_handle.block_ids))
            if host_ids is not None:
                self.handing_off[request.request_id] = (request, host_ids)

    def _device_short(self, needing: Iterable[Request]) -> bool:
        need, free = 0, self.kv.num_free_blocks
        for r in needing:
            need += self.kv.num_blocks_missing(r)
            if need > free:
                return True
        return False

    def output_waits(self, request_id: str) -> bool:
        """Whether a finished request's output waits for its hand-off (its handle names the host's
        blocks once they landed there)."""
        return request_id in self.handing_off

    def handed_off(self, req_id: str) -> RequestUpdate:
        """A held request's blocks landed on the host tier: its device blocks go, and its output
        (held back until now) carries a handle naming the host's."""
        request, host_ids = self.handing_off.pop(req_id)
        if self.held.get(req_id) is request:
            self.kv.free(request)
            request.kv_handle = msgspec.structs.replace(request.kv_handle, block_ids=host_ids, tier=KVTier.HOST,
                                                       draft_start=-1)  # (the host tier keeps no draft KV)
        else:  # let go meanwhile (its caller left): nothing to pull, and its blocks were freed
            request.kv_handle = None
        return RequestUpdate(request, [request.output_token_ids[-1]], True)

    # ---- the decode side: loaded from the host tier, landed or failed from a peer ----------------
    def host_loaded(self, req_ids: Iterable[str], live: Mapping[str, Request]) -> list[Request]:
        """Requests whose blocks came back from the host tier: WAITING again, their blocks cached
        (those aborted meanwhile freed). Returns them for the scheduler to put first in line: they
        hold every block they need now, and a request ahead that waits for blocks must not wait on these."""
        ready = []
        for req_id in req_ids:
            request = live.get(req_id)
            if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                request.status = RequestStatus.WAITING
                self.host.release_owned(request)
                self.kv.cache_blocks(request, request.num_computed_tokens)
                ready.append(request)
            elif (held := self.held.pop(req_id, None)) is not None:
                self.free(held)
        return ready

    def connector_reported(self, kv_out: KVConnectorOutput, live: Mapping[str, Request], now: float,
                           recompute_at: int | None) -> list[Request]:
        """What the connector's worker half reported after a step (`now`): loads started, loads
        landed or failed (WAITING again, failed blocks to compute again), holds ended (their
        blocks freed). `recompute_at`: the scheduler's LongRoPE length (None: none). Returns the
        requests restarted from their first token because their first token took them past it:
        the scheduler gives them their block-hash root."""
        for transfer in kv_out.transfers_started:
            self.record(self._live_or_held(live, transfer.request_id), EventType.KV_LOAD_START, transfer.start_time,
                        transfer=transfer)
        for req_id, start in kv_out.draft_kv_landed.items():
            if req_id in live:
                live[req_id].draft_start = start
        restarted = []
        for req_id in kv_out.finished_recving:
            request = live.get(req_id)
            if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if self._load_ended(request, kv_out, now, recompute_at):
                    restarted.append(request)
        for req_id, transfer in kv_out.transfers_ended.items():
            r = self._live_or_held(live, req_id)
            recompute = r.num_prompt_tokens - max(r.num_cached_tokens, 0) - r.num_external_tokens if r else 0
            self.record(r, EventType.KV_LOAD_END, transfer.end_time, transfer=transfer, num_tokens=recompute)
        for end in kv_out.holds_ended:
            self.record(self.held.get(end.request_id), EventType.HOLD_END, end.time, detail=end.outcome.value)
        for req_id in kv_out.finished_sending | kv_out.finished_recving:  # pulled, released, expired; or landed
            request = self.held.pop(req_id, None)
            if request is not None:
                self.free(request)
        return restarted

    def _load_ended(self, request: Request, kv_out: KVConnectorOutput, now: float, recompute_at: int | None) -> bool:
        """WAITING_FOR_REMOTE_KVS → WAITING: its blocks landed, or those from the first bad one
        on are computed again. Returns whether it restarts for LongRoPE."""
        req_id = request.request_id
        request.remote_kv = None  # loaded or failed: never pulled twice
        request.kv_ready_time = now
        bad = min((i for blocks in self.kv.block_ids(req_id) for i, b in enumerate(blocks)
                   if b in kv_out.invalid_block_ids), default=None)
        if bad is not None:  # recompute from the last valid block (vLLM: _handle_invalid_blocks)
            request.num_computed_tokens = min(request.num_computed_tokens, bad * self.kv.block_size)
            if self.kv.hybrid:  # a sliding group kept no blocks before the load's window: from the prompt's start
                bad = 0
                self._restart(request)
            request.num_external_tokens = max(0, request.num_computed_tokens - request.num_cached_tokens)
            self.num_failed_loads += 1
            if req_id in kv_out.transfers_ended:
                kv_out.transfers_ended[req_id].recompute_from_block = bad
        request.status = RequestStatus.WAITING
        # A prompt computed within recompute_at tokens (by the prefill) that its first token took
        # past: its prompt's KV came short, and it runs long from here.
        long = (recompute_at is not None and request.num_prompt_tokens <= recompute_at < request.num_tokens
                and request.num_computed_tokens > 0)
        if long:
            self._restart(request)
        self.kv.cache_blocks(request, request.num_computed_tokens)
        return long

    def _restart(self, request: Request) -> None:
        """Its blocks go (a prefix it hit keeps its hashes) and it computes from its first token."""
        request.num_computed_tokens = max(request.num_cached_tokens, 0)  # (those blocks' KV is sound)
        self.kv.free(request)
        request.num_computed_tokens = 0

    def _live_or_held(self, live: Mapping[str, Request], request_id: str) -> Request | None:
        return live.get(request_id) or self.held.get(request_id)
