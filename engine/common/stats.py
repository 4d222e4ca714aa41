"""What the engine tells its callers about each request as it happens, in plain data (vLLM
v1's EngineCoreEvents): the services turn these events into live spans and metrics. The
engine itself never imports a telemetry library; the events cross from the engine core's
process to its front with each step's outputs.

Events are recorded only when a caller asks (`LLMEngine.record_events`) and takes them after
each step (`LLMEngine.take_events`); the offline API records none.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec

from baton.kv_transfer.base import KVTransfer


class EventType(enum.Enum):
    SCHEDULED = "scheduled"  # admitted to run: first time, or again after a preemption
    PREEMPTED = "preempted"  # its blocks were taken back; it waits to be recomputed
    PREFILL_CHUNK = "prefill_chunk"  # num_tokens prompt tokens were computed in the step
    KV_WAIT = "kv_wait"  # parked in WAITING_FOR_REMOTE_KVS
    KV_LOAD_START = "kv_load_start"  # the worker started pulling its blocks (transfer)
    KV_LOAD_END = "kv_load_end"  # the pull ended (transfer says how; num_tokens: prompt tokens to recompute)
    FINISHED = "finished"  # stats say how it went; a prefill may now hold its blocks
    HOLD_END = "hold_end"  # a prefill let go of the blocks it held for a reader (detail: outcome)
    GRAMMAR_READY = "grammar_ready"  # its grammar compiled (or came from the cache): it may run (detail: kind)


class RequestStats(msgspec.Struct, array_like=True, gc=False):
    """A request's figures when it finished (the FINISHED event's), times from time.monotonic()."""
    finish_reason: str
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens the local prefix cache held
    num_preemptions: int
    scheduled_time: float | None  # first admitted to run
    first_token_time: float | None  # first sampled here (not a prefill peer's)
    last_token_time: float | None
    finished_time: float
    num_held_blocks: int  # blocks held for a decode peer (0: none)
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for it
    num_accepted_tokens: int = 0  # ... and kept


class RequestEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    key: int  # the request's key (Request.key): an id may be reused once its request ended
    type: EventType
    time: float  # time.monotonic()
    num_tokens: int = 0  # PREFILL_CHUNK: tokens computed; SCHEDULED: tokens already computed; KV_LOAD_END: to recompute
    transfer: KVTransfer | None = None  # KV_LOAD_*
    detail: str | None = None  # HOLD_END: pulled, released or expired; GRAMMAR_READY: the constraint's kind
    stats: RequestStats | None = None  # FINISHED


class StepEvents(msgspec.Struct, array_like=True, gc=False):
    """Everything recorded since the last `take_events`."""
    events: list[RequestEvent]
    step_tokens: list[int]  # tokens scheduled in each step that ran (vLLM's iteration tokens)
    time: float  # when the last of those steps' tokens were sampled


@dataclass(slots=True)
class SpecDecodeStats:
    """Verification so far, vLLM's SpecDecodingStats: requests' steps whose drafts were checked,
    drafts, and those accepted, in all and by position (the scheduler counts them as it takes
    each step's tokens)."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.accepted_per_pos.extend([0] * (num_accepted - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


@dataclass(slots=True)
class EngineSnapshot:
    """The engine's load and its running totals at one moment (taken on the step-loop thread)."""
    num_running: int
    num_waiting: int  # all waiting requests, those in WAITING_FOR_REMOTE_KVS included
    num_waiting_for_kvs: int
    num_held_requests: int  # finished; their blocks wait for a transfer
    num_held_blocks: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found there
    num_preemptions: int
    num_failed_loads: int
    num_prompt_tokens: int  # prompts of requests that got their first token here
    num_prompt_tokens_cached: int  # ... of which the local prefix cache held
    num_prompt_tokens_external: int  # ... of which a peer sent
    num_generation_tokens: int
    # The host KV tier (kv_offloading_size; all 0 without one).
    num_host_kv_blocks: int = 0
    num_empty_host_kv_blocks: int = 0  # holding nothing (no copy, no swapped or in-flight block)
    num_cached_host_kv_blocks: int = 0  # holding a prefix block's copy
    host_kv_cache_hits: int = 0  # prompt tokens found there, beyond the device's prefix hits
    num_host_kv_stored_blocks: int = 0  # written back to it
    num_host_kv_loaded_blocks: int = 0  # brought back from it (prefix hits and swap-ins)
    num_swapped: int = 0  # preempted requests whose blocks wait there
    num_swap_preemptions: int = 0
    num_host_hand_offs: int = 0  # holds for a decode peer moved there (the device pool was short)
    num_free_host_kv_blocks: int = 0  # referenced by nothing (empty, or a copy nobody pins)
    # LoRA adapters (all 0 without enable_lora).
    num_loras: int = 0  # loaded
    num_running_loras: int = 0  # distinct among running requests (at most max_loras)
    num_lora_device_loads: int = 0  # put on the device (a slot taken by another adapter before)
    # Speculative decoding (vLLM's SpecDecodingStats, since start; all 0 without it).
    num_spec_drafts: int = 0  # requests' steps whose drafts were verified
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()  # kept drafts by their position (0: the first after a token)

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks

    @property
    def host_kv_cache_usage(self) -> float:
        """The share of the host tier holding something (cached copies, swapped or in-flight blocks)."""
        if not self.num_host_kv_blocks:
            return 0.0
        return 1.0 - self.num_empty_host_kv_blocks / self.num_host_kv_blocks
