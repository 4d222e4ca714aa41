"""Which attention kernel family runs an engine's cache: the worker's choice, from what the
kernels (kernels/) can run here."""
from __future__ import annotations

import importlib.util
import logging
import os

import torch

from baton.engine.common.errors import check
from baton.kernels import cpu_kernels

log = logging.getLogger(__name__)

TRITON_MAX_HEAD_DIM = 256  # a 1024-wide padded head overflowed an H100's shared memory in every kernel


def choose_backend(asked: str, dtype: torch.dtype, device: torch.device, num_heads: int, num_kv_heads: int,
                   head_dim: int, latent: bool = False, kv_dtype: torch.dtype | None = None) -> str:
    """The attention backend for a cache: "cpu" (the C++ kernel), "triton" or "torch" (the
    reference). "auto": the C++ kernel on CPU where it builds and fits the model, Triton on
    CUDA where it is installed and takes the heads (at most TRITON_MAX_HEAD_DIM wide, any
    width for MLA's latent), else the reference. An explicit choice that cannot run here is
    an error naming attention_backend. `latent`: MLA's cache, whose Triton kernel
    (kernels/triton_mla.py) takes any width. `kv_dtype`: the cache's, where it is not `dtype`
    (FP8: every backend reads it, but Triton reads e4m3 only on GPUs of compute capability 8.9
    and up, whose hardware converts it)."""
    if asked == "cpu" or (asked == "auto" and device.type == "cpu"):
        if cpu_kernels.supports(dtype, device, num_heads, num_kv_heads, head_dim):
            return "cpu"
        check(asked == "auto", "attention_backend", f"the CPU kernel cannot run {dtype} on {device} with "
              f"{num_heads} query / {num_kv_heads} KV heads of {head_dim} (or it did not build; see the log)")
        return "torch"
    if asked in ("triton", "auto"):
        if importlib.util.find_spec("triton") is None:
            check(asked == "auto", "attention_backend", "triton is not installed")
            log.warning("triton is not installed: attention on %s uses the PyTorch reference", device)
            return "torch"
        check(device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1", "attention_backend",
              f"triton runs on CUDA, or on CPU under Triton's interpreter (TRITON_INTERPRET=1); the device is {device}")
        if head_dim > TRITON_MAX_HEAD_DIM and not latent:  # its tiles would not fit in shared memory
            check(asked == "auto", "attention_backend",
                  f"the Triton kernels take heads of at most {TRITON_MAX_HEAD_DIM}, this cache's are {head_dim}")
            log.warning("heads of %d: attention on %s uses the PyTorch reference", head_dim, device)
            return "torch"
        capability = (torch.cuda.get_device_capability(device)
                      if kv_dtype == torch.float8_e4m3fn and device.type == "cuda" else None)
        if capability is not None and capability < (8, 9):
            check(asked == "auto", "attention_backend",
                  f"Triton reads an fp8_e4m3 KV cache on compute capability 8.9 and up; {device} has "
                  f"{capability[0]}.{capability[1]} (use kv_cache_dtype fp8_e5m2, or attention_backend torch)")
            log.warning("fp8_e4m3 KV on %s (compute capability %d.%d): attention uses the PyTorch reference", device,
                        *capability)
            return "torch"
        return "triton"
    return "torch"
