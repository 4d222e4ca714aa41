"""The engine core's steps: scheduled, run on the worker and taken back by the scheduler; or,
under async scheduling (vLLM's), step N+1 scheduled and queued on the device before step N's
tokens are taken, so the host's work for a step overlaps the device's for the one before.

Scheduling ahead needs nothing of step N on the host: the scheduler counts each request's tokens
on their way (Request.num_pending_tokens) and does not schedule a request they end by length; the
runner reads a request's last token on the device (ModelRunner.submit). A stop token found in step
N's output ends its request while step N+1 computes one more position for it, which nobody reads
(its KV is the right KV of that position, its token dropped). A step while some request needs the
host between its steps (SamplingParams.needs_host_between_steps: logprobs, penalties, grammars,
min_tokens) takes the step in flight first and runs alone, as does every step of an engine that cannot schedule ahead
(async_off_because)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from baton.engine.common.config import EngineConfig
from baton.engine.common.scheduler_output import ModelRunnerOutput, SchedulerOutput
from baton.engine.core.request import RequestUpdate
from baton.engine.core.scheduler import Scheduler
from baton.engine.worker.model_runner import ModelRunner
from baton.engine.worker.parallel.workers import TPWorkers
from baton.engine.worker.queued_step import QueuedStep

Done = tuple[SchedulerOutput, ModelRunnerOutput, list[RequestUpdate]]  # a step taken back


@dataclass(slots=True)
class StepTimes:
    """Wall time spent, for the benchmark's scheduler share."""
    steps: int = 0
    step_s: float = 0.0
    scheduler_s: float = 0.0  # schedule() + update_from_output()


class StepLoop:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, workers: TPWorkers | None, ahead: bool):
        """`ahead`: schedule each step before the one before is taken (async scheduling)."""
        self.scheduler, self.runner, self.workers, self.ahead = scheduler, runner, workers, ahead
        self.in_flight: tuple[SchedulerOutput, QueuedStep] | None = None  # queued, its tokens not taken yet
        self.times = StepTimes()

    def step(self) -> list[Done]:
        """The steps that ended now."""
        if not self.ahead:
            return [self._step_now()]
        if self.scheduler.num_host_bound:  # a request needs its tokens on the host before its next step
            return ([self._take()] if self.in_flight is not None else []) + [self._step_now()]
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        self.times.scheduler_s += time.perf_counter() - t0
        queued = self.runner.submit(sched) if self.workers is None else self.workers.submit(self.runner, sched)
        done = [self._take()] if self.in_flight is not None else []
        self.in_flight = (sched, queued)
        if not sched.total_num_scheduled_tokens:  # nothing ahead: take it now
            done.append(self._take())
        self.times.steps += 1
        self.times.step_s += time.perf_counter() - t0
        return done

    def _step_now(self) -> Done:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        result = (self.runner.execute_model(sched) if self.workers is None else
                  self.workers.execute(self.runner, sched))
        t2 = time.perf_counter()
        updates = self.scheduler.update_from_output(sched, result)
        t3 = time.perf_counter()
        self.times.steps += 1
        self.times.step_s += t3 - t0
        self.times.scheduler_s += (t1 - t0) + (t3 - t2)
        return sched, result, updates

    def _take(self) -> Done:
        """The step in flight's tokens, waited for, and the scheduler's updates from them."""
        (sched, queued), self.in_flight = self.in_flight, None
        result = queued.result()
        t0 = time.perf_counter()
        updates = self.scheduler.update_from_output(sched, result)
        self.times.scheduler_s += time.perf_counter() - t0
        return sched, result, updates


def async_off_because(config: EngineConfig, rope_by_length: bool) -> str | None:
    """Why an engine asked for async scheduling steps one at a time (None: it schedules ahead)."""
    for reason, off in (("speculative decoding", config.speculative_config is not None),
                        ("RoPE by sequence length", rope_by_length)):
        if off:
            return reason
    return None
