"""Several router processes behind one port (`baton serve --role router --router-workers N`):
a router's CPU per streamed token is gRPC's Python machinery, so more router capacity is
more processes. The kernel spreads connections (not requests: one HTTP/2 connection stays
with one worker) over the workers, which bind the public gRPC, HTTP and frames ports (a
multiplexing client's streams) with SO_REUSEPORT.

The workers share nothing but what a client may ask of any of them: an Abort for a call
another worker carries is passed on to it (each also listens on a loopback port of its own,
and names its siblings' as peers), and /metrics shows every worker's series, labelled
`worker` (each serves its own registry on a loopback port; the set's page reads them all).
Everything else a router keeps is per worker by design: in-flight counts and the
`max_in_flight` bound, the policies' load ledgers and prefix tables, kv_aware's index (each
follows the engines' KV events itself), failover state (a stream's, in the worker carrying it).

This process only starts the workers, says where the set serves once all do, forwards a
stop to them, and ends when they have drained; a worker that dies ends the set with status
1, for the supervisor (`baton up`, Kubernetes) to restart it, as an engine server does when
its core dies.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import urllib.request

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from baton.engine.common.lifetime import child_argv
from baton.services.rpc.serving import free_port
from baton.services.telemetry.metrics import MetricsServer

WORKER_FLAG = "--router-worker"  # its value: a WorkerSlot as JSON, set by this module only
_START_TIMEOUT_S = 300.0


class WorkerSlot(msgspec.Struct, frozen=True):
    """What one worker of a set is told besides the router's own flags."""
    index: int
    grpc_port: int  # its own, on 127.0.0.1: the siblings pass Aborts there
    sibling_grpc_ports: list[int]
    metrics_ports: list[int]  # every worker's own registry on 127.0.0.1, this one's at [index] (empty: no metrics)

    @property
    def peers(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.sibling_grpc_ports]


class WorkersCollector:
    """Every worker's metrics, read from their loopback pages at each scrape, each sample
    labelled with its worker (a worker that does not answer is left out of that scrape)."""

    def __init__(self, ports: list[int], timeout_s: float = 2.0):
        self.ports = ports
        self.timeout_s = timeout_s

    def collect(self):
        merged = {}
        for index, port in enumerate(self.ports):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=self.timeout_s) as page:
                    text = page.read().decode()
            except OSError:
                continue
            for family in text_string_to_metric_families(text):
                labelled = [s._replace(labels={**s.labels, "worker": str(index)}) for s in family.samples]
                if family.name in merged:
                    merged[family.name].samples += labelled
                else:
                    family.samples = labelled
                    merged[family.name] = family
        yield from merged.values()


def workers_registry(ports: list[int]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkersCollector(ports))
    return registry


def run_workers(argv: list[str], workers: int, host: str, port: int, http_port: int | None,
                metrics_port: int | None, grace_s: float, frames_port: int | None = None, https: bool = False,
                child_env: dict | None = None) -> int:
    """Start `workers` copies of `baton serve` (its arguments `argv`, a router's) on one port,
    serve the set's /metrics on `metrics_port`, and wait: the exit status. The workers ignore
    Ctrl-C (this process stops them, with SIGTERM) and die with it; `child_env`: more of their
    environment."""
    port = port or free_port(host)
    http_port = (http_port or free_port(host)) if http_port is not None else None
    frames_port = (frames_port or free_port(host)) if frames_port is not None else -1
    grpc_ports = [free_port("127.0.0.1") for _ in range(workers)]
    metered = metrics_port is not None or http_port is not None
    metrics_ports = [free_port("127.0.0.1") for _ in range(workers)] if metered else []
    stop = threading.Event()  # asked for before any worker starts: none is left without its parent
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # under `baton up` SIGINT stays the launcher's
            signal.signal(sig, lambda *_: stop.set())
    procs = []
    for i in range(workers):
        slot = WorkerSlot(i, grpc_ports[i], grpc_ports[:i] + grpc_ports[i + 1:], metrics_ports)
        procs.append(subprocess.Popen(
            [*child_argv("baton.services.cli"), "serve", *argv, "--router-workers", "1", "--port", str(port),
             "--frames-port", str(frames_port),
             *(("--http-port", str(http_port)) if http_port is not None else ()),
             *(("--metrics-port", str(metrics_ports[i])) if metered else ()),
             WORKER_FLAG, msgspec.json.encode(slot).decode()], stdout=subprocess.PIPE, text=True,
            env={**os.environ, **(child_env or {})}))
    ready = [threading.Event() for _ in procs]
    for i, proc in enumerate(procs):
        threading.Thread(target=_relay, args=(i, proc, ready[i]), daemon=True).start()
    metrics = MetricsServer(workers_registry(metrics_ports), host, metrics_port) if metrics_port is not None else None
    try:
        if not _wait_ready(procs, ready, stop):
            return _stop(procs, grace_s, "a router worker exited before it served" if not stop.is_set() else None)
        if metrics is not None:
            print(f"metrics on {metrics.url}", flush=True)
        if http_port is not None:
            print(f"OpenAI API on {'https' if https else 'http'}://{host}:{http_port}/v1", flush=True)
        print(f"serving on {host}:{port} ({workers} router workers)", flush=True)
        while not stop.wait(0.2):
            if any(p.poll() is not None for p in procs):
                return _stop(procs, grace_s, "a router worker died")
        return _stop(procs, grace_s, None)
    finally:
        if metrics is not None:
            metrics.close()


def _relay(index: int, proc: subprocess.Popen, ready: threading.Event) -> None:
    """A worker's output, its lines marked with it; `ready` once it serves (or has exited)."""
    for line in proc.stdout:
        if line.startswith("serving on "):
            ready.set()
        print(f"[router worker {index}] {line}", end="", flush=True)
    ready.set()


def _wait_ready(procs: list[subprocess.Popen], ready: list[threading.Event], stop: threading.Event) -> bool:
    for proc, event in zip(procs, ready, strict=True):
        if not event.wait(_START_TIMEOUT_S) or proc.poll() is not None or stop.is_set():
            return False
    return True


def _stop(procs: list[subprocess.Popen], grace_s: float, failure: str | None) -> int:
    """Drain every worker (SIGTERM: each gives its streams the grace period), then the status."""
    if failure:
        print(f"baton serve: {failure}; stopping the others", file=sys.stderr, flush=True)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(grace_s + 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return 1 if failure else 0
