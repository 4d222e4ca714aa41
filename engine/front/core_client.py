"""A front's handle on its engine core process, from asyncio: requests go out as they come,
each step's outputs come back as one message, are detokenized here (the output processor) and
fanned out to per-request streams. The front never waits on a step, and the core never
detokenizes or encodes an RPC.

The core process is a fresh interpreter (`python -m baton.engine.core.process`: nothing of
the front's threads, sockets or main module is inherited), watched through a pidfd: when it
exits, every stream fails with EngineDead at once, pending
calls too, and `on_dead` tells the server (which reports NOT_SERVING and exits, so that its
supervisor restarts the pair). The core dies with the front (engine/core/process.py), and
ignores SIGINT (lifetime.child_argv): a terminal's Ctrl-C is the front's, which stops the core
in order (CoreShutdown).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import subprocess
import uuid
from collections.abc import AsyncIterator, Callable

import msgspec
import zmq

from baton.engine.common.config import EngineConfig
from baton.engine.common.core_messages import (
    Call,
    CallResult,
    CoreAbort,
    CoreCall,
    CoreFailed,
    CoreMessage,
    CoreOptions,
    CoreReady,
    CoreRequest,
    CoreShutdown,
    CoreStep,
    EngineFacts,
    error_from,
)
from baton.engine.common.errors import StartupError
from baton.engine.common.kv_cache_events import KVEvent
from baton.engine.common.lifetime import child_argv
from baton.engine.common.pixel_frames import request_frames
from baton.engine.common.stats import StepEvents
from baton.engine.common.tokenizer import load_tokenizer
from baton.engine.front.images import image_processor
from baton.engine.front.input_processor import InputProcessor
from baton.engine.front.output_processor import OutputProcessor, StepOutput

log = logging.getLogger("baton.engine")
_STOP_WAIT_S = 10.0  # a core told to stop gets this long before it is killed


class EngineDead(RuntimeError):
    """The engine core is gone (it died, or the server stops): the request cannot go on here."""


class DuplicateRequest(KeyError):
    pass


class QueueFull(RuntimeError):
    pass


def merge_outputs(out: StepOutput, more: StepOutput) -> StepOutput:
    """Two consecutive outputs of one request as one, `more` (the later, which the caller owns)
    updated in place: its state, both one's tokens."""
    more.new_token_ids = out.new_token_ids + more.new_token_ids
    more.text = out.text + more.text
    more.prompt_logprobs = out.prompt_logprobs or more.prompt_logprobs
    if out.logprobs is not None or more.logprobs is not None:
        more.logprobs = (out.logprobs or []) + (more.logprobs or [])
    more.ready_time = out.ready_time or more.ready_time
    return more


class _Stream:
    """One request's way to its caller: its outputs queued, and under a stream interval the
    one held back until it carries enough tokens (kept here, so that a held output costs
    the caller no wake-up); or, once the caller gave a sink (CoreClient.sink), its outputs
    but the last handed to the sink in the step's fan-out, with no wake-up at all, and its
    plain tokens (CoreStep's columns) to `on_token` with no output made for them."""
    __slots__ = ("queue", "held", "started", "sink", "on_token")

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.held: StepOutput | None = None
        self.started = False  # its first output is on its way
        self.sink: Callable[[StepOutput], None] | None = None
        self.on_token: Callable[[int, str], None] | None = None

    def put(self, out: StepOutput, interval: int) -> None:
        if self.held is not None:
            out, self.held = merge_outputs(self.held, out), None
        if self.started and not out.finished and len(out.new_token_ids) < interval:
            self.held = out
            return
        self.started = True  # the first at once: time to first token is not the interval's to delay
        if self.sink is not None and not out.finished:  # (the last goes to the caller, who ends the request)
            self.sink(out)
        else:
            self.queue.put_nowait(out)


def merge_queued(out: StepOutput | BaseException, outputs: asyncio.Queue) -> StepOutput:
    """When the caller fell behind the engine (a slow client, a busy event loop), fold
    everything queued into one output: one message per read instead of one per step, as
    vLLM's output collector does."""
    if isinstance(out, BaseException):
        raise out
    while not out.finished and not outputs.empty():
        more = outputs.get_nowait()
        if isinstance(more, BaseException):
            raise more
        out = merge_outputs(out, more)
    return out


