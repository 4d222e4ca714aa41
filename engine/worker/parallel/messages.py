"""What an engine core and its tensor-parallel ranks say to each other: a rank's start
arguments (on its stdin), whether it could load (through the group's TCP store), then, over the
shared-memory ring, its runner's set-up and one message per step."""
from __future__ import annotations

from dataclasses import dataclass, field

from baton.engine.common.config import EngineConfig
from baton.engine.common.kv_groups import KVGroups
from baton.engine.common.messages import CallError
from baton.engine.common.scheduler_output import SchedulerOutput


@dataclass(slots=True)
class RankStart:
    config: EngineConfig  # as the core resolved its device: this rank's device is the next ones
    rank: int
    store_port: int  # the group's TCP store, on 127.0.0.1
    ring_path: str  # the step ring (shm_broadcast)
    parent: int  # the engine core's pid: the rank dies with it
    threads: int  # torch threads (CPU)


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


@dataclass(slots=True)
class RankStep:
    sched: SchedulerOutput
    # The tokens the driver (rank 0) sampled in the step before, per request: the other ranks
    # append them to their copy of each request, as the driver did, before building this step.
    sampled: dict[str, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class RankStop:
    """The engine stops: the rank exits 0."""
