"""`baton up` supervises: a killed engine is restarted on its address while the router
serves on the survivors, and is used again once back; a service in a crash loop stops the
stack with its last output shown; --no-restart keeps the stop-at-first-death behaviour."""
from __future__ import annotations

import os
import subprocess
import time

from helpers import stats
from servers import Up

from baton.services.cli.launcher import free_port
from baton.services.client import Client


def generate(address: str, n: int = 4) -> list[str]:
    with Client(address) as client:
        return [[c.finish_reason for c in client.generate([5, 6, 7, 8, 9], max_tokens=4, temperature=0.0,
                                                          ignore_eos=True, timeout=30)][-1] for _ in range(n)]


def kill(pid: int) -> None:
    subprocess.run(["kill", "-9", str(pid)], check=True)


def test_a_killed_engine_comes_back_and_a_crash_loop_stops_the_stack(tiny_llama):
    port = free_port("127.0.0.1")
    up = Up("--model", tiny_llama, "--port", str(port), "--dtype", "float32", "--prefill", "2", "--decode", "2",
            "--http-port", "0")
    router, cores = f"127.0.0.1:{port}", []
    try:
        up.wait_for("Baton is up")  # once the router sees every engine healthy
        pid, address = up.children()["decode"][0]
        kill(pid)
        up.wait_for(r"decode-0 .* exited with status -9; restarting it")
        assert generate(router) == ["length"] * 4  # the survivors serve meanwhile
        mark = len(up.lines)
        up.wait_for(r"decode-0 serves again", after=mark)
        used = stats(address).num_requests
        deadline = time.monotonic() + 30
        while stats(address).num_requests == used:  # round robin sends the next requests its way too
            assert generate(router, 2) == ["length"] * 2 and time.monotonic() < deadline
        # A decode's engine core killed under a long stream: the router moves the stream, the
        # front exits 1 (its core died), `baton up` restarts the server.
        decodes = [a for _, a in up.children()["decode"]]
        cores = [stats(a).engine_core_pid for role, procs in up.children().items() if role != "router"
                 for _, a in procs]
        mark = len(up.lines)
        with Client(router) as client:
            stream = client.generate([5, 6, 7], max_tokens=300, temperature=0.0, ignore_eos=True, timeout=60)
            got, busy = [next(stream)], []
            while not busy:  # the first token comes from a prefill
                busy = [a for a in decodes if stats(a).num_running]
                got += [] if busy else [next(stream)]
            (busy,) = busy
            kill(stats(busy).engine_core_pid)
            got += list(stream)
        assert got[-1].finish_reason == "length" and sum(len(c.token_ids) for c in got) == 300
        name = up.wait_for(r"(decode-\d) .* exited with status 1; restarting it", after=mark).group(1)
        up.wait_for(rf"{name} serves again", after=mark)
        pid = next(p for p, a in up.children()["decode"] if a == address)  # decode-0 may have been the one
        # Killed until its fifth death, each time as soon as it is started again: a crash loop.
        deaths = 3 if name == "decode-0" else 4
        for kills in range(deaths):
            mark = len(up.lines)
            kill(pid)
            if kills < deaths - 1:
                pid = int(up.wait_for(r"decode-0 restarted \(pid (\d+)\)", after=mark).group(1))
        assert up.proc.wait(60) == 1
        out = "".join(up.lines)
        assert "decode-0 died 5 times within 60s; stopping the stack. Its last output:" in out
        assert out.rstrip().splitlines()[-1] != "Its last output:"  # the child's lines follow
    finally:
        up.stop()
    assert not [pid for pid in cores if os.path.exists(f"/proc/{pid}")]  # no engine core outlives the stack


def test_no_restart_stops_the_stack_at_the_first_death(tiny_llama):
    up = Up("--model", tiny_llama, "--port", str(free_port("127.0.0.1")), "--dtype", "float32", "--http-port", "0",
            "--no-restart")
    try:
        up.wait_for("Baton is up")
        kill(up.children()["prefill"][0][0])
        assert up.proc.wait(60) == 1
        assert "prefill-0 exited with status -9; stopping the stack (--no-restart)" in "".join(up.lines)
    finally:
        up.stop()
