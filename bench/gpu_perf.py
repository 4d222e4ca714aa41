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
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import gc
import json
import math
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zipfile
from pathlib import Path

import numpy as np
import torch

STARTED = time.monotonic()
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # random_checkpoint.py
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


def _alarm(signum, frame):
    raise OutOfTime


# ---- making `baton` and its dependencies importable ------------------------------------------------
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


# ---- the run: plan, budget, report ----------------------------------------------------------------
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


# ---- 1. ceilings ----------------------------------------------------------------------------------
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


def section_ceilings(run: Run, row: dict) -> None:
    plan, dev = run.plan, run.plan.device
    row.update(device_facts(dev))
    copy = copy_times(plan.copy_bytes, dev)
    bw = 2 * plan.copy_bytes / float(np.median(copy))  # read and written
    row["copy"] = {"bytes": plan.copy_bytes, **stats_ms(copy), "tb_per_s": round(bw / 1e12, 3)}
    n, dtype = plan.matmul_n, getattr(torch, plan.dtype)
    gen = torch.Generator(dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, generator=gen).to(dtype)
    b = torch.randn(n, n, device=dev, generator=gen).to(dtype)
    mm = timed_s(lambda: a @ b, dev, repeat=10)
    peak = 2 * n ** 3 / float(np.median(mm))
    row["matmul"] = {"size": n, "dtype": plan.dtype, **stats_ms(mm), "tflop_per_s": round(peak / 1e12, 1)}
    run.ceilings = {"copy_bytes_per_s": bw, "flop_per_s": peak}


def copy_times(nbytes: int, dev: str) -> list[float]:
    src = torch.full((nbytes,), 7, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return timed_s(lambda: dst.copy_(src), dev, repeat=10)


def device_facts(dev: str) -> dict:
    facts = {"torch": torch.__version__}
    for name in ("triton", "transformers"):
        try:
            facts[name] = __import__(name).__version__
        except ImportError:
            facts[name] = "not installed"
    if dev == "cuda":
        p = torch.cuda.get_device_properties(0)
        facts.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / GIB, 1), sms=p.multi_processor_count,
                     cuda=torch.version.cuda)
    else:
        facts.update(gpu="none (CPU smoke run)", cpu_threads=torch.get_num_threads())
    return facts


# ---- checkpoints ----------------------------------------------------------------------------------
def llama_checkpoint(run: Run) -> str:
    """The Llama checkpoint, written once per run (drawn on the GPU there)."""
    if run.llama_dir is None:
        from random_checkpoint import SHAPES, write_random_checkpoint

        d = SHAPES[run.plan.llama_shape]
        h, inter, layers, v = d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"], d["vocab_size"]
        kv = h // d["num_attention_heads"] * d["num_key_value_heads"]
        params = 2 * v * h + layers * (2 * h * h + 2 * h * kv + 3 * h * inter)
        folder = run.scratch_dir(2 * params)
        t0 = time.perf_counter()
        write_random_checkpoint(folder, run.plan.llama_shape, device=run.plan.device)
        run.llama_dir = folder
        run.report["llama_checkpoint"] = {"dir": folder, "gib": round(2 * params / GIB, 2),
                                          "write_s": round(time.perf_counter() - t0, 1)}
        run.save()
    return run.llama_dir


def write_moe_checkpoint(folder: str, shape: dict, layers: int, device: str, seed: int = 0) -> dict:
    """A Qwen3-MoE checkpoint of random bf16 weights (std 0.02, norms at 1) as the published ones
    lay it out (one tensor per expert and projection), drawn on `device`, a shard per layer;
    the tests' small tokenizer. Returns its layers and size."""
    from safetensors.torch import save_file

    from baton.testing.checkpoints import train_tokenizer

    s = shape
    h, hd, inter, experts = s["hidden_size"], s["head_dim"], s["moe_intermediate_size"], s["num_experts"]
    q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    gen = torch.Generator(device).manual_seed(seed)

    def normal(*dims):
        return (torch.randn(*dims, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    num_shards, weight_map = layers + 1, {}

    def save(n: int, tensors: dict) -> None:
        name = f"model-{n + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    save(0, {"model.embed_tokens.weight": normal(s["vocab_size"], h), "lm_head.weight": normal(s["vocab_size"], h),
             "model.norm.weight": ones(h)})
    for i in range(layers):
        p = f"model.layers.{i}."
        shard = {p + "self_attn.q_proj.weight": normal(q, h), p + "self_attn.k_proj.weight": normal(kv, h),
                 p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, q),
                 p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd),
                 p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
                 p + "mlp.gate.weight": normal(experts, h)}
        for j in range(experts):
            e = f"{p}mlp.experts.{j}."
            shard.update({e + "gate_proj.weight": normal(inter, h), e + "up_proj.weight": normal(inter, h),
                          e + "down_proj.weight": normal(h, inter)})
        save(i + 1, shard)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    tokenizer = train_tokenizer()
    tokenizer.save_pretrained(folder)
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **s, "num_hidden_layers": layers,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu", "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
              "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
              "torch_dtype": "bfloat16", "bos_token_id": tokenizer.bos_token_id,
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    with open(os.path.join(folder, "config.json"), "w") as f:  # last: a folder with config.json is complete
        json.dump(config, f, indent=1)
    written = sum(os.path.getsize(os.path.join(folder, n)) for n in set(weight_map.values()))
    return {"layers": layers, "gib": round(written / GIB, 2)}


