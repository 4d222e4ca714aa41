"""`baton up`: the whole stack on this machine, each service its own process: N prefill
and M decode engines on free ports, and the router in front of them on the public port.

It waits until every process reports SERVING over the health protocol, prints where to
talk to it (and each service's /metrics; the services it starts invite no request of their
own, since one serving is not the stack serving), and stops them all on Ctrl-C: the router
first, then the engines, each told with SIGTERM. The services ignore SIGINT (a terminal's Ctrl-C
reaches every process of its foreground group, theirs included), so a clean stop keeps that
order and prints no traceback. It supervises as
Kubernetes would: a service that dies is started again on its address after a backoff
(doubling from RESTART_BACKOFF_S, reset once it has run for a minute), while the router serves
on the survivors; only a crash loop (CRASH_LOOP deaths within CRASH_WINDOW_S) stops the stack.
With restart off, the first death does. Children die with the launcher (PR_SET_PDEATHSIG), so
a killed launcher leaves no orphans. With `trace`, a trace receiver in this process takes every service's spans and
prints a waterfall per request.
"""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from baton.services.cli.placement import Placement
from baton.services.rpc.health import backend_health, is_serving
from baton.services.rpc.serving import free_port

RESTART_BACKOFF_S, MAX_BACKOFF_S = 0.5, 30.0
CRASH_LOOP, CRASH_WINDOW_S = 5, 60.0  # this many deaths of one service within the window stop the stack
STABLE_S = 60.0  # a service that ran this long starts its backoff over
UP_CHILD_ENV = "BATON_UP_CHILD"  # set for the services `baton up` starts: they leave inviting requests to it


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _child_setup() -> None:
    """In the child before exec: SIGTERM when the launcher goes away, however it goes, and
    SIGINT ignored (kept across exec, and by what the service starts: its engine core and ranks)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the launcher's stop still ends the services
        pass


@dataclass
class Service:
    name: str
    role: str
    address: str
    argv: list[str]
    metrics_url: str = ""
    proc: subprocess.Popen | None = None
    tail: deque = field(default_factory=lambda: deque(maxlen=30))
    deaths: deque = field(default_factory=lambda: deque(maxlen=CRASH_LOOP))  # monotonic times
    started_at: float = 0.0
    restart_at: float | None = None  # dead, to be started again then
    backoff_s: float = RESTART_BACKOFF_S
    coming_back: bool = False  # restarted, not serving yet
    placement: Placement = Placement(None)  # an engine's device

    def start(self, env: dict) -> None:
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, preexec_fn=_child_setup)
        threading.Thread(target=self._relay, daemon=True).start()

    def _relay(self) -> None:
        for line in self.proc.stdout:
            self.tail.append(line)
            sys.stdout.write(f"[{self.name}] {line}")
            sys.stdout.flush()


class Stack:
    def __init__(self, services: list[Service]):
        self.services = services
        self.env: dict = {}

    def start(self, env: dict) -> None:
        self.env = env
        self._start_due()

    def _start_due(self) -> None:
        """Start what has not started, but an engine on a shared GPU only once every engine
        before it on that GPU serves: each measures its memory use with no other loading."""
        for i, s in enumerate(self.services):
            if s.proc is None and not self._gpu_busy(s, self.services[:i]):
                s.start(self.env)

    @staticmethod
    def _gpu_busy(s: Service, others: list[Service]) -> bool:
        """Whether another engine on one of s's shared GPUs (any of its ranks' GPUs) is not
        started yet, or running but not serving yet (loading)."""
        gpus = s.placement.gpus() if s.placement.shares_gpu else frozenset()
        return bool(gpus) and any(
            o is not s and gpus & o.placement.gpus()
            and (o.proc is None or (o.proc.poll() is None and not is_serving(o.address, 0.2))) for o in others)

    def supervise(self) -> Service | None:
        """One round of supervision: note deaths, restart what is due, report what serves
        again. Returns a service in a crash loop (the stack should stop), else None."""
        now = time.monotonic()
        for s in self.services:
            if s.restart_at is None and s.proc.poll() is not None:  # just died
                s.deaths.append(now)
                s.coming_back = False
                if len(s.deaths) == CRASH_LOOP and now - s.deaths[0] <= CRASH_WINDOW_S:
                    return s
                if now - s.started_at >= STABLE_S:
                    s.backoff_s = RESTART_BACKOFF_S
                s.restart_at = now + s.backoff_s
                print(f"baton up: {s.name} ({s.address}) exited with status {s.proc.returncode}; restarting it in "
                      f"{s.backoff_s:g}s (death {len(s.deaths)} in the last {CRASH_WINDOW_S:g}s)", file=sys.stderr,
                      flush=True)
                s.backoff_s = min(s.backoff_s * 2, MAX_BACKOFF_S)
            elif s.restart_at is not None and now >= s.restart_at and not self._gpu_busy(s, self.services):
                s.restart_at = None
                s.coming_back = True
                s.start(self.env)
                print(f"baton up: {s.name} restarted (pid {s.proc.pid})", file=sys.stderr, flush=True)
            elif s.coming_back and s.proc.poll() is None and is_serving(s.address, 0.2):
                s.coming_back = False
                print(f"baton up: {s.name} serves again on {s.address}", file=sys.stderr, flush=True)
        return None

    def num_ranks(self) -> int:
        """The engines' processes that compute: one per tensor-parallel rank."""
        return sum(s.placement.tensor_parallel_size for s in self.services[1:])

    def dead(self) -> Service | None:
        return next((s for s in self.services if s.proc is not None and s.proc.poll() is not None), None)

    def wait_serving(self, timeout_s: float, stopping: threading.Event | None = None) -> bool:
        """Until all serve (True), or `stopping` is set (False: Ctrl-C while starting); raises with
        the reason when one dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        pending = list(self.services)
        while stopping is None or not stopping.is_set():
            dead = self.dead()
            if dead is not None:
                raise RuntimeError(f"{dead.name} exited with status {dead.proc.returncode} while starting:\n"
                                   + "".join(dead.tail))
            self._start_due()
            pending = [s for s in pending if s.proc is None or not is_serving(s.address)]
            # The router's own view lags by a health watch: until it sees every engine, a request
            # could skip a prefill that is in fact up.
            if not pending and sum(backend_health(self.services[0].address) or ()) >= len(self.services) - 1:
                return True
            if time.monotonic() > deadline:
                raise RuntimeError(f"not serving after {timeout_s:g}s: "
                                   f"{', '.join(s.name for s in pending) or 'the router, seeing every engine'}")
            time.sleep(0.2)
        return False

    def stop(self, grace_s: float) -> None:
        """Router first (no new requests), then the decode engines (the prefills' clients: a
        prefill going first would close their channels under them, and gRPC logs the GOAWAY),
        then the rest, each drained on SIGTERM (they ignore SIGINT; one still importing ends at
        once, quietly); SIGKILL whatever outlives the grace."""
        engines = self.services[1:]
        for group in (self.services[:1], [s for s in engines if s.role == "decode"],
                      [s for s in engines if s.role != "decode"]):
            group = [s for s in group if s.proc is not None]  # (never started: waited for a shared GPU)
            for s in group:
                if s.proc.poll() is None:
                    s.proc.send_signal(signal.SIGTERM)
            for s in group:
                try:
                    s.proc.wait(grace_s + 5)
                except subprocess.TimeoutExpired:
                    s.proc.kill()
                    s.proc.wait()


def build_stack(model: str, host: str, port: int, num_prefill: int, num_decode: int, engine_argv: list[str],
                policy: str, http_port: int | None = None, placements: list[Placement] | None = None,
                router_argv: tuple[str, ...] = (), num_encoder: int = 0) -> Stack:
    """`placements`: each engine's device and tensor parallel size (prefill engines first;
    default: the engine's own device, one rank). `http_port`: the router's OpenAI front, which
    serves its /metrics too (None or 0: none; the router then gets a metrics port, as engines do);
    `router_argv`: the router's own flags; `num_encoder`: an encoder tier's instances (E/P/D: a
    vision-language model's image encoder alone, with the engines' model, dtype and device)."""
    serve = [sys.executable, "-m", "baton.services.cli", "serve", "--host", host, "--model", model]
    taken = {port, http_port}

    def fresh_port() -> int:
        """A free port none of the stack's services was given: one free now may be one already
        given (the public port, picked free by the caller), as nobody binds it before it starts."""
        while (found := free_port(host)) in taken:
            pass
        taken.add(found)
        return found

    def service(name: str, role: str, port: int, *argv: str, http_port: int | None = None,
                metrics: bool = True) -> Service:
        """`metrics`: it serves /metrics (an encoder does not)."""
        if http_port:  # /metrics on the API's port, where vLLM's scrape configs and guides look
            endpoint, url_port = ["--http-port", str(http_port)], http_port
        elif metrics:
            url_port = fresh_port()
            endpoint = ["--metrics-port", str(url_port)]
        else:
            endpoint, url_port = [], None
        return Service(name, role, f"{host}:{port}", [*serve, "--role", role, "--port", str(port), *endpoint, *argv],
                       f"http://{host}:{url_port}/metrics" if url_port else "")
    roles = [(role, i) for role, n in (("prefill", num_prefill), ("decode", num_decode)) for i in range(n)]
    placements = placements or [Placement(None)] * len(roles)
    engines = [service(f"{role}-{i}", role, fresh_port(), *engine_argv, *place.argv())
               for (role, i), place in zip(roles, placements, strict=True)]
    for engine, place in zip(engines, placements):
        engine.placement = place
    encoders = [service(f"encoder-{i}", "encoder", fresh_port(), *engine_argv, metrics=False)
                for i in range(num_encoder)]
    backends = [arg for e in [*engines, *encoders] for arg in ("--" + e.role, e.address)]
    return Stack([service("router", "router", port, "--policy", policy, *backends, *router_argv, http_port=http_port),
                  *engines, *encoders])


def up(model: str, host: str, port: int, num_prefill: int, num_decode: int, engine_argv: list[str],
       policy: str = "round_robin", start_timeout_s: float = 300.0, grace_s: float = 10.0, trace: bool = False,
       http_port: int | None = None, restart: bool = True, placements: list[Placement] | None = None,
       router_argv: tuple[str, ...] = (), num_encoder: int = 0) -> int:
    if not os.path.isfile(os.path.join(model, "config.json")):
        print(f"baton up: {model} is not a checkpoint directory (no config.json); "
              f"`baton prepare-models` writes the demo model", file=sys.stderr)
        return 2
    for taken, flag in ((port, "--port"), (http_port, "--http-port")):
        if taken and not port_is_free(host, taken):
            print(f"baton up: {host}:{taken} is taken; pick another with {flag}", file=sys.stderr)
            return 2
    stack = build_stack(model, host, port, num_prefill, num_decode, engine_argv, policy, http_port, placements,
                        router_argv, num_encoder)
    env = dict(os.environ, BATON_INTERNAL_TOKEN=os.environ.get("BATON_INTERNAL_TOKEN") or secrets.token_hex(16),
               **{UP_CHILD_ENV: "1"})
    # Engines share the cores instead of each assuming all of them: every rank is a process of its own.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, stack.num_ranks()))))
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    trace_port = free_port(host) if trace else None
    if trace_port is not None:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://{host}:{trace_port}"
        env.setdefault("OTEL_BSP_SCHEDULE_DELAY", "200")  # waterfalls within a second of the request's end
    stack.start(env)
    # After the children are forked: gRPC's threads in this process would make it warn at each fork.
    receiver, printing = _start_trace_receiver(host, trace_port) if trace else (None, None)
    try:
        try:
            if not stack.wait_serving(start_timeout_s, stopping):
                return 130
        except RuntimeError as e:
            if stopping.is_set():
                return 130
            print(f"baton up: {e}", file=sys.stderr)
            return 1
        engines = ", ".join(s.address + s.placement.summary() for s in stack.services[1:])
        metrics = "".join(f"\n  {s.name:<10} {s.metrics_url}" for s in stack.services if s.metrics_url)
        traces = (f"\nTraces: every request's waterfall is printed here (receiver on {receiver.endpoint})"
                  if receiver is not None else "")
        http = (f"OpenAI API: http://{host}:{http_port}/v1 (e.g. curl http://{host}:{http_port}/v1/models)\n"
                if http_port else "")
        encode = f"{num_encoder} encoder + " if num_encoder else ""
        print(f"Baton is up: router on {host}:{port} -> {encode}{num_prefill} prefill + {num_decode} decode "
              f"({engines})\n"
              f"  baton generate --target {host}:{port} 'What is the capital of France?'\n"
              f"{http}Metrics:{metrics}{traces}\nCtrl-C stops all.", flush=True)
        while not stopping.wait(0.5):
            if not restart:
                dead = stack.dead()
                if dead is not None:
                    print(f"baton up: {dead.name} exited with status {dead.proc.returncode}; stopping the stack "
                          f"(--no-restart)", file=sys.stderr)
                    return 1
                continue
            looping = stack.supervise()
            if looping is not None:
                print(f"baton up: {looping.name} died {CRASH_LOOP} times within {CRASH_WINDOW_S:g}s; stopping the "
                      f"stack. Its last output:\n" + "".join(looping.tail), file=sys.stderr)
                return 1
        return 0
    finally:
        print("stopping", flush=True)
        stack.stop(grace_s)
        if receiver is not None:
            time.sleep(1.5)  # the services export their last spans as they stop: print those too
            printing.set()
            receiver.stop()


def _start_trace_receiver(host: str, port: int):
    """A receiver for the services' spans, printing waterfalls until the returned event is set."""
    from baton.services.telemetry.trace_view import TraceReceiver, print_waterfalls

    receiver, stop = TraceReceiver(host, port), threading.Event()
    threading.Thread(target=print_waterfalls, args=(receiver, stop), daemon=True).start()
    return receiver, stop
