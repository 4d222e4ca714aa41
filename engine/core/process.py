"""The engine core in a process of its own: a busy step loop fed and drained over ZMQ.

Two sockets join it to its front (core_client.py), both over IPC in Linux's abstract
namespace (no file to leak, gone with the process): the front PUSHes CoreInputs, the core
PUSHes CoreMessages back, msgspec-encoded. A thread receives and decodes the inputs, another
encodes and sends the outputs, so the step loop only applies what arrived, steps, and hands
one CoreStep per step over: the GIL is free while torch computes, and the threads' work
overlaps the model's.

The core dies with its front: PR_SET_PDEATHSIG, and a check of the parent every second (the
signal is lost when the parent died before it was set). It ignores SIGINT from its first line
(started through lifetime.child_argv): a terminal's Ctrl-C is the front's, which stops the core
in order (CoreShutdown).
"""
from __future__ import annotations

import logging
import os
import pickle
import queue
import sys
import threading

import msgspec
import zmq

from baton.engine.common.config import EngineConfig
from baton.engine.common.core_messages import (
    AddPeer,
    Call,
    CallResult,
    CoreAbort,
    CoreCall,
    CoreFailed,
    CoreFailure,
    CoreInput,
    CoreOptions,
    CoreReady,
    CoreRequest,
    CoreShutdown,
    CoreStep,
    GetKVBlockHashes,
    GetSnapshot,
    GetStats,
    ListAdapters,
    LoadAdapter,
    ReleaseHold,
    UnloadAdapter,
    error_of,
)
from baton.engine.common.errors import InvalidArgument, StartupError
from baton.engine.common.lifetime import die_with_parent
from baton.engine.common.pixel_frames import ZERO_COPY_BYTES, attach_pixels
from baton.engine.core.engine_core import EngineCore
from baton.kv_transfer.base import KVUnreachable
from baton.kv_transfer.nixl_connector import make_nixl_connector

log = logging.getLogger("baton.core")

_HELD_POLL_S = 0.001  # only finished requests' blocks are held: poll the connector this often


def main() -> None:
    """`python -m baton.engine.core.process`, its (config, options, parent pid) pickled on stdin:
    a fresh interpreter, which imports nothing of the front's (a script's main module
    included, as multiprocessing's spawn would)."""
    config, options, parent = pickle.load(sys.stdin.buffer)
    run_engine_core(config, options, parent)


def _reserve_a_cpu_for_the_front(device: str) -> None:
    """On a CPU of 8 cores or more, torch's threads leave one to the front, as vLLM's CPU
    backend reserves one for its API server: its gRPC and detokenizing then never wait for a
    step's threads. On fewer cores that core is worth more to the model: on two, reserving it
    served 11.5k vs 9.4k tokens/s on a 2-layer toy model but 1.5k vs 2.3k on a 4-layer
    hidden-512 Llama. OMP_NUM_THREADS, when set, wins."""
    cores = len(os.sched_getaffinity(0))
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ and cores >= 8:
        import torch

        torch.set_num_threads(cores - 1)


def run_engine_core(config: EngineConfig, options: CoreOptions, parent: int) -> None:
    """The core process: load, say ready, loop until told to stop or the front is gone. Exits
    non-zero when it cannot start or its loop fails."""
    die_with_parent(parent)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # The output socket has a context of its own: terminating it waits until what was sent has
    # left, which the input socket (blocked in its thread) would never let a shared one do.
    out = zmq.Context().socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 5000)
    out.setsockopt(zmq.SNDHWM, 0)  # never block the step loop's sender on a slow front
    out.connect(options.output_address)
    try:
        connector = make_nixl_connector(options.engine_id, config.block_size, options.hold_timeout_s)
        core = EngineCore(config, connector)
    except Exception as e:  # told to the front in one sentence, then the process ends
        if not isinstance(e, (InvalidArgument, StartupError, KVUnreachable)):
            log.exception("the engine core could not start")
        out.send(msgspec.msgpack.encode(CoreFailed(error_of(e))))
        _close(out)
        os._exit(1)
    if core.workers is None:  # (tensor-parallel ranks split the CPUs among themselves: workers.threads_per_rank)
        _reserve_a_cpu_for_the_front(core.config.device)
    if options.record_events:
        core.record_events()
    loop = CoreLoop(core, options, out, parent)
    if core.workers is not None:
        core.workers.on_dead = loop.rank_died
    code = loop.run()
    core.close()  # (its KV connector's too)
    os._exit(code)  # NIXL's and torch's threads must not hold the exit up


def _close(sock: zmq.Socket) -> None:
    """Close an output socket once what it holds has left (up to its linger)."""
    ctx = sock.context
    sock.close()
    ctx.term()