def moe_bytes(shape: dict, layers: int) -> int:
    s = shape
    h, hd = s["hidden_size"], s["head_dim"]
    attn = 2 * h * s["num_attention_heads"] * hd + 2 * h * s["num_key_value_heads"] * hd
    experts = s["num_experts"] * (3 * h * s["moe_intermediate_size"] + h)
    return 2 * (2 * s["vocab_size"] * h + layers * (attn + experts))


# ---- engines and synthetic steps ------------------------------------------------------------------
def engine_args(plan: Plan, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                capture: tuple[int, ...]) -> dict:
    """LLM's keyword arguments: the plan's device and dtype, no prefix caching, the pool from
    gpu_memory_utilization (0.9) on a GPU; graphs captured at `capture` only (where this tree's
    EngineConfig has cudagraph_capture_sizes): the batches measured, not 35 sizes."""
    from baton.engine.common.config import EngineConfig

    kw = dict(device=plan.device, dtype=plan.dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False)
    if plan.device == "cuda":
        kw["gpu_memory_utilization"] = 0.9
    else:
        kw["num_kv_blocks"] = plan.cpu_kv_blocks
    if "cudagraph_capture_sizes" in {f.name for f in dataclasses.fields(EngineConfig)}:
        kw["cudagraph_capture_sizes"] = sorted(set(capture))
    return kw


def llama_engine_args(plan: Plan) -> dict:
    return engine_args(plan, max(plan.contexts) + 256, max(plan.batches), max(plan.prefill), plan.batches)


def start_engine(path: str, kwargs: dict, row: dict):
    from baton import LLM

    t0 = time.perf_counter()
    llm = LLM(path, **kwargs)
    runner = llm.engine.runner
    graphs = getattr(runner, "graphs", None)
    off = getattr(runner, "graphs_off", "this tree has no ModelRunner.graphs")
    row["engine"] = {"start_s": round(time.perf_counter() - t0, 1), "args": kwargs,
                     "num_kv_blocks": llm.engine.num_kv_blocks, "block_size": runner.block_size,
                     "attention_backend": runner.attention_backend,
                     "graphs": (f"captured for {list(graphs.sizes)}" if graphs is not None else
                                f"not available ({off})")}
    return llm


