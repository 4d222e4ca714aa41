"""CPU kernels in C++, compiled on first use with the system compiler and loaded with ctypes:
paged attention (cpu/paged_attention.cpp) and quantized weights' rows to float32
(cpu/dequant.cpp, wrapped by cpu_dequant.py), one library.

The source has no torch headers; a build takes about 25 s on 2 cores (attention's instances for
each pair of query and cache dtypes, FP8 included, are most of it), once: the library is cached
under ~/.cache/baton/kernels, keyed by the source, the flags, the compiler and the CPU (it is
built with -march=native). Without a
compiler, or with BATON_CPU_KERNELS=0, `load()` returns None and callers use the PyTorch
reference in kernels/attention.py.

A container image builds the library once, for a portable target (BATON_KERNEL_MARCH, e.g.
x86-64-v3, instead of the build machine's CPU), with `python -m baton.kernels.cpu_kernels
OUT.so`, and points BATON_KERNEL_LIB at it: the runtime image needs no compiler.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("cpu") / name for name in ("paged_attention.cpp", "dequant.cpp")]
# No -ffast-math: its start-up code would set flush-to-zero for the whole process.
# -fno-math-errno lets floor and the softmax loop vectorize.
MARCH = os.environ.get("BATON_KERNEL_MARCH", "native")
FLAGS = ["-O3", f"-march={MARCH}", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-std=c++17", "-shared",
         "-fPIC"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the queries'
CACHE_DTYPES = {**DTYPES, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}  # the cache's, whatever the queries'
MAX_GROUP, MAX_HEAD_DIM = 16, 256  # the kernel's stack buffers
# What the CPU must have for a library built for a portable -march (from /proc/cpuinfo's flags).
MARCH_NEEDS = {"x86-64-v2": {"sse4_2", "popcnt", "ssse3"}, "x86-64-v3": {"avx2", "fma", "bmi2", "f16c", "movbe"},
               "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}}


def _cache_dir() -> Path:
    if "BATON_KERNEL_CACHE" in os.environ:
        return Path(os.environ["BATON_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "baton" / "kernels"


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _cpu_signature() -> str:
    """The CPU model and flags, since -march=native code may not run on another CPU."""
    lines = _cpuinfo()
    if not lines:
        return platform.processor() or platform.machine()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def _cpu_flags() -> set[str]:
    return {f for ln in _cpuinfo() if ln.startswith("flags") for f in ln.partition(":")[2].split()}


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _build(compiler: str, target: Path | None = None) -> Path:
    if target is None:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
        cpu = _cpu_signature() if MARCH == "native" else MARCH
        key = hashlib.sha256("\0".join([*(s.read_text() for s in SOURCES), " ".join(FLAGS), version, cpu]).encode())
        target = _cache_dir() / f"baton_kernels-{key.hexdigest()[:16]}.so"
        if target.exists():
            return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True, check=True,
                       timeout=300)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o755 & ~umask)  # mkstemp's 0600 would keep other users (an image's) from loading it
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class Batch(ctypes.Structure):
    """The kernel's arguments (struct Batch in the source): pointers, and strides in elements."""
    _fields_ = [("q", ctypes.c_void_p), ("q_row_stride", ctypes.c_int64),
                ("k", ctypes.c_void_p), ("k_row_stride", ctypes.c_int64),
                ("v", ctypes.c_void_p), ("v_row_stride", ctypes.c_int64),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("block_stride", ctypes.c_int64), ("token_stride", ctypes.c_int64),
                ("block_ids", ctypes.c_void_p), ("row_block_start", ctypes.c_void_p), ("positions", ctypes.c_void_p),
                ("num_rows", ctypes.c_int64), ("num_block_ids", ctypes.c_int64), ("num_blocks", ctypes.c_int64),
                ("num_kv_heads", ctypes.c_int32), ("group", ctypes.c_int32),
                ("head_dim", ctypes.c_int32), ("block_size", ctypes.c_int32), ("scale", ctypes.c_float),
                ("out", ctypes.c_void_p), ("window", ctypes.c_int32), ("softcap", ctypes.c_float),
                ("sinks", ctypes.c_void_p), ("cache_dtype", ctypes.c_int32), ("k_scales", ctypes.c_void_p),
                ("v_scales", ctypes.c_void_p)]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, or None when it cannot be built here (the reason is logged once)."""
    if os.environ.get("BATON_CPU_KERNELS", "1") == "0":
        return None
    prebuilt = os.environ.get("BATON_KERNEL_LIB")
    if prebuilt:
        return _load_prebuilt(prebuilt)
    compiler = _compiler()
    if compiler is None:
        log.warning("no C++ compiler found: CPU attention uses the PyTorch reference")
        return None
    try:
        # torch is imported, so the library's libgomp resolves to the one torch loaded:
        # one OpenMP thread pool, sized by torch.set_num_threads.
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as e:
        failed = isinstance(e, (subprocess.CalledProcessError, subprocess.TimeoutExpired))
        detail = (e.stderr if failed else None) or e
        log.warning("building the CPU kernels failed, CPU attention uses the PyTorch reference: %s", detail)
        return None
    return _declare(lib)


def _load_prebuilt(path: str) -> ctypes.CDLL | None:
    """A library built elsewhere for BATON_KERNEL_MARCH (an image's), if this CPU can run it."""
    missing = MARCH_NEEDS.get(MARCH, set()) - _cpu_flags()
    if missing:
        log.warning("%s was built for %s, which this CPU lacks (%s): CPU attention uses the PyTorch reference",
                    path, MARCH, " ".join(sorted(missing)))
        return None
    try:
        return _declare(ctypes.CDLL(path))
    except OSError as e:
        log.warning("cannot load BATON_KERNEL_LIB=%s, CPU attention uses the PyTorch reference: %s", path, e)
        return None


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    from baton.kernels.cpu_dequant import QuantRows  # (its own module: the struct of the other source)

    lib.baton_paged_attention.argtypes = [ctypes.c_int, ctypes.POINTER(Batch)]
    lib.baton_paged_attention.restype = ctypes.c_int
    lib.baton_dequant_rows.argtypes = [ctypes.POINTER(QuantRows), ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.baton_dequant_rows.restype = ctypes.c_int
    return lib


def supports(dtype: torch.dtype, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether paged_attention can serve this model's attention (and the library builds here)."""
    return (device.type == "cpu" and dtype in DTYPES and num_heads // num_kv_heads <= MAX_GROUP
            and head_dim <= MAX_HEAD_DIM and load() is not None)


def _check_rows(name: str, t: torch.Tensor, heads: int, head_dim: int) -> None:
    if t.dim() != 3 or t.shape[1:] != (heads, head_dim) or t.stride(2) != 1 or t.stride(1) != head_dim:
        raise ValueError(f"{name}: expected rows of [{heads}, {head_dim}] with contiguous heads, got shape "
                         f"{tuple(t.shape)} strides {t.stride()}")


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_ids: torch.Tensor, row_block_start: torch.Tensor, positions: torch.Tensor,
                    scale: float, softcap: float | None = None, window: int | None = None,
                    sinks: torch.Tensor | None = None, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Writes this step's k, v ([rows, kv_heads, D]) into the cache, then returns attention of
    each row of q ([rows, q_heads, D]) at positions[row] over its sequence's first
    positions[row] + 1 tokens (with a sliding `window`, the last `window` of them; blocks
    wholly before are not read), scores soft-capped (cap * tanh(s / cap)) where `softcap`, each
    head's `sinks` score ([q_heads], gpt-oss) counted in its softmax's sum where given.
    Row r's sequence's blocks are block_ids[row_block_start[r]:].
    k_cache/v_cache: [num_blocks, block_size, kv_heads, D], one layer's views of the engine's
    cache. Rows of q, k, v may be strided (views into the fused QKV output); the index
    tensors are int64. An FP8 cache (kernels/kv_quant.py) takes k and v quantized already, in its
    dtype, and `kv_scales` ([2, kv_heads] float32: K's and V's per head)."""
    num_rows, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    for name, t, heads in (("q", q, num_heads), ("k", k, num_kv_heads), ("v", v, num_kv_heads),
                           ("k_cache", k_cache[0], num_kv_heads), ("v_cache", v_cache[0], num_kv_heads)):
        _check_rows(name, t, heads, head_dim)
    fp8 = k_cache.dtype in CACHE_DTYPES and k_cache.dtype not in DTYPES
    if (k_cache.stride() != v_cache.stride() or not k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
            or q.dtype not in DTYPES or k_cache.dtype not in CACHE_DTYPES):
        raise ValueError("k, v and the caches must share a dtype (float32, bfloat16 or FP8; q float32 or bfloat16), "
                         "and the caches their strides")
    if fp8 and (kv_scales is None or kv_scales.shape != (2, num_kv_heads)):
        raise ValueError(f"kv_scales: an FP8 cache needs [2, {num_kv_heads}] scales")
    kv_scales = kv_scales.to(torch.float32).contiguous() if fp8 else None  # (a head cast to bf16 holds them so)
    if not block_ids.dtype == row_block_start.dtype == positions.dtype == torch.int64:
        raise ValueError("block_ids, row_block_start and positions must be int64")
    if not k.shape[0] == v.shape[0] == row_block_start.shape[0] == positions.shape[0] == num_rows:
        raise ValueError(f"q, k, v, row_block_start and positions must have {num_rows} rows")
    # Named, so copies made here outlive the call.
    block_ids, row_block_start, positions = block_ids.contiguous(), row_block_start.contiguous(), positions.contiguous()
    if sinks is not None:
        if sinks.shape != (num_heads,):
            raise ValueError(f"sinks: expected one per query head ({num_heads}), got shape {tuple(sinks.shape)}")
        sinks = sinks.to(torch.float32).contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch = Batch(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                  k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                  block_ids.data_ptr(), row_block_start.data_ptr(), positions.data_ptr(), num_rows, block_ids.numel(),
                  num_blocks, num_kv_heads,
                  num_heads // num_kv_heads, head_dim, block_size, scale, out.data_ptr(), window or 0, softcap or 0.0,
                  None if sinks is None else sinks.data_ptr(), CACHE_DTYPES[k_cache.dtype],
                  *((kv_scales[0].data_ptr(), kv_scales[1].data_ptr()) if fp8 else (None, None)))
    rc = load().baton_paged_attention(DTYPES[q.dtype], ctypes.byref(batch))
    if rc == -2:
        raise ValueError("a row's position reaches past its blocks in block_ids, or a block id is outside the cache")
    if rc == -3:
        raise MemoryError("paged_attention: out of memory for scratch buffers")
    if rc != 0:
        raise ValueError(f"paged_attention: unsupported shape q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    return out


if __name__ == "__main__":  # python -m baton.kernels.cpu_kernels OUT.so: build for BATON_KERNEL_MARCH there
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m baton.kernels.cpu_kernels OUT.so")
    compiler = _compiler()
    if compiler is None:
        sys.exit("no C++ compiler (set CXX or install g++)")
    print(_build(compiler, Path(sys.argv[1])))
