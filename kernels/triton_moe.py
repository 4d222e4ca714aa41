"""A fused mixture-of-experts feed-forward in Triton, for the GPU path: the same sum as
engine/worker/models/moe.py's grouped_experts (its oracle), in two kernel launches whatever the
number of experts.

The grouped PyTorch path gathers each pair's row, reads every expert's token count to the host
and launches a matmul pair per expert that has tokens; gate and up go to memory at [pairs, 2I]
before the activation reads them back. Here an alignment step (torch ops on the device, no
sync: its buffers are sized for the most blocks the pairs could take) sorts the step's (token,
k) pairs by expert and pads each expert's run to a multiple of BLOCK_M, so every M-block of the
sorted order belongs to one expert. The first kernel reads its block's rows of x in place (row
= pair // k), multiplies them by the expert's gate and up rows together (the same N columns of
each half) and applies the activation in its epilogue, writing the activated [pairs, I]; the
second multiplies that by the expert's down projection, scales each row by the pair's routing
weight and writes [pairs, H] in float32, which a sum over k reduces (no atomics: the result
does not depend on the order pairs finish in). Accumulation is in float32; float32 inputs use
tl.dot's "ieee" precision, so results match PyTorch's to ~1e-5.

Activations: "silu" (silu(gate) · up, Mixtral/Qwen/DeepSeek) and "swiglu_oai" (gpt-oss: gate
clamped above at `limit`, up to ±limit, (up + 1) · gate · sigmoid(alpha · gate)), with the
optional per-expert biases gpt-oss has. Runs on CUDA tensors, or on CPU tensors under Triton's
interpreter (TRITON_INTERPRET=1, set before triton is imported), which is how CI tests it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ACTIVATIONS = ("silu", "swiglu_oai")


@triton.jit
def _glu(gate, up, alpha, limit, ACTIVATION: tl.constexpr):
    """The activated product of a gate and an up tile (float32). ACTIVATION: 0 silu, 1 swiglu_oai."""
    if ACTIVATION == 1:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        out = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
    else:
        out = gate * tl.sigmoid(gate) * up
    return out


@triton.jit
def _block_rows(SORTED, BLOCK_EXPERT, num_pairs, BLOCK_M: tl.constexpr):
    """This program's M-block: its expert (-1: a block past the last run, which holds no pair)
    and its BLOCK_M sorted pairs (padding is num_pairs)."""
    m_block = tl.program_id(0)
    expert = tl.load(BLOCK_EXPERT + m_block).to(tl.int64)
    pair = tl.load(SORTED + m_block * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pair.to(tl.int64), pair < num_pairs


# num_pairs (tokens × k) changes from step to step: specialized on, it would compile a new
# variant whenever its value class changes (equal to 1, divisible by 16), stalling the step.
@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up(X, W, BIAS, SORTED, BLOCK_EXPERT, OUT, num_pairs, top_k, hidden, inter,
             stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_be, stride_ot, alpha, limit,
             HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """OUT[pair, n] = glu(gate_up[e, n] · x[token], gate_up[e, inter + n] · x[token]) for the
    block's pairs and BLOCK_N columns n of the intermediate."""
    expert, pair, row_ok = _block_rows(SORTED, BLOCK_EXPERT, num_pairs, BLOCK_M)
    if expert < 0:
        return
    token = pair // top_k
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    w_gate = W + expert * stride_we + n[None, :] * stride_wn
    w_up = w_gate + inter * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        a = tl.load(X + token[:, None] * stride_xt + k[None, :] * stride_xh, mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        gate += tl.dot(a, tl.load(w_gate + k[:, None] * stride_wh, mask=w_mask, other=0.0), input_precision="ieee")
        up += tl.dot(a, tl.load(w_up + k[:, None] * stride_wh, mask=w_mask, other=0.0), input_precision="ieee")
    if HAS_BIAS:
        gate += tl.load(BIAS + expert * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(BIAS + expert * stride_be + inter + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = _glu(gate, up, alpha, limit, ACTIVATION)
    tl.store(OUT + pair[:, None] * stride_ot + n[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down(A, W, BIAS, WEIGHTS, SORTED, BLOCK_EXPERT, OUT, num_pairs, hidden, inter,
          stride_at, stride_we, stride_wn, stride_wi, stride_be, stride_ot,
          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """OUT[pair, n] = weight[pair] · (down[e, n] · A[pair] + bias[e, n]), float32, for the
    block's pairs and BLOCK_N columns n of the hidden size."""
    expert, pair, row_ok = _block_rows(SORTED, BLOCK_EXPERT, num_pairs, BLOCK_M)
    if expert < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    w = W + expert * stride_we + n[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        a = tl.load(A + pair[:, None] * stride_at + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w + k[:, None] * stride_wi, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.dot(a, b, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(BIAS + expert * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(WEIGHTS + pair, mask=row_ok, other=0.0)[:, None]
    tl.store(OUT + pair[:, None] * stride_ot + n[None, :], acc, mask=row_ok[:, None] & n_ok[None, :])


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, k) pairs (flat index t · k + j into ids) sorted by expert, each expert's run
    padded to a multiple of block_m with the sentinel ids.numel(): (sorted_pairs [padded] int32,
    block_expert [padded / block_m] int32, the expert of each M-block). Experts without pairs get
    no block. Torch ops on ids' device, sized for the most blocks the pairs can take (each
    expert's run padded by up to block_m - 1), the blocks past the last run marked -1 (their
    programs return at once): nothing waits for the device, so a CUDA graph can hold it. The ids'
    range is checked on a CPU only (there reading them costs no sync; on a GPU they come from a
    top-k over the router's experts)."""
    flat = ids.flatten()
    num_pairs = flat.numel()
    if flat.device.type == "cpu":
        low, high = int(flat.min()), int(flat.max())
        if low < 0 or high >= num_experts:
            raise ValueError(f"fused_moe: ids must lie in [0, {num_experts}) (the experts of gate_up), "
                             f"got {low}..{high}")
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat.clamp(0, num_experts - 1), torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    most = -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m) * block_m
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - (counts.cumsum(0) - counts)[expert]  # within its run
    sorted_pairs = torch.full((most,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[(ends - padded)[expert] + rank] = order.to(torch.int32)
    starts = torch.arange(0, most, block_m, device=flat.device)
    block_expert = torch.where(starts < ends[-1], torch.searchsorted(ends, starts, right=True), -1).to(torch.int32)
    return sorted_pairs, block_expert


def _blocks(x: torch.Tensor, num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small tiles under the interpreter (each program is Python);
    on a GPU, M-blocks about as tall as an expert's share of the pairs (decode pads little)."""
    if x.device.type != "cuda":
        return 16, 32, 32
    per_expert = num_pairs / num_experts
    return (16 if per_expert <= 16 else 32 if per_expert <= 64 else 64), 64, 64 if x.element_size() <= 2 else 32


def _check(x, weights, ids, gate_up, down, gate_up_bias, down_bias, activation) -> None:
    if x.dim() != 2:
        raise ValueError(f"fused_moe: x must be [tokens, hidden], got {tuple(x.shape)}")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or ids.is_floating_point():
        raise ValueError(f"fused_moe: ids must be integer [tokens, k] = [{x.shape[0]}, k], got {tuple(ids.shape)}")
    if weights.shape != ids.shape:
        raise ValueError(f"fused_moe: weights must be shaped as ids {tuple(ids.shape)}, got {tuple(weights.shape)}")
    num_experts, two_inter, hidden = gate_up.shape if gate_up.dim() == 3 else (0, 1, 0)
    if hidden != x.shape[1] or two_inter % 2 or gate_up.dtype != x.dtype:
        raise ValueError(f"fused_moe: gate_up must be [experts, 2 · intermediate, {x.shape[1]}] of {x.dtype}, "
                         f"got {tuple(gate_up.shape)} of {gate_up.dtype}")
    if down.shape != (num_experts, hidden, two_inter // 2) or down.dtype != x.dtype:
        raise ValueError(f"fused_moe: down must be {(num_experts, hidden, two_inter // 2)} of {x.dtype}, "
                         f"got {tuple(down.shape)} of {down.dtype}")
    for name, bias, shape in (("gate_up_bias", gate_up_bias, (num_experts, two_inter)),
                              ("down_bias", down_bias, (num_experts, hidden))):
        if bias is not None and bias.shape != shape:
            raise ValueError(f"fused_moe: {name} must be {shape}, got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe: activation must be one of {ACTIVATIONS}, got {activation!r}")


def fused_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
              activation: str = "silu", alpha: float = 1.702, limit: float = 7.0, *, block_m: int | None = None,
              block_n: int | None = None, block_k: int | None = None) -> torch.Tensor:
    """sum_k weights[t, k] · (down[e] · glu(gate_up[e] · x[t] + gate_up_bias[e]) + down_bias[e]),
    e = ids[t, k], for every token t, in x's dtype: x [T, H], weights [T, k] (float32), ids [T, k],
    gate_up [E, 2I, H] (gate the first I rows, up the second), down [E, H, I], the biases [E, 2I]
    and [E, H] or None. `activation`: "silu" or "swiglu_oai" (with `alpha`, `limit`); see the
    module's docstring. `block_m`, `block_n`, `block_k`: tile sizes (powers of two, at least 16;
    default: `_blocks`). Raises ValueError naming the argument that does not fit."""
    _check(x, weights, ids, gate_up, down, gate_up_bias, down_bias, activation)
    num_tokens, top_k = ids.shape
    num_experts, hidden, inter = down.shape
    num_pairs = num_tokens * top_k
    if not num_pairs:
        return torch.zeros_like(x)
    default_m, default_n, default_k = _blocks(x, num_pairs, num_experts)
    block_m, block_n, block_k = block_m or default_m, block_n or default_n, block_k or default_k
    sorted_pairs, block_expert = align(ids, num_experts, block_m)
    num_blocks = block_expert.shape[0]
    weights = weights.to(torch.float32).contiguous()
    gate_up_bias = gate_up_bias.contiguous() if gate_up_bias is not None else None
    down_bias = down_bias.contiguous() if down_bias is not None else None
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _gate_up[(num_blocks, triton.cdiv(inter, block_n))](
        x, gate_up, gate_up_bias if gate_up_bias is not None else x, sorted_pairs, block_expert, act, num_pairs,
        top_k, hidden, inter, x.stride(0), x.stride(1), *gate_up.stride(),
        gate_up_bias.stride(0) if gate_up_bias is not None else 0, act.stride(0), alpha, limit,
        HAS_BIAS=gate_up_bias is not None, ACTIVATION=ACTIVATIONS.index(activation),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    _down[(num_blocks, triton.cdiv(hidden, block_n))](
        act, down, down_bias if down_bias is not None else x, weights, sorted_pairs, block_expert, out, num_pairs,
        hidden, inter, act.stride(0), *down.stride(), down_bias.stride(0) if down_bias is not None else 0,
        out.stride(0), HAS_BIAS=down_bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
