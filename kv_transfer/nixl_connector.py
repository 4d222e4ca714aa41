"""The NIXL KV connector: a decode engine pulls a prompt's KV blocks from the prefill engine
that computed them, with one-sided NIXL READs (UCX; CPU or GPU memory).

This module has the worker half (the scheduler half: nixl_scheduler.py; a prefill's holds:
nixl_holds.py). The path of one request:
- prefill: the request runs with `hold_for_remote` and `max_tokens=1`; when it finishes,
  `request_finished` holds its blocks and returns their KVHandle (engine id, request id,
  block ids, token count, first token).
- decode: the request arrives with that handle. `get_num_new_matched_tokens` offers the
  prompt tokens beyond the local prefix-cache hit, asynchronously; the scheduler allocates
  blocks and parks the request in WAITING_FOR_REMOTE_KVS; `update_state_after_alloc`
  records which local blocks receive which remote ones; the next step's metadata carries
  the load and the worker starts it (READ, tagged with the remote request id).
- when the READ is done the worker reports the request in `finished_recving` (a failed READ
  also lists its blocks in `invalid_block_ids`, and the scheduler recomputes from there);
  NIXL delivers the tag to the prefill side as a notification, whose worker reports the
  request in `finished_sending`, and the held blocks are freed. A decode whose load failed
  says so (a LetGo notification), so the prefill frees them without waiting; a handle
  nobody pulls within `hold_timeout_s` is freed too, with a log line and `num_expired_holds`.

A block holds all layers' K and V ([num_blocks, layers, 2, block_size, heads, head_dim]),
so a run of consecutive block ids on both sides is one contiguous region: one descriptor.
Peers learn each other's `KVLayout` through the services' own RPC (`add_peer`), which
refuses a peer whose KVFormat (model, shapes, block size, attention backend, speculative
proposer) differs; one whose cache holds another dtype or FP8 scales is staged and converted as
its blocks land (kv_conversion.py). The speculative proposer's own KV cache (a draft model's, an EAGLE head's, an
MTP layer's; rank 0's, which alone drafts) is registered too, block for block with the first
full-attention group's: a load's READ from the peer's rank 0 carries those blocks' draft blocks
as more descriptors (one transfer, one notice; a READ of their own where rank 0's KV heads come
staged or from other ranks), unless the handle names the peer's host tier.

Under tensor parallelism every rank has a worker of its own (`for_rank`), over its share of the
KV heads; a rank reads its heads of a load from the peer ranks holding them (base.read_plan),
straight into its cache or staged (nixl_staging.py), and only rank 0 keeps holds and, once every
rank's part landed (`finish_load`), tells the peer its blocks may go.

UCX only moves a transfer when its agents are polled, the target's included: a READ from a
prefill that is busy with a long forward pass would not finish before that pass ends. So
a small thread polls the agent (under the same lock as every other agent call) while
transfers or holds are about; NIXL's own progress thread costs too much on a few cores.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from baton.kv_transfer.base import (
    DEFAULT_HOLD_TIMEOUT_S,
    HeadSlice,
    HoldOutcome,
    KVConnectorOutput,
    KVConnectorWorker,
    KVConverter,
    KVFormat,
    KVLayout,
    KVTier,
    KVTransfer,
    kv_head_range,
    read_plan,
)
from baton.kv_transfer.kv_conversion import KVConversion
from baton.kv_transfer.nixl_holds import Holds
from baton.kv_transfer.nixl_scheduler import DEFAULT_LOAD_TIMEOUT_S, LoadSpec, NixlConnectorMeta, NixlConnectorScheduler
from baton.kv_transfer.nixl_staging import Staged, StagingPool, land, merge_runs

if TYPE_CHECKING:
    import torch

log = logging.getLogger("baton.kv_transfer")


class ReadDone(msgspec.Struct, tag=True, array_like=True):
    """A reader has a hold's blocks: its READ finished (NIXL delivers this with the READ), or it
    found them all in its own prefix cache."""
    request_id: str  # the holder's request


class LetGo(msgspec.Struct, tag=True, array_like=True):
    """A reader will not read a hold (its load failed)."""
    request_id: str


# On the wire as JSON: NIXL hands a notification on as UTF-8 text.
Notification = ReadDone | LetGo
_OUTCOMES = {ReadDone: HoldOutcome.PULLED, LetGo: HoldOutcome.RELEASED}
encode_notification = msgspec.json.Encoder().encode
decode_notification = msgspec.json.Decoder(Notification).decode


@dataclass(slots=True)
class _Peer:
    agent_names: list[str]  # each rank's agent, in rank order
    layout: KVLayout
    conversion: KVConversion | None = None  # its blocks hold another dtype or scales: staged, converted

    @property
    def tp(self) -> int:
        return self.layout.format.tensor_parallel_size


@dataclass(slots=True)
class _Load:
    spec: LoadSpec
    handles: list  # one NIXL READ per head slice
    give_up: float
    record: KVTransfer
    staged: list[Staged] = field(default_factory=list)
    with_draft: bool = False  # the READ brings the draft's KV of the blocks too
    conversion: KVConversion | None = None  # the peer's, as the load started


def _torch_dtype(name: str):
    """A KVFormat.dtype (one of base.KV_DTYPES: the handshake checked it) as torch's."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}[name]


