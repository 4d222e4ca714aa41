"""Quantized linear layers in Triton, for the GPU path: x [T, K] times a quantized weight's
transpose, the weight dequantized a [BLOCK_K, BLOCK_N] tile at a time in registers inside the K
loop (never a float copy of it), accumulated in float32, the output in x's dtype.

Weight formats (engine/worker/quant/weights.py's layouts, read as stored):
- integer codes (`int_matmul`): 4-bit two to a byte (the low nibble the even column) or 8-bit,
  row-major [N, K * bits / 8]; scales [N, groups] in their stored dtype; zero points [N, groups]
  (int16) or one constant; the group of column k is g_idx[k] (act-order) or k // group_size.
  W[n, k] = (code - zero) * scale: GPTQ, AWQ and compressed-tensors' W4A16 / W8A16.
- FP8 (`fp8_matmul`): float8 values [N, K] and a float32 scale per (bo, bi) block of the grid
  [ceil(N / bo), ceil(K / bi)]: block FP8 (DeepSeek), per channel, per tensor; FP8 weight-only,
  for GPUs without FP8 tensor cores as for those with them.

The tile's dequantized values meet x's tile in x's dtype (tl.dot with float32 accumulation;
float32 inputs with "ieee" precision, as the other kernels). Runs on CUDA tensors, or on CPU
tensors under Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported), which is
how CI tests it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FORMAT_INT, FORMAT_FP8, FORMAT_MXFP4 = 0, 1, 2


@dataclass(frozen=True)
class QuantOperand:
    """A quantized weight [*lead, N, K] as dequant_tile reads it: `w` its codes or values (rows of
    w.stride(-2) elements), `scales` (FP8: the block grid; MXFP4: exponents), `zeros` (laid out as
    the scales) or the constant `zero`, `g_idx` or plain groups of `group`, FP8's `block`. With a
    leading dimension (experts), stride(0) steps from one to the next."""
    w: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    fmt: int
    bits: int
    zero: float
    group: int
    block: tuple[int, int]
    k: int  # input columns

    @property
    def g_expert(self) -> int:
        """Elements from one expert's g_idx to the next's (0: the experts share one)."""
        return self.g_idx.stride(0) if self.g_idx is not None and self.g_idx.dim() > 1 else 0

    def same_kind(self, other: QuantOperand) -> bool:
        """Whether one kernel specialization reads both (a layer's gate and up)."""
        return ((self.fmt, self.bits, self.zeros is None, self.g_idx is None, self.group, self.block, self.k,
                 self.w.stride(), self.scales.stride(), self.g_expert)
                == (other.fmt, other.bits, other.zeros is None, other.g_idx is None, other.group, other.block,
                    other.k, other.w.stride(), other.scales.stride(), other.g_expert))


@triton.jit
def fp4_values(code):
    """E2M1 codes (0..15) as float32: 0, 0.5, 1, 1.5, 2, 3, 4, 6, and their negatives."""
    mag = code & 7
    exp = mag >> 1
    value = tl.where(exp == 0, (mag & 1).to(tl.float32) * 0.5,
                     (1.0 + (mag & 1).to(tl.float32) * 0.5) * tl.exp2((exp - 1).to(tl.float32)))
    return tl.where(code >= 8, -value, value)


@triton.jit
def dequant_tile(W, SCALES, ZEROS, G_IDX, row, k, tile_ok, k_ok, w_row, s_row, zero, group, block_rows, block_cols,
                 FORMAT: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr):
    """The float32 tile [BLOCK_K, BLOCK_N] of W[row, k] (row [1, BLOCK_N] int64, k [BLOCK_K]):
    FORMAT 0 integer codes ((code - zero) * scale per (row, group)), 1 FP8 (value * the scale of
    its (block_rows, block_cols) block), 2 MXFP4 (E2M1 code * 2^(exponent - 127) per 32 columns).
    4-bit codes sit two to a byte, the low nibble the even column (MXFP4's too)."""
    if FORMAT == 1:
        v = tl.load(W + row * w_row + k[:, None], mask=tile_ok, other=0.0).to(tl.float32)
        scale = tl.load(SCALES + (row // block_rows) * s_row + (k[:, None] // block_cols), mask=tile_ok, other=0.0)
        return v * scale
    if BITS == 4:
        byte = tl.load(W + row * w_row + (k[:, None] // 2), mask=tile_ok, other=0).to(tl.int32)
        code = (byte >> ((k[:, None] % 2) * 4)) & 0xF
    else:
        code = tl.load(W + row * w_row + k[:, None], mask=tile_ok, other=0).to(tl.int32)
    if FORMAT == 2:
        exponent = tl.load(SCALES + row * s_row + k[:, None] // 32, mask=tile_ok, other=127).to(tl.float32)
        return fp4_values(code) * tl.exp2(exponent - 127.0)
    if HAS_G_IDX:
        g = tl.load(G_IDX + k, mask=k_ok, other=0)
    else:
        g = k // group
    scale = tl.load(SCALES + row * s_row + g[:, None], mask=tile_ok, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(ZEROS + row * s_row + g[:, None], mask=tile_ok, other=0).to(tl.float32)
    else:
        z = zero
    return (code.to(tl.float32) - z) * scale


# T (tokens) changes from step to step: not specialized on (see triton_moe.py).
@triton.jit(do_not_specialize=["T"])
def _quant_matmul(X, Y, W, SCALES, ZEROS, G_IDX, T, N, K, stride_xt, stride_yt, w_row, s_row, zero, group,
                  block_rows, block_cols,
                  FORMAT: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
                  IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y[m, n] = sum_k X[m, k] · W[n, k] for the program's BLOCK_M rows and BLOCK_N columns."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < T, n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(X + m[:, None].to(tl.int64) * stride_xt + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = dequant_tile(W, SCALES, ZEROS, G_IDX, n[None, :].to(tl.int64), k, k_ok[:, None] & n_ok[None, :], k_ok,
                         w_row, s_row, zero, group, block_rows, block_cols, FORMAT, BITS, HAS_ZEROS, HAS_G_IDX)
        if IEEE:
            acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype))
    tl.store(Y + m[:, None].to(tl.int64) * stride_yt + n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _blocks(x: torch.Tensor, n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small tiles under the interpreter (each program is Python); on a
    GPU, M as tall as the step's rows need (decode: 16), N and K wide enough to keep loads coalesced."""
    if x.device.type != "cuda":
        return 16, 32, 32
    rows = x.shape[0]
    return (16 if rows <= 16 else 32 if rows <= 64 else 64), 64 if n >= 64 else 32, 64


def _launch(x, w, scales, zeros, g_idx, n, k, w_row, s_row, zero, group, block, fmt, bits) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [tokens, {k}], got {tuple(x.shape)}")
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return y
    bm, bn, bk = _blocks(x, n)
    _quant_matmul[(triton.cdiv(x.shape[0], bm), triton.cdiv(n, bn))](
        x, y, w, scales, zeros if zeros is not None else scales, g_idx if g_idx is not None else scales,
        x.shape[0], n, k, x.stride(0), y.stride(0), w_row, s_row, float(zero), group, block[0], block[1],
        FORMAT=fmt, BITS=bits, HAS_ZEROS=zeros is not None, HAS_G_IDX=g_idx is not None,
        IEEE=x.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y


def int_matmul(x: torch.Tensor, codes: torch.Tensor, bits: int, in_features: int, scales: torch.Tensor,
               zeros: torch.Tensor | None, zero: int, group_size: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] @ W.T for integer codes (see the module's docstring): [T, N] in x's dtype."""
    if bits not in (4, 8) or codes.dtype != torch.uint8 or codes.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError(f"codes must be row-major uint8 of 4 or 8 bits, got {codes.dtype} of {bits} bits")
    if zeros is not None and zeros.stride() != scales.stride():
        raise ValueError("zeros must be laid out as the scales")
    return _launch(x, codes, scales, zeros, g_idx, codes.shape[0], in_features, codes.stride(0), scales.stride(0),
                   zero, group_size, (1, 1), FORMAT_INT, bits)


def fp8_matmul(x: torch.Tensor, values: torch.Tensor, grid: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [T, K] @ W.T for float8 values [N, K] and their float32 scale grid (per block): [T, N]."""
    if values.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or values.stride(1) != 1:
        raise ValueError(f"values must be row-major float8, got {values.dtype}")
    if grid.dtype != torch.float32 or grid.stride(1) != 1:
        raise ValueError("grid must be row-major float32")
    return _launch(x, values, grid, None, None, values.shape[0], values.shape[1], values.stride(0), grid.stride(0), 0,
                   1, block, FORMAT_FP8, 8)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group FP8 (DeepSeek's and vLLM's W8A8 activations): x [T, K] as e4m3
    values [T, K] and float32 scales [T, ceil(K / group)], each group's amax over 448."""
    t, k = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -k % group)).view(t, -1, group)
    scales = (padded.abs().amax(dim=-1) / 448.0).clamp(min=1e-12)
    values = (padded / scales[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return values.view(t, -1)[:, :k].contiguous(), scales


@triton.jit(do_not_specialize=["T"])
def _w8a8_matmul(XQ, XS, Y, W, WS, T, N, K, stride_xt, stride_xs, stride_yt, w_row, ws_row, block_rows, block_cols,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y[m, n] = sum over K tiles of (XQ tile · W tile, an FP8 dot) · XS[m, tile] · WS[n // bo, k // bi]:
    each K tile is one activation group and lies in one weight block."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < T, n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(XQ + m[:, None].to(tl.int64) * stride_xt + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(W + n[None, :].to(tl.int64) * w_row + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        a_scale = tl.load(XS + m * stride_xs + k0 // BLOCK_K, mask=m_ok, other=0.0)
        w_scale = tl.load(WS + (n // block_rows) * ws_row + k0 // block_cols, mask=n_ok, other=0.0)
        acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
    tl.store(Y + m[:, None].to(tl.int64) * stride_yt + n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def w8a8_group(k: int, block_cols: int) -> int | None:
    """The activation group (and K tile) W8A8 uses over weight blocks `block_cols` wide: 128 (as
    DeepSeek's) or the largest of 64, 32 that stays within one weight block (any, where one scale
    spans the columns); None where none does (an FP8 dot takes K tiles of 32 at least)."""
    return next((g for g in (128, 64, 32) if (block_cols >= k and g <= max(k, 32)) or block_cols % g == 0), None)


def w8a8_matmul(x: torch.Tensor, values: torch.Tensor, grid: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [T, K] @ W.T with x quantized to FP8 per token and group and the dot in FP8 (Hopper's and
    Ada's tensor cores): the weight's e4m3 values [N, K] with float32 scales per (bo, bi) block.
    Approximate by nature (activations lose precision): checked against the same quantization."""
    if values.dtype != torch.float8_e4m3fn or values.stride(1) != 1 or grid.dtype != torch.float32:
        raise ValueError(f"values must be row-major float8_e4m3fn with a float32 grid, got {values.dtype}")
    n, k = values.shape
    group = w8a8_group(k, block[1])
    if group is None:
        raise ValueError(f"block: no activation group fits weight blocks of {block[1]} columns")
    xq, xs = quantize_activations(x, group)
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return y
    bm, bn, _ = _blocks(x, n)
    _w8a8_matmul[(triton.cdiv(x.shape[0], bm), triton.cdiv(n, bn))](
        xq, xs, y, values, grid, x.shape[0], n, k, xq.stride(0), xs.stride(0), y.stride(0), values.stride(0),
        grid.stride(0), block[0], block[1] if block[1] < k else k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=group)
    return y