def fill_kv_random(runner) -> None:
    """Random values in every block (not zeros: what a decode reads should be what it would)."""
    cache = runner.kv_cache
    per_block = cache[0].numel() * cache.element_size()
    chunk = max(1, GIB // per_block)
    with torch.inference_mode():  # (the cache may be an inference tensor)
        for start in range(0, cache.shape[0], chunk):
            cache[start:start + chunk].normal_()
    sync(runner.device.type)


@contextlib.contextmanager
def graphs_enabled(runner, on: bool):
    graphs = getattr(runner, "graphs", None)
    if graphs is None:
        yield
        return
    before, graphs.enabled = graphs.enabled, on
    try:
        yield
    finally:
        graphs.enabled = before


def modes(runner) -> tuple[str, ...]:
    return ("graphs", "eager") if getattr(runner, "graphs", None) is not None else ("eager",)


def blocks_needed(runner, batch: int, context: int, max_steps: int) -> tuple[int, int]:
    """(blocks B requests of context C need for max_steps more tokens, blocks in the pool)."""
    return batch * -(-(context + max_steps + 1) // runner.block_size), runner.kv_cache.shape[0]


class DecodeBatch:
    """B requests of context C decoding one token a step, straight through the runner: the
    first step adds them with C random tokens, C - 1 computed (so its one token is a decode that
    samples), the rest follow as cached requests (the runner appends what it sampled); closing
    drops them. Each request's blocks: distinct, drawn from the whole pool."""

    def __init__(self, runner, batch: int, context: int, max_steps: int, rng: np.random.Generator, tag: str):
        from baton.engine.common.sampling_params import SamplingParams
        from baton.engine.common.scheduler_output import NewRequestData

        self.runner, self.batch, self.context = runner, batch, context
        self.per_request = -(-(context + max_steps + 1) // runner.block_size)
        self.need, self.pool = blocks_needed(runner, batch, context, max_steps)
        self.ids = [f"{tag}-{i}" for i in range(batch)]
        self.step_no = 0
        self.sampled = 0
        if not self.fits:
            return
        blocks = rng.permutation(self.pool)[:self.need]
        groups = len(runner.kv_groups.layers)
        vocab = runner.model.args.vocab_size
        params = SamplingParams(max_tokens=max_steps + 8, temperature=0.0, ignore_eos=True)
        self.new = [NewRequestData(r, rng.integers(FIRST_ID, vocab, context).tolist(),
                                   [blocks[i * self.per_request:(i + 1) * self.per_request].tolist()] * groups,
                                   context - 1, params, context - 1) for i, r in enumerate(self.ids)]

    @property
    def fits(self) -> bool:
        return self.need <= self.pool

    def step(self) -> float:
        """One step; its wall time (execute_model ends in a device sync: the sampled tokens
        come to the host)."""
        from baton.engine.common.scheduler_output import CachedRequestData, SchedulerOutput

        if self.step_no == 0:
            sched = SchedulerOutput(scheduled_new_reqs=self.new)
        else:
            sched = SchedulerOutput(scheduled_cached_reqs=[
                CachedRequestData(r, [[]], self.context - 1 + self.step_no) for r in self.ids])
        sched.num_scheduled_tokens = dict.fromkeys(self.ids, 1)
        sched.total_num_scheduled_tokens = self.batch
        t0 = time.perf_counter()
        out = self.runner.execute_model(sched)
        elapsed = time.perf_counter() - t0
        self.step_no += 1
        self.sampled = len(out.sampled_token_ids)
        return elapsed

    def close(self) -> None:
        from baton.engine.common.scheduler_output import SchedulerOutput

        if self.fits and self.step_no:
            self.runner.execute_model(SchedulerOutput(finished_req_ids=set(self.ids)))


def decode_run(runner, batch: int, context: int, plan: Plan, rng, tag: str) -> dict:
    d = DecodeBatch(runner, batch, context, plan.warmup + plan.steps, rng, tag)
    try:
        times = [d.step() for _ in range(plan.warmup + plan.steps)][plan.warmup:]
    finally:
        d.close()
    s = stats_ms(times)
    return {**s, "tok_s": round(batch / (s["median_ms"] / 1e3), 1), "sampled_per_step": d.sampled}


def weight_figures(model) -> dict:
    """Bytes and parameters the model's steps read: every parameter once (a tied head's shared),
    the input embedding table aside (a step gathers rows of it, unless it is the tied head)."""
    params = list(model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    embed, head = model.embed_tokens.weight, model.lm_head.weight
    tied = head is embed  # (the loader ties them so)
    embed_bytes = 0 if tied else embed.numel() * embed.element_size()
    args, size = model.args, embed.element_size()
    experts = [(p.shape[0], p.numel() * p.element_size()) for n, p in model.named_parameters() if ".experts." in n]
    return {"read_bytes": total - embed_bytes, "row_bytes": embed.shape[1] * embed.element_size(),
            # prefill's matmuls: every parameter but the embedding and the head (one row a request)
            "matmul_params": sum(p.numel() for p in params) - embed.numel() - (0 if tied else head.numel()),
            "kv_token_bytes": args.num_layers * args.kv_parts * args.num_kv_heads * args.head_dim * size,
            "expert_bytes": sum(b for _, b in experts), "num_experts": experts[0][0] if experts else 0,
            "top_k": getattr(args, "num_experts_per_tok", 0) or 0}


def decode_floor_s(w: dict, batch: int, context: int, bandwidth: float, moe: bool = False) -> tuple[float, float]:
    """(floor seconds, bytes) of a decode step: its weights (for a MoE, less the experts the
    batch is not expected to hit) and the KV it attends over, over the copy bandwidth."""
    weights = w["read_bytes"] + batch * w["row_bytes"]
    if moe and w["num_experts"]:
        e, k = w["num_experts"], w["top_k"]
        hit = e * (1 - (1 - k / e) ** batch)
        weights -= w["expert_bytes"] * (1 - hit / e)
    total = weights + batch * context * w["kv_token_bytes"]
    return total / bandwidth, total


def with_floor(entry: dict, floor_s: float) -> None:
    entry["itl_over_floor"] = round(entry["median_ms"] / (floor_s * 1e3), 3)
    entry["tput_share_of_floor"] = round(floor_s * 1e3 / entry["median_ms"], 3)


def decode_grid(run: Run, runner, w: dict, grid: list[tuple[int, int]], table: dict, tag: str, moe: bool = False):
    """Each (batch, context) of grid, in each mode, into table["B{b} C{c}"]; saved as it goes."""
    rng = np.random.default_rng(1)
    bw = run.ceilings.get("copy_bytes_per_s")
    for batch, context in grid:
        entry = table[f"B{batch} C{context}"] = {}
        need, pool = blocks_needed(runner, batch, context, run.plan.warmup + run.plan.steps)
        if need > pool:
            entry["skipped"] = f"does not fit: needs {need} blocks, the pool has {pool}"
            continue
        if run.left() < 5:
            entry["skipped"] = "out of time"
            continue
        if bw:
            floor, nbytes = decode_floor_s(w, batch, context, bw, moe)
            entry["floor_ms"], entry["floor_gb_per_step"] = round(floor * 1e3, 3), round(nbytes / 1e9, 2)
        for mode in modes(runner):
            with graphs_enabled(runner, mode == "graphs"):
                entry[mode] = decode_run(runner, batch, context, run.plan, rng, f"{tag}-{mode}-b{batch}c{context}")
            if bw:
                with_floor(entry[mode], floor)
        run.save()


def busy_share(runner, batch: int, context: int, plan: Plan, tag: str) -> dict:
    """The device's busy share of `busy_steps` decode steps: the union of its kernels' (and
    copies') intervals over the steps' wall time, by torch.profiler (CUDA activity only, so the
    host side is not slowed by recording ops). On a CPU: the union of the ATen ops'."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = runner.device.type == "cuda"
    d = DecodeBatch(runner, batch, context, plan.warmup + plan.busy_steps, np.random.default_rng(2), tag)
    if not d.fits:
        return {"skipped": f"does not fit: needs {d.need} blocks, the pool has {d.pool}"}
    try:
        for _ in range(plan.warmup):
            d.step()
        with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
            wall = sum(d.step() for _ in range(plan.busy_steps))
    finally:
        d.close()
    kind = DeviceType.CUDA if on_gpu else DeviceType.CPU
    work = {"kernel", "gpu_memcpy", "gpu_memset"} if on_gpu else {"cpu_op"}
    spans = sorted(_span_ns(e) for e in prof.profiler.kineto_results.events()
                   if e.device_type() == kind and _is_work(e, work))
    spans = [(a, b) for a, b in spans if b > a]
    busy, end = 0, -1
    for a, b in spans:  # the union of the intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    busy_s = busy / 1e9
    return {"busy_share": round(busy_s / wall, 3), "step_ms": round(wall / plan.busy_steps * 1e3, 3),
            "device_busy_ms": round(busy_s / plan.busy_steps * 1e3, 3),
            "host_overhead_ms": round((wall - busy_s) / plan.busy_steps * 1e3, 3), "device_events": len(spans)}


def _is_work(event, kinds: set[str]) -> bool:
    """A kernel, copy or fill (an op on a CPU), not an annotation spanning idle time."""
    if hasattr(event, "activity_type"):
        return str(event.activity_type()) in kinds
    return not (hasattr(event, "is_user_annotation") and event.is_user_annotation())


def _span_ns(event) -> tuple[int, int]:
    """A kineto event's (start, end) in ns (torch before 2.1 gives microseconds only)."""
    if hasattr(event, "start_ns"):
        return event.start_ns(), event.start_ns() + event.duration_ns()
    return event.start_us() * 1000, (event.start_us() + event.duration_us()) * 1000


def prefill_run(runner, tokens: int, reps: int, rng, tag: str) -> list[float]:
    """One request of `tokens` computed in one step, reps + 1 times (the first a warm-up)."""
    from baton.engine.common.sampling_params import SamplingParams
    from baton.engine.common.scheduler_output import NewRequestData, SchedulerOutput

    blocks = rng.permutation(runner.kv_cache.shape[0])[:-(-(tokens + 1) // runner.block_size)].tolist()
    groups = len(runner.kv_groups.layers)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = rng.integers(FIRST_ID, runner.model.args.vocab_size, tokens).tolist()
    times = []
    for rep in range(reps + 1):
        rid = f"{tag}-{rep}"
        sched = SchedulerOutput(scheduled_new_reqs=[NewRequestData(rid, prompt, [blocks] * groups, 0, params, tokens)],
                                num_scheduled_tokens={rid: tokens}, total_num_scheduled_tokens=tokens)
        t0 = time.perf_counter()
        runner.execute_model(sched)
        times.append(time.perf_counter() - t0)
        runner.execute_model(SchedulerOutput(finished_req_ids={rid}))
    return times[1:]


def prefill_flops(w: dict, args, tokens: int) -> float:
    """2 x the matmul parameters per token, and causal attention's QK^T and PV (T^2 / 2 pairs)."""
    return 2 * w["matmul_params"] * tokens + 2 * 2 * tokens ** 2 / 2 * args.num_heads * args.head_dim * args.num_layers


def workload(plan: Plan, vocab: int) -> list[list[int]]:
    """The offline and served runs' prompts: the same random token ids for both."""
    rng = np.random.default_rng(7)
    return [rng.integers(FIRST_ID, vocab, plan.serve_input).tolist() for _ in range(plan.serve_requests)]


def offline_run(llm, plan: Plan) -> dict:
    from baton import SamplingParams

    prompts = workload(plan, llm.engine.vocab_size)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    times = llm.engine.times
    steps0, step_s0, sched_s0 = times.steps, times.step_s, times.scheduler_s
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=plan.serve_output, temperature=0.0, ignore_eos=True))
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"requests": len(prompts), "input_len": plan.serve_input, "output_len": plan.serve_output,
            "seconds": round(wall, 3), "output_tokens": tokens, "output_tok_s": round(tokens / wall, 1),
            "steps": times.steps - steps0, "step_s": round(times.step_s - step_s0, 3),
            "scheduler_share": round((times.scheduler_s - sched_s0) / wall, 4)}


# ---- 2. llama8b -----------------------------------------------------------------------------------
def section_llama(run: Run, row: dict) -> None:
    plan = run.plan
    path = llama_checkpoint(run)
    row["checkpoint"] = run.report["llama_checkpoint"]
    llm = start_engine(path, llama_engine_args(plan), row)
    try:
        runner = llm.engine.runner
        fill_kv_random(runner)
        w = weight_figures(runner.model)
        row["weights_gb"] = round(w["read_bytes"] / 1e9, 3)
        row["kv_kib_per_token"] = round(w["kv_token_bytes"] / 1024, 1)
        row["floor"] = ("(weights read per step, the input embedding's B rows only, + B x C x KV bytes per token) "
                        "/ the measured copy bandwidth" if run.ceilings else "no ceilings: no floor")
        row["decode"] = {}
        decode_grid(run, runner, w, [(b, c) for c in plan.contexts for b in plan.batches], row["decode"], "llama")
        row["prefill"] = {}
        peak = run.ceilings.get("flop_per_s")
        for tokens in plan.prefill:
            if run.left() < 5:
                row["prefill"][f"T{tokens}"] = {"skipped": "out of time"}
                continue
            times = prefill_run(runner, tokens, plan.prefill_reps, np.random.default_rng(3), f"prefill{tokens}")
            s = stats_ms(times)
            flops = prefill_flops(w, runner.model.args, tokens)
            entry = row["prefill"][f"T{tokens}"] = {**s, "tok_s": round(tokens / (s["median_ms"] / 1e3), 1),
                                                    "tflop_per_s": round(flops / (s["median_ms"] / 1e3) / 1e12, 1)}
            if peak:
                entry["share_of_peak"] = round(flops / (s["median_ms"] / 1e3) / peak, 3)
            run.save()
        row["busy"] = {}
        for batch, context in plan.busy:
            for mode in modes(runner):
                if run.left() < 5:
                    row["busy"][f"B{batch} C{context} {mode}"] = {"skipped": "out of time"}
                    continue
                with graphs_enabled(runner, mode == "graphs"):
                    row["busy"][f"B{batch} C{context} {mode}"] = busy_share(runner, batch, context, plan,
                                                                            f"busy-{mode}-{batch}")
                run.save()
        if run.left() < 10:
            row["offline_generate"] = {"skipped": "out of time"}
        else:
            run.offline = row["offline_generate"] = offline_run(llm, plan)
            loop = getattr(llm.engine.core, "loop", None)
            if loop is not None and run.left() > 10:  # the same, each step queued behind the one before
                loop.ahead = True
                row["offline_generate_async"] = offline_run(llm, plan)
                loop.ahead = False
        row["targets"] = llama_targets(row, plan)
    finally:
        llm.close()
        del llm


def llama_targets(row: dict, plan: Plan) -> dict:
    """The issue's targets, at context 1k (graphs where there are)."""
    c = min(plan.contexts)
    out = {}

    def best(key):
        e = row["decode"].get(key, {})
        return e.get("graphs") or e.get("eager") or {}

    b1 = best(f"B1 C{c}").get("itl_over_floor")
    out[f"B1 C{c} ITL <= 1.3x floor"] = None if b1 is None else {"value": b1, "met": b1 <= 1.3}
    for b in (64, 256):
        share = best(f"B{b} C{c}").get("tput_share_of_floor")
        out[f"B{b} C{c} throughput >= 0.7x floor"] = None if share is None else {"value": share, "met": share >= 0.7}
    pre = row["prefill"].get(f"T{max(plan.prefill)}", {}).get("share_of_peak")
    out[f"prefill {max(plan.prefill)} >= 50% of peak"] = None if pre is None else {"value": pre, "met": pre >= 0.5}
    return out


# ---- 3. transformers ------------------------------------------------------------------------------
def section_transformers(run: Run, row: dict) -> None:
    import transformers

    plan, dev = run.plan, run.plan.device
    path = llama_checkpoint(run)
    dtype = getattr(torch, plan.dtype)
    t0 = time.perf_counter()
    place = {"device_map": "cuda"} if dev == "cuda" else {}
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **place)
    except TypeError:  # transformers before 4.56 names it torch_dtype
        model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, **place)
    model.eval()
    row["load_s"] = round(time.perf_counter() - t0, 1)
    row["transformers"] = transformers.__version__
    row["attention"] = getattr(model.config, "_attn_implementation", "?")
    row["itl"] = f"(time for N + 1 new tokens - time for 1) / N, N = {plan.hf_new}, greedy, static cache"
    try:
        hf_decode(run, row, model)
        hf_prefill(run, row, model)
    finally:
        del model
        free_memory()


def hf_generate(model, ids: torch.Tensor, n: int, switch: dict) -> float:
    """Seconds for transformers to make n new tokens after ids (greedy, static cache)."""
    dev = ids.device.type
    sync(dev)
    t = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         cache_implementation="static", max_new_tokens=n, min_new_tokens=n,
                         pad_token_id=model.config.pad_token_id, **switch)
    sync(dev)
    if out.shape[1] - ids.shape[1] != n:
        raise RuntimeError(f"transformers made {out.shape[1] - ids.shape[1]} tokens, not {n}")
    return time.perf_counter() - t


