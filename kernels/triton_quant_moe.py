"""The fused mixture-of-experts of triton_moe.py over quantized experts: the same two launches
(gate and up with the activation, then down scaled by the routing weights), the same alignment
of the step's (token, k) pairs by expert, with each expert's weight tiles dequantized in
registers inside the K loops (triton_quant.dequant_tile): integer codes (GPTQ, AWQ,
compressed-tensors), FP8 with block scales, and MXFP4 (gpt-oss's experts, never widened in
memory). Gate and up are two operands of one kind (each with its own scales). Runs on CUDA
tensors, or on CPU tensors under Triton's interpreter, which is how CI tests it."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.kernels.triton_moe import ACTIVATIONS, _block_rows, _blocks, _glu, align  # (jit functions: by name)
from baton.kernels.triton_quant import QuantOperand, dequant_tile


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up(X, GW, GS, GZ, GG, UW, US, UZ, UG, BIAS, SORTED, BLOCK_EXPERT, OUT, num_pairs, top_k, hidden, inter,
             stride_xt, w_expert, w_row, s_expert, s_row, g_expert, stride_be, stride_ot, zero, group, block_rows,
             block_cols, alpha, limit, FORMAT: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
             HAS_G_IDX: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, IEEE: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """OUT[pair, n] = glu(gate[e, n] · x[token], up[e, n] · x[token]) for the block's pairs."""
    expert, pair, row_ok = _block_rows(SORTED, BLOCK_EXPERT, num_pairs, BLOCK_M)
    if expert < 0:
        return
    token = pair // top_k
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    row = n[None, :].to(tl.int64)
    gw, gs, gz, gg = GW + expert * w_expert, GS + expert * s_expert, GZ + expert * s_expert, GG + expert * g_expert
    uw, us, uz, ug = UW + expert * w_expert, US + expert * s_expert, UZ + expert * s_expert, UG + expert * g_expert
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        a = tl.load(X + token[:, None] * stride_xt + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        tile_ok = k_ok[:, None] & n_ok[None, :]
        g = dequant_tile(gw, gs, gz, gg, row, k, tile_ok, k_ok, w_row, s_row, zero, group, block_rows, block_cols,
                         FORMAT, BITS, HAS_ZEROS, HAS_G_IDX)
        u = dequant_tile(uw, us, uz, ug, row, k, tile_ok, k_ok, w_row, s_row, zero, group, block_rows, block_cols,
                         FORMAT, BITS, HAS_ZEROS, HAS_G_IDX)
        if IEEE:
            gate += tl.dot(a.to(tl.float32), g, input_precision="ieee")
            up += tl.dot(a.to(tl.float32), u, input_precision="ieee")
        else:
            gate += tl.dot(a, g.to(a.dtype))
            up += tl.dot(a, u.to(a.dtype))
    if HAS_BIAS:
        gate += tl.load(BIAS + expert * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(BIAS + expert * stride_be + inter + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = _glu(gate, up, alpha, limit, ACTIVATION)
    tl.store(OUT + pair[:, None] * stride_ot + n[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down(A, W, S, Z, G, BIAS, WEIGHTS, SORTED, BLOCK_EXPERT, OUT, num_pairs, hidden, inter, stride_at,
          w_expert, w_row, s_expert, s_row, g_expert, stride_be, stride_ot, zero, group, block_rows, block_cols,
          FORMAT: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
          HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr):
    """OUT[pair, n] = weight[pair] · (down[e, n] · A[pair] + bias[e, n]), float32."""
    expert, pair, row_ok = _block_rows(SORTED, BLOCK_EXPERT, num_pairs, BLOCK_M)
    if expert < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    row = n[None, :].to(tl.int64)
    w, s, z, g = W + expert * w_expert, S + expert * s_expert, Z + expert * s_expert, G + expert * g_expert
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        a = tl.load(A + pair[:, None] * stride_at + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = dequant_tile(w, s, z, g, row, k, k_ok[:, None] & n_ok[None, :], k_ok, w_row, s_row, zero, group,
                         block_rows, block_cols, FORMAT, BITS, HAS_ZEROS, HAS_G_IDX)
        if IEEE:
            acc += tl.dot(a.to(tl.float32), b, input_precision="ieee")
        else:
            acc += tl.dot(a, b.to(a.dtype))
    if HAS_BIAS:
        acc += tl.load(BIAS + expert * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(WEIGHTS + pair, mask=row_ok, other=0.0)[:, None]
    tl.store(OUT + pair[:, None] * stride_ot + n[None, :], acc, mask=row_ok[:, None] & n_ok[None, :])


def _kind(op: QuantOperand) -> dict:
    """The kernel's specialization and scalars for an operand's kind."""
    return dict(FORMAT=op.fmt, BITS=op.bits, HAS_ZEROS=op.zeros is not None, HAS_G_IDX=op.g_idx is not None)


def _pointers(op: QuantOperand) -> tuple:
    return (op.w, op.scales, op.zeros if op.zeros is not None else op.scales,
            op.g_idx if op.g_idx is not None else op.scales)


def fused_moe_quantized(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate: QuantOperand,
                        up: QuantOperand, down: QuantOperand, gate_up_bias: torch.Tensor | None = None,
                        down_bias: torch.Tensor | None = None, activation: str = "silu", alpha: float = 1.702,
                        limit: float = 7.0) -> torch.Tensor:
    """triton_moe.fused_moe's sum with quantized experts: gate and up [E, I, H] (one kind), down
    [E, H, I]; the biases [E, 2I] and [E, H] or None. Raises ValueError naming what does not fit."""
    if not gate.same_kind(up):
        raise ValueError("gate and up: the experts' gate and up must be quantized alike")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    num_tokens, top_k = ids.shape
    num_experts, inter, hidden = gate.w.shape[0], gate.w.shape[1], gate.k
    if x.shape[1] != hidden or down.k != inter or down.w.shape[1] != hidden:
        raise ValueError(f"x [T, {hidden}], gate/up [E, I, {hidden}] and down [E, {hidden}, I] must agree; got x "
                         f"{tuple(x.shape)}, down of {down.w.shape[1]} rows and {down.k} columns")
    num_pairs = num_tokens * top_k
    if not num_pairs:
        return torch.zeros_like(x)
    block_m, block_n, block_k = _blocks(x, num_pairs, num_experts)
    sorted_pairs, block_expert = align(ids, num_experts, block_m)
    num_blocks = block_expert.shape[0]
    x, weights = x.contiguous(), weights.to(torch.float32).contiguous()
    ieee = x.dtype == torch.float32
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _gate_up[(num_blocks, triton.cdiv(inter, block_n))](
        x, *_pointers(gate), *_pointers(up), gate_up_bias if gate_up_bias is not None else x, sorted_pairs,
        block_expert, act, num_pairs, top_k, hidden, inter, x.stride(0), gate.w.stride(0), gate.w.stride(1),
        gate.scales.stride(0), gate.scales.stride(1), gate.g_expert,
        gate_up_bias.stride(0) if gate_up_bias is not None else 0,
        act.stride(0), gate.zero, gate.group, *gate.block, alpha, limit, **_kind(gate),
        HAS_BIAS=gate_up_bias is not None, ACTIVATION=ACTIVATIONS.index(activation), IEEE=ieee,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    _down[(num_blocks, triton.cdiv(hidden, block_n))](
        act, *_pointers(down), down_bias if down_bias is not None else x, weights, sorted_pairs, block_expert, out,
        num_pairs, hidden, inter, act.stride(0), down.w.stride(0), down.w.stride(1), down.scales.stride(0),
        down.scales.stride(1), down.g_expert, down_bias.stride(0) if down_bias is not None else 0, out.stride(0),
        down.zero,
        down.group, *down.block, **_kind(down), HAS_BIAS=down_bias is not None, IEEE=ieee,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
