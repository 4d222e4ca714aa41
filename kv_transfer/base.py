"""The KV connector seam: how a scheduler and a model runner learn about KV held elsewhere.

Like vLLM v1's connector it has two halves. The scheduler half answers questions about
requests (how many prompt tokens can be loaded from a peer, must finished blocks be held for
a remote reader) and builds one KVConnectorMetadata per step, its own subclass of it. The worker half sits next to the
KV cache tensor: it registers the memory with a transport, starts the loads the metadata
asks for, reports which transfers finished, lets go of holds, and learns its peers' layouts.
Every engine server plugs the NIXL connector (nixl_connector.py, nixl_scheduler.py); the
offline engine plugs none.

This module imports nothing of the engine: the engine imports it (the one direction between
the two packages), so a second connector can be written from this file alone.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import msgspec

if TYPE_CHECKING:
    import torch


DEFAULT_HOLD_TIMEOUT_S = 120.0  # how long a prefill holds a request's blocks for a reader that has not come


def first_needed_block(num_tokens: int, window: int | None, block_size: int) -> int:
    """The first block that a query at position `num_tokens` (the next one computed after
    `num_tokens` tokens) reads in a layer group with a sliding `window` (None: every block).
    A query sees the `window` positions ending at its own; earlier blocks are never read again."""
    return max(0, num_tokens - window + 1) // block_size if window else 0


def handle_block_counts(num_tokens: int, windows: tuple[int | None, ...], block_size: int) -> list[int]:
    """How many of a handle's block ids belong to each KV cache group: a group's blocks from its
    first needed one (a sliding group's window) through the prompt's last, in group order."""
    end = -(-num_tokens // block_size)
    return [end - first_needed_block(num_tokens, w, block_size) for w in windows]


class KVTier(enum.Enum):
    """Which pool of an engine a block lives in."""
    DEVICE = "device"  # the engine's KV pool (GPU memory, or the CPU pool of a CPU engine)
    HOST = "host"  # host memory holding blocks offloaded from the device pool


class KVHandle(msgspec.Struct, frozen=True):
    """Where a prompt's computed KV blocks wait for a decode peer: what a prefill's finished
    request gives out, and what the decode's request for the same prompt comes with."""
    engine_id: str  # the prefill engine holding the blocks
    request_id: str  # the prefill's request, whose blocks they are
    # The prompt's blocks there, in order: each KV cache group's (KVFormat.kv_groups) in turn, a
    # sliding-window group's from the first a next query reads (handle_block_counts).
    block_ids: list[int]
    num_tokens: int  # the prompt's tokens they hold
    first_token: int  # sampled by the prefill: the decode's first output
    hold_s: float = 0.0  # how long the prefill holds the blocks from when it gave the handle out (0: unknown)
    tier: KVTier = KVTier.DEVICE  # the pool `block_ids` index (HOST: the prefill moved them to its host tier)
    # The first prompt position whose speculative draft (or head) KV the blocks hold: 0, or where
    # a head started past the prefill's prefix hit (-1: none).
    draft_start: int = -1


# The dtypes a KV cache may hold (KVFormat.dtype): a peer's of any of them is converted as its
# blocks land where it is not this engine's (kv_conversion.py).
KV_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")


class KVConverter(Protocol):
    """The engine's conversion of KV blocks between dtypes and FP8 scales (kernels/kv_quant.py's
    convert_kv): blocks [..., heads, D] held with `scales_from` (None: values) as `dtype`'s
    elements under `scales_to` (None: values). Scales broadcast over the blocks' heads."""

    def __call__(self, blocks: torch.Tensor, scales_from: torch.Tensor | None, dtype: torch.dtype,
                 scales_to: torch.Tensor | None) -> torch.Tensor: ...


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
    num_kv_heads: int  # the model's (a tensor-parallel rank holds its share: kv_head_range)
    head_size: int
    block_size: int
    attention_backend: str  # the kernel family that reads the cache
    # Which layers share a block (one tuple per KV cache group; a block holds one group's
    # layers) and each group's sliding window (0: full attention): blocks and handles mean
    # different things under another grouping.
    kv_groups: tuple[tuple[int, ...], ...] = ()
    kv_windows: tuple[int, ...] = ()
    attention: str = "mha"  # the attention's cache kind: per-head K and V ("mha", GQA included)
    # The engine's ranks, each holding kv_head_range's heads of every block. It may differ
    # between peers where one size divides the other: a rank reads its heads from the peer's
    # ranks that hold them.
    tensor_parallel_size: int = 1
    # The speculative proposer's own KV (a draft model's, an EAGLE head's, an MTP layer's), shipped
    # with the prompt's: its method, its checkpoint's fingerprint and its cache's block shape
    # (layers, parts, block size, heads, head size); empty where it has none (ngram, suffix).
    draft_method: str = ""
    draft_model: str = ""
    draft_kv: tuple[int, ...] = ()
    # Fingerprints of other checkpoints whose KV this engine takes as its own model's (another
    # quantization of the same model, named by the operator: accept_kv_from). Not compared:
    # either side naming the other's checkpoint pairs them.
    accepts_models: tuple[str, ...] = ()
    # An FP8 cache's scales, [num_layers][parts][num_kv_heads] flattened (empty: the cache holds
    # values, `dtype` not FP8). Not compared: a peer of another dtype or other scales has its
    # blocks converted as they land (kv_conversion.py), where `dtype` is one both can read.
    kv_scales: tuple[float, ...] = ()

    def check_peer(self, theirs: KVFormat) -> None:
        """Raises KVFormatMismatch naming the first field that differs."""
        mine_tp, their_tp = self.tensor_parallel_size, theirs.tensor_parallel_size
        if max(mine_tp, their_tp) % min(mine_tp, their_tp):
            raise KVFormatMismatch("tensor_parallel_size", f"the peer has {their_tp} ranks, this engine {mine_tp}: "
                                                           f"one size must divide the other")
        for side, dtype in (("the peer's", theirs.dtype), ("this engine's", self.dtype)):
            if dtype not in KV_DTYPES:
                raise KVFormatMismatch("kv_cache_dtype", f"{side} KV cache holds {dtype!r}, which this engine cannot "
                                                         f"convert (it converts between {', '.join(KV_DTYPES)})")
        for name in self.__struct_fields__:
            mine, other = getattr(self, name), getattr(theirs, name)
            # (another dtype or other FP8 scales: converted as the blocks land, kv_conversion.py)
            if mine == other or name in ("tensor_parallel_size", "accepts_models", "dtype", "kv_scales"):
                continue
            if name == "model" and (other in self.accepts_models or mine in theirs.accepts_models):
                continue
            if name.startswith("draft_"):
                raise KVFormatMismatch(name, f"the peer's is {other!r}, this engine's {mine!r}: a draft's KV "
                                             f"(draft_model, eagle, eagle3, mtp) goes from prefill to decode, so both "
                                             f"must run the same speculative_config method and model")
            raise KVFormatMismatch(name, f"the peer's KV cache has {other!r}, this engine's {mine!r}; prefill and "
                                         f"decode must serve the same checkpoint (or name the other's in "
                                         f"accept_kv_from) with the same block size, "
                                         f"attention backend, max_model_len (it decides which windows slide) and "
                                         f"hybrid KV cache setting")


def kv_head_range(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """The KV heads [first, last + 1) that rank `rank` of `tp` holds: an even share, or where the
    ranks outnumber the heads, the one head its query heads read (replicated)."""
    if num_kv_heads >= tp:
        each = num_kv_heads // tp
        return rank * each, (rank + 1) * each
    head = rank * num_kv_heads // tp
    return head, head + 1


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """Part of a rank's KV heads, read from one rank of the peer."""
    peer_rank: int
    first: int  # the model's KV heads [first, last)
    last: int
    direct: bool  # the peer rank holds exactly this rank's heads: its blocks are ours byte for byte


def read_plan(num_kv_heads: int, tp: int, rank: int, peer_tp: int) -> list[HeadSlice]:
    """Where rank `rank` of `tp` reads its KV heads from a peer of `peer_tp` ranks: each head from
    a peer rank holding it (replicated heads spread over their holders), consecutive heads
    from one peer rank in one slice."""
    first, last = kv_head_range(num_kv_heads, tp, rank)
    slices: list[list[int]] = []
    for head in range(first, last):
        holders = [p for p in range(peer_tp) if kv_head_range(num_kv_heads, peer_tp, p)[0] <= head
                   < kv_head_range(num_kv_heads, peer_tp, p)[1]]
        peer = holders[rank % len(holders)]
        if slices and slices[-1][0] == peer:
            slices[-1][2] = head + 1
        else:
            slices.append([peer, head, head + 1])
    return [HeadSlice(p, a, b, kv_head_range(num_kv_heads, peer_tp, p) == (first, last)) for p, a, b in slices]


@dataclass(slots=True)
class KVLayout:
    """What a peer needs to read this engine's blocks, and what they hold (traded at the KV
    handshake by the services, checked by the peer's `add_peer`)."""
    engine_id: str
    agent_metadata: bytes  # the transport's own description of this engine's agent
    base_addr: int
    block_bytes: int
    num_blocks: int
    mem_type: str  # "DRAM" or "VRAM"
    dev_id: int
    format: KVFormat
    # The host KV tier's pool (always DRAM), registered too: a prefill may move a hold's blocks
    # there while they wait for their decode, and its handle then names blocks of this pool.
    host_base_addr: int = 0
    host_num_blocks: int = 0  # 0: no host tier
    # The speculative proposer's KV cache (format.draft_kv), registered too: block b of it goes
    # with block b of the first full-attention group (0: none).
    draft_base_addr: int = 0
    draft_block_bytes: int = 0
    # Under tensor parallelism, this is rank 0's and `ranks` the others' (each registered by its
    # own agent), in rank order.
    ranks: list[KVLayout] = field(default_factory=list)

    def rank(self, r: int) -> KVLayout:
        return self if r == 0 else self.ranks[r - 1]

    def region(self, tier: KVTier) -> tuple[int, str, int]:
        """(base address, memory type, device id) of the pool a handle's `tier` names."""
        if tier is KVTier.HOST:
            if not self.host_num_blocks:
                raise ValueError(f"engine {self.engine_id} has no host KV tier to read from")
            return self.host_base_addr, "DRAM", 0
        return self.base_addr, self.mem_type, self.dev_id


class KVUnreachable(RuntimeError):
    """Peers could not read this engine's KV cache over the transport: the engine must not start."""


class ConnectorRequest(Protocol):
    """What a connector reads of a request (the engine's Request has these)."""
    request_id: str
    arrival_time: float  # time.monotonic()
    num_prompt_tokens: int
    output_token_ids: list[int]
    hold_for_remote: bool  # a prefill's: hold its blocks for a decode peer
    remote_kv: KVHandle | None  # a decode's: where the prompt's KV waits; the connector clears it once done
    draft_start: int  # a prefill's, once it ended: where its draft's KV starts (KVHandle.draft_start)

    @property
    def length_capped(self) -> bool:
        """It ended at its max_tokens (a prefill's asked-for end), not at a stop or an abort."""


class ScheduledStep(Protocol):
    """What a scheduler half may read of the step it builds metadata for (the engine's
    SchedulerOutput, engine/common/scheduler_output.py, which this module cannot import)."""
    num_scheduled_tokens: dict[str, int]  # request id -> its tokens computed in the step
    finished_req_ids: set[str]  # ended since the step before
    preempted_req_ids: set[str]  # their blocks freed: they come back as new


class KVConnectorMetadata:
    """One step's instructions from a connector's scheduler half to its worker half (which
    loads to start, into which blocks; which holds begin). Each connector subclasses it with
    its own fields (NixlConnectorMeta); the engine only carries it, in the step's
    SchedulerOutput, to the worker half of every tensor-parallel rank, pickled: plain data."""
    __slots__ = ()


class KVConnectorScheduler(ABC):
    # Each KV cache group's sliding window (None: full attention), as the engine's cache is
    # grouped: the block id lists it passes in and out have one list per group. Set by the engine.
    group_windows: tuple[int | None, ...] = (None,)

    @abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond `num_computed_tokens` that a peer can supply, and whether they arrive
        asynchronously (the request then waits in WAITING_FOR_REMOTE_KVS)."""

    @abstractmethod
    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[list[int]],
                                 num_external_tokens: int) -> None:
        """Local blocks (per group; -1 where a sliding group keeps none) now hold room for the
        request; remember where the external tokens go."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: ScheduledStep) -> KVConnectorMetadata:
        """The step's instructions for the worker half: what this half gathered since the last
        step (loads after `update_state_after_alloc`, holds after `request_finished`)."""

    @abstractmethod
    def request_finished(self, request: ConnectorRequest, block_ids: list[list[int]]
                         ) -> tuple[bool, KVHandle | None]:
        """Called once a request ends (`block_ids`: its blocks per group, -1 where none).
        Returns (hold_blocks, handle): when hold_blocks is true
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


class HoldOutcome(enum.Enum):
    """How a prefill's hold for a remote reader ended."""
    PULLED = "pulled"  # a reader said it is done
    RELEASED = "released"  # nobody will come (the router or the decode said so)
    EXPIRED = "expired"  # nobody came within the hold's time


@dataclass(slots=True)
class KVHoldEnd:
    """Blocks a prefill held for a remote reader were let go."""
    request_id: str
    outcome: HoldOutcome
    time: float


@dataclass(slots=True)
class KVConnectorOutput:
    """What the worker half reports after a step."""
    finished_sending: set[str] = field(default_factory=set)  # held blocks may now be freed
    finished_recving: set[str] = field(default_factory=set)  # remote KV arrived: the request can run
    invalid_block_ids: set[int] = field(default_factory=set)  # loads that failed: recompute from there
    invalid_by_request: dict[str, set[int]] = field(default_factory=dict)  # the same, by request
    transfers_started: list[KVTransfer] = field(default_factory=list)  # since the last report
    transfers_ended: dict[str, KVTransfer] = field(default_factory=dict)  # request id -> its load, ended
    holds_ended: list[KVHoldEnd] = field(default_factory=list)
    # Loads that brought the draft's KV too (request id -> the first prompt position it covers).
    draft_kv_landed: dict[str, int] = field(default_factory=dict)


class KVConnectorWorker(ABC):
    """The worker half. Besides the three step methods, all the engine core uses of it."""
    engine_id: str  # this engine's name among its peers
    layout: KVLayout | None = None  # set by register_kv_caches: what peers need to read this engine
    num_expired_holds: int = 0  # holds nobody pulled in time
    num_blocks_pulled: int = 0  # blocks this engine read from peers
    num_bytes_pulled: int = 0  # and their bytes (a draft's KV included)

    @abstractmethod
    def register_kv_caches(self, kv_cache: torch.Tensor, kv_format: KVFormat,
                           host_cache: torch.Tensor | None = None, draft_cache: torch.Tensor | None = None,
                           convert: KVConverter | None = None) -> None:
        """Register the engine's KV cache ([num_blocks, layers per block, 2, block_size, kv_heads,
        head_dim]: a block holds one KV cache group's layers, every layer without groups) and
        what its blocks hold (peers compare it before reading); `host_cache`, the host KV
        tier's pool of the same block shape, where a handle may name blocks moved there;
        `draft_cache`, the speculative proposer's KV cache ([num_blocks, ...]: format.draft_kv),
        whose blocks go with the first full-attention group's: a load of a prompt's blocks
        brings them too; `convert`, the engine's own writer of KV elements (KVConverter), for
        blocks of a peer whose format holds another dtype or scales (None: such a peer is
        refused, naming kv_cache_dtype). Raises KVUnreachable when a peer could not read it."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        """Start the transfers the step's metadata (its scheduler half's own subclass) asks for,
        without waiting for them. None: a step built outside the scheduler (the runner's memory
        profile) carries none."""

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Transfers completed (or failed) since the last call."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """Nobody will read this request's held blocks (a router's word): let go of them now."""

    @abstractmethod
    def add_peer(self, layout: KVLayout) -> None:
        """Learn a peer's layout; raises KVFormatMismatch naming the first field that differs."""

    @abstractmethod
    def close(self) -> None:
        """Let go of the transport (the engine is stopping)."""

    def for_rank(self, rank: int) -> Callable[[], KVConnectorWorker]:
        """A picklable factory of the worker half of tensor-parallel rank `rank` (this is rank
        0's), called in that rank's process."""
        raise NotImplementedError(f"{type(self).__name__} does not run under tensor parallelism")

    def finish_load(self, request_id: str, ok: bool) -> None:
        """Under tensor parallelism, on rank 0: every rank has ended its reads of this request's
        load (ok: all of them landed); tell the peer it may let go of its hold."""
        raise NotImplementedError(f"{type(self).__name__} does not run under tensor parallelism")
