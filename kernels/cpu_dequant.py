"""Quantized weights' rows to float32 on CPU (cpu/dequant.cpp, in cpu_kernels' library): one pass
over the stored bytes per row, the rows spread over torch's OpenMP threads. None of it is needed
for correctness: without a compiler (BATON_CPU_KERNELS=0) the weights' own PyTorch
dequantization gives the same values."""
from __future__ import annotations

import ctypes

import torch

from baton.kernels import cpu_kernels

FORMAT_INTEGER, FORMAT_E4M3, FORMAT_E5M2, FORMAT_MXFP4 = 0, 1, 2, 3
SCALE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class QuantRows(ctypes.Structure):
    """struct QuantRows in cpu/dequant.cpp, field for field; `keep` holds the tensors it points into."""
    _fields_ = [("format", ctypes.c_int32), ("bits", ctypes.c_int32), ("data", ctypes.c_void_p),
                ("row_bytes", ctypes.c_int64), ("in_features", ctypes.c_int64), ("scales", ctypes.c_void_p),
                ("scale_dtype", ctypes.c_int32), ("scale_row_stride", ctypes.c_int64), ("zeros", ctypes.c_void_p),
                ("zero", ctypes.c_int32), ("g_idx", ctypes.c_void_p), ("group_size", ctypes.c_int32),
                ("block_rows", ctypes.c_int32), ("block_cols", ctypes.c_int32)]


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.device.type != "cpu" or t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name}: expected a CPU tensor [rows, columns] with contiguous rows, got {tuple(t.shape)} "
                         f"strides {t.stride()} on {t.device}")
    return t


def integer_rows(codes: torch.Tensor, bits: int, in_features: int, scales: torch.Tensor, zeros: torch.Tensor | None,
                 zero: int, group_size: int, g_idx: torch.Tensor | None) -> QuantRows:
    """Integer codes [out, in * bits / 8] (uint8), scales [out, groups] (float32, bf16 or fp16), zeros
    [out, groups] int16 or None, g_idx [in] int32 or None."""
    _rows(codes, "codes")
    _rows(scales, "scales")
    if zeros is not None and (zeros.dtype != torch.int16 or zeros.stride() != scales.stride()):
        raise ValueError("zeros: expected int16 laid out as the scales")
    if g_idx is not None and (g_idx.dtype != torch.int32 or not g_idx.is_contiguous()):
        raise ValueError("g_idx: expected contiguous int32")
    rows = QuantRows(FORMAT_INTEGER, bits, codes.data_ptr(), codes.stride(0), in_features, scales.data_ptr(),
                     SCALE_DTYPES[scales.dtype], scales.stride(0), None if zeros is None else zeros.data_ptr(), zero,
                     None if g_idx is None else g_idx.data_ptr(), group_size, 1, 1)
    rows.keep = (codes, scales, zeros, g_idx)
    return rows


def fp8_rows(values: torch.Tensor, grid: torch.Tensor, block: tuple[int, int]) -> QuantRows:
    """float8 values [out, in] and float32 scales per (bo, bi) block, [ceil(out / bo), ceil(in / bi)]."""
    _rows(values, "values")
    _rows(grid, "grid")
    fmt = {torch.float8_e4m3fn: FORMAT_E4M3, torch.float8_e5m2: FORMAT_E5M2}[values.dtype]
    rows = QuantRows(fmt, 8, values.data_ptr(), values.stride(0), values.shape[1], grid.data_ptr(), 0,
                     grid.stride(0), None, 0, None, 1, block[0], block[1])
    rows.keep = (values, grid)
    return rows


def mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor) -> QuantRows:
    """MXFP4 blocks [out, G, 16] and exponents [out, G], uint8."""
    flat = _rows(blocks.reshape(blocks.shape[0], -1), "blocks")
    _rows(scales, "scales")
    rows = QuantRows(FORMAT_MXFP4, 4, flat.data_ptr(), flat.stride(0), scales.shape[1] * 32, scales.data_ptr(), 0,
                     scales.stride(0), None, 0, None, 32, 1, 1)
    rows.keep = (flat, scales)
    return rows


def available() -> bool:
    return cpu_kernels.load() is not None


def dequant_rows(weight: QuantRows, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
    """Rows [start, stop) of `weight` into `out` (float32, contiguous, [stop - start, in] at least)."""
    if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() < (stop - start) * weight.in_features:
        raise ValueError(f"out: expected contiguous float32 of at least {stop - start} x {weight.in_features}")
    if cpu_kernels.load().baton_dequant_rows(ctypes.byref(weight), start, stop, out.data_ptr()) != 0:
        raise ValueError(f"dequant_rows: unsupported format {weight.format} of {weight.bits} bits")
    return out
