"""Every way the tests start Baton's servers, in one place; each is stopped by its caller or
fixture (conftest.py), also when a test fails:
- ServerThread: a server in this process, its event loop on a thread (the `serve` fixture);
- ServerProcess: `baton serve` in a process of its own (the `spawn` fixture), and pd_stack,
  prefill and decode processes with a router in front;
- baton(...) and Up: the `baton` command itself (`baton up` with its output collected)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

from helpers import TOKEN

from baton.engine.common.core_messages import GetSnapshot


class ServerThread:
    """A real Baton server on 127.0.0.1 (a free port), its event loop on a thread of its own,
    so that tests can be plain functions calling it with sync or asyncio clients."""

    def __init__(self, model_dir: str, options: dict | None = None, **engine_args):
        from baton.engine.common.config import EngineConfig
        from baton.services.server.server import Server, ServerOptions

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self.thread.start()
        config = EngineConfig.from_kwargs(model_dir, dtype="float32", device="cpu", **engine_args)
        self.server = self.call(self._make(Server, config, ServerOptions(**{"port": 0, **(options or {})})))
        self.address = self.server.address

    @staticmethod
    async def _make(server_cls, config, options):
        return server_cls(config, options)  # the grpc.aio server binds to the running loop

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> ServerThread:
        self.call(self.server.start())
        return self

    def snapshot(self):
        """The engine core's load and totals (EngineSnapshot), asked over its IPC."""
        return self.call(self.server.core.call(GetSnapshot()))

    def wait_pool_full(self, timeout: float = 10) -> bool:
        """Aborts land at the next step: wait (bounded) until every KV block is free again, no
        request left in the core, none held, none streaming."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.snapshot()
            if (s.num_free_kv_blocks == s.num_kv_blocks and s.num_running == s.num_waiting == s.num_held_requests == 0
                    and self.server.core.num_in_flight == 0):
                return True
            time.sleep(0.02)
        return False

    @contextlib.contextmanager
    def core_stopped(self):
        """The engine core process stopped (SIGSTOP) for the block, as a stuck GPU or a long
        step would hold it: its front must go on answering."""
        pid = self.server.core.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def close(self, grace_s: float = 0) -> None:
        if not self.thread.is_alive():  # closed already
            return
        try:
            self.call(self.server.stop(grace_s))
        finally:
            try:  # its threads (asyncio.to_thread's) end now, not once the loop is garbage collected
                self.call(self.loop.shutdown_default_executor(), timeout=10)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(10)
                if not self.thread.is_alive():
                    self.loop.close()


class ServerProcess:
    """`baton serve` in a process of its own, on 127.0.0.1 and a free port. Starting returns at
    once (so that several load side by side); `address` waits until it serves."""

    def __init__(self, model_dir: str, *flags: str):
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-m", "baton.services.cli", "serve", "--model", model_dir,
                                      "--port", "0", "--dtype", "float32", "--device", "cpu", *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._address: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read_output, daemon=True).start()  # never blocks on a full pipe

    def _read_output(self) -> None:
        for line in self.proc.stdout:  # ends at EOF when the process exits
            self.lines.append(line)
            if self._address is None and line.startswith("serving on "):
                self._address = line.split()[2].rstrip(";")
                self._ready.set()
        self._ready.set()

    @property
    def address(self) -> str:
        if not self._ready.wait(120) or self._address is None:
            self.kill()
            raise RuntimeError("baton serve did not start:\n" + "".join(self.lines))
        return self._address

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode


@contextlib.contextmanager
def pd_stack(model_dir: str, num_prefill: int = 1, num_decode: int = 1, prefill: tuple = (), decode: tuple = (),
             router: tuple = (), common: tuple = ()):
    """Prefill and decode processes (each with the stack's token) and a router in front of
    them: yields (prefills, decodes, router); every process is stopped on exit, also when
    one fails to start. `prefill`, `decode`, `router`: flags of that tier; `common`: of all."""
    common = ("--internal-token", TOKEN, *common)
    with contextlib.ExitStack() as stack:
        def start(*flags: str) -> ServerProcess:
            proc = ServerProcess(model_dir, *flags)
            stack.callback(proc.stop)
            return proc
        prefills = [start("--role", "prefill", *common, *prefill) for _ in range(num_prefill)]
        decodes = [start("--role", "decode", *common, *decode) for _ in range(num_decode)]
        backends = [("--prefill", prefills), ("--decode", decodes)]
        yield prefills, decodes, start("--role", "router", *common, *router, *(
            arg for flag, procs in backends if procs for arg in (flag, ",".join(p.address for p in procs))))


@contextlib.contextmanager
def epd_stack(model_dir: str, num_encoder: int = 1, encoder: tuple = (), **pd):
    """pd_stack with an encoder tier (E/P/D) its router sends image requests through: yields
    (encoders, prefills, decodes, router)."""
    with contextlib.ExitStack() as stack:
        encoders = []
        for _ in range(num_encoder):
            encoders.append(ServerProcess(model_dir, "--role", "encoder", "--internal-token", TOKEN,
                                          *pd.get("common", ()), *encoder))
            stack.callback(encoders[-1].stop)
        router = ("--encoder", ",".join(e.address for e in encoders), *pd.pop("router", ()))
        with pd_stack(model_dir, router=router, **pd) as (prefills, decodes, router_proc):
            yield encoders, prefills, decodes, router_proc


def baton(*argv: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "baton.services.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)


class Up:
    """`baton up` in a process, its output collected as it comes."""

    def __init__(self, *argv: str):
        # The stack's token known here, for the engines' Stats.
        self.proc = subprocess.Popen([sys.executable, "-m", "baton.services.cli", "up", *argv],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, BATON_INTERNAL_TOKEN=TOKEN))
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def wait_for(self, pattern: str, timeout: float = 120, after: int = 0) -> re.Match:
        """The first line from index `after` on that matches pattern."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.lines[after:]:
                if m := re.search(pattern, line):
                    return m
            assert time.monotonic() < deadline and self.proc.poll() is None, "".join(self.lines[-60:])
            time.sleep(0.05)

    def children(self) -> dict[str, tuple[int, str]]:
        """role-index -> (pid, address), from the children's command lines."""
        out = {}
        for pid in subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split():
            argv = open(f"/proc/{pid}/cmdline").read().split("\0")
            if "serve" in argv:
                role, port = argv[argv.index("--role") + 1], argv[argv.index("--port") + 1]
                out.setdefault(role, []).append((int(pid), f"127.0.0.1:{port}"))
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                return self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()
