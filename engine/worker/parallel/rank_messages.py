"""What an engine core and its tensor-parallel ranks say to each other: a rank's start
arguments (on its stdin), whether it could load and its KV layout (through the group's TCP
store), then, over the shared-memory ring, its runner's set-up, one message per step, the KV
peers learnt and the LoRA adapters loaded or unloaded; back, on a ring of its own, the KV loads
and host-tier copies it finished."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from baton.engine.common.config import EngineConfig
from baton.engine.common.core_messages import CallError
from baton.engine.common.kv_groups import KVGroups
from baton.engine.common.scheduler_output import SchedulerOutput
from baton.kv_transfer.base import KVConnectorWorker, KVLayout


@dataclass(slots=True)
class RankStart:
    config: EngineConfig  # as the core resolved its device: this rank's device is the next ones
    rank: int
    store_port: int  # the group's TCP store, on 127.0.0.1
    ring_path: str  # the step ring (shm_broadcast)
    parent: int  # the engine core's pid: the rank dies with it
    threads: int  # torch threads (CPU)
    back_path: str  # the ring this rank answers on (its KV loads' ends)
    connector: Callable[[], KVConnectorWorker] | None = None  # the KV connector's worker half, as the core plugs it


@dataclass(slots=True)
class RankReady:
    """A rank loaded its share (or could not, and exits)."""
    error: CallError | None = None


@dataclass(slots=True)
class RunnerSetup:
    """How the core sized the KV cache: every rank's runner is built alike."""
    config: EngineConfig
    num_kv_blocks: int
    eos_token_ids: frozenset[int]
    kv_groups: KVGroups
    num_host_blocks: int = 0  # the host KV tier's (each rank holds its heads of every block)
    draft_format: tuple = ()  # rank 0's draft fields of its KVFormat (only rank 0 drafts): every rank's says so


@dataclass(slots=True)
class RankStep:
    sched: SchedulerOutput
    # The tokens the driver (rank 0) sampled in the step before, per request: the other ranks
    # append them to their copy of each request, as the driver did, before building this step.
    sampled: dict[str, list[int]] = field(default_factory=dict)
    # Async scheduling: queued behind the step in flight (ModelRunner.submit), whose tokens each
    # rank takes from its own device once this one is queued (rank 0's broadcast as sampled).
    ahead: bool = False


@dataclass(slots=True)
class RankStop:
    """The engine stops: the rank exits 0."""


@dataclass(slots=True)
class RankAddPeer:
    """A KV peer's layout (every rank of it), learnt at the handshake."""
    layout: KVLayout


@dataclass(slots=True)
class RankAdapter:
    """A LoRA adapter rank 0 loaded (under this id) or unloaded: the other ranks do the same."""
    name: str
    path: str
    adapter_id: int
    unload: bool = False


@dataclass(slots=True)
class RankReport:
    """A rank's answer, when it has one: its reads of these requests' KV ended (the blocks that
    failed, by request), and its copies of these host KV tier jobs landed."""
    rank: int
    loads_ended: set[str]
    invalid: dict[str, set[int]]
    host_jobs: list[int]

    def __bool__(self) -> bool:
        return bool(self.loads_ended or self.host_jobs)
