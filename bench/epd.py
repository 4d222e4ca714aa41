"""E/P/D against P/D: a Qwen2.5-VL of random weights (bench/images.py's: a 12-layer ViT, 99 tokens
for a 320x240 picture, over a small Qwen2) served as a prefill and a decode behind a router, then
the same with an encoder tier in front of the prefill (`--role encoder`, the router's
`--encoder`). Each stack takes the same requests from --concurrency gRPC streams at once, under
two loads:

- image-heavy: every request a picture not seen before (the encoder runs for each) and a short text;
- image-light: one request in 8 with a new picture, the rest text only of the same length.

Per stack and load: the client's time to first token (median and p90), requests per second, and
each process's CPU seconds. Every process gets one OpenMP thread (as `baton up` gives them on a
machine of this many cores): the stacks share the machine's cores as they would share a node.

    python bench/epd.py [--requests 24] [--concurrency 4] [--max-tokens 16]
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from images import QWEN_ROPE, QWEN_VISION, TEXT

from baton.services.rpc.health import is_serving
from baton.testing.checkpoints import write_random_qwen2_5_vl
from baton.testing.processes import cpu_seconds, descendants
from baton.v1 import generate_pb2 as pb
from baton.v1 import generate_pb2_grpc as pb_grpc

TOKEN = "bench-epd"


def start(model: str, *flags: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "baton.services.cli", "serve", "--model", model, "--port", "0",
                             "--dtype", "float32", "--device", "cpu", "--internal-token", TOKEN, *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    for line in proc.stdout:
        if line.startswith("serving on "):
            address = line.split()[2].rstrip(";")
            deadline = time.monotonic() + 120
            while not is_serving(address):
                if time.monotonic() > deadline:
                    sys.exit(f"{address} is not serving")
                time.sleep(0.1)
            return proc, address
    sys.exit(f"`baton serve {' '.join(flags)}` exited before it served")


def stack(model: str, encoder: bool) -> list[tuple[str, subprocess.Popen, str]]:
    """(name, process, address) of each service, the router last."""
    procs = [("encoder", *start(model, "--role", "encoder"))] if encoder else []
    procs += [(role, *start(model, "--role", role)) for role in ("prefill", "decode")]
    tiers = [arg for name, _, address in procs for arg in (f"--{name}", address)]
    return procs + [("router", *start(model, "--role", "router", *tiers))]


def png(rng: np.random.Generator) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def workload(n: int, every: int, seed: int) -> list[pb.GenerateRequest]:
    """n chats, one in `every` with a new picture; the others' text as long as a picture's tokens."""
    rng = np.random.default_rng(seed)
    words = "the of a picture shows some things and colors in it".split()
    out = []
    for i in range(n):
        text = " ".join(rng.choice(words, 12))
        images = [pb.Image(data=png(rng))] if i % every == 0 else []
        if not images:
            text = " ".join(rng.choice(words, 12 + 99))  # (about the tokens a picture takes)
        out.append(pb.GenerateRequest(request_id=f"r{seed}-{i}", chat=pb.Chat(messages=[
            pb.ChatMessage(role="user", content=text, images=images)])))
    return out


def run(address: str, requests: list[pb.GenerateRequest], concurrency: int, max_tokens: int) -> dict:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def one(request: pb.GenerateRequest) -> float:
        request.sampling.CopyFrom(sampling)
        with grpc.insecure_channel(address) as channel:
            t0, first = time.perf_counter(), None
            for _ in pb_grpc.TextGenerationStub(channel).Generate(request, timeout=600):
                first = first or time.perf_counter() - t0
        return first
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        ttfts = sorted(pool.map(one, requests))
    wall = time.perf_counter() - t0
    return {"ttft_p50": statistics.median(ttfts), "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
            "rps": len(requests) / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()
    loads = {"image-heavy": 1, "image-light": 8}
    rows = []
    with tempfile.TemporaryDirectory() as scratch:  # (the checkpoint is ~0.6 GB: never left behind)
        model = write_random_qwen2_5_vl(scratch + "/qwen-vl", seed=1, patch_size=14, window_size=112,
                                        max_pixels=1280 * 28 * 28, vision=QWEN_VISION, text={**TEXT, **QWEN_ROPE})
        print(f"Qwen2.5-VL (12-layer ViT, 99 tokens a picture); {args.requests} requests, {args.concurrency} at "
              f"once, {args.max_tokens} tokens each; {os.cpu_count()} cores, one thread a process", flush=True)
        for encoder in (False, True):
            services = stack(model, encoder)
            try:
                for seed, (load, every) in enumerate(loads.items()):
                    run(services[-1][2], workload(2, every, 100 + seed), 2, 2)  # (warm: first calls, imports)
                    before = {name: _cpu(proc) for name, proc, _ in services}
                    figures = run(services[-1][2], workload(args.requests, every, seed), args.concurrency,
                                  args.max_tokens)
                    cpu = {name: _cpu(proc) - before[name] for name, proc, _ in services}
                    rows.append(("E/P/D" if encoder else "P/D", load, figures, cpu))
                    print(f"  {rows[-1][0]:<6} {load:<12} TTFT p50 {figures['ttft_p50'] * 1e3:7.0f} ms  p90 "
                          f"{figures['ttft_p90'] * 1e3:7.0f} ms  {figures['rps']:5.2f} req/s  CPU s: "
                          + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items()), flush=True)
            finally:
                for _, proc, _ in reversed(services):
                    proc.send_signal(2)
                    proc.wait(60)
    for load in loads:
        pd, epd = (next(r[2] for r in rows if r[0] == s and r[1] == load) for s in ("P/D", "E/P/D"))
        print(f"{load}: E/P/D over P/D: TTFT p50 x{epd['ttft_p50'] / pd['ttft_p50']:.2f}, p90 "
              f"x{epd['ttft_p90'] / pd['ttft_p90']:.2f}, throughput x{epd['rps'] / pd['rps']:.2f}")


def _cpu(proc: subprocess.Popen) -> float:
    return cpu_seconds(proc.pid) + sum(cpu_seconds(child) for child in descendants(proc.pid))


if __name__ == "__main__":
    main()
