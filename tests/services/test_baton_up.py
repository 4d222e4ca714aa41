"""`baton up`: the whole stack from one command answers over gRPC and the OpenAI front, invites
a request once (after every service serves), prints each request's trace waterfall, stops
cleanly, and fails clearly on a bad model, a taken port or an engine that cannot start."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import openai

from baton.services.cli.launcher import free_port

from servers import baton


def waterfalls(lines: list[str]) -> list[list[list[str]]]:
    """The (tier, phase) rows of each complete waterfall `baton up --trace` printed."""
    found, rows = [], None
    for line in list(lines):
        if line.startswith("trace "):
            rows = []
        elif rows is not None and line == "\n":
            found.append(rows)
            rows = None
        elif rows is not None and line.startswith("  "):
            rows.append(line.split()[:2])
    return found


def test_baton_up_answers_traces_and_stops_cleanly(tiny_llama):
    port, http_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    up = baton("up", "--model", tiny_llama, "--port", str(port), "--dtype", "float32", "--trace",
               "--http-port", str(http_port))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(up.stdout), daemon=True)  # never blocks the test
    reader.start()

    def wait_for(pattern: str, timeout: float = 120) -> list[str]:
        deadline = time.monotonic() + timeout
        while not any(line.startswith(pattern) for line in lines):
            assert time.monotonic() < deadline and up.poll() is None, "".join(lines)
            time.sleep(0.1)
        return lines[next(i for i, line in enumerate(lines) if line.startswith(pattern)):]

    try:
        wait_for("Baton is up")
        # One invitation, after every service said it serves: the children print none of their own.
        invites = [i for i, line in enumerate(lines) if "baton generate --target" in line]
        serving = [i for i, line in enumerate(lines) if "serving on " in line]
        up_at = next(i for i, line in enumerate(lines) if line.startswith("Baton is up"))
        assert len(invites) == 1 and invites[0] > up_at and len(serving) == 3 and max(serving) < up_at, "".join(lines)
        pids = [int(x) for x in subprocess.run(["pgrep", "-P", str(up.pid)], capture_output=True,
                                                text=True).stdout.split()]
        assert len(pids) == 3
        metrics = [line.split()[1] for line in wait_for("Metrics:")[1:4]]
        assert all(urllib.request.urlopen(url, timeout=10).read().startswith(b"#") for url in metrics)
        answer = subprocess.run([sys.executable, "-m", "baton.services.cli", "generate", "--target",
                                 f"127.0.0.1:{port}", "--raw", "--max-tokens", "5", "hello"],
                                capture_output=True, text=True, timeout=60)
        assert answer.returncode == 0 and "5 tokens" in answer.stderr, answer.stderr
        assert any(line.startswith(f"OpenAI API: http://127.0.0.1:{http_port}/v1") for line in lines)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=client.models.list().data[0].id, prompt="hello", max_tokens=5, temperature=0, stream=True))
        assert streamed == answer.stdout  # what `baton generate --raw` printed
        wait_for("trace ", 30)
        want = (["router", "request"], ["prefill", "compute"], ["decode", "transfer"], ["prefill", "hold"])
        deadline = time.monotonic() + 20
        # One of the two requests' waterfalls (a blank line ends each) shows every tier's phases;
        # on a loaded machine a tier's spans may come after the first one was printed.
        while not any(all(p in phases for p in want) for phases in waterfalls(lines)):
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        time.sleep(0.2)
        assert not [pid for pid in pids
                    if subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode == 0]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_baton_up_fails_clearly(tiny_llama, tmp_path):
    bad = baton("up", "--model", str(tmp_path / "nowhere"), "--port", str(free_port("127.0.0.1")))
    out, _ = bad.communicate(timeout=60)
    assert bad.returncode == 2 and "not a checkpoint directory" in out
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        bad = baton("up", "--model", tiny_llama, "--port", str(taken.getsockname()[1]))
        out, _ = bad.communicate(timeout=60)
    assert bad.returncode == 2 and "is taken" in out
    # An engine that dies at start-up (a context longer than the model's) stops the rest.
    bad = baton("up", "--model", tiny_llama, "--port", str(free_port("127.0.0.1")), "--max-model-len", "999999")
    out, _ = bad.communicate(timeout=120)
    assert bad.returncode == 1 and "exited with status" in out and "max_model_len" in out, out
    # Its children (reparented once it exited) carry the flag as one argument; none is left.
    assert subprocess.run(["pgrep", "-f", "max-model-len=999999"], capture_output=True).stdout == b""
