"""One request's state as the scheduler sees it: token ids, progress, status."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from baton.engine.common.block_hashes import ROOT_HASH
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.common.stats import RequestStats

if TYPE_CHECKING:
    from baton.engine.common.core_messages import ImageInput
    from baton.kv_transfer.base import KVHandle


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # decode side: KV blocks are being pulled from a prefill peer
    WAITING_FOR_FSM = enum.auto()  # its grammar is compiling (the engine core holds it back until then)
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this line is finished.
    FINISHED_STOPPED = enum.auto()  # EOS or a stop token
    FINISHED_LENGTH_CAPPED = enum.auto()  # max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

_arrival_counter = itertools.count()


class Request:
    __slots__ = ("request_id", "key", "prompt_token_ids", "output_token_ids", "all_token_ids", "sampling_params",
                 "eos_token_ids", "priority", "arrival_time", "arrival_seq", "status", "num_computed_tokens",
                 "num_cached_tokens", "num_external_tokens", "num_preemptions", "block_hashes", "hold_for_remote",
                 "remote_kv", "kv_handle", "scheduled_time", "kv_ready_time", "first_token_time", "last_token_time",
                 "finished_time", "stop_token_id", "grammar", "lora_id", "hash_root", "spec_token_ids",
                 "num_draft_tokens", "num_accepted_tokens", "draft_start", "num_pending_tokens", "images")

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: frozenset[int] = frozenset(), priority: int = 0, arrival_time: float | None = None,
                 key: int = 0):
        self.request_id = request_id
        self.key = key  # the front's number for it (unique among its requests, unlike ids): outputs carry it
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_seq = next(_arrival_counter)  # breaks arrival_time ties deterministically
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hits at first admission (-1: not admitted yet)
        self.num_external_tokens = 0  # prompt tokens whose KV a peer supplied
        self.num_preemptions = 0
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of all_token_ids
        self.lora_id = 0  # its LoRA adapter (0: the base model)
        self.hash_root = ROOT_HASH  # where its block-hash chain starts: the adapter's own root, so none share KV
        # For a KV connector. A prefill's request: hold the blocks for a decode peer once it ends,
        # and give out `kv_handle`; a decode's: its prompt's KV is at `remote_kv` (None once pulled).
        self.hold_for_remote = False
        self.remote_kv: KVHandle | None = None
        self.kv_handle: KVHandle | None = None
        # A speculative draft's (or head's) KV that goes with the prompt's, from this prompt position
        # on (-1: none). A prefill's: what its blocks hold once it ended; a decode's: what its load
        # brought, for the runner when the request first runs.
        self.draft_start = -1
        self.grammar = None  # a Future of its compiled grammar, for structured output
        # When things happened (time.monotonic(), like arrival_time), for latency figures;
        # None until they do. first/last token: sampled by this engine (not a prefill peer's).
        self.scheduled_time: float | None = None  # first admitted to run
        self.kv_ready_time: float | None = None  # a peer's KV landed (or its load failed)
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.stop_token_id: int | None = None  # the stop token id that ended it (stop strings are the front's)
        self.spec_token_ids: list[int] = []  # drafts to verify with its next token (speculative decoding)
        self.num_draft_tokens = self.num_accepted_tokens = 0  # drafts verified for it, and kept
        # Under async scheduling: tokens sampled in steps whose output has not come back (0 or 1 but
        # between scheduling ahead and taking the step before's output, 2).
        self.num_pending_tokens = 0
        self.images: list[ImageInput] = []  # a vision-language model's, in prompt order (core_messages.ImageInput)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def stats(self) -> RequestStats:
        """Its figures once it finished (the FINISHED event's)."""
        return RequestStats(self.status.finish_reason, self.num_output_tokens, max(self.num_cached_tokens, 0),
                            self.num_preemptions, self.scheduled_time, self.first_token_time, self.last_token_time,
                            self.finished_time, len(self.kv_handle.block_ids) if self.kv_handle is not None else 0,
                            self.num_draft_tokens, self.num_accepted_tokens)

    @property
    def length_capped(self) -> bool:
        """It ended at its max_tokens or the model's length (a prefill's asked-for end)."""
        return self.status == RequestStatus.FINISHED_LENGTH_CAPPED

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def priority_key(self) -> tuple:
        """Smaller runs first under the priority policy; the largest key is preempted first."""
        return (self.priority, self.arrival_time, self.arrival_seq)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")


@dataclass(slots=True)
class RequestUpdate:
    """One request's progress in one step, for the engine's callers."""
    request: Request
    new_token_ids: list[int]
    finished: bool