def hf_decode(run: Run, row: dict, model) -> None:
    """ITL at each batch of hf_batches, beside Baton's at the same batch and context."""
    plan, dev = run.plan, run.plan.device
    gen = torch.Generator(dev).manual_seed(4)
    switch = {"disable_compile": True}  # generate's compile switch (on a GPU it compiles a static cache's step)
    row["compiled"] = "not compiled (--hf-compile off)"
    for batch in plan.hf_batches:
        ids = torch.randint(FIRST_ID, model.config.vocab_size, (batch, plan.hf_prompt), device=dev, generator=gen)
        if run.args.hf_compile and batch == plan.hf_batches[0]:
            switch = try_compile(run, row, model, ids, plan.hf_new)
        else:  # warm-up, at both cache lengths
            hf_generate(model, ids, 1, switch)
            hf_generate(model, ids, plan.hf_new + 1, switch)
        one, many = hf_generate(model, ids, 1, switch), hf_generate(model, ids, plan.hf_new + 1, switch)
        itl = (many - one) / plan.hf_new
        entry = row[f"B{batch} C{plan.hf_prompt}"] = {"itl_ms": round(itl * 1e3, 3), "tok_s": round(batch / itl, 1)}
        baton = run.report["sections"].get("llama8b", {}).get("decode", {}).get(f"B{batch} C{plan.hf_prompt}", {})
        for mode in ("graphs", "eager"):
            if "median_ms" in baton.get(mode, {}):
                entry[f"baton_{mode}_itl_ms"] = baton[mode]["median_ms"]
                entry[f"baton_{mode}_speedup"] = round(itl * 1e3 / baton[mode]["median_ms"], 2)
        run.save()


