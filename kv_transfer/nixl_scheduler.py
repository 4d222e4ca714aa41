"""The NIXL connector's scheduler half (nixl_connector.py has the path of a request and the
worker half): which prompt tokens a decode request pulls and into which blocks, which blocks a
finished prefill request holds, and the handle it gives out for them. No tensors, no agent."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from baton.kv_transfer.base import (
    DEFAULT_HOLD_TIMEOUT_S,
    ConnectorRequest,
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVHandle,
    KVTier,
    ScheduledStep,
    first_needed_block,
    handle_block_counts,
)

log = logging.getLogger("baton.kv_transfer")

DEFAULT_LOAD_TIMEOUT_S = 30.0
_HANDOFF_SLACK = 0.1  # of a hold: the most a handle may spend between its prefill and its decode


@dataclass(slots=True)
class LoadSpec:
    """One decode request's pull: which of the peer's blocks go into which of ours."""
    request_id: str
    local_block_ids: list[int]
    remote_engine_id: str
    remote_block_ids: list[int]
    remote_request_id: str
    remote_tier: KVTier = KVTier.DEVICE  # the peer's pool that remote_block_ids index
    # Where the first full-attention group's blocks are in both lists, [start, end): a
    # speculative proposer's KV cache goes with them, from prompt position draft_start on (-1:
    # none of it holds such KV).
    full_attention: tuple[int, int] = (0, 0)
    draft_start: int = -1
    group_counts: tuple[int, ...] = ()  # how many of the block lists are each KV cache group's, in order


@dataclass(slots=True)
class NixlConnectorMeta(KVConnectorMetadata):
    """What the scheduler half hands its worker half (NixlConnectorWorker.start_load_kv) each step."""
    loads: list[LoadSpec] = field(default_factory=list)  # decode: READs to start (each rank its heads)
    holds: dict[str, float] = field(default_factory=dict)  # prefill: request id -> monotonic deadline (rank 0's)


class NixlConnectorScheduler(KVConnectorScheduler):
    def __init__(self, engine_id: str, block_size: int, hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S,
                 load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S):
        self.engine_id = engine_id
        self.block_size = block_size
        self.hold_timeout_s = hold_timeout_s
        self.load_timeout_s = load_timeout_s  # the worker's: a READ may run this long
        self.num_late_handles = 0
        self._meta = NixlConnectorMeta()

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        handle = request.remote_kv
        if handle is None:
            return 0, False
        if self._too_late(request, handle):  # the prompt is computed here instead (and the hold let go)
            self.num_late_handles += 1
            log.warning("the KV hold of %s may expire before a read would end; computing its prompt",
                        request.request_id)
            return 0, False
        num_remote = handle.num_tokens - num_computed_tokens
        return (num_remote, True) if num_remote > 0 else (0, False)

    def _too_late(self, request: ConnectorRequest, handle: KVHandle) -> bool:
        """Whether a READ starting now might still be running when the prefill's hold expires and
        its blocks go to other requests: a one-sided read would then load their KV, not this
        prompt's. The hold started before the request arrived here (the router hands the handle
        on at once; `_HANDOFF_SLACK` of the hold allows for its delay) and a READ ends within
        load_timeout_s, else it counts as failed."""
        if not handle.hold_s:
            return False
        deadline = request.arrival_time + handle.hold_s * (1 - _HANDOFF_SLACK) - self.load_timeout_s
        return time.monotonic() >= deadline

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[list[int]],
                                 num_external_tokens: int) -> None:
        handle = request.remote_kv
        if handle is None:
            return
        # Local hits are whole blocks, so the pulled range starts on a block boundary. When
        # they cover everything the load is empty: it only tells the prefill side to let go.
        n, bs = handle.num_tokens, self.block_size
        first = (n - num_external_tokens) // bs
        end = math.ceil(n / bs) if num_external_tokens else first
        local, remote, at, full, counts = [], [], 0, None, []
        # The handle lists each group's blocks from its window's first (handle_block_counts; the
        # server checked its length). Block lists of other lengths fail this request's load only.
        for blocks, window, count in zip(block_ids, self.group_windows,
                                         handle_block_counts(n, self.group_windows, bs), strict=True):
            start = first_needed_block(n, window, bs)
            lo = max(first, start)
            if window is None and full is None:
                full = (len(local), len(local) + len(blocks[lo:end]))
            local += blocks[lo:end]
            counts.append(len(blocks[lo:end]))
            remote += handle.block_ids[at + lo - start:at + end - start]
            at += count
        # (Past a local prefix hit: its blocks' draft KV, if any, was not validated for this prompt.)
        draft_start = max(handle.draft_start, first * bs) if handle.draft_start >= 0 else -1
        self._meta.loads.append(LoadSpec(request.request_id, local, handle.engine_id, remote, handle.request_id,
                                         handle.tier, full or (0, 0), draft_start, tuple(counts)))
        if not num_external_tokens:
            request.remote_kv = None  # nothing to wait for: never released twice

    def build_connector_meta(self, scheduler_output: ScheduledStep) -> NixlConnectorMeta:
        meta, self._meta = self._meta, NixlConnectorMeta()
        return meta

    def request_finished(self, request: ConnectorRequest, block_ids: list[list[int]]
                         ) -> tuple[bool, KVHandle | None]:
        # Held only when the prefill ended as asked (max_tokens=1): a first token that stops the
        # request (EOS, a stop id), or an abort, leaves no decode to do.
        if not request.hold_for_remote or not request.length_capped:
            return False, None
        self._meta.holds[request.request_id] = time.monotonic() + self.hold_timeout_s
        n, bs = request.num_prompt_tokens, self.block_size
        end = math.ceil(n / bs)
        ids = [i for blocks, window in zip(block_ids, self.group_windows, strict=True)
               for i in blocks[first_needed_block(n, window, bs):end]]
        return True, KVHandle(self.engine_id, request.request_id, ids, n, request.output_token_ids[0],
                              self.hold_timeout_s, draft_start=request.draft_start)
