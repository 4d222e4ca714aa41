"""What a test (or a module's fixtures) may not leave behind, checked by conftest.py's autouse
fixtures once its fixtures are torn down: a child process still running (an engine core, a
server, a tensor-parallel rank), after each test and each module; a non-daemon thread still
alive, after each module (a module fixture's engine may start its pool's thread in a test, and
keep it). And garbage kept between tests:
an engine that ends in a reference cycle (a test's monkeypatch on an instance makes one) waits
for the garbage collector, whose full collections come rarely in a process this large."""
from __future__ import annotations

import gc
import glob
import os
import threading
import time
import weakref

GRACE_S = 5.0  # for processes and threads already on their way out (a server stopping, a pool's worker)

# Started once by multiprocessing (torch.multiprocessing.spawn) and kept for the process's life by design.
_LONG_LIVED = ("from multiprocessing.resource_tracker import main", "from multiprocessing.forkserver import main")


def children() -> dict[int, str]:
    """This process's running child processes (those of every thread): pid -> command line."""
    out = {}
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            with open(path) as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:  # the thread ended meanwhile
            continue
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # exited, waits to be reaped
                        continue
                with open(f"/proc/{pid}/cmdline") as f:
                    cmdline = f.read().replace("\0", " ").strip()
            except OSError:  # gone meanwhile
                continue
            if not any(mark in cmdline for mark in _LONG_LIVED):
                out[pid] = cmdline
    return out


def threads() -> set[threading.Thread]:
    """The live non-daemon threads but this one (those that hold the interpreter's exit up)."""
    return {t for t in threading.enumerate() if not t.daemon and t is not threading.current_thread()}


# Processes ((pid, command line)) and threads named once already: by a test, not again by its module.
_reported: set = set()
_started_in: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # thread -> the test that started it


class Snapshot:
    """The child processes and non-daemon threads running when `what` (a test, a module) began."""

    def __init__(self, what: str):
        self.what = what
        self.procs, self.threads = children(), threads()

    def new_threads(self) -> list[threading.Thread]:
        return sorted((t for t in threads() - self.threads - _reported if t.is_alive()), key=lambda t: t.name)

    def note_threads(self) -> None:
        """Threads started since, and alive: checked at the module's end (a module fixture's object
        may start one lazily, in a test: a pool's worker), named there with the test that started it."""
        for t in self.new_threads():
            _started_in.setdefault(t, self.what)

    def left_behind(self, with_threads: bool) -> str | None:
        """What was started since and still runs after GRACE_S: a message naming each process
        (pid and command line) and, `with_threads`, each non-daemon thread, not named before; or None."""
        deadline, collected = time.monotonic() + GRACE_S, False
        while True:
            procs = {pid: cmd for pid, cmd in children().items()
                     if pid not in self.procs and (pid, cmd) not in _reported}
            alive = self.new_threads() if with_threads else []
            if not (procs or alive) or time.monotonic() >= deadline:
                break
            if not collected:  # an engine in a reference cycle stops its threads once collected
                gc.collect()
                collected = True
            time.sleep(0.05)
        if not (procs or alive):
            return None
        _reported.update(procs.items(), alive)
        lines = [f"{self.what} left running after its teardown:"]
        lines += [f"  process {pid}: {cmd[:300]}" for pid, cmd in sorted(procs.items())]
        lines += [f"  thread {t.name!r} (non-daemon, target {getattr(t, '_target', None)!r}, started during "
                  f"{_started_in.get(t, 'a fixture')})" for t in alive]
        return "\n".join(lines)


class Garbage:
    """Collects the garbage once this process grew by `step` bytes since the last collection:
    a full collection costs ~0.1 s here, an engine waiting for one up to a GiB."""

    def __init__(self, step: int = 256 << 20):
        self.step = step
        self.mark = rss()

    def maybe_collect(self) -> None:
        if rss() - self.mark > self.step:
            gc.collect()
            self.mark = rss()


def rss() -> int:
    """This process's resident set, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
