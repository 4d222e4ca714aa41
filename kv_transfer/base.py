"""The KV connector seam: how a scheduler and a model runner learn about KV held elsewhere.

Like vLLM v1's connector it has two halves. The scheduler half answers questions about
requests (how many prompt tokens can be loaded from a peer, must finished blocks be held for
a remote reader) and builds one metadata object per step. The worker half sits next to the
KV cache tensor: it registers the memory with a transport, starts the loads the metadata
asks for, and reports which transfers finished. Nothing is plugged in by default.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from baton.engine.kv_events import DEVICE

if TYPE_CHECKING:
    import torch

    from baton.engine.request import Request
    from baton.engine.scheduler_output import SchedulerOutput


class KVHandle(msgspec.Struct, frozen=True):
    """Where a prompt's computed KV blocks wait for a decode peer: what a prefill's finished
    request gives out, and what the decode's request for the same prompt comes with."""
    engine_id: str  # the prefill engine holding the blocks
    request_id: str  # the prefill's request, whose blocks they are
    block_ids: list[int]  # the prompt's blocks there, in order
    num_tokens: int  # the prompt's tokens they hold
    first_token: int  # sampled by the prefill: the decode's first output
    hold_s: float = 0.0  # how long the prefill holds the blocks from when it gave the handle out (0: unknown)
    tier: str = DEVICE  # the pool `block_ids` index: "device", or "host" (the prefill moved them to its host tier)


class KVFormatMismatch(ValueError):
    """A peer's KV blocks are not this engine's format: reading them would load garbage."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


class KVFormat(msgspec.Struct, frozen=True):
    """What must be equal between two engines for one to read the other's KV blocks as its own
    (compared at the KV handshake, before any block moves)."""
    model: str  # a fingerprint of the checkpoint's contents (engine/loader.checkpoint_fingerprint)
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    attention_backend: str  # the kernel family that reads the cache

    def check_peer(self, theirs: KVFormat) -> None:
        """Raises KVFormatMismatch naming the first field that differs."""
        for name in self.__struct_fields__:
            mine, other = getattr(self, name), getattr(theirs, name)
            if mine != other:
                raise KVFormatMismatch(name, f"the peer's KV cache has {other!r}, this engine's {mine!r}; prefill and "
                                             f"decode must serve the same checkpoint with the same dtype, block size "
                                             f"and attention backend")


class KVConnectorScheduler(ABC):
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond `num_computed_tokens` that a peer can supply, and whether they arrive
        asynchronously (the request then waits in WAITING_FOR_REMOTE_KVS)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Local blocks now hold room for the request; remember where the external tokens go."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """The per-step instructions for the worker half (which loads to start, into which blocks)."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, KVHandle | None]:
        """Called once a request ends. Returns (hold_blocks, handle): when hold_blocks is true
        the scheduler keeps the blocks until the worker reports the send done, and the handle
        tells a decode peer where they are."""


@dataclass(slots=True)
class KVTransfer:
    """One pull of a request's blocks from a peer, as the worker saw it (for spans and metrics)."""
    request_id: str
    remote_engine_id: str
    num_blocks: int  # 0: every block was a local prefix-cache hit, nothing moved
    num_bytes: int
    num_descriptors: int
    start_time: float  # time.monotonic()
    end_time: float | None = None  # None while it moves
    ok: bool = False
    error: str | None = None  # why it failed
    recompute_from_block: int | None = None  # set by the scheduler when blocks were invalid


@dataclass(slots=True)
class KVHoldEnd:
    """Blocks a prefill held for a remote reader were let go."""
    request_id: str
    outcome: str  # "pulled" (a reader said it is done), "released" (nobody will come), "expired"
    time: float


@dataclass(slots=True)
class KVConnectorOutput:
    """What the worker half reports after a step."""
    finished_sending: set[str] = field(default_factory=set)  # held blocks may now be freed
    finished_recving: set[str] = field(default_factory=set)  # remote KV arrived: the request can run
    invalid_block_ids: set[int] = field(default_factory=set)  # loads that failed: recompute from there
    transfers_started: list[KVTransfer] = field(default_factory=list)  # since the last report
    transfers_ended: dict[str, KVTransfer] = field(default_factory=dict)  # request id -> its load, ended
    holds_ended: list[KVHoldEnd] = field(default_factory=list)


class KVConnectorWorker(ABC):
    @abstractmethod
    def register_kv_caches(self, kv_cache: torch.Tensor, kv_format: KVFormat,
                           host_cache: torch.Tensor | None = None) -> None:
        """Register the engine's KV cache ([num_blocks, num_layers, 2, block_size, kv_heads, head_dim])
        and what its blocks hold (peers compare it before reading); `host_cache`, the host KV
        tier's pool of the same block shape, where a handle may name blocks moved there."""

    @abstractmethod
    def start_load_kv(self, metadata: Any) -> None:
        """Start the transfers the step's metadata asks for, without waiting for them."""

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Transfers completed (or failed) since the last call."""
