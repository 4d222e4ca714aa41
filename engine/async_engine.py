"""An LLMEngine driven from asyncio: the step loop runs on its own thread.

The engine is not thread-safe, so only the loop thread touches it. Callers validate a
request with `LLMEngine.make_request` (read-only) on their own thread, then hand it over
through a command queue; each step's outputs come back to the event loop in one
`call_soon_threadsafe` and are fanned out to per-request queues. Streaming therefore never
stalls a step, and a step never blocks the event loop (torch releases the GIL in its ops).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from baton.engine.llm_engine import LLMEngine, StepOutput
from baton.engine.request import Request
from baton.engine.stats import StepEvents

log = logging.getLogger("baton.engine")


class EngineDead(RuntimeError):
    """The step loop stopped on an error; the request cannot go on."""


class DuplicateRequest(KeyError):
    pass


class QueueFull(RuntimeError):
    pass


def _merge_queued(out: StepOutput | BaseException, outputs: asyncio.Queue) -> StepOutput:
    """When the caller fell behind the engine (a slow client, a busy event loop), fold
    everything queued into one output: one message per read instead of one per step, as
    vLLM's output collector does."""
    if isinstance(out, BaseException):
        raise out
    while not out.finished and not outputs.empty():
        more = outputs.get_nowait()
        if isinstance(more, BaseException):
            raise more
        out = dataclasses.replace(more, new_token_ids=out.new_token_ids + more.new_token_ids,
                                  text=out.text + more.text, prompt_logprobs=out.prompt_logprobs or more.prompt_logprobs,
                                  logprobs=None if out.logprobs is None and more.logprobs is None
                                  else (out.logprobs or []) + (more.logprobs or []))
    return out


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None,
                 on_dead: Callable[[BaseException], None] | None = None,
                 on_step: Callable[[StepEvents, list[StepOutput]], None] | None = None):
        """`on_step`: given each step's request events and outputs on the event loop, before the
        outputs reach their streams (telemetry); without it the engine records no events."""
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.on_dead = on_dead
        self.on_step = on_step
        if on_step is not None:
            engine.record_events()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}  # event-loop side: request id -> its outputs
        # Ids whose stream left before the request finished, until the step loop has aborted
        # it: a new request with the id waits, or it would get the old one's last outputs.
        self._leaving: dict[str, asyncio.Future] = {}
        self._num_pending_adds = 0  # handed over, not yet in the scheduler (event-loop side)
        self.num_requests = 0  # admitted since start
        self._stopping = False
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="baton-step-loop", daemon=True)

    # ---- lifecycle (event loop) -------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        await asyncio.to_thread(self._thread.join)
        self._release_leaving()

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._num_pending_adds

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests (event loop) --------------------------------------------------------------
    async def generate(self, request: Request) -> AsyncIterator[StepOutput]:
        """Run a request made by `engine.make_request`; yields its outputs as steps produce
        them. Leaving the iteration early (cancellation included) aborts it in the engine."""
        req_id = request.request_id
        if self._error is not None:
            raise EngineDead(f"the engine stopped: {self._error!r}")
        while req_id in self._leaving and req_id not in self._streams:
            await asyncio.shield(self._leaving[req_id])
        if self._error is not None:
            raise EngineDead(f"the engine stopped: {self._error!r}")
        if req_id in self._streams:
            raise DuplicateRequest(req_id)
        if self.max_waiting_requests is not None and self.num_waiting >= self.max_waiting_requests:
            raise QueueFull(f"{self.num_waiting} requests are waiting, the bound (max_waiting_requests) is "
                            f"{self.max_waiting_requests}")
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[req_id] = outputs
        self._num_pending_adds += 1
        self.num_requests += 1
        self._submit(("add", request))
        finished = False
        try:
            while not finished:
                out = _merge_queued(await outputs.get(), outputs)
                finished = out.finished
                yield out
        finally:
            del self._streams[req_id]
            if not finished and self._error is None:  # a dead loop applies no abort: nothing to wait for
                self._leaving[req_id] = self._loop.create_future()
                self._submit(("abort", ([req_id], False)))

    async def call(self, fn, *args):
        """Run fn(*args) on the step-loop thread between steps (for anything that touches the
        engine or its transport); returns its result."""
        if self._error is not None:
            raise EngineDead(f"the engine stopped: {self._error!r}")
        future = concurrent.futures.Future()
        self._submit(("call", (future, fn, args)))
        if self._error is not None:  # the loop died meanwhile: nobody will run it
            self._fail_pending_calls()
        return await asyncio.wrap_future(future)

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests by id (the Abort API): each stream gets a last output, finish reason
        "abort"; ids not in the engine are ignored."""
        self._submit(("abort", (list(request_ids), True)))

    def _submit(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _dispatch(self, outputs: list[StepOutput], num_added: int, failed: list[tuple[str, Exception]],
                  events: StepEvents | None, left: list[str]) -> None:
        self._num_pending_adds -= num_added
        if events is not None:
            try:
                self.on_step(events, outputs)
            except Exception:  # noqa: BLE001 - telemetry must never cost a request
                log.exception("telemetry failed on a step's events")
        for req_id, error in failed:
            stream = self._streams.get(req_id)
            if stream is not None:
                stream.put_nowait(error)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:  # else the caller left already; its abort is queued
                stream.put_nowait(out)
        # After this step's outputs: those of an earlier step reached their dispatch first.
        for req_id in left:
            done = self._leaving.pop(req_id, None)
            if done is not None:
                done.set_result(None)

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(EngineDead(f"the engine stopped: {error!r}"))
        self._release_leaving()
        if self.on_dead is not None:
            self.on_dead(error)

    def _release_leaving(self) -> None:
        """The step loop is gone: nobody waits for an abort that will not be applied."""
        for done in self._leaving.values():
            if not done.done():
                done.set_result(None)
        self._leaving.clear()

    def _fail_pending_calls(self) -> None:
        """Commands queued for a step loop that is gone: their callers get EngineDead."""
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "call" and arg[0].set_running_or_notify_cancel():
                arg[0].set_exception(EngineDead(f"the engine stopped: {self._error!r}"))

    # ---- the step loop (its own thread) -----------------------------------------------------
    def _apply_commands(self) -> tuple[int, list[tuple[str, Exception]], list[StepOutput], list[str]]:
        """Adds, aborts and calls queued since the last step: how many were added, the adds that
        failed, the last outputs of requests the Abort API ended, and the ids of those whose
        stream had left (ended quietly)."""
        num_added, failed, aborted, left = 0, [], [], []
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return num_added, failed, aborted, left
            if kind == "abort":
                request_ids, tell = arg
                outputs = self.engine.abort_request(request_ids)
                if tell:
                    aborted += outputs
                else:
                    left += request_ids
                continue
            if kind == "call":
                future, fn, args = arg
                # Runs even when its caller was cancelled meanwhile (a handshake or a release
                # still counts); only the result goes nowhere then.
                waited = future.set_running_or_notify_cancel()
                try:
                    result = fn(*args)
                except Exception as error:  # noqa: BLE001 - handed to the caller
                    if waited:
                        future.set_exception(error)
                else:
                    if waited:
                        future.set_result(result)
                continue
            num_added += 1
            try:
                self.engine.add(arg)
            except Exception as error:  # noqa: BLE001 - that request fails, the loop goes on
                failed.append((arg.request_id, error))

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                num_added, failed, outputs, left = self._apply_commands()
                busy = engine.has_unfinished_requests()
                if busy or engine.num_held_requests:
                    outputs += engine.step()
                events = engine.take_events() if self.on_step is not None else None
                if outputs or num_added or left or (events is not None and (events.events or events.step_tokens)):
                    self._loop.call_soon_threadsafe(self._dispatch, outputs, num_added, failed, events, left)
                if not busy:  # idle, or only polling held blocks for a remote reader
                    self._wakeup.wait(0.001 if engine.num_held_requests else None)
                    self._wakeup.clear()
        except BaseException as error:  # noqa: BLE001 - reported to every stream, then logged
            log.exception("the engine step loop stopped")
            self._error = error
            self._fail_pending_calls()
            self._loop.call_soon_threadsafe(self._fail_all, error)