def hf_prefill(run: Run, row: dict, model) -> None:
    """One prompt of each prefill length through generate(max_new_tokens=1): the prompt's
    forward and one token, beside Baton's one-step prefill of the same length."""
    plan, dev = run.plan, run.plan.device
    gen = torch.Generator(dev).manual_seed(5)
    row["prefill"] = {}
    for tokens in plan.prefill:
        if run.left() < 10:
            row["prefill"][f"T{tokens}"] = {"skipped": "out of time"}
            continue
        ids = torch.randint(FIRST_ID, model.config.vocab_size, (1, tokens), device=dev, generator=gen)
        switch = {"disable_compile": True}
        hf_generate(model, ids, 1, switch)  # warm-up
        took = min(hf_generate(model, ids, 1, switch) for _ in range(2))
        entry = row["prefill"][f"T{tokens}"] = {"ms": round(took * 1e3, 3), "tok_s": round(tokens / took, 1)}
        baton = run.report["sections"].get("llama8b", {}).get("prefill", {}).get(f"T{tokens}", {})
        if "median_ms" in baton:
            entry["baton_ms"] = baton["median_ms"]
            entry["baton_speedup"] = round(took * 1e3 / baton["median_ms"], 2)
        run.save()


def try_compile(run: Run, row: dict, model, ids: torch.Tensor, n: int) -> dict:
    """transformers' own compile of the decode step (generate compiles it with a static cache on
    a GPU), within --hf-compile-cap seconds; eager past that. Returns generate's compile switch."""
    t0 = time.perf_counter()
    try:
        with run.time_cap(run.args.hf_compile_cap):
            hf_generate(model, ids, 1, {})
            hf_generate(model, ids, n + 1, {})
        row["compiled"] = f"compiled by generate in {time.perf_counter() - t0:.0f} s"
        return {}
    except OutOfTime:
        if time.monotonic() >= run.alarm_at - 1:  # the section's own alarm, not the cap's
            raise
        row["compiled"] = f"not compiled: past the {run.args.hf_compile_cap:g} s cap, eager instead"
        return {"disable_compile": True}


