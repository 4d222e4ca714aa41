"""An engine core's tensor-parallel ranks, seen from the core: rank 0 runs in the core's own
process (its runner is the engine's runner: the step's output never crosses a process), ranks
1..N-1 are processes of their own (rank.py) that this class starts, feeds and watches.

Each step's SchedulerOutput goes to every rank once, through a shared-memory ring
(shm_broadcast.py), with the tokens rank 0 sampled the step before: only rank 0 samples, the
others mirror its tokens. Then every rank runs the same forward, meeting in its collectives.

With a KV connector every rank has its own worker half (its own NIXL agent over its own
cache, made by rank 0's `for_rank`); the engine's layout lists every rank's. Each rank reads
its own heads of a load; a rank answers on a ring of its own when its part of a load ended, and
rank 0 reports the load ended (and tells the peer) once every rank's did. Host KV tier jobs
likewise: each rank copies its heads of the blocks, and a job is done once every rank's landed.

A rank that dies is the engine's death. Before the group met, rank 0's rendezvous gives up at
once (a StartupError naming the rank: watched_store.py), not after the store's timeout. After,
a watcher thread per rank sees it exit: a core in a process of its own is told (`on_dead`: the
process exits non-zero, so its front fails every stream UNAVAILABLE); an engine in this process
(offline) has the group aborted (NCCL's collectives would wait for ever; gloo's fail by
themselves once the dead rank's sockets close). Either way the step under way, and every step
after, raises RankDied naming the rank, whatever error the collective or the ring raised. The
ranks die with the core (PR_SET_PDEATHSIG) and ignore SIGINT (a terminal's Ctrl-C is the
front's, which stops the core, which stops them: lifetime.child_argv), and the ring's file is
unlinked as soon as every rank has it mapped.
"""
from __future__ import annotations

import datetime
import logging
import os
import pickle
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from baton.engine.common.config import EngineConfig
from baton.engine.common.core_messages import error_from
from baton.engine.common.errors import StartupError
from baton.engine.common.lifetime import child_argv
from baton.engine.common.scheduler_output import ModelRunnerOutput, SchedulerOutput
from baton.engine.worker.parallel.rank_messages import (
    RankAdapter,
    RankAddPeer,
    RankReady,
    RankReport,
    RankStart,
    RankStep,
    RankStop,
    RunnerSetup,
)
from baton.engine.worker.parallel.shm_broadcast import PeerGone, ShmBroadcast
from baton.engine.worker.parallel.tensor_parallel import TPGroup
from baton.engine.worker.queued_step import QueuedStep
from baton.kv_transfer.base import KVConnectorOutput, KVConnectorWorker, KVLayout, KVTransfer

log = logging.getLogger("baton.tp")
T = TypeVar("T")

_STORE_TIMEOUT = datetime.timedelta(seconds=600)
_READY_POLL_S = 0.05
_STOP_WAIT_S = 5.0
# A collective on a dead rank can fail (its sockets closed) a moment before the rank's watcher
# thread has seen the exit; a step that failed waits this long for the watcher's word (it comes
# within milliseconds, even on a loaded machine) before taking its own error as the cause.
_DEATH_GRACE_S = 2.0


class RankDied(RuntimeError):
    """A tensor-parallel rank of this engine exited."""


def threads_per_rank(size: int) -> int:
    """Torch threads for each of `size` ranks sharing this machine's CPUs (OMP_NUM_THREADS wins)."""
    if "OMP_NUM_THREADS" in os.environ:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, len(os.sched_getaffinity(0)) // size)


