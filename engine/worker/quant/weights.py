"""Weights kept as their checkpoint ships them: FP8 values with a grid of scales (per tensor, per
channel, per block), integer codes with scales and zero points per group (GPTQ, AWQ,
compressed-tensors' int formats), and MXFP4 (gpt-oss's experts). Each holds the bytes the
checkpoint had (4-bit codes two to a byte) and turns a span of its rows into float32 on demand:
what a linear layer multiplies by, a tile at a time (linear.py), and what an expert runs with.

A weight may carry leading dimensions (a stack of experts: [experts, out, in]); `index` picks
one. `dequantize` here, in float32, is the reference: the CPU kernel (`kernel_rows`, computing
every value as it does) and the Triton kernels (`triton_operand`, `triton_matmul`) read the same
bytes, and a tensor-parallel rank takes its share with `take_rows`, `take_columns`,
`take_experts`, scales and zero points going with their rows and columns.
"""
from __future__ import annotations

import torch
from torch import nn

from baton.engine.common.errors import InvalidArgument
from baton.kernels import cpu_dequant
from baton.kernels.cpu_dequant import QuantRows

# MXFP4's 4-bit values (E2M1), by code; a byte holds two, the low nibble first.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class QuantizedWeight(nn.Module):
    """A [*lead, out, in] weight in a quantized format; its tensors are buffers (they move with
    the model and are not trained)."""
    out_features: int
    in_features: int

    def dequantize(self, index: tuple[int, ...] = (), rows: slice = slice(None)) -> torch.Tensor:
        """Rows `rows` of the weight at leading `index`, in float32: [rows, in]."""
        raise NotImplementedError

    @property
    def lead(self) -> tuple[int, ...]:
        """The leading dimensions (experts), () for a plain layer's weight."""
        raise NotImplementedError

    def __init__(self):
        super().__init__()
        self._cpu_rows: dict[tuple[int, ...], tuple[tuple, QuantRows]] = {}

    def kernel_rows(self, index: tuple[int, ...] = ()) -> QuantRows:
        """The weight at leading `index` as the CPU kernel reads it (kernels/cpu_dequant.py)."""
        raise NotImplementedError

    def cpu_rows(self, index: tuple[int, ...] = ()) -> QuantRows:
        """kernel_rows(index), built once while the buffers stay where they are: every step's
        matmul asks for it, and the struct of pointers takes ~15 us to build per layer part."""
        key = tuple(b.data_ptr() for b in self.buffers())
        cached = self._cpu_rows.get(index)
        if cached is None or cached[0] != key:
            cached = self._cpu_rows[index] = (key, self.kernel_rows(index))
        return cached[1]

    def triton_operand(self):
        """The weight as the Triton kernels read it (kernels/triton_quant.QuantOperand)."""
        raise NotImplementedError

    def triton_matmul(self, x: torch.Tensor, index: tuple[int, ...] = ()) -> torch.Tensor:
        """x [T, in] times the weight at `index` transposed, by the Triton kernel of its format
        (kernels/triton_quant.py); formats without one dequantize here."""
        return torch.nn.functional.linear(x, self.dequantize(index).to(x.dtype))

    def stacked(self, others: list[QuantizedWeight]) -> QuantizedWeight:
        """This weight and `others` (the same format and shape) as one with a leading dimension."""
        raise NotImplementedError

    # A tensor-parallel rank's share (parallel/tensor_parallel.py): copies of their own, scales and
    # zero points travelling with their rows and columns. A share that would cut what one scale
    # covers where the format cannot follow is refused naming tensor_parallel_size.

    def take_rows(self, rows: torch.Tensor) -> QuantizedWeight:
        """The output rows `rows` (an index tensor), in that order."""
        raise NotImplementedError

    def take_columns(self, cols: slice, layer: str) -> QuantizedWeight:
        """The input columns `cols` (of the layer named `layer`, for the refusal)."""
        raise NotImplementedError

    def take_experts(self, experts: slice) -> QuantizedWeight:
        """The experts `experts` of a stack."""
        raise NotImplementedError


def _rows(t: torch.Tensor, rows: torch.Tensor, dim: int = -2) -> torch.Tensor:
    return t.index_select(dim, rows.to(t.device)).contiguous()