# ---- 4. moe ---------------------------------------------------------------------------------------
def section_moe(run: Run, row: dict) -> None:
    plan, layers = run.plan, run.args.moe_layers
    row["layers"] = (f"{layers} of Qwen3-30B-A3B's {QWEN3_30B_A3B_LAYERS}" if plan.moe_shape is QWEN3_30B_A3B
                     else f"{layers} (tiny shape)")
    folder = run.scratch_dir(moe_bytes(plan.moe_shape, layers))
    t0 = time.perf_counter()
    row["checkpoint"] = write_moe_checkpoint(folder, plan.moe_shape, layers, plan.device)
    row["checkpoint"]["write_s"] = round(time.perf_counter() - t0, 1)
    run.save()
    llm = None
    try:
        llm = start_engine(folder, engine_args(plan, plan.moe_context + 256, max(plan.moe_batches), 2048,
                                               plan.moe_batches), row)
        runner = llm.engine.runner
        fill_kv_random(runner)
        w = weight_figures(runner.model)
        row["weights_gb"] = round(w["read_bytes"] / 1e9, 3)
        row["floor"] = ("active bytes per step over the measured copy bandwidth: every weight but the input "
                        "embedding (attention, routers, norms, lm_head) and, per layer, E (1 - (1 - k/E)^B) of its "
                        "E experts (the distinct experts B tokens of top-k routing hit if routing were uniform), "
                        "+ B x C x KV bytes per token")
        row["decode"] = {}
        decode_grid(run, runner, w, [(b, plan.moe_context) for b in plan.moe_batches], row["decode"], "moe", moe=True)
        e, k = w["num_experts"], w["top_k"]
        for b in plan.moe_batches:
            if e and f"B{b} C{plan.moe_context}" in row["decode"]:
                row["decode"][f"B{b} C{plan.moe_context}"]["experts_hit_per_layer"] = round(e * (1 - (1 - k / e) ** b),
                                                                                            1)
    finally:
        if llm is not None:
            llm.close()
        del llm
        free_memory()
        shutil.rmtree(folder, ignore_errors=True)


