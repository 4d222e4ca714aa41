"""How the scheduler takes KV that arrives, or fails to, outside its own steps: a decode's pull
from a prefill peer (finished, failed blocks computed again, LongRoPE prompts that came short),
blocks loaded back from the host KV tier, and a prefill's hold handed to the host tier. Scheduler
takes it as a mixin: these read and change its queues and requests."""
from __future__ import annotations

import msgspec

from baton.engine.core.request import Request, RequestStatus, RequestUpdate
from baton.engine.common.stats import EventType
from baton.kv_transfer.base import KVConnectorOutput, KVTier


class KVArrivals:
    def _handed_off(self, req_id: str) -> RequestUpdate:
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

    def _host_loaded(self, req_id: str) -> None:
        """A request's blocks came back from the host tier: it may run (or, aborted meanwhile, free them)."""
        request = self.requests.get(req_id)
        if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            request.status = RequestStatus.WAITING
            self.host.release_owned(request)
            self.kv.cache_blocks(request, request.num_computed_tokens)
            # First in line: it holds every block it needs now, and a request ahead of it that
            # waits for blocks must not wait on these.
            self.waiting.remove(request)
            self.waiting.appendleft(request)
        elif (held := self.held.pop(req_id, None)) is not None:
            self._free(held)

    def _restart(self, request: Request) -> None:
        """Its blocks go (a prefix it hit keeps its hashes) and it computes from its first token."""
        request.num_computed_tokens = max(request.num_cached_tokens, 0)  # (those blocks' KV is sound)
        self.kv.free(request)
        request.num_computed_tokens = 0

    def _crosses_recompute_at(self, request: Request) -> bool:
        """A request whose prompt was computed within recompute_at tokens (by a prefill peer) but
        that is longer now: its first token took it past."""
        return (self.recompute_at is not None and request.num_prompt_tokens <= self.recompute_at < request.num_tokens
                and request.num_computed_tokens > 0)

    def _update_from_connector(self, kv_out: KVConnectorOutput) -> None:
        for transfer in kv_out.transfers_started:
            self.record(self._live_or_held(transfer.request_id), EventType.KV_LOAD_START, transfer.start_time,
                         transfer=transfer)
        for req_id, start in kv_out.draft_kv_landed.items():
            if req_id in self.requests:
                self.requests[req_id].draft_start = start
        for req_id in kv_out.finished_recving:
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            request.remote_kv = None  # loaded or failed: never pulled twice
            request.kv_ready_time = self.last_step_time
            groups = self.kv.block_ids(req_id)
            bad = min((i for blocks in groups for i, b in enumerate(blocks) if b in kv_out.invalid_block_ids),
                      default=None)
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
            if self._crosses_recompute_at(request):  # its prompt's KV came short; it runs long from here
                self._restart(request)
                self.rekey(request)
            self.kv.cache_blocks(request, request.num_computed_tokens)
        for req_id, transfer in kv_out.transfers_ended.items():
            r = self._live_or_held(req_id)
            recompute = r.num_prompt_tokens - max(r.num_cached_tokens, 0) - r.num_external_tokens if r else 0
            self.record(r, EventType.KV_LOAD_END, transfer.end_time, transfer=transfer, num_tokens=recompute)
        for end in kv_out.holds_ended:
            self.record(self.held.get(end.request_id), EventType.HOLD_END, end.time, detail=end.outcome.value)
        for req_id in kv_out.finished_sending | kv_out.finished_recving:
            request = self.held.pop(req_id, None)
            if request is not None:
                self._free(request)
