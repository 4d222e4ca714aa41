"""Ctrl-C in a terminal stops Baton quietly. A terminal sends SIGINT to its whole foreground
process group: the engine cores and tensor-parallel ranks get it too, not only the command.
Each command here runs in a process group of its own, signalled as a terminal does after one
request: it exits 0, its stop lines ("stopping", "draining") are all it prints from then on (no
traceback), and no process and no shared-memory file of Baton's is left."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from helpers import alive

from baton.services.cli.launcher import free_port
from baton.services.client import Client
from baton.testing.processes import descendants

STOP_LINE = re.compile(r"^(\[[\w-]+\] )?draining \(up to |^stopping$")


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def baton_shm() -> set[str]:
    """Baton's files in /dev/shm (shm_broadcast.py's tensor-parallel rings)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("baton-")}


def wait_for(pattern: str, lines: list[str], proc: subprocess.Popen, timeout: float = 120) -> re.Match:
    """The first line that matches, once printed."""
    deadline = time.monotonic() + timeout
    while True:
        for line in list(lines):
            if m := re.search(pattern, line):
                return m
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.05)


def ctrl_c_after_one_request(argv: list[str], ready: str, target: Callable[[re.Match], str]) -> tuple[list[str], set]:
    """`baton ARGV` in a process group of its own; once a line matches `ready`, one request to
    target(the match), then SIGINT to the whole group. Asserts that it exits 0 and leaves nothing
    behind; returns (what it printed from the signal on, the processes it had started)."""
    shm = baton_shm()
    proc = subprocess.Popen([sys.executable, "-m", "baton.services.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # never blocks the test
    reader.start()
    started: set[int] = set()
    try:
        with Client(target(wait_for(ready, lines, proc))) as client:
            chunks = list(client.generate([5, 6, 7, 8], max_tokens=4, temperature=0.0, ignore_eos=True, timeout=30))
        assert chunks[-1].finish_reason == "length"
        started = descendants(proc.pid)
        mark = len(lines)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: every process of the group
        assert proc.wait(60) == 0, "".join(lines)
        reader.join(10)  # EOF once every process that held the pipe is gone
        deadline = time.monotonic() + 5
        while [p for p in started if alive(p)] or not group_gone(proc.pid):
            assert time.monotonic() < deadline, f"left running: {[p for p in started if alive(p)]}"
            time.sleep(0.05)
        assert baton_shm() <= shm
        return lines[mark:], started
    finally:
        if not group_gone(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def assert_quiet_stop(after: list[str]) -> None:
    text = "".join(after)
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert after and all(STOP_LINE.match(line) for line in after), text


def test_ctrl_c_stops_baton_up_quietly(tiny_llama):
    """`./dev up`, one request, Ctrl-C: the router, the engines and their cores all get SIGINT;
    the launcher alone acts on it and stops the services in order."""
    port = free_port("127.0.0.1")
    after, started = ctrl_c_after_one_request(
        ["up", "--model", tiny_llama, "--port", str(port), "--http-port", "0", "--dtype", "float32", "--device", "cpu"],
        r"^Ctrl-C stops all", lambda m: f"127.0.0.1:{port}")
    assert len(started) == 5  # the router, a prefill and a decode, the engines' cores
    assert_quiet_stop(after)
    assert after[0] == "stopping\n" and sum("draining" in line for line in after) == 3, after


def test_ctrl_c_stops_baton_serve_with_tensor_parallel_ranks_quietly(tiny_llama):
    """`baton serve` alone, two ranks: the core and rank 1 leave SIGINT to the server, which
    drains and stops them."""
    after, started = ctrl_c_after_one_request(
        ["serve", "--model", tiny_llama, "--port", "0", "--dtype", "float32", "--device", "cpu",
         "--tensor-parallel-size", "2"], r"^serving on (\S+?);", lambda m: m.group(1))
    assert len(started) == 2  # the engine core and tensor-parallel rank 1
    assert_quiet_stop(after)