class TPWorkers:
    def __init__(self, config: EngineConfig, connector: KVConnectorWorker | None = None):
        """Start ranks 1..N-1 (they load their shares while the caller loads rank 0's);
        `connector`: rank 0's KV connector worker, whose `for_rank` makes the others'."""
        self.size = config.tensor_parallel_size
        self.threads = threads_per_rank(self.size)
        self.store = dist.TCPStore("127.0.0.1", 0, self.size, True, timeout=_STORE_TIMEOUT, wait_for_workers=False)
        self.ring = ShmBroadcast.create(self.size - 1)
        self.back = [ShmBroadcast.create(1, reader=0) for _ in range(1, self.size)]  # each rank's answers
        self.has_connector = connector is not None
        # KV loads some ranks ended: request id -> the ranks, and the blocks that failed there.
        self._loads_ended: dict[str, set[int]] = {}
        self._loads_invalid: dict[str, set[int]] = {}
        self._load_records: dict[str, KVTransfer] = {}  # rank 0's record of each, until every rank ended
        self._host_jobs: dict[int, int] = {}  # host KV tier job -> ranks whose copies landed
        self.sampled: dict[str, list[int]] = {}  # rank 0's tokens of the last step, for the others
        self.dead: tuple[int, int] | None = None  # (rank, exit status) of a rank that died
        self._died = threading.Event()  # set with `dead`
        self.on_dead: Callable[[RankDied], None] | None = None  # without it, the watcher aborts the group
        self.group: TPGroup | None = None  # rank 0's, once the ranks met
        self.broadcast_s = 0.0  # time spent handing steps over (the benchmark's figure)
        self._stopping = False
        self.procs: list[subprocess.Popen] = []
        try:
            for rank in range(1, self.size):
                proc = subprocess.Popen(child_argv("baton.engine.worker.parallel.rank"), stdin=subprocess.PIPE)
                self.procs.append(proc)
                proc.stdin.write(pickle.dumps(RankStart(
                    config, rank, self.store.port, self.ring.path, os.getpid(), self.threads, self.back[rank - 1].path,
                    connector.for_rank(rank) if connector is not None else None)))
                proc.stdin.close()
        except BaseException:
            self.close()
            raise
        torch.set_num_threads(self.threads)

    def join(self, device: torch.device) -> TPGroup:
        """Once every rank loaded its share: rank 0's place in the group. A rank that could not
        load is this engine's error (its own, naming the field where it names one)."""
        for rank in range(1, self.size):
            ready: RankReady = self._await(rank, "ready", "loading")
            if ready.error is not None:
                raise error_from(ready.error)
        for ring in [self.ring, *self.back]:  # every rank has them mapped by now
            ring.unlink()
        self.group = TPGroup.join(0, self.size, self.store, device, give_up=self._check_joining)
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"tp-rank{rank}-watch", daemon=True).start()
        return self.group

    def _check_joining(self) -> None:
        """Between the rendezvous's looks at the store: a rank that exited ends it."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                raise StartupError(f"tensor-parallel rank {rank} exited with status {proc.returncode} "
                                   "while joining the group")

    def setup(self, setup: RunnerSetup) -> list[KVLayout]:
        """Build every rank's runner; the KV layouts of ranks 1..N-1 (with a KV connector)."""
        self._to_ranks(setup)
        if not self.has_connector:
            return []
        return [self._await(rank, "layout", "registering its KV cache") for rank in range(1, self.size)]

    def _await(self, rank: int, key: str, doing: str):
        """What rank `rank` put in the store under `key` (it is still `doing` that, unless it died)."""
        proc = self.procs[rank - 1]
        while not self.store.check([f"{key}{rank}"]):
            if proc.poll() is not None:
                raise StartupError(f"tensor-parallel rank {rank} exited with status {proc.returncode} while {doing}")
            time.sleep(_READY_POLL_S)
        return pickle.loads(self.store.get(f"{key}{rank}"))

    def add_peer(self, layout: KVLayout) -> None:
        self.send(RankAddPeer(layout))

    def send(self, message: RankAddPeer | RankAdapter) -> None:
        """What every rank must learn between steps (in order with the steps)."""
        self._to_ranks(message)

    def _to_ranks(self, message: object) -> None:
        try:
            self.ring.send(message, self._alive)
        except PeerGone as e:  # (only once a watcher saw a rank exit)
            raise self._death() from e

    def execute(self, runner, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One step on every rank: rank 0's output (its KV loads ended once every rank's did).
        Raises RankDied once a rank died, whatever the step itself raised."""
        out = self._on_every_rank(RankStep(sched, self.sampled), lambda: runner.execute_model(sched))
        self.sampled = out.sampled_token_ids
        return self._merge_reports(out, runner)

    def submit(self, runner, sched: SchedulerOutput) -> QueuedStep:
        """A step queued behind the one in flight (async scheduling) on every rank: rank 0's
        queued step, its transfers those that ended on every rank. Each rank reads the tokens in
        flight on its own device (rank 0 broadcasts them as it samples: ModelRunner._queue) and
        takes them itself once the next step is queued, so none goes back through the ring."""
        queued = self._on_every_rank(RankStep(sched, self.sampled, ahead=True), lambda: runner.submit(sched))
        self.sampled = {}
        queued.transfers = self._merge_reports(queued.transfers, runner)
        return queued

    def _on_every_rank(self, step: RankStep, run: Callable[[], T]) -> T:
        """`step` sent to the other ranks, then `run` here (rank 0's part). Raises RankDied once
        a rank died, whatever the step itself raised."""
        if self.dead is not None:
            raise self._death()
        try:
            t0 = time.perf_counter()
            self.ring.send(step, self._alive)
            self.broadcast_s += time.perf_counter() - t0
            result = run()
        except Exception as e:
            if self._died.wait(_DEATH_GRACE_S):
                raise self._death() from e
            raise
        if self.dead is not None:  # (an aborted NCCL group: what the step computed is not to be trusted)
            raise self._death()
        return result

    def _merge_reports(self, out: ModelRunnerOutput, runner) -> ModelRunnerOutput:
        """Rank 0's transfers in `out`, held back until every rank's ended (the other ranks'
        reports read off their rings)."""
        kv = out.kv_connector_output
        reports = [RankReport(0, kv.finished_recving if kv else set(), kv.invalid_by_request if kv else {},
                              out.host_kv_finished)]
        for ring in self.back:
            while ring.poll():
                reports.append(ring.recv())
        out.host_kv_finished = self._merge_host_jobs(reports)
        if kv is not None:
            self._merge_loads(kv, reports, runner.connector)
        return out

    def _merge_host_jobs(self, reports: list[RankReport]) -> list[int]:
        """Host KV tier jobs whose copies landed on every rank."""
        for report in reports:
            for job in report.host_jobs:
                self._host_jobs[job] = self._host_jobs.get(job, 0) + 1
        done = [job for job, n in self._host_jobs.items() if n == self.size]
        for job in done:
            del self._host_jobs[job]
        return done

    def _merge_loads(self, kv: KVConnectorOutput, reports: list[RankReport], connector: KVConnectorWorker) -> None:
        """Hold back rank 0's ended loads until every rank's ended; then report them (with every
        rank's failed blocks) and let the peer know."""
        for report in reports:
            for req_id in report.loads_ended:
                self._loads_ended.setdefault(req_id, set()).add(report.rank)
                self._loads_invalid.setdefault(req_id, set()).update(report.invalid.get(req_id, ()))
        self._load_records.update(kv.transfers_ended)
        kv.finished_recving, kv.invalid_block_ids, kv.invalid_by_request, kv.transfers_ended = set(), set(), {}, {}
        for req_id in [r for r, ranks in self._loads_ended.items() if len(ranks) == self.size]:
            del self._loads_ended[req_id]
            invalid = self._loads_invalid.pop(req_id)
            kv.finished_recving.add(req_id)
            kv.invalid_block_ids |= invalid
            kv.invalid_by_request[req_id] = invalid
            record = self._load_records.pop(req_id, None)
            if record is not None:
                record.end_time, record.ok = time.monotonic(), record.ok and not invalid
                kv.transfers_ended[req_id] = record
            connector.finish_load(req_id, not invalid)

    def _alive(self) -> bool:
        return self.dead is None

    def _death(self) -> RankDied:
        rank, code = self.dead
        return RankDied(f"tensor-parallel rank {rank} exited with status {code}")

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self._stopping or self.dead is not None:
            return
        self.dead = (rank, code)
        self._died.set()
        log.error("tensor-parallel rank %d (pid %d) exited with status %d", rank, proc.pid, code)
        if self.on_dead is not None:
            self.on_dead(self._death())
            return
        try:  # an engine in this process: the step waiting on the dead rank must end (then raise RankDied)
            self.group.abort()
        except Exception:  # (logged: the step still raises RankDied once it ends)
            log.exception("could not abort the tensor-parallel group")

    def close(self) -> None:
        """Stop every rank (told to, then killed after a while) and let go of the ring."""
        self._stopping = True
        deadline = time.monotonic() + _STOP_WAIT_S
        if self.dead is None and all(p.poll() is None for p in self.procs):
            try:  # (a full ring whose ranks hang in a collective: given up at the deadline)
                self.ring.send(RankStop(), lambda: time.monotonic() < deadline
                               and all(p.poll() is None for p in self.procs))
            except RuntimeError:  # one died meanwhile, or they hang: the kill below
                pass
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for ring in [self.ring, *self.back]:
            ring.unlink()
            ring.close()
