"""Baton's speed on one GPU beside what the GPU allows and beside transformers, in one command
that fits in about 8 minutes of an H100: report.json (every figure) and report.txt (the table)
under --out, the table printed last. Without a CUDA device it says so and exits 0.

Sections, in this order; each on its own (one that fails leaves its traceback in the report and
the rest go on); the report is rewritten after every measurement, so a run cut short keeps what
finished; past --budget seconds the sections left are skipped, and one still running is cut
GRACE_S later:
- ceilings: the GPU's copy bandwidth (a 2 GiB device-to-device copy, bytes read and written
  over the time, median of 10 by CUDA events) and bf16 matmul peak (8192^3, random data).
- llama8b: a Llama-3.1-8B-shaped checkpoint of random bf16 weights drawn on the GPU, loaded by
  LLM; its ModelRunner driven directly with synthetic steps (the KV cache holds random values,
  so a decode needs no prefill): inter-token latency and throughput at batch 1-256 x context
  1k and 8k, with CUDA graphs and eager, each beside its floor (the bytes of every weight a
  step reads, the input embedding's B rows aside, and of the KV it attends over, over the
  copy bandwidth); the GPU's busy share of a step (torch.profiler: the union of its kernels
  over the wall time, so host overhead shows); prefill tokens/s and TFLOP/s at 2k and 8k
  beside the bf16 peak; an end-to-end LLM.generate of the serve section's workload.
- transformers: the same checkpoint in transformers on the same GPU, `generate` with a static
  cache (eager unless --hf-compile) at batch 1 and 32 on 1k prompts: ITL beside Baton's; and
  one prompt of 2k and 8k through generate(max_new_tokens=1) beside Baton's prefill.
- moe: a Qwen3-30B-A3B-shaped MoE (--moe-layers of its 48 layers), decoding at batch 1, 32,
  128 x 1k beside a floor of the bytes a step touches: attention, routers, lm_head and the
  experts a batch is expected to hit (E (1 - (1 - k/E)^B) per layer, routing taken uniform).
- serve: `baton serve` on the 8B checkpoint, a client process streaming the workload over gRPC
  (token ids): output tok/s, TTFT, ITL, and its tok/s over the offline engine's.

Targets (8B, context 1k): batch 1 ITL <= 1.3x the floor; batch 64 and 256 throughput >= 0.7x the
floor's; prefill at 8k >= 50% of the measured bf16 peak.

    python bench/gpu_perf.py --out /tmp/perf
    python bench/gpu_perf.py --out /tmp/perf --only llama8b transformers --budget 200   # (ceilings always run)
    python bench/gpu_perf.py --smoke --out /tmp/gp     # tiny shapes on the CPU: the logic, in under a minute

Baton imports msgspec even offline, and `baton serve` more (NIXL, pyzmq, gRPC's health and
reflection services, protobuf >= 7.35.1); where the machine lacks some (a GPU image),
bench/gpu_wheels.sh fetches them into .whl/, which this script unpacks into a temporary folder
on its own and its children's path. Without them the serve section is skipped, naming the
missing module.

The parts: gpu_perf_run.py (the plan, the budget, the report), gpu_perf_engine.py (engines and
synthetic steps, floors), gpu_perf_sections.py (ceilings, llama8b, transformers, moe),
gpu_perf_serve.py (serve, and its client) and gpu_perf_report.py (the table).
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from gpu_perf_report import summary_lines  # bench/gpu_perf_report.py
from gpu_perf_run import FULL, SECTIONS, SMOKE, Run, on_alarm, run_section  # bench/gpu_perf_run.py
from gpu_perf_sections import (  # bench/gpu_perf_sections.py
    section_ceilings,
    section_llama,
    section_moe,
    section_transformers,
)
from gpu_perf_serve import section_serve, serve_client  # bench/gpu_perf_serve.py

REPO = Path(__file__).resolve().parent.parent


# What Baton imports that a GPU image may lack (msgspec even offline; the rest to serve), with the
# least version its code needs.
NEEDED = {"msgspec": ("msgspec", None), "zmq": ("pyzmq", None), "nixl": ("nixl", None),
          "grpc_health": ("grpcio-health-checking", None), "grpc_reflection": ("grpcio-reflection", None),
          "google.rpc": ("googleapis-common-protos", None), "google.protobuf": ("protobuf", (7, 35, 1))}


def lacking() -> list[str]:
    """The distributions of NEEDED that this Python lacks, or has older than needed."""
    import importlib.metadata
    import importlib.util

    out = []
    for module, (dist, least) in NEEDED.items():
        try:
            found = importlib.util.find_spec(module) is not None
            if found and least:
                have = tuple(int(x) for x in importlib.metadata.version(dist).split(".")[:3] if x.isdigit())
                found = have >= least
        except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
            found = False
        if not found:
            out.append(dist)
    return out


def ensure_wheels() -> dict:
    """Where this Python lacks some of NEEDED: .whl/'s wheels (bench/gpu_wheels.sh) that fit it,
    unpacked into a temporary folder put first on sys.path and on PYTHONPATH (the server, its
    engine core and the client take it too); nothing is installed."""
    missing = lacking()
    wheels = [w for w in sorted((REPO / ".whl").glob("*.whl")) if wheel_fits(w.name)] if missing else []
    if wheels:
        site = tempfile.mkdtemp(prefix="gpu-perf-wheels-")
        atexit.register(shutil.rmtree, site, True)
        for w in wheels:
            with zipfile.ZipFile(w) as z:
                z.extractall(site)
        sys.path.insert(0, site)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))
    return {"lacking_here": missing, "unpacked": [w.name for w in wheels], "lacking_after": lacking()}


def wheel_fits(name: str) -> bool:
    """Whether a wheel's tags are this interpreter's."""
    try:
        from packaging.tags import sys_tags
        from packaging.utils import parse_wheel_filename

        return not parse_wheel_filename(name)[3].isdisjoint(set(sys_tags()))
    except ImportError:
        return "-py3-none-any" in name or f"-cp{sys.version_info.major}{sys.version_info.minor}-" in name


def ensure_baton() -> None:
    """Import baton from an install, else from this checkout through a folder of links laid out
    as the install maps it (baton.engine -> engine/, ...), put on PYTHONPATH for the processes
    started here too (the server, its engine core, the client: each started outside the
    checkout, whose baton/ would come first)."""
    try:
        import baton.engine  # noqa: F401
        return
    except ImportError:
        pass
    shim = tempfile.mkdtemp(prefix="baton-shim-")
    atexit.register(shutil.rmtree, shim, True)
    pkg = os.path.join(shim, "baton")
    os.mkdir(pkg)
    for entry in os.listdir(REPO / "baton"):
        if entry != "__pycache__":
            os.symlink(REPO / "baton" / entry, os.path.join(pkg, entry))
    for sub in ("engine", "kernels", "kv_transfer", "services"):
        os.symlink(REPO / sub, os.path.join(pkg, sub))
    for name in [m for m in sys.modules if m == "baton" or m.startswith("baton.")]:
        del sys.modules[name]
    sys.path.insert(0, shim)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [shim, os.environ.get("PYTHONPATH")]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="a folder for report.json and report.txt")
    p.add_argument("--only", nargs="+", choices=SECTIONS,
                   help="run these sections only (default: all; ceilings always, the floors need them)")
    p.add_argument("--budget", type=float, default=420.0,
                   help="seconds from start after which the sections left are skipped (default: %(default)s)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, float32: the logic, not the speed")
    p.add_argument("--moe-layers", type=int, help="layers of the Qwen3-30B-A3B-shaped MoE (default 12; smoke 2)")
    p.add_argument("--hf-compile", action="store_true", help="let transformers compile its decode step")
    p.add_argument("--hf-compile-cap", type=float, default=120.0, help="seconds the compile may take")
    p.add_argument("--serve-client", metavar="JSON", help=argparse.SUPPRESS)  # the serve section's client process
    args = p.parse_args()
    wheels = ensure_wheels()
    ensure_baton()
    if args.serve_client:
        print(json.dumps(serve_client(json.loads(args.serve_client))))
        return
    if not args.smoke and not torch.cuda.is_available():
        os.makedirs(args.out, exist_ok=True)
        print("gpu_perf: no CUDA device here: nothing to measure (--smoke runs the logic on the CPU)")
        return
    if args.moe_layers is None:
        args.moe_layers = 2 if args.smoke else 12
    run = Run(args, SMOKE if args.smoke else FULL)
    run.report["wheels"] = wheels
    if wheels["lacking_after"]:
        print(f"gpu_perf: this Python lacks {', '.join(wheels['lacking_after'])}: the engine sections need msgspec, "
              "serve all of them (bench/gpu_wheels.sh fetches them into .whl/)", flush=True)
    signal.signal(signal.SIGALRM, on_alarm)
    # An outer `timeout` (SIGTERM) still stops the server and frees /dev/shm on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        for name, fn in (("ceilings", section_ceilings), ("llama8b", section_llama),
                         ("transformers", section_transformers), ("moe", section_moe), ("serve", section_serve)):
            if not args.only or name in args.only or name == "ceilings":  # (the floors need the ceilings)
                run_section(run, name, fn)
    finally:
        for folder in run.scratch:
            shutil.rmtree(folder, ignore_errors=True)
        run.save()
    print("\n".join(summary_lines(run.report)))


if __name__ == "__main__":
    main()
