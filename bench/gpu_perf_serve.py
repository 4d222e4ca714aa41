"""bench/gpu_perf.py's serve section: `baton serve` on the Llama checkpoint with the offline
engine's arguments, and a client process (bench/gpu_perf.py --serve-client) streaming the
workload over gRPC, its throughput beside the offline engine's."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from gpu_perf_engine import llama_checkpoint, llama_engine_args, workload  # bench/gpu_perf_engine.py
from gpu_perf_run import FULL, GRACE_S, SMOKE, Plan, Run, stats_ms  # bench/gpu_perf_run.py

_PREFLIGHT = """
import grpc, google.protobuf, msgspec, zmq, aiohttp, prometheus_client, yaml
import baton.services.server.server, baton.engine.core.process, baton.services.client
import nixl._api
print(grpc.__version__, google.protobuf.__version__)
"""


def serve_argv(plan: Plan, path: str) -> list[str]:
    """`baton serve` with the offline engine's arguments (same pool, same graphs)."""
    from baton.services.cli.engine_args import config_argv

    return [sys.executable, "-m", "baton.services.cli", "serve", "--model", path, "--host", "127.0.0.1", "--port", "0",
            "--grace-period", "2", "--max-waiting-requests", str(plan.serve_requests + 8),
            *config_argv(llama_engine_args(plan))]


def wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float) -> str | None:
    """The first line of proc's stdout that starts with prefix (None: it exited or timed out)."""
    lines: queue.Queue = queue.Queue()

    def read():
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    end = time.monotonic() + timeout
    while (left := end - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            return None
        if line is None:
            return None
        if line.startswith(prefix):
            return line
    return None


def orphan_guard():
    """A child's preexec_fn: SIGKILL it when this process dies, however (a killed benchmark must
    not leave a server holding the GPU for whatever runs next; its engine core follows it)."""
    from baton.engine.common.lifetime import die_with_parent

    parent = os.getpid()
    return lambda: die_with_parent(parent)


def stop(proc: subprocess.Popen) -> None:
    """SIGINT (the server drains and exits), then SIGKILL to its process group (its engine core)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def section_serve(run: Run, row: dict) -> None:
    plan = run.plan
    path = llama_checkpoint(run)
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # (PYTHONPATH: the wheels and baton, as this process has them)
    cwd = tempfile.mkdtemp(prefix="gpu-perf-serve-")  # not the checkout: its baton/ is not the whole package
    run.scratch.append(cwd)
    pre = subprocess.run([sys.executable, "-c", _PREFLIGHT], env=env, capture_output=True, text=True, timeout=120,
                         cwd=cwd)
    if pre.returncode != 0:
        missing = (pre.stderr.strip().splitlines() or ["?"])[-1]
        row["ok"] = None
        row["skipped"] = (f"`baton serve` cannot start here: {missing} (bench/gpu_wheels.sh fetches the wheels "
                          f"it needs into .whl/)")
        return
    row["grpc"], row["protobuf"] = pre.stdout.split()
    log_path = os.path.join(run.args.out, "serve.log")
    argv = serve_argv(plan, path)
    row["argv"] = argv[3:]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=cwd,
                                start_new_session=True, preexec_fn=orphan_guard())
    try:
        line = wait_for_line(proc, "serving on ", min(300.0, max(30.0, run.left() + GRACE_S - 30)))
        if line is None:
            raise RuntimeError(f"`baton serve` did not serve (exit code {proc.poll()}); its log ends:\n"
                               + "\n".join(Path(log_path).read_text().splitlines()[-25:]))
        address = line.split()[2].rstrip(";")
        row["start_s"] = round(time.perf_counter() - t0, 1)
        spec = {"address": address, "requests": plan.serve_requests, "input_len": plan.serve_input,
                "output_len": plan.serve_output, "vocab": read_vocab(path), "smoke": run.args.smoke}
        client = subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "gpu_perf.py"),
                                 "--serve-client", json.dumps(spec),
                                 "--out", run.args.out], env=env, capture_output=True, text=True, cwd=cwd,
                                preexec_fn=orphan_guard(),
                                timeout=max(30.0, run.left() + GRACE_S - 10))
        if client.returncode != 0:
            raise RuntimeError(f"the client failed:\n{client.stderr[-3000:]}")
        row["client"] = json.loads(client.stdout.strip().splitlines()[-1])
        offline = run.offline.get("output_tok_s")
        if offline:
            row["server_over_offline"] = round(row["client"]["output_tok_s"] / offline, 3)
        else:
            row["server_over_offline"] = "no offline figure (the llama8b section did not get that far)"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)  # the server goes, whatever the time
        stop(proc)


def read_vocab(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["vocab_size"]


def serve_client(spec: dict) -> dict:
    """The client process: every request at once over gRPC, streaming token ids; TTFT from the
    call, ITL between chunks, TPOT per request ((last - first) / (tokens - 1))."""
    import asyncio

    from baton.services.client import AsyncClient

    plan = dataclasses.replace(SMOKE if spec["smoke"] else FULL, serve_requests=spec["requests"],
                               serve_input=spec["input_len"], serve_output=spec["output_len"])
    prompts = workload(plan, spec["vocab"])
    kw = dict(temperature=0.0, ignore_eos=True, output="token_ids")

    async def drive():
        async with AsyncClient(spec["address"]) as client:
            async for _ in client.generate(prompts[0][:8], max_tokens=2, **kw):  # warm-up
                pass

            async def one(prompt):
                start, marks = time.perf_counter(), []
                async for chunk in client.generate(prompt, max_tokens=spec["output_len"], **kw):
                    if chunk.token_ids:
                        marks.append((time.perf_counter(), len(chunk.token_ids)))
                return start, marks

            t0 = time.perf_counter()
            results = await asyncio.gather(*(one(p) for p in prompts))
            return results, time.perf_counter() - t0

    results, wall = asyncio.run(drive())
    tokens = [sum(n for _, n in marks) for _, marks in results]
    ttft = [marks[0][0] - start for start, marks in results if marks]
    gaps = [b[0] - a[0] for _, marks in results for a, b in zip(marks, marks[1:])]
    tpot = [(marks[-1][0] - marks[0][0]) / (n - 1) for (_, marks), n in zip(results, tokens) if n > 1]

    def ms(xs):
        return stats_ms(xs) if xs else {}

    return {"requests": len(prompts), "input_len": spec["input_len"], "output_len": spec["output_len"],
            "seconds": round(wall, 3), "output_tokens": sum(tokens), "output_tok_s": round(sum(tokens) / wall, 1),
            "ttft": ms(ttft), "itl": ms(gaps), "tpot": ms(tpot)}