class CoreLoop:
    def __init__(self, core: EngineCore, options: CoreOptions, out: zmq.Socket, parent: int):
        self.core = core
        self.record = options.record_events
        self.kv_log = core.record_kv_events() if options.kv_events else None
        self.inputs: queue.SimpleQueue = queue.SimpleQueue()
        self.outputs: queue.SimpleQueue = queue.SimpleQueue()
        self._parent = parent
        self.num_received = 0  # requests received since start (taken in or failed)
        inp = zmq.Context().socket(zmq.PULL)
        inp.bind(options.input_address)  # (before it says it is ready: what the front sent meanwhile waits)
        self.outputs.put(CoreReady(core.facts()))
        threading.Thread(target=self._receive, args=(inp,), name="core-input", daemon=True).start()
        self._sender = threading.Thread(target=self._send, args=(out,), name="core-output", daemon=True)
        self._sender.start()

    # ---- the I/O threads -------------------------------------------------------------------
    def _receive(self, sock: zmq.Socket) -> None:
        decoder = msgspec.msgpack.Decoder(CoreInput)
        while True:
            if not sock.poll(1000):
                if os.getppid() != self._parent:
                    log.error("the front is gone; the engine core stops")
                    os._exit(1)
                continue
            frames = sock.recv_multipart(copy=False)
            msg = decoder.decode(frames[0].buffer)
            if len(frames) > 1:  # a request's large pixels, each a frame of its own
                attach_pixels(msg, frames)
            self.inputs.put(msg)

    def _send(self, sock: zmq.Socket) -> None:
        encoder = msgspec.msgpack.Encoder()
        while (msg := self.outputs.get()) is not None:
            raw = encoder.encode(msg.to_columns() if isinstance(msg, CoreStep) else msg)
            sock.send(raw, copy=len(raw) < ZERO_COPY_BYTES)
        _close(sock)

    def rank_died(self, e: Exception) -> None:
        """A tensor-parallel rank died (from its watcher thread): the front fails every stream
        at once, whatever the step loop is waiting on, and the process ends non-zero."""
        self.outputs.put(CoreFailed(error_of(e)))
        self.outputs.put(None)
        self._sender.join(5)
        os._exit(1)

    # ---- the step loop -----------------------------------------------------------------------
    def run(self) -> int:
        core = self.core
        try:
            while True:
                busy = core.scheduler.num_unfinished > 0 or core.step_in_flight
                # Held blocks and compiling grammars are polled, not stepped for.
                polled = core.num_held_requests or core.awaiting_grammar or core.host_copies_pending
                wait = None if busy else (_HELD_POLL_S if polled else 3600.0)
                taken, outputs, failures, stop = self._apply_inputs(wait)
                if stop:
                    return 0
                if busy or taken or polled:
                    outputs += core.step()
                    failures += core.take_failures()
                events = core.take_events() if self.record else None
                kv_events = self.kv_log.take() if self.kv_log is not None else []
                if (outputs or taken or failures or kv_events
                        or (events is not None and (events.events or events.step_tokens))):
                    self.outputs.put(CoreStep(outputs, core.scheduler.last_step_time, core.num_waiting,
                                              self.num_received, failures, events, kv_events))
        except Exception as e:  # the front fails its streams with this, then the process ends
            log.exception("the engine core's step loop failed")
            err = error_of(e)
            err.message = f"the engine core's step loop failed: {err.message}"
            self.outputs.put(CoreFailed(err))
            return 1
        finally:
            self.outputs.put(None)
            self._sender.join(5)

    def _apply_inputs(self, wait: float | None) -> tuple[int, list, list[CoreFailure], bool]:
        """Apply what arrived (waiting up to `wait` seconds for a first input when given): the
        number of requests taken, outputs of aborted ones, failed adds, and whether to stop."""
        taken, outputs, failures = 0, [], []
        try:
            msg = self.inputs.get(timeout=wait) if wait is not None else self.inputs.get_nowait()
        except queue.Empty:
            return taken, outputs, failures, False
        while True:
            if isinstance(msg, CoreRequest):
                self.num_received += 1
                try:
                    self.core.add(msg)
                    taken += 1
                except InvalidArgument as e:  # that request fails, the loop goes on
                    failures.append(CoreFailure(msg.key, error_of(e)))
            elif isinstance(msg, CoreAbort):
                outputs += self.core.abort(msg.request_ids)
            elif isinstance(msg, CoreCall):
                self.outputs.put(self._call(msg))
            elif isinstance(msg, CoreShutdown):
                return taken, outputs, failures, True
            try:
                msg = self.inputs.get_nowait()
            except queue.Empty:
                return taken, outputs, failures, False

    def _call(self, msg: CoreCall) -> CallResult:
        """Its result, or why not: a call that cannot be decoded, or that fails, is its caller's error."""
        try:
            call = _CALL_DECODER.decode(msg.call)
            result = _ANSWERS[type(call)](self.core, call)
        except Exception as e:  # noqa: BLE001 - handed to the caller; the loop goes on
            return CallResult(msg.call_id, error=error_of(e))
        return CallResult(msg.call_id, msgspec.Raw(msgspec.msgpack.encode(result)))


_CALL_DECODER = msgspec.msgpack.Decoder(Call)
# How the core answers each call (EngineCore's methods, by the call's type).
_ANSWERS = {
    GetSnapshot: lambda core, call: core.snapshot(),
    GetStats: lambda core, call: core.stats(),
    ReleaseHold: lambda core, call: core.release_hold(call.request_id),
    AddPeer: lambda core, call: core.add_peer(call.layout),
    GetKVBlockHashes: lambda core, call: core.kv_block_hashes(),
    LoadAdapter: lambda core, call: core.load_adapter(call),
    UnloadAdapter: lambda core, call: core.unload_adapter(call.name),
    ListAdapters: lambda core, call: core.list_adapters(),
}



if __name__ == "__main__":
    main()
