"""The CPU kernel that turns quantized rows into float32 (kernels/cpu/dequant.cpp) equals each
weight's own PyTorch dequantization bit for bit: every format, odd shapes, partial blocks and
groups, act-order's g_idx, a stack of experts; and a quantized layer computes with it what it
computes without it."""
from __future__ import annotations

import pytest
import torch
from conftest import require_cpu_kernel

from baton.engine.worker.quant.formats import pack_codes
from baton.engine.worker.quant.linear import ExpertStack, QuantizedLinear, quantized_matmul
from baton.engine.worker.quant.weights import FP8Weight, IntWeight, MXFP4Weight
from baton.kernels import cpu_dequant


def _weights(gen: torch.Generator) -> dict[str, object]:
    out, cols = 37, 48  # rows not a multiple of any block
    w = torch.randn(out, cols, generator=gen)
    codes4 = torch.randint(0, 16, (out, cols), generator=gen, dtype=torch.uint8)
    codes8 = torch.randint(0, 256, (out, cols), generator=gen, dtype=torch.uint8)
    return {
        "fp8 e4m3 block 16x32": FP8Weight(w.to(torch.float8_e4m3fn), torch.rand(3, 2, generator=gen) + 0.1, (16, 32)),
        "fp8 e5m2 per channel": FP8Weight(w.to(torch.float8_e5m2), torch.rand(out, 1, generator=gen), (1, cols)),
        "int4 fp16 scales, zeros": IntWeight(pack_codes(codes4, 4), torch.rand(out, 6, generator=gen).half(),
                                             torch.randint(0, 16, (out, 6), generator=gen), 0, 4, 8),
        "int4 bf16 scales, symmetric, odd group": IntWeight(pack_codes(codes4[:, :45], 4), torch.rand(
            out, 5, generator=gen).bfloat16(), None, 8, 4, 9, in_features=45),
        "int4 act-order": IntWeight(pack_codes(codes4, 4), torch.rand(out, 3, generator=gen), torch.randint(
            0, 17, (out, 3), generator=gen), 0, 4, 16, torch.randperm(cols, generator=gen).int() % 3),
        "int8 float32 scales": IntWeight(codes8, torch.rand(out, 1, generator=gen), None, 128, 8, cols),
        "mxfp4": MXFP4Weight(torch.randint(0, 256, (out, 2, 16), generator=gen, dtype=torch.uint8),
                             torch.randint(118, 130, (out, 2), generator=gen, dtype=torch.uint8)),
    }


def test_the_kernel_dequantizes_every_format_as_the_reference_does():
    require_cpu_kernel()
    for name, weight in _weights(torch.Generator().manual_seed(0)).items():
        want = weight.dequantize()
        out = torch.empty(weight.out_features, weight.in_features)
        got = cpu_dequant.dequant_rows(weight.kernel_rows(), 0, weight.out_features, out)
        assert torch.equal(got, want), name
        part = torch.empty(10, weight.in_features)  # rows from the middle of a block
        assert torch.equal(cpu_dequant.dequant_rows(weight.kernel_rows(), 13, 23, part), want[13:23]), name
        stack = weight.stacked([weight, weight])  # experts: the kernel reads the one asked for
        assert torch.equal(cpu_dequant.dequant_rows(stack.kernel_rows((2,)), 0, weight.out_features, out), want), name


def test_a_layer_computes_the_same_with_and_without_the_kernel(monkeypatch):
    require_cpu_kernel()
    weights = _weights(torch.Generator().manual_seed(1))
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(2))
    for name, weight in weights.items():
        if weight.in_features != 48:
            continue
        layer = QuantizedLinear([weight, weight], torch.randn(2 * weight.out_features))
        with_kernel = layer(x)
        monkeypatch.setattr(cpu_dequant, "available", lambda: False)
        without = layer(x)
        monkeypatch.undo()
        torch.testing.assert_close(with_kernel, without, rtol=1e-6, atol=1e-6, msg=name)
        torch.testing.assert_close(without, x @ torch.cat([weight.dequantize()] * 2).T + layer.bias, rtol=1e-5,
                                   atol=1e-5, msg=name)


def test_large_layers_go_a_tile_at_a_time(monkeypatch):
    """A layer bigger than a tile is dequantized a tile of rows at a time (with and without the
    kernel), each tile's outputs in place: equal to the whole weight's."""
    from baton.engine.worker.quant import linear

    require_cpu_kernel()
    weight = _weights(torch.Generator().manual_seed(3))["int4 fp16 scales, zeros"]
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(4))
    whole = quantized_matmul(x, weight)
    monkeypatch.setattr(linear, "_TILE_VALUES", 48 * 5)  # 5 rows a tile: 8 tiles, the last of 2
    torch.testing.assert_close(quantized_matmul(x, weight), whole, rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(cpu_dequant, "available", lambda: False)
    torch.testing.assert_close(quantized_matmul(x, weight), whole, rtol=1e-6, atol=1e-6)


def test_an_expert_stack_gives_each_experts_weight_in_the_compute_dtype():
    gen = torch.Generator().manual_seed(5)
    gate, up = (IntWeight(pack_codes(torch.randint(0, 16, (3, 6, 16), generator=gen, dtype=torch.uint8), 4),
                          torch.rand(3, 6, 2, generator=gen), None, 8, 4, 8) for _ in range(2))
    stack = ExpertStack([gate, up], torch.bfloat16)
    assert len(stack) == 3 and stack.shape == (3, 12, 16)
    assert torch.equal(stack[1], torch.cat([gate.dequantize((1,)), up.dequantize((1,))]).bfloat16())


@pytest.mark.parametrize("bits", [4, 8])
def test_integer_codes_pack_two_to_a_byte_or_one(bits):
    codes = torch.randint(0, 1 << bits, (4, 7), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == ((4, 4) if bits == 4 else (4, 7))
    weight = IntWeight(packed, torch.ones(4, 1), None, 0, bits, 7, in_features=7)
    assert torch.equal(weight.dequantize(), codes.float())