# ---- 5. serve -------------------------------------------------------------------------------------
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
        client = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--serve-client", json.dumps(spec),
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


# ---- the table ------------------------------------------------------------------------------------
def summary_lines(report: dict) -> list[str]:
    """The compact table: per section its key figures and ratios (report.json has the rest)."""
    lines = []
    w = report.get("wheels") or {}
    if w.get("unpacked") or w.get("lacking_after"):
        lines.append(f"wheels unpacked from .whl: {len(w.get('unpacked', []))}; still lacking: "
                     f"{', '.join(w.get('lacking_after', [])) or 'nothing'}")
    s = report.get("sections", {})
    for name, fmt in (("ceilings", _fmt_ceilings), ("llama8b", _fmt_llama), ("transformers", _fmt_hf),
                      ("moe", _fmt_moe), ("serve", _fmt_serve)):
        row = s.get(name)
        if row is None:
            continue
        head = f"== {name}: " + ("skipped: " + row["skipped"] if "skipped" in row else
                                 f"{'ok' if row.get('ok') else 'FAILED' if 'ok' in row else 'running'}"
                                 f" ({row.get('seconds', '?')} s)")
        lines.append(head)
        if "skipped" in row:
            continue
        try:
            lines += fmt(row)
        except Exception as e:  # noqa: BLE001 - a table that cannot be formatted still leaves report.json
            lines.append(f"   (not formatted: {type(e).__name__}: {e})")
        if "cut" in row:
            lines.append("   " + row["cut"])
        if "error" in row:
            lines += ["   " + x for x in row["error"].strip().splitlines()[-6:]]
    lines.append(f"elapsed {report.get('elapsed_s', '?')} s of a {report.get('budget_s')} s budget; "
                 "every figure in report.json")
    return lines


def _fmt_ceilings(r: dict) -> list[str]:
    out = [f"   {r.get('gpu')} | torch {r.get('torch')} | triton {r.get('triton')} | "
           f"transformers {r.get('transformers')}"]
    if "copy" in r:
        out.append(f"   copy {r['copy']['tb_per_s']} TB/s (read + written) | "
                   f"{r.get('matmul', {}).get('dtype')} matmul {r.get('matmul', {}).get('tflop_per_s')} TFLOP/s")
    return out