def _refuse(layer: str, cols: slice, what: str) -> InvalidArgument:
    return InvalidArgument("tensor_parallel_size", f"{layer}: a rank's input columns {cols.start}..{cols.stop - 1} "
                                                   f"would cut {what}; choose a size whose shares keep them whole")


def _expand(grid: torch.Tensor, block: tuple[int, int], rows: slice, out: int, cols: int) -> torch.Tensor:
    """A grid of per-block values ([ceil(out / bo), ceil(in / bi)]) spread over rows `rows` (of
    `out`) and `cols` columns: each element's block's value."""
    start, stop, _ = rows.indices(out)
    bo, bi = block
    first, last = start // bo, -(-stop // bo)
    per_row = grid[first:last].repeat_interleave(bo, dim=0)[start - first * bo:stop - first * bo]
    return per_row.repeat_interleave(bi, dim=1)[:, :cols] if bi > 1 else per_row[:, :cols]


class FP8Weight(QuantizedWeight):
    """float8 values [*lead, out, in] times float32 scales, one per (bo, bi) block of the grid
    [*lead, ceil(out / bo), ceil(in / bi)]: per tensor a block of the whole weight, per channel
    (1, in), DeepSeek's (128, 128); partial blocks at the edges."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale.float())
        self.block = block
        self.out_features, self.in_features = weight.shape[-2:]

    @property
    def lead(self):
        return tuple(self.weight.shape[:-2])

    def dequantize(self, index=(), rows=slice(None)):
        w = self.weight[index][rows].float()
        return w * _expand(self.scale[index], self.block, rows, self.out_features, self.in_features)

    def kernel_rows(self, index=()):
        return cpu_dequant.fp8_rows(self.weight[index], self.scale[index], self.block)

    def triton_operand(self):
        from baton.kernels.triton_quant import FORMAT_FP8, QuantOperand

        return QuantOperand(self.weight, self.scale, None, None, FORMAT_FP8, 8, 0.0, 1, self.block, self.in_features)

    def triton_matmul(self, x, index=()):
        from baton.kernels import triton_quant  # (triton is optional: imported where used)

        # Half-precision activations on GPUs with FP8 tensor cores (Ada, Hopper): quantized per token
        # group, an FP8 x FP8 dot (vLLM's W8A8 block FP8). float32 compute stays weight-only: exact.
        if (x.dtype in (torch.bfloat16, torch.float16) and self.weight.dtype == torch.float8_e4m3fn
                and torch.cuda.get_device_capability(x.device) >= (8, 9)
                and triton_quant.w8a8_group(self.in_features, self.block[1]) is not None):
            return triton_quant.w8a8_matmul(x, self.weight[index], self.scale[index], self.block)
        return triton_quant.fp8_matmul(x, self.weight[index], self.scale[index], self.block)

    def stacked(self, others):
        parts = [self, *others]
        return FP8Weight(torch.stack([p.weight for p in parts]), torch.stack([p.scale for p in parts]), self.block)

    def take_rows(self, rows):
        # Each kept row keeps its block's scales (a grid of one row per row where rows cut a block).
        bo, bi = self.block
        return FP8Weight(_rows(self.weight, rows), _rows(self.scale, rows // bo), (1, bi))

    def take_columns(self, cols, layer):
        bi = self.block[1]
        whole = self.scale.shape[-1] == 1  # per tensor or per channel: one scale across the columns
        if not whole and (cols.start % bi or (cols.stop % bi and cols.stop != self.in_features)):
            raise _refuse(layer, cols, f"FP8 scale blocks of {bi} columns")
        grid = self.scale if whole else self.scale[..., cols.start // bi:-(-cols.stop // bi)].contiguous()
        block = (self.block[0], min(bi, cols.stop - cols.start))
        return FP8Weight(self.weight[..., cols].contiguous(), grid, block)

    def take_experts(self, experts):
        return FP8Weight(self.weight[experts].contiguous(), self.scale[experts].contiguous(), self.block)


class IntWeight(QuantizedWeight):
    """Integer codes of `bits` (4: two to a byte, the low nibble the even column; 8: one byte)
    [*lead, out, in * bits / 8], scales [*lead, out, groups] and zero points (codes, the same
    shape; None: `zero` for every group): W = (code - zero) * scale. Input column i is in group
    g_idx[i] (GPTQ's act-order; [*lead, in] where a stack's experts each have their own), else
    i // group_size. `in_features`: where 4-bit codes of an odd count end in half a byte (default:
    every code stored)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, zero: int, bits: int,
                 group_size: int, g_idx: torch.Tensor | None = None, in_features: int | None = None):
        super().__init__()
        self.register_buffer("codes", codes)
        # (Scales stay as shipped where the CPU kernel reads that dtype; zero points as int16, which
        # holds GPTQ v1's 2^bits too.)
        self.register_buffer("scales", scales if scales.dtype in cpu_dequant.SCALE_DTYPES else scales.float())
        self.register_buffer("zeros", None if zeros is None else zeros.to(torch.int16).contiguous())
        self.register_buffer("g_idx", None if g_idx is None else g_idx.to(torch.int32).contiguous())
        self.zero, self.bits, self.group_size = zero, bits, group_size
        self.out_features, self.in_features = codes.shape[-2], in_features or codes.shape[-1] * 8 // bits

    @property
    def lead(self):
        return tuple(self.codes.shape[:-2])

    def dequantize(self, index=(), rows=slice(None)):
        codes = self.codes[index][rows]
        if self.bits == 4:
            codes = torch.stack((codes & 0x0F, codes >> 4), dim=-1).flatten(-2)[..., :self.in_features]
        values, g_idx = codes.float(), self._g_idx(index)
        scales = self._per_column(self.scales[index][rows].float(), g_idx)
        if self.zeros is None:
            return (values - self.zero) * scales
        return (values - self._per_column(self.zeros[index][rows].float(), g_idx)) * scales

    def _g_idx(self, index: tuple[int, ...]) -> torch.Tensor | None:
        """The g_idx of the weight at leading `index` (its expert's own, where each has one)."""
        return self.g_idx if self.g_idx is None or self.g_idx.dim() == 1 else self.g_idx[index]

    def triton_operand(self):
        from baton.kernels.triton_quant import FORMAT_INT, QuantOperand

        return QuantOperand(self.codes, self.scales, self.zeros, self.g_idx, FORMAT_INT, self.bits, float(self.zero),
                            self.group_size, (1, 1), self.in_features)

    def triton_matmul(self, x, index=()):
        from baton.kernels.triton_quant import int_matmul  # (triton is optional: imported where used)

        zeros = None if self.zeros is None else self.zeros[index]
        return int_matmul(x, self.codes[index], self.bits, self.in_features, self.scales[index], zeros, self.zero,
                          self.group_size, self._g_idx(index))

    def kernel_rows(self, index=()):
        zeros = None if self.zeros is None else self.zeros[index]
        return cpu_dequant.integer_rows(self.codes[index], self.bits, self.in_features, self.scales[index], zeros,
                                        self.zero, self.group_size, self._g_idx(index))

    def take_rows(self, rows):
        zeros = None if self.zeros is None else _rows(self.zeros, rows)
        return IntWeight(_rows(self.codes, rows), _rows(self.scales, rows), zeros, self.zero, self.bits,
                         self.group_size, self.g_idx, self.in_features)

    def take_columns(self, cols, layer):
        if self.bits == 4 and cols.start % 2:
            raise _refuse(layer, cols, "a byte of two 4-bit codes")
        per_byte = 8 // self.bits
        codes = self.codes[..., cols.start // per_byte:-(-cols.stop // per_byte)].contiguous()
        if self.g_idx is not None and self.g_idx.dim() > 1:  # each expert's own groups: all kept, columns cut
            return IntWeight(codes, self.scales, self.zeros, self.zero, self.bits, self.group_size,
                             self.g_idx[..., cols], cols.stop - cols.start)
        groups = (self.g_idx.long() if self.g_idx is not None
                  else torch.arange(self.in_features, device=self.codes.device) // self.group_size)[cols]
        if self.g_idx is None and cols.start % self.group_size == 0:  # whole groups: plain groups still
            first = cols.start // self.group_size
            last = -(-cols.stop // self.group_size)
            zeros = None if self.zeros is None else self.zeros[..., first:last].contiguous()
            return IntWeight(codes, self.scales[..., first:last].contiguous(), zeros, self.zero, self.bits,
                             self.group_size, None, cols.stop - cols.start)
        used, g_idx = torch.unique(groups, return_inverse=True)  # the groups the columns use, renumbered
        zeros = None if self.zeros is None else self.zeros[..., used].contiguous()
        return IntWeight(codes, self.scales[..., used].contiguous(), zeros, self.zero, self.bits, self.group_size,
                         g_idx.to(torch.int32), cols.stop - cols.start)

    def take_experts(self, experts):
        zeros = None if self.zeros is None else self.zeros[experts].contiguous()
        g_idx = self.g_idx if self.g_idx is None or self.g_idx.dim() == 1 else self.g_idx[experts]
        return IntWeight(self.codes[experts].contiguous(), self.scales[experts].contiguous(), zeros, self.zero,
                         self.bits, self.group_size, g_idx, self.in_features)

    def _per_column(self, grouped: torch.Tensor, g_idx: torch.Tensor | None) -> torch.Tensor:
        if g_idx is not None:
            return grouped[:, g_idx.long()]
        return grouped.repeat_interleave(self.group_size, dim=1)[:, :self.in_features]

    def stacked(self, others):
        parts = [self, *others]
        zeros = None if self.zeros is None else torch.stack([p.zeros for p in parts])
        g_idx = self.g_idx  # one for the stack, or each expert's own (act-order quantizes each alone)
        if g_idx is not None and any(not torch.equal(p.g_idx, g_idx) for p in others):
            g_idx = torch.stack([p.g_idx for p in parts])
        return IntWeight(torch.stack([p.codes for p in parts]), torch.stack([p.scales for p in parts]), zeros,
                         self.zero, self.bits, self.group_size, g_idx, self.in_features)


class MXFP4Weight(QuantizedWeight):
    """OCP microscaling FP4 (gpt-oss's experts): blocks [*lead, out, G, 16] bytes of two E2M1
    codes each, the low nibble first, and scales [*lead, out, G], biased exponents (2^(s - 127))
    each shared by a block's 32 values: in = G * 32."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.register_buffer("blocks", blocks)
        self.register_buffer("scales", scales)
        self.register_buffer("lut", torch.tensor(FP4_VALUES, dtype=torch.float32), persistent=False)
        self.out_features, self.in_features = blocks.shape[-3], blocks.shape[-2] * 32

    @property
    def lead(self):
        return tuple(self.blocks.shape[:-3])

    def dequantize(self, index=(), rows=slice(None)):
        return dequantize_mxfp4(self.blocks[index][rows], self.scales[index][rows], self.lut)

    def kernel_rows(self, index=()):
        return cpu_dequant.mxfp4_rows(self.blocks[index], self.scales[index])

    def triton_operand(self):
        from baton.kernels.triton_quant import FORMAT_MXFP4, QuantOperand

        flat = self.blocks.flatten(-2)  # [..., out, in / 2]: two codes a byte, as 4-bit integer codes
        return QuantOperand(flat, self.scales, None, None, FORMAT_MXFP4, 4, 0.0, 32, (1, 1), self.in_features)

    def stacked(self, others):
        parts = [self, *others]
        return MXFP4Weight(torch.stack([p.blocks for p in parts]), torch.stack([p.scales for p in parts]))

    def take_rows(self, rows):
        return MXFP4Weight(_rows(self.blocks, rows, -3), _rows(self.scales, rows))

    def take_columns(self, cols, layer):
        if cols.start % 32 or cols.stop % 32:
            raise _refuse(layer, cols, "MXFP4 blocks of 32")
        groups = slice(cols.start // 32, cols.stop // 32)
        return MXFP4Weight(self.blocks[..., groups, :].contiguous(), self.scales[..., groups].contiguous())

    def take_experts(self, experts):
        return MXFP4Weight(self.blocks[experts].contiguous(), self.scales[experts].contiguous())


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, lut: torch.Tensor | None = None) -> torch.Tensor:
    """MXFP4 blocks [..., G, 16] and scales [..., G] (MXFP4Weight) as float32 [..., G * 32]."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device) if lut is None else lut
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1).flatten(-2)
    return torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None].float()).flatten(-2)
