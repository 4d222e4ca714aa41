"""A KV cache's elements: what a key or value becomes when it is written into a cache of another
dtype than the compute's (float8_e4m3fn or float8_e5m2 with scales; bfloat16 under float32
compute, and so on), and back.

A layer keeps one scale per KV head for K and one for V (float32, [2, kv_heads]): a cached
element is the value divided by its head's scale, clamped to the format's largest finite value
and rounded to nearest; reading multiplies back (vLLM's k_scale / v_scale meaning). Every
writer goes through `to_cache` (the attention backends, a P/D landing that converts a peer's
blocks; the host tier copies bytes as stored), so a block holds the same bytes whichever path
wrote it. The kernels read FP8 elements themselves and fold the scales into the score (K) and
the output (V); `from_cache` is the PyTorch reference's read.
"""
from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Calculated scales map this fraction of the format's range to the first K/V's largest value:
# later values up to twice as large still fit (vLLM's k/v constants leave about as much room).
CALIBRATION_HEADROOM = 2.0
_MIN_SCALE = 1e-12  # a head whose first values were all zero still divides by something


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize_kv(x: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., heads, D] (any float dtype) into `dtype`'s elements: x / scales[head], clamped to
    the finite range (FP8 has no room for an overflow), rounded to nearest even."""
    limit = torch.finfo(dtype).max
    return (x.float() / scales[..., None]).clamp_(-limit, limit).to(dtype)


def dequantize_kv(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached FP8 elements [..., heads, D] back to values in `dtype`."""
    return (q.float() * scales[..., None]).to(dtype)


def to_cache(x: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values [..., heads, D] as a cache of `dtype` holds them: FP8 quantized with
    `scales`, any other dtype cast."""
    return quantize_kv(x, scales, dtype) if is_fp8(dtype) else x.to(dtype)


def from_cache(x: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A cache's elements [..., heads, D] as values in `dtype` (FP8 read with `scales`)."""
    return dequantize_kv(x, scales, dtype) if is_fp8(x.dtype) else x.to(dtype)


def convert_kv(x: torch.Tensor, scales_from: torch.Tensor | None, dtype: torch.dtype,
               scales_to: torch.Tensor | None) -> torch.Tensor:
    """Blocks of one cache's elements [..., heads, D] (FP8 read with `scales_from`, else values)
    as another's in `dtype` (FP8 written with `scales_to`): what a P/D landing between two KV
    dtypes or two sets of scales writes."""
    return to_cache(from_cache(x, scales_from, torch.float32) if is_fp8(x.dtype) else x, scales_to, dtype)


def calibrated_scales(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-head scales [heads] (float32) for values x [T, heads, D] seen first: each head's
    largest magnitude, times CALIBRATION_HEADROOM, maps to the format's largest value."""
    amax = x.detach().abs().amax(dim=(0, 2)).float()
    return (amax * CALIBRATION_HEADROOM / torch.finfo(dtype).max).clamp_(min=_MIN_SCALE)