def _decode_table(decode: dict) -> list[str]:
    out = [f"   {'decode':<12}{'graphs ITL ms':>14}{'p90':>8}{'tok/s':>9}{'xfloor':>8}"
           f"{'eager ITL ms':>14}{'tok/s':>9}{'xfloor':>8}{'floor ms':>10}"]
    for key, e in decode.items():
        if "skipped" in e:
            out.append(f"   {key:<12}{e['skipped']}")
            continue
        g, x = e.get("graphs", {}), e.get("eager", {})
        out.append(f"   {key:<12}{g.get('median_ms', '-'):>14}{g.get('p90_ms', '-'):>8}{g.get('tok_s', '-'):>9}"
                   f"{g.get('itl_over_floor', '-'):>8}{x.get('median_ms', '-'):>14}{x.get('tok_s', '-'):>9}"
                   f"{x.get('itl_over_floor', '-'):>8}{e.get('floor_ms', '-'):>10}")
    return out


def _fmt_llama(r: dict) -> list[str]:
    out = []
    ck, en = r.get("checkpoint", {}), r.get("engine")
    if ck:
        out.append(f"   checkpoint {ck.get('gib')} GiB written in {ck.get('write_s')} s" + (
            f" | engine start {en['start_s']} s, {en['num_kv_blocks']} KV blocks, graphs {en['graphs']}" if en else ""))
    out += _decode_table(r.get("decode", {}))
    for key, e in r.get("prefill", {}).items():
        if "skipped" in e:
            out.append(f"   prefill {key}: {e['skipped']}")
            continue
        out.append(f"   prefill {key}: {e['median_ms']} ms, {e['tok_s']:.0f} tok/s, {e['tflop_per_s']} TFLOP/s"
                   + (f" = {e['share_of_peak']:.0%} of peak" if "share_of_peak" in e else ""))
    for key, e in r.get("busy", {}).items():
        out.append(f"   busy {key}: " + (e["skipped"] if "skipped" in e else
                                         f"{e['busy_share']:.0%} of {e['step_ms']} ms/step, host overhead "
                                         f"{e['host_overhead_ms']} ms ({e['device_events']} device events)"))
    for key, label in (("offline_generate", "offline generate"), ("offline_generate_async", "  async scheduling")):
        o = r.get(key)
        if o and "skipped" in o:
            out.append(f"   {label}: {o['skipped']}")
        elif o:
            out.append(f"   {label} {o['requests']} x ({o['input_len']} in, {o['output_len']} out): "
                       f"{o['output_tok_s']} output tok/s in {o['seconds']} s, scheduler {o['scheduler_share']:.1%}")
    for key, t in (r.get("targets") or {}).items():
        out.append(f"   target {key}: " + ("no figure" if t is None else
                                           f"{t['value']} -> {'MET' if t['met'] else 'NOT MET'}"))
    return out


def _fmt_hf(r: dict) -> list[str]:
    out = [f"   transformers {r.get('transformers')}, {r.get('attention')} attention, {r.get('compiled')}, "
           f"load {r.get('load_s')} s"]
    for key, e in r.items():
        if key.startswith("B") and isinstance(e, dict):
            out.append(f"   {key}: ITL {e['itl_ms']} ms ({e['tok_s']} tok/s); Baton graphs "
                       f"{e.get('baton_graphs_itl_ms', '-')} ms = {e.get('baton_graphs_speedup', '-')}x faster, "
                       f"eager {e.get('baton_eager_itl_ms', '-')} ms = {e.get('baton_eager_speedup', '-')}x")
    for key, e in r.get("prefill", {}).items():
        out.append(f"   prefill {key}: " + (e["skipped"] if "skipped" in e else
                                            f"{e['ms']} ms ({e['tok_s']:.0f} tok/s); Baton {e.get('baton_ms', '-')} ms "
                                            f"= {e.get('baton_speedup', '-')}x faster"))
    return out


def _fmt_moe(r: dict) -> list[str]:
    ck, en = r.get("checkpoint", {}), r.get("engine", {})
    out = [f"   {r.get('layers')} layers | checkpoint {ck.get('gib')} GiB in {ck.get('write_s')} s | "
           f"engine start {en.get('start_s')} s, graphs {en.get('graphs')}"]
    return out + _decode_table(r.get("decode", {}))


def _fmt_serve(r: dict) -> list[str]:
    c = r.get("client")
    if not c:
        return [f"   server start {r.get('start_s', '-')} s"]
    ratio = r.get("server_over_offline")
    ratio = f"= {ratio} x offline" if isinstance(ratio, float) else f"({ratio})"
    return [f"   {c['requests']} x ({c['input_len']} in, {c['output_len']} out) over gRPC: {c['output_tok_s']} "
            f"output tok/s {ratio} | TTFT p50 {c['ttft'].get('median_ms')} ms "
            f"p90 {c['ttft'].get('p90_ms')} | ITL p50 {c['itl'].get('median_ms')} ms p90 {c['itl'].get('p90_ms')} | "
            f"TPOT p50 {c['tpot'].get('median_ms')} ms | server start {r.get('start_s')} s"]


# ---- main -----------------------------------------------------------------------------------------
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
    signal.signal(signal.SIGALRM, _alarm)
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