class CoreClient:
    def __init__(self, config: EngineConfig, engine_id: str, hold_timeout_s: float,
                 max_waiting_requests: int | None = None, on_dead: Callable[[BaseException], None] | None = None,
                 on_step: Callable[[StepEvents, list[StepOutput], list[int]], None] | None = None,
                 on_kv_events: Callable[[list[KVEvent]], None] | None = None, stream_interval: int = 1):
        """`engine_id`: the core's NIXL agent name. `on_step`: given each step's request events, its
        outputs and the keys of its plain tokens that went out (CoreStep's columns), in the turn
        of the event loop that fans them out, before any caller reads them (telemetry); without
        it the core records no events. `on_kv_events`: given the KV cache's events
        (kv_cache_events.py) in the order they happened, from the core's start on; without it the
        core records none. `stream_interval`: a stream's outputs after its first are held until
        they carry this many new tokens, or end it (vLLM's `--stream-interval`: fewer, larger
        messages on every hop, a less smooth stream)."""
        self.config = config
        self.engine_id = engine_id
        self.hold_timeout_s = hold_timeout_s
        self.max_waiting_requests = max_waiting_requests
        self.on_dead = on_dead
        self.on_step = on_step
        self.on_kv_events = on_kv_events
        self.stream_interval = stream_interval
        self.facts: EngineFacts | None = None
        self.tokenizer = None  # the front's own, loaded while the core loads
        self.inputs: InputProcessor | None = None
        self.outputs: OutputProcessor | None = None
        self.num_requests = 0  # admitted since start
        self._streams: dict[int, _Stream] = {}  # request key -> its outputs
        self._live: dict[str, int] = {}  # request id -> key, while its stream is open
        self._calls: dict[int, tuple[asyncio.Future, object]] = {}  # id -> (its future, its result type)
        self._call_ids = itertools.count()
        self._num_sent = 0  # requests sent to the core
        self._num_received = 0  # ... that it said it received (as of its last step)
        self._core_waiting = 0
        self._dead: EngineDead | None = None
        self._failure: str | None = None  # what the core said before it went, if anything
        self._stopping = False
        self._proc = None
        self._reading = False  # the event loop watches the core's socket
        self._first: asyncio.Future | None = None  # the core's first message (CoreReady or CoreFailed)
        self._exited: asyncio.Future | None = None
        self._ctx = zmq.Context()
        name = f"baton-core-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # abstract namespace: no file to clean up
        self._addresses = (f"ipc://@{name}-in", f"ipc://@{name}-out")
        # Plain sockets, not zmq.asyncio's, which make and settle a future per message (a send
        # costs ~23 us there, ~1.5 here). Sends never block (no high-water mark); the event loop
        # watches the receiving socket's fd and reads every message there when it says so. The
        # input socket connects to the core's (which binds once it has loaded): a connecting
        # PUSH queues what it is given from the start, where a binding one has no peer to queue
        # for until the core's connection is through, which can be after the core said it is ready.
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.RECONNECT_IVL, 10)  # (ms: the core binds seconds later, and requests wait on it)
        self._push.connect(self._addresses[0])
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self._addresses[1])
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)

    # ---- lifecycle ----------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> EngineFacts:
        """Start the core and wait until it has loaded; raises InvalidArgument or StartupError (in
        one sentence) when it cannot start."""
        loop = asyncio.get_running_loop()
        options = CoreOptions(self.engine_id, self.hold_timeout_s, self.on_step is not None, *self._addresses,
                              kv_events=self.on_kv_events is not None)
        self._proc = subprocess.Popen(child_argv("baton.engine.core.process"), stdin=subprocess.PIPE)
        self._proc.stdin.write(pickle.dumps((self.config, options, os.getpid())))
        self._proc.stdin.close()
        self._exited = loop.create_future()
        self._pidfd = os.pidfd_open(self._proc.pid)  # readable once it exits
        loop.add_reader(self._pidfd, self._on_exit)
        first = self._first = loop.create_future()
        loop.add_reader(self._pull.FD, self._read)
        self._reading = True
        self.tokenizer = await asyncio.to_thread(load_tokenizer, self.config.model)
        self.outputs = OutputProcessor(self.tokenizer)
        await asyncio.wait([first, self._exited], return_when=asyncio.FIRST_COMPLETED)
        if not first.done():
            first.cancel()
            raise StartupError(f"the engine core exited with status {self._proc.returncode} while loading "
                               "(see its log)")
        msg = first.result()
        if isinstance(msg, CoreFailed):
            raise error_from(msg.error)
        assert isinstance(msg, CoreReady), msg
        self.facts = msg.facts
        self.inputs = InputProcessor(self.tokenizer, self.facts,
                                     image_processor(self.config.model, self.tokenizer, self.facts))
        return self.facts

    def _on_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._proc.wait()  # reaped: no zombie
        if not self._exited.done():
            self._exited.set_result(self._proc.returncode)
        if self.facts is not None and not self._stopping:
            asyncio.ensure_future(self._died())

    async def _died(self) -> None:
        """Read what the core sent before it went, then fail everything that waits on it."""
        self._read()  # what it sent before it went
        self._stop_reading()
        why = f": {self._failure}" if self._failure else ""
        log.error("the engine core (pid %s) exited with status %s%s", self._proc.pid, self._proc.returncode, why)
        self._fail_all(EngineDead(f"the engine core exited with status {self._proc.returncode}{why}"))
        if self.on_dead is not None:
            self.on_dead(self._dead)

    def _fail_all(self, error: EngineDead) -> None:
        self._dead = error
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        for future, _ in self._calls.values():
            if not future.done():
                future.set_exception(error)

    async def stop(self) -> None:
        """Stop the core (it ends its requests where they are) and close the sockets."""
        self._stopping = True
        if self._proc is not None and self._proc.returncode is None:
            self._send(CoreShutdown())
            try:
                await asyncio.wait_for(asyncio.shield(self._exited), _STOP_WAIT_S)
            except TimeoutError:
                log.warning("the engine core did not stop within %gs; killing it", _STOP_WAIT_S)
                self._proc.kill()
                await self._exited
        self._stop_reading()
        if self._dead is None:
            self._fail_all(EngineDead("the server stopped"))
        self._push.close()
        self._pull.close()
        self._ctx.term()

    # ---- requests -----------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests waiting to run: the core's queue, and those on their way to it."""
        return self._core_waiting + self._num_sent - self._num_received

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def _send(self, msg) -> None:
        # Never blocks: no high-water mark, and the connecting socket's pipe exists from the start.
        if isinstance(msg, CoreRequest) and msg.images:  # (large pixels as frames of their own)
            self._push.send_multipart(request_frames(msg, self._encoder.encode), zmq.NOBLOCK, copy=False)
        else:  # (small: a copy costs less than tracking a frame)
            self._push.send(self._encoder.encode(msg), zmq.NOBLOCK)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self.facts is None:
            raise EngineDead("the engine core is not running")

    async def generate(self, request: CoreRequest, detokenize: bool = True,
                       min_tokens: int | None = None) -> AsyncIterator[StepOutput]:
        """Run a request made by `inputs.core_request`; yields its outputs as steps produce them
        (once given a sink, only the last: `sink`). Leaving the iteration early (cancellation
        included) aborts it in the core.
        `min_tokens`: OutputProcessor.add's."""
        self._check_alive()
        if request.request_id in self._live:
            raise DuplicateRequest(request.request_id)
        bound = self.max_waiting_requests
        if bound is not None and self.num_waiting >= bound:
            raise QueueFull(f"{self.num_waiting} requests are waiting, the bound (max_waiting_requests) is {bound}")
        stream = self._streams[request.key] = _Stream()
        self._live[request.request_id] = request.key
        self.outputs.add(request, detokenize, min_tokens)
        self._send(request)
        self._num_sent += 1
        self.num_requests += 1
        finished = False
        try:
            while not finished:
                out = merge_queued(await stream.queue.get(), stream.queue)
                finished = out.finished
                yield out
        finally:
            del self._streams[request.key]
            if self._live.get(request.request_id) == request.key:
                del self._live[request.request_id]
            if not finished:
                self.outputs.drop(request.key)
                if self._dead is None:  # sent before any later request under this id: the core sees it first
                    self._send(CoreAbort([request.request_id]))

    def sink(self, request: CoreRequest, sink: Callable[[StepOutput], None],
             on_token: Callable[[int, str], None] | None = None) -> bool:
        """From now on, hand the request's outputs but its last to `sink` as each step fans out,
        instead of queueing them for its generate() loop, which then wakes only for the last one
        (or an error); and a token with nothing else to say (most of them) to `on_token`, with
        the text it completes, unless a stream interval merges outputs. Only while nothing is
        queued, so that the sink's come after every output the loop yielded: False if something
        is (the caller may ask again after its next one)."""
        stream = self._streams.get(request.key)
        if stream is None or not stream.queue.empty():
            return False
        stream.sink = sink
        stream.on_token = on_token if self.stream_interval <= 1 else None
        return True

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests by id (the Abort API): each stream gets a last output, finish reason
        "abort"; ids the core does not run are ignored (a held prefill's blocks are let go)."""
        self._check_alive()
        self._send(CoreAbort(list(request_ids)))

    async def call(self, call: Call):
        """Run a call in the core between two steps: its result (of the type `call.result`
        names), or its error raised."""
        self._check_alive()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (future, type(call).result)
        self._send(CoreCall(call_id, msgspec.Raw(msgspec.msgpack.encode(call))))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    # ---- what the core sends ------------------------------------------------------------------
    def _read(self) -> None:
        """Every message the core's socket holds (its fd only says that something changed: it is
        read until empty, or it would not say so again)."""
        pull, first = self._pull, self._first
        while True:
            try:
                frame = pull.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = self._decoder.decode(frame.buffer)
                if first is not None and not first.done():
                    first.set_result(msg)
                else:
                    self._dispatch(msg)
            except Exception:  # one bad message must not stop every stream
                log.exception("a message from the engine core could not be handled")

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            asyncio.get_running_loop().remove_reader(self._pull.FD)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, CoreStep):
            self._on_step(msg)
        elif isinstance(msg, CallResult):
            self._on_result(msg)
        elif isinstance(msg, CoreFailed):
            self._failure = msg.error.message

    def _on_step(self, msg: CoreStep) -> None:
        self._core_waiting, self._num_received = msg.num_waiting, msg.num_received
        if msg.kv_events:  # (only sent to a client with on_kv_events)
            try:
                self.on_kv_events(msg.kv_events)
            except Exception:  # publishing must never cost a request
                log.exception("the KV cache's events could not be published")
        outputs, stopped = self.outputs.process(msg.outputs, msg.time)
        ended, token_keys = self._fan_out_tokens(msg, stopped) if msg.token_keys else ((), ())
        if stopped:  # ended here by a stop string: the core still runs them (or holds their blocks)
            self._send(CoreAbort(stopped))
        if self.on_step is not None and msg.events is not None:
            try:
                self.on_step(msg.events, [*outputs, *ended], token_keys)
            except Exception:  # telemetry must never cost a request
                log.exception("telemetry failed on a step's events")
        for failure in msg.failures:
            stream = self._streams.get(failure.key)
            if stream is not None:
                self.outputs.drop(failure.key)
                stream.queue.put_nowait(error_from(failure.error))
        interval = self.stream_interval
        for out in (*outputs, *ended):  # (a request's tokens went out before what ended it)
            stream = self._streams.get(out.key)
            if stream is not None:  # else the caller left already; its abort is on its way
                stream.put(out, interval)

    def _fan_out_tokens(self, msg: CoreStep, stopped: list[str]) -> tuple[list[StepOutput], list[int]]:
        """The step's plain tokens to their streams: to on_token where a stream has one, else as
        outputs. Returns the last outputs of requests a stop string ended (OutputProcessor.token)
        and the keys of the tokens that went out."""
        token, streams, interval, step_time = self.outputs.token, self._streams, self.stream_interval, msg.time
        ended, sent = [], []
        for key, token_id in zip(msg.token_keys, msg.token_ids):
            text = token(key, token_id, step_time, stopped)
            if text is None:  # its caller left, or a stop string ended it a step ago
                continue
            if type(text) is not str:
                ended.append(text)
                continue
            sent.append(key)
            stream = streams.get(key)
            if stream is None:
                continue
            if stream.on_token is not None and stream.held is None:
                stream.on_token(token_id, text)
            else:
                stream.put(self.outputs.token_output(key, token_id, text, step_time), interval)
        return ended, sent

    def _on_result(self, msg: CallResult) -> None:
        entry = self._calls.get(msg.call_id)
        if entry is None or entry[0].done():  # its caller was cancelled
            return
        future, result_type = entry
        if msg.error is not None:
            future.set_exception(error_from(msg.error))
            return
        future.set_result(msgspec.msgpack.decode(msg.result, type=result_type))
