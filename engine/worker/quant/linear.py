"""Layers over quantized weights (weights.py), computing in the activations' dtype with the
weights dequantized a tile at a time: the weights stay as shipped in memory, and a tile of
float32 rows lives only for its matmul.

A merged projection (q/k/v, gate/up) keeps each checkpoint tensor as a part of its own: each
has its own scales and groups, which need not line up with the others' rows. A part's rows are
its output rows, in order; the layer's output is the parts' outputs side by side.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.worker.quant.weights import QuantizedWeight
from baton.kernels import cpu_dequant

_TRITON = importlib.util.find_spec("triton") is not None
# A tile of dequantized rows: at most this many float32 values (1 MiB), so that it stays in cache
# and a large layer never has its whole float copy at once.
_TILE_VALUES = 1 << 18


def quantized_matmul(x: torch.Tensor, weight: QuantizedWeight, index: tuple[int, ...] = ()) -> torch.Tensor:
    """x [T, in] times weight (at leading `index`) transposed: [T, out], in x's dtype. On CUDA by
    the format's Triton kernel; on CPU the rows are dequantized by the C++ kernel into one reused
    float32 tile; elsewhere (or without a compiler) by the weight's own PyTorch code."""
    if x.device.type == "cuda" and _TRITON:
        return weight.triton_matmul(x, index)
    step = max(1, _TILE_VALUES // weight.in_features)
    if x.device.type == "cpu" and cpu_dequant.available():
        rows, tile = weight.cpu_rows(index), torch.empty(min(step, weight.out_features), weight.in_features)
        return _tiled(x.float(), weight.out_features, step,
                      lambda start, stop: cpu_dequant.dequant_rows(rows, start, stop, tile)[:stop - start]).to(x.dtype)
    return _tiled(x, weight.out_features, step,
                  lambda start, stop: weight.dequantize(index, slice(start, stop)).to(x.dtype))


def _tiled(x: torch.Tensor, out: int, step: int, rows_of) -> torch.Tensor:
    """x times the weight whose rows [start, stop) `rows_of` gives, `step` rows at a time."""
    if step >= out:
        return F.linear(x, rows_of(0, out))
    y = torch.empty(x.shape[0], out, dtype=x.dtype, device=x.device)
    for start in range(0, out, step):
        stop = min(start + step, out)
        y[:, start:stop] = F.linear(x, rows_of(start, stop))
    return y


def dequantize(weight: QuantizedWeight, index: tuple[int, ...] = ()) -> torch.Tensor:
    """The whole float32 weight at leading `index` (one expert of a stack; the C++ kernel's where
    it can)."""
    on_cpu = next(weight.buffers()).device.type == "cpu"
    whole_stack = weight.lead and not index
    if whole_stack or not (on_cpu and cpu_dequant.available()):
        return weight.dequantize(index)
    out = torch.empty(weight.out_features, weight.in_features)
    return cpu_dequant.dequant_rows(weight.cpu_rows(index), 0, weight.out_features, out)


def dequantized(parts: list[QuantizedWeight], index: tuple[int, ...] = ()) -> torch.Tensor:
    """The parts' whole float32 weight, rows one after the other."""
    return torch.cat([dequantize(p, index) for p in parts]) if len(parts) > 1 else dequantize(parts[0], index)


def _share_of_parts(parts, rows: torch.Tensor | slice) -> list[QuantizedWeight]:
    """Each part's share of a layer's output rows `rows` (the parts' rows one after the other),
    parts without any left out."""
    total = sum(p.out_features for p in parts)
    rows = torch.arange(total)[rows] if isinstance(rows, slice) else rows.long().cpu()
    kept, start = [], 0
    for part in parts:
        mine = rows[(rows >= start) & (rows < start + part.out_features)] - start
        if len(mine):
            kept.append(part.take_rows(mine))
        start += part.out_features
    return kept


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is `parts` (output rows one after the other); `bias` in the
    compute dtype or None."""

    def __init__(self, parts: list[QuantizedWeight], bias: torch.Tensor | None):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        # (models/basic.Linear's: the rows of the whole layer a tensor-parallel split kept)
        self.kept_rows: torch.Tensor | slice | None = None

    def keep_rows(self, rows: torch.Tensor | slice) -> None:
        """In place, a tensor-parallel rank's output rows (parallel/tensor_parallel.py's _keep_rows)."""
        self.parts = nn.ModuleList(_share_of_parts(list(self.parts), rows))
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.data[rows].clone(), requires_grad=False)
        self.out_features = sum(p.out_features for p in self.parts)
        self.kept_rows = rows

    def columns_taken(self, cols: slice, name: str, bias: bool) -> QuantizedLinear:
        """A rank's input columns of this layer (a row-parallel projection's share), with the bias
        where `bias` (the rank that adds it once)."""
        parts = [p.take_columns(cols, name) for p in self.parts]
        return QuantizedLinear(parts, self.bias.data if bias and self.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        outs = [quantized_matmul(flat, part) for part in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"parts={[type(p).__name__ for p in self.parts]}")


class ExpertStack(nn.Module):
    """Every expert's weight of one projection, as grouped_experts (models/moe.py) reads it:
    `stack[e]` is expert e's weight [out, in] in `dtype`, the compute dtype (its parts' rows one
    after the other: the gate's, then up's)."""

    def __init__(self, parts: list[QuantizedWeight], dtype: torch.dtype):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.dtype = dtype
        self.num_experts = parts[0].lead[0]
        self.shape = (self.num_experts, sum(p.out_features for p in parts), parts[0].in_features)

    def __len__(self) -> int:
        return self.num_experts

    def __getitem__(self, expert: int) -> torch.Tensor:
        return dequantized(list(self.parts), (expert,)).to(self.dtype)

    def rows_taken(self, rows: torch.Tensor | slice) -> ExpertStack:
        """Every expert's output rows `rows` (a rank's share of the intermediate: gate's and up's)."""
        return ExpertStack(_share_of_parts(list(self.parts), rows), self.dtype)

    def columns_taken(self, cols: slice, name: str) -> ExpertStack:
        return ExpertStack([p.take_columns(cols, name) for p in self.parts], self.dtype)

    def experts_taken(self, experts: slice) -> ExpertStack:
        return ExpertStack([p.take_experts(experts) for p in self.parts], self.dtype)


def fused_quantized_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: ExpertStack,
                            down: ExpertStack, gate_up_bias, down_bias, glu) -> torch.Tensor | None:
    """The Triton fused MoE over quantized experts (kernels/triton_quant_moe.py) where it reads
    them: gate and up quantized alike, one part each (None: it does not; run them grouped)."""
    from baton.kernels.triton_quant_moe import fused_moe_quantized  # (triton is optional: imported where used)

    if len(gate_up.parts) != 2 or len(down.parts) != 1:
        return None
    gate, up = (p.triton_operand() for p in gate_up.parts)
    if not gate.same_kind(up):
        return None
    return fused_moe_quantized(x, weights, ids, gate, up, down.parts[0].triton_operand(), gate_up_bias, down_bias,
                               glu.kind, glu.alpha, glu.limit)
