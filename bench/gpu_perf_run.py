"""bench/gpu_perf.py's run: what it measures at which sizes (FULL on a GPU, SMOKE on a CPU),
its budget (a section past it is cut by SIGALRM), the report rewritten after every measurement,
and the timing helpers every section uses."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import shutil
import signal
import tempfile
import time
import traceback

import numpy as np
import torch
from gpu_perf_report import summary_lines  # bench/gpu_perf_report.py

STARTED = time.monotonic()


GIB = 1 << 30


SECTIONS = ("ceilings", "llama8b", "transformers", "moe", "serve")


GRACE_S = 20  # a section still running this long past the budget is cut


FIRST_ID = 3  # random prompts skip the usual special ids


# Qwen3-30B-A3B's shape (its config.json, less the layer count: --moe-layers of 48).
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True)


QWEN3_30B_A3B_LAYERS = 48


TINY_MOE = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a run measures at which sizes: the GPU's (FULL) or the CPU smoke run's (SMOKE)."""
    device: str
    dtype: str
    llama_shape: str  # a random_checkpoint.SHAPES name
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    warmup: int  # decode steps before the timed ones (the first adds the requests)
    steps: int
    busy: tuple[tuple[int, int], ...]  # (batch, context) of the profiled decodes
    busy_steps: int
    prefill: tuple[int, ...]
    prefill_reps: int
    copy_bytes: int
    matmul_n: int
    hf_batches: tuple[int, ...]
    hf_prompt: int
    hf_new: int
    moe_shape: dict
    moe_batches: tuple[int, ...]
    moe_context: int
    serve_requests: int
    serve_input: int
    serve_output: int
    min_seconds: dict  # a section starts only with this much of the budget left
    cpu_kv_blocks: int = 0  # on the CPU, the pool's size (a GPU's is what gpu_memory_utilization leaves)


FULL = Plan(device="cuda", dtype="bfloat16", llama_shape="llama3-8b", batches=(1, 8, 32, 64, 128, 256),
            contexts=(1024, 8192), warmup=3, steps=20, busy=((1, 1024), (32, 1024), (256, 1024)), busy_steps=5,
            prefill=(2048, 8192), prefill_reps=3, copy_bytes=2 * GIB, matmul_n=8192, hf_batches=(1, 32),
            hf_prompt=1024, hf_new=64, moe_shape=QWEN3_30B_A3B, moe_batches=(1, 32, 128), moe_context=1024,
            serve_requests=64, serve_input=1024, serve_output=128,
            min_seconds={"ceilings": 5, "llama8b": 90, "transformers": 40, "moe": 60, "serve": 60})


SMOKE = Plan(device="cpu", dtype="float32", llama_shape="tiny", batches=(1, 4), contexts=(64,), warmup=2, steps=5,
             busy=((4, 64),), busy_steps=3, prefill=(64, 128), prefill_reps=2, copy_bytes=64 << 20, matmul_n=512,
             hf_batches=(1, 4), hf_prompt=64, hf_new=8, moe_shape=TINY_MOE, moe_batches=(1, 4), moe_context=64,
             serve_requests=8, serve_input=64, serve_output=16, min_seconds=dict.fromkeys(SECTIONS, 0),
             cpu_kv_blocks=256)


class OutOfTime(Exception):
    """The budget (or a time cap) ran out: raised from SIGALRM."""


def on_alarm(signum, frame):
    raise OutOfTime


class Run:
    def __init__(self, args: argparse.Namespace, plan: Plan):
        self.args, self.plan = args, plan
        self.deadline = STARTED + args.budget
        self.alarm_at = math.inf  # when the running section's SIGALRM fires
        self.report: dict = {"smoke": args.smoke, "budget_s": args.budget, "plan": dataclasses.asdict(plan),
                             "sections": {}}
        self.scratch: list[str] = []  # folders to remove at the end
        self.ceilings: dict = {}
        self.llama_dir: str | None = None
        self.offline: dict = {}
        os.makedirs(args.out, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.report["elapsed_s"] = round(time.monotonic() - STARTED, 1)
        for name, text in (("report.json", json.dumps(self.report, indent=1, default=str)),
                           ("report.txt", "\n".join(summary_lines(self.report)) + "\n")):
            with open(os.path.join(self.args.out, name + ".tmp"), "w") as f:
                f.write(text)
            os.replace(os.path.join(self.args.out, name + ".tmp"), os.path.join(self.args.out, name))

    def scratch_dir(self, need: int) -> str:
        """A folder with `need` bytes free: under /dev/shm (memory: written and read fastest)
        when it has room, else the temporary folder."""
        for base in ("/dev/shm", tempfile.gettempdir()):
            if os.path.isdir(base) and shutil.disk_usage(base).free > need + 2 * GIB:
                path = tempfile.mkdtemp(prefix="gpu-perf-", dir=base)
                self.scratch.append(path)
                return path
        raise RuntimeError(f"no room for {need / GIB:.1f} GiB in /dev/shm or {tempfile.gettempdir()}")

    @contextlib.contextmanager
    def time_cap(self, seconds: float):
        """Raise OutOfTime after `seconds` (or the section's own alarm, whichever is first)."""
        signal.setitimer(signal.ITIMER_REAL, max(0.01, min(seconds, self.alarm_at - time.monotonic())))
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, max(0.01, self.alarm_at - time.monotonic()))


def run_section(run: Run, name: str, fn) -> None:
    row: dict = {}
    run.report["sections"][name] = row
    left, need = run.left(), run.plan.min_seconds[name]
    if left < need:
        row["skipped"] = f"out of time ({left:.0f} s of the budget left, the section needs ~{need} s)"
        run.save()
        print(f"{name}: skipped, out of time", flush=True)
        return
    t0 = time.perf_counter()
    run.alarm_at = time.monotonic() + max(left, 0) + GRACE_S
    signal.setitimer(signal.ITIMER_REAL, run.alarm_at - time.monotonic())
    try:
        fn(run, row)
        row.setdefault("ok", True)
    except OutOfTime:
        row["ok"], row["cut"] = False, "out of time: the budget ran out in this section (what finished is kept)"
    except Exception:  # noqa: BLE001 - one section's failure is a line in the report
        row["ok"], row["error"] = False, traceback.format_exc(limit=12)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        run.alarm_at = math.inf
        row["seconds"] = round(time.perf_counter() - t0, 1)
        free_memory()
        if torch.cuda.is_available():  # what this process still holds (a leak would starve the next section)
            row["gpu_gib_after"] = {"allocated": round(torch.cuda.memory_allocated() / GIB, 2),
                                    "free": round(torch.cuda.mem_get_info()[0] / GIB, 2)}
        run.save()
    state = "skipped" if "skipped" in row else "ok" if row.get("ok") else "FAILED"
    print(f"{name}: {state} ({row['seconds']} s)", flush=True)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def stats_ms(seconds: list[float]) -> dict:
    a = np.asarray(seconds) * 1e3
    return {"median_ms": round(float(np.median(a)), 3), "p90_ms": round(float(np.percentile(a, 90)), 3),
            "min_ms": round(float(a.min()), 3), "n": len(a)}


def timed_s(fn, device: str, repeat: int, warmup: int = 3) -> list[float]:
    """Seconds per call of fn, each alone: CUDA events on a GPU, the wall clock on a CPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(repeat):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out