def new_agent(name: str):
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs to stdout otherwise
    from nixl._api import nixl_agent, nixl_agent_config
    # No progress thread: on 2 cores it slowed 256 MiB READs from 5-6 to ~3 GB/s and delayed
    # notifications from ~26 µs to ~8 ms (and sometimes lost one), measured between two processes.
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


class NixlConnectorWorker(KVConnectorWorker):
    def __init__(self, engine_id: str, agent=None, load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S, rank: int = 0):
        """`agent`: a nixl_agent, or any object with its methods (tests inject faults so).
        `load_timeout_s`: a READ still moving after this long counts as failed (a hung peer
        must not park a request forever). `rank`: this worker's tensor-parallel rank (its
        engine_id then names the rank); only rank 0 keeps holds and tells peers about reads."""
        self.engine_id = engine_id
        self.agent = agent if agent is not None else new_agent(engine_id)
        self.load_timeout_s = load_timeout_s
        self.rank = rank
        self.tp = 1  # the engine's ranks, from the registered format
        self._cache: torch.Tensor | None = None
        self._convert: KVConverter | None = None  # the engine's, for peers of another KV dtype or scales
        self._staging = StagingPool(self.agent)  # buffers for head slices read from a peer of another split
        self._deferred: dict[str, LoadSpec] = {}  # loads whose reader-is-done notice waits for every rank
        self.layout: KVLayout | None = None
        self.peers: dict[str, _Peer] = {}
        self._loading: dict[str, _Load] = {}
        self._failed: dict[str, tuple[list[int], KVTransfer]] = {}  # loads that could not start
        self._started: list[KVTransfer] = []  # loads started since the last report
        self._holds = Holds()  # rank 0's: blocks held for decode readers
        self._lock = threading.Lock()  # one caller into the agent at a time
        self._inbox: list[bytes] = []  # notifications the progress thread collected
        self._active_until = 0.0  # the progress thread polls until then (or while work is pending)
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._poller: threading.Thread | None = None  # started once the cache is registered
        self.num_descriptors = 0  # READ descriptors issued, for tests and benchmarks
        self.num_blocks_pulled = 0
        self.num_bytes_pulled = 0

    # ---- memory and peers ---------------------------------------------------------------------
    def register_kv_caches(self, kv_cache: torch.Tensor, kv_format: KVFormat, host_cache: torch.Tensor | None = None,
                           draft_cache: torch.Tensor | None = None, convert: KVConverter | None = None) -> None:
        """Register the cache (as VRAM where it is on a GPU), the host tier's pool and a draft's
        cache where there are. GPU memory is checked at once: UCX built without its CUDA
        transports fails the first READ, so a probe READ runs now."""
        with self._lock:
            self._regs = [self.agent.register_memory(t) for t in (kv_cache, host_cache, draft_cache) if t is not None]
        self._cache, self.tp, self._convert = kv_cache, kv_format.tensor_parallel_size, convert
        on_gpu = kv_cache.device.type == "cuda"
        self.layout = KVLayout(self.engine_id, self.agent.get_agent_metadata(), kv_cache.data_ptr(),
                               kv_cache[0].numel() * kv_cache.element_size(), kv_cache.shape[0],
                               "VRAM" if on_gpu else "DRAM", (kv_cache.device.index or 0) if on_gpu else 0, kv_format,
                               *((host_cache.data_ptr(), host_cache.shape[0]) if host_cache is not None else ()))
        if draft_cache is not None:
            self.layout.draft_base_addr = draft_cache.data_ptr()
            self.layout.draft_block_bytes = draft_cache[0].numel() * draft_cache.element_size()
        if on_gpu:
            self.check_reachable(kv_cache)
        # The thread holds the worker weakly: one dropped unclosed is freed, with its cache and agent.
        self._poller = threading.Thread(target=_poll, args=(weakref.ref(self), self._closed, self._wake,
                                                            kv_cache.device), name="nixl-progress", daemon=True)
        self._poller.start()

    def check_reachable(self, kv_cache: torch.Tensor, probe_agent=None) -> None:
        """Raises KVUnreachable where a peer's READ of this cache would fail (see reachability);
        `probe_agent`: injected by tests."""
        from baton.kv_transfer.reachability import probe_read  # torch: only where the cache is

        probe_read(self.agent, self._lock, self.layout, kv_cache,
                   probe_agent if probe_agent is not None else new_agent(f"{self.engine_id}-probe"))

    def for_rank(self, rank: int):
        return functools.partial(NixlConnectorWorker, f"{self.engine_id}.r{rank}", None, self.load_timeout_s, rank)

    def add_peer(self, layout: KVLayout) -> None:
        """Learn a peer's layout, every rank's (once per peer; again when it restarted with new
        metadata). Raises KVFormatMismatch, naming what differs, for a peer whose blocks hold
        another format."""
        known = self.peers.get(layout.engine_id)
        if known is not None and known.layout.agent_metadata == layout.agent_metadata:
            return
        self.layout.format.check_peer(layout.format)
        with self._lock:
            if known is not None:
                for name in known.agent_names:
                    self.agent.remove_remote_agent(name)
            names = [self.agent.add_remote_agent(rank.agent_metadata) for rank in [layout, *layout.ranks]]
        self.peers[layout.engine_id] = _Peer([n.decode() if isinstance(n, bytes) else n for n in names], layout,
                                             KVConversion.between(self.layout.format, layout.format, self._cache.dtype,
                                                                  self._convert))

    def _descs(self, layout: KVLayout, runs: list[tuple[int, int, int]], side: int, tier: KVTier = KVTier.DEVICE,
               draft_runs: list[tuple[int, int, int]] = ()):
        """The descriptors of `runs` of the `tier` pool's blocks, then of `draft_runs` of the draft's."""
        base, mem_type, dev_id = layout.region(tier)
        ranges = [(base + run[side] * layout.block_bytes, run[2] * layout.block_bytes, dev_id) for run in runs]
        ranges += [(layout.draft_base_addr + run[side] * layout.draft_block_bytes, run[2] * layout.draft_block_bytes,
                    dev_id) for run in draft_runs]
        return self.agent.get_xfer_descs(ranges, mem_type)

    def _draft_runs(self, spec: LoadSpec, conversion: KVConversion | None) -> list[tuple[int, int, int]]:
        """The runs of a load's blocks whose draft KV comes too: the first full-attention group's,
        where this engine has a draft cache (a peer's is then the same: check_peer; on rank 0, of
        either) and the blocks are in the peer's device pool (its host tier keeps no draft KV).
        None from a peer whose cache holds another KV dtype or scales (`conversion`): the draft's
        cache holds the same dtype, and its blocks are not converted; the draft computes its KV."""
        if (not self.layout.draft_block_bytes or spec.remote_tier is not KVTier.DEVICE or spec.draft_start < 0
                or conversion is not None):
            return []
        start, end = spec.full_attention
        return merge_runs(spec.local_block_ids[start:end], spec.remote_block_ids[start:end])

    # ---- polling during steps ----------------------------------------------------------------
    def _poll_once(self) -> bool:
        """One turn of the progress thread (_poll): whether there was work to poll for; False
        once closed."""
        if not (self._loading or self._holds or time.monotonic() < self._active_until):
            return False
        time.sleep(0.001)
        with self._lock:
            if self.layout is None:
                return False
            self._collect_notifs()
        return True

    def _collect_notifs(self) -> None:  # under self._lock
        for messages in self.agent.get_new_notifs().values():
            self._inbox.extend(messages)

    def _stay_active(self) -> None:
        self._active_until = time.monotonic() + 5.0  # a hold registers a step after its handle leaves
        self._wake.set()

    # ---- each step ----------------------------------------------------------------------------
    def start_load_kv(self, metadata: NixlConnectorMeta | None) -> None:
        if metadata is not None and not isinstance(metadata, NixlConnectorMeta):
            raise TypeError(f"kv_connector_metadata: the NIXL worker half takes its scheduler half's "
                            f"NixlConnectorMeta, not {type(metadata).__name__}")
        if metadata is None or not (metadata.loads or metadata.holds):
            return
        self._stay_active()
        with self._lock:
            self._start_loads(metadata)

    def _start_loads(self, metadata: NixlConnectorMeta) -> None:
        for req_id, deadline in metadata.holds.items() if self.rank == 0 else ():
            self._holds.register(req_id, deadline)
        for load in metadata.loads:
            blocks = load.local_block_ids
            record = KVTransfer(load.request_id, load.remote_engine_id, len(blocks), 0, 0, time.monotonic())
            self._started.append(record)
            entry = None
            try:  # a malformed handle (block lists of other lengths) fails this request only
                if len(blocks) != len(load.remote_block_ids):
                    raise ValueError(f"{len(blocks)} local blocks for {len(load.remote_block_ids)} remote ones")
                peer = self.peers.get(load.remote_engine_id)
                if peer is None:
                    raise KeyError(f"no layout for peer {load.remote_engine_id!r}")
                # One READ per head slice; it carries the peer's notice only where it is the
                # whole load (no rank on either side); else rank 0 tells the peer once all landed.
                with_read = self.tp == 1 and peer.tp == 1
                if not with_read and self.rank == 0:
                    self._deferred[load.request_id] = load
                if not blocks:  # all hit locally: as good as read, the prefill's hold may go
                    record.end_time, record.ok = record.start_time, True
                    if self.rank == 0:  # (no rank has anything to read)
                        self._deferred.pop(load.request_id, None)
                        self._notify(load, ReadDone(load.remote_request_id))
                    continue
                entry = _Load(load, [], time.monotonic() + self.load_timeout_s, record, conversion=peer.conversion)
                notice = encode_notification(ReadDone(load.remote_request_id)) if with_read else b""
                for head_slice in read_plan(self.layout.format.num_kv_heads, self.tp, self.rank, peer.tp):
                    self._read_slice(entry, peer, head_slice, notice)
                draft_runs = self._draft_runs(load, entry.conversion)
                if draft_runs and not entry.with_draft:  # no READ from the peer's rank 0 took it along
                    self._read(entry, peer, 0, self._descs(self.layout, [], 0, draft_runs=draft_runs),
                               self._descs(peer.layout, [], 1, draft_runs=draft_runs), b"")
                    self._count(entry, [], draft_runs, peer.layout)
                self._loading[load.request_id] = entry
                self.num_blocks_pulled += len(blocks)
                self.num_bytes_pulled += record.num_bytes
            except Exception as e:  # noqa: BLE001 - the request recomputes instead
                log.warning("KV load for %s from %s failed to start: %s", load.request_id, load.remote_engine_id, e)
                record.error = f"failed to start: {e}"
                if entry is not None:
                    self._release(entry)
                self._failed[load.request_id] = (blocks, record)
                self._let_go(load)

    def _read_slice(self, entry: _Load, peer: _Peer, head_slice: HeadSlice, notice: bytes) -> None:
        """Start the READ of one head slice: straight into the cache where the peer rank's
        blocks are ours byte for byte, else into a buffer of the peer rank's block shape."""
        spec, remote = entry.spec, peer.layout.rank(head_slice.peer_rank)
        draft_runs = []
        if head_slice.direct and entry.conversion is None:
            runs = merge_runs(spec.local_block_ids, spec.remote_block_ids)
            if head_slice.peer_rank == 0:  # (a draft lives on rank 0: its blocks come along)
                draft_runs = self._draft_runs(spec, entry.conversion)
            local = self._descs(self.layout, runs, 0, draft_runs=draft_runs)
        else:
            first, last = kv_head_range(self.layout.format.num_kv_heads, peer.tp, head_slice.peer_rank)
            buffer, registration = self._staging.take(self._cache, len(spec.local_block_ids), last - first,
                                                      _torch_dtype(peer.layout.format.dtype))
            entry.staged.append(Staged(buffer, registration, head_slice, first))
            runs = merge_runs(list(range(len(spec.local_block_ids))), spec.remote_block_ids)
            on_gpu = buffer.device.type == "cuda"
            local = self.agent.get_xfer_descs(
                [(buffer.data_ptr() + start * remote.block_bytes, n * remote.block_bytes,
                  (buffer.device.index or 0) if on_gpu else 0) for start, _, n in runs], "VRAM" if on_gpu else "DRAM")
        # One READ for the draft's blocks too: the notice it carries frees both on the prefill.
        self._read(entry, peer, head_slice.peer_rank, local, self._descs(remote, runs, 1, spec.remote_tier, draft_runs),
                   notice)
        self._count(entry, runs, draft_runs, remote)

    def _read(self, entry: _Load, peer: _Peer, peer_rank: int, local, remote, notice: bytes) -> None:
        handle = self.agent.initialize_xfer("READ", local, remote, peer.agent_names[peer_rank], notice)
        if self.agent.transfer(handle) == "ERR":
            self.agent.release_xfer_handle(handle)
            raise RuntimeError("NIXL refused the transfer")
        entry.handles.append(handle)

    def _count(self, entry: _Load, runs: list, draft_runs: list, remote: KVLayout) -> None:
        """A READ's descriptors and bytes: `runs` of whole blocks of `remote`'s, and of its draft's."""
        entry.with_draft = entry.with_draft or bool(draft_runs)
        entry.record.num_descriptors += len(runs) + len(draft_runs)
        entry.record.num_bytes += (sum(n for *_, n in runs) * remote.block_bytes
                                   + sum(n for *_, n in draft_runs) * remote.draft_block_bytes)
        self.num_descriptors += len(runs) + len(draft_runs)

    def _release(self, entry: _Load, reusable: bool = False) -> None:
        for handle in entry.handles:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as e:  # noqa: BLE001 - a READ that cannot be cancelled: forget it
                log.warning("could not release the KV load of %s: %s", entry.spec.request_id, e)
        for staged in entry.staged:  # (reused only once every READ into it is over and done)
            self._staging.give_back(staged.buffer, staged.registration, reusable)
        entry.handles, entry.staged = [], []

    def _let_go(self, load: LoadSpec) -> None:
        """Tell the prefill to free a hold this engine will not read (best effort: it expires
        anyway). Under tensor parallelism rank 0 says it once every rank ended (finish_load)."""
        if self.tp == 1:
            self._deferred.pop(load.request_id, None)
            self._notify(load, LetGo(load.remote_request_id))

    def _notify(self, load: LoadSpec, note: Notification) -> None:  # under self._lock
        peer = self.peers.get(load.remote_engine_id)
        try:
            if peer is not None:
                self.agent.send_notif(peer.agent_names[0], encode_notification(note))
        except Exception as e:  # noqa: BLE001
            log.warning("could not tell %s about the blocks of %s: %s", load.remote_engine_id,
                        load.remote_request_id, e)

    def finish_load(self, request_id: str, ok: bool) -> None:
        load = self._deferred.pop(request_id, None)
        if load is not None:
            with self._lock:
                self._notify(load, ReadDone(load.remote_request_id) if ok else LetGo(load.remote_request_id))

    def release(self, req_id: str) -> None:
        """Let go of a hold no decode will pull, as if its reader had said it is done."""
        self._holds.end(req_id, HoldOutcome.RELEASED, time.monotonic())

    @property
    def num_expired_holds(self) -> int:
        return self._holds.num_expired

    def get_finished(self) -> KVConnectorOutput:
        with self._lock:
            return self._get_finished()

    def _get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput(transfers_started=self._started)
        self._started = []
        now = time.monotonic()
        for req_id, entry in list(self._loading.items()):
            states = [self.agent.check_xfer_state(handle) for handle in entry.handles]
            state = next((s for s in states if s not in ("PROC", "WAIT", "DONE")), None)  # one failed: all did
            if state is None and any(s != "DONE" for s in states):
                if now < entry.give_up:  # still moving
                    continue
                state = "PROC"
            if state is None:
                land(self._cache, entry.staged, entry.spec.local_block_ids,
                     kv_head_range(self.layout.format.num_kv_heads, self.tp, self.rank)[0], entry.conversion,
                     entry.spec.group_counts)
            self._release(entry, reusable=state is None)
            del self._loading[req_id]
            load, record = entry.spec, entry.record
            record.end_time = time.monotonic()  # (after the staged slices' copies)
            if state is not None:
                log.warning("KV load for %s ended in state %s; recomputing its blocks", req_id, state)
                timed_out = state in ("PROC", "WAIT")
                record.error = "timed out" if timed_out else f"ended in state {state}"
                self._failed[req_id] = (load.local_block_ids, record)
                if not timed_out:  # over: the prefill need not wait for its timeout (a stuck read may still land)
                    self._let_go(load)
            else:
                record.ok = True
                out.finished_recving.add(req_id)
                if entry.with_draft:
                    out.draft_kv_landed[req_id] = load.draft_start
                out.transfers_ended[req_id] = record
                if self.tp == 1 and req_id in self._deferred:  # a peer of ranks: its notice did not go with a READ
                    self._notify(self._deferred.pop(req_id), ReadDone(load.remote_request_id))
        for req_id, (blocks, record) in self._failed.items():
            record.end_time = record.end_time or now
            out.finished_recving.add(req_id)
            out.invalid_block_ids.update(blocks)
            out.invalid_by_request[req_id] = set(blocks)
            out.transfers_ended[req_id] = record
        self._failed = {}
        for record in out.transfers_started:  # nothing to move: done as it started
            if record.ok and record.request_id not in out.transfers_ended:
                out.transfers_ended[record.request_id] = record
        self._collect_notifs()
        inbox, self._inbox = self._inbox, []
        for raw in inbox:
            try:
                note = decode_notification(raw)
            except msgspec.DecodeError as e:  # not from a Baton peer of this version: ignore it
                log.warning("ignoring a KV notification that is not one: %s", e)
                continue
            self._holds.end(note.request_id, _OUTCOMES[type(note)], now)
        out.holds_ended = self._holds.take(now)
        out.finished_sending.update(end.request_id for end in out.holds_ended)
        return out

    def close(self) -> None:
        """Stop the progress thread, end the loads under way and let the agent go of the memory
        (the cache too: a closed worker keeps no tensor). Twice is once."""
        self._closed.set()
        self._wake.set()
        if self._poller is not None and self._poller is not threading.current_thread():
            self._poller.join(1.0)  # it waits 0.1 s at most before it sees _closed
        with self._lock:
            for entry in self._loading.values():
                self._release(entry)
            self._loading.clear()
            self._staging.close()
            if self.layout is not None:
                for reg in self._regs:
                    self.agent.deregister_memory(reg)
                self.layout = None
                self._regs, self._cache = [], None


def _poll(worker: weakref.ref, closed: threading.Event, wake: threading.Event, device) -> None:
    """The progress thread: keep UCX moving while a forward pass runs (the GIL is free then, the
    agent is not). It holds its worker only for a turn, so that a worker its engine dropped
    without closing it is freed (and this thread ends) rather than kept, cache and all, for the
    life of the process. On the engine's GPU: a thread starts on device 0, where UCX's CUDA
    transports would otherwise make their context for an engine placed on another."""
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
    while not closed.is_set():
        w = worker()
        if w is None:
            return
        busy = w._poll_once()
        del w
        if not busy:
            wake.wait(0.1)
            wake.clear()


def make_nixl_connector(engine_id: str, block_size: int, hold_timeout_s: float = DEFAULT_HOLD_TIMEOUT_S,
                        agent=None, load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
                        ) -> tuple[NixlConnectorScheduler, NixlConnectorWorker]:
    """The two halves for LLMEngine(config, kv_connector=...)."""
    return (NixlConnectorScheduler(engine_id, block_size, hold_timeout_s, load_timeout_s),
            NixlConnectorWorker(engine_id, agent, load_timeout_s))
