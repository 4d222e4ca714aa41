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

if TYPE_CHECKING:
    import torch

    from baton.engine.request import Request
    from baton.engine.scheduler import SchedulerOutput


class KVConnectorScheduler(ABC):
    @abstractmethod
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond `num_computed_tokens` that a peer can supply, and whether they arrive
        asynchronously (the request then waits in WAITING_FOR_REMOTE_KVS)."""

    @abstractmethod
    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        """Local blocks now hold room for the request; remember where the external tokens go."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> Any:
        """The per-step instructions for the worker half (which loads to start, into which blocks)."""

    @abstractmethod
    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict | None]:
        """Called once a request ends. Returns (hold_blocks, kv_transfer_params): when
        hold_blocks is true the scheduler keeps the blocks until the worker reports the send done."""


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
    def register_kv_caches(self, kv_cache: "torch.Tensor") -> None:
        """Register the engine's KV cache ([num_blocks, num_layers, 2, block_size, kv_heads, head_dim])."""

    @abstractmethod
    def start_load_kv(self, metadata: Any) -> None:
        """Start the transfers the step's metadata asks for, without waiting for them."""

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Transfers completed (or failed) since the last call."""
