"""The Triton kernels of quantized linear layers (kernels/triton_quant.py) equal x @ W.T with the
weight dequantized by its own PyTorch code: 4- and 8-bit codes with zero points or symmetric,
plain groups and act-order's g_idx, FP8 e4m3 and e5m2 with block, channel and tensor scales,
shapes that are no multiple of any tile and partial blocks. Without CUDA the kernels run under
Triton's interpreter on CPU tensors (float32); with CUDA, on the GPU, where a quantized layer
routes to them."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from baton.engine.worker.quant.formats import pack_codes
from baton.engine.worker.quant.weights import FP8Weight, IntWeight, MXFP4Weight

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")
triton_quant = pytest.importorskip("baton.kernels.triton_quant")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OUT, IN = 37, 48  # no multiple of a tile (32 wide here)


def weights(gen: torch.Generator) -> dict[str, object]:
    codes4 = torch.randint(0, 16, (OUT, IN), generator=gen, dtype=torch.uint8)
    codes8 = torch.randint(0, 256, (OUT, IN), generator=gen, dtype=torch.uint8)
    w = torch.randn(OUT, IN, generator=gen)
    return {
        "int4, zeros, fp16 scales": IntWeight(pack_codes(codes4, 4), torch.rand(OUT, 6, generator=gen).half(),
                                              torch.randint(0, 16, (OUT, 6), generator=gen), 0, 4, 8),
        "int4 symmetric, groups of 12": IntWeight(pack_codes(codes4, 4), torch.rand(OUT, 4, generator=gen), None,
                                                  8, 4, 12),
        "int4 act-order": IntWeight(pack_codes(codes4, 4), torch.rand(OUT, 3, generator=gen),
                                    torch.randint(0, 17, (OUT, 3), generator=gen), 0, 4, 16,
                                    torch.randperm(IN, generator=gen).int() % 3),
        "int8 per channel": IntWeight(codes8, torch.rand(OUT, 1, generator=gen), None, 128, 8, IN),
        "fp8 e4m3 blocks 16x32": FP8Weight(w.to(torch.float8_e4m3fn), torch.rand(3, 2, generator=gen), (16, 32)),
        "fp8 e5m2 per channel": FP8Weight(w.to(torch.float8_e5m2), torch.rand(OUT, 1, generator=gen), (1, IN)),
        "fp8 per tensor": FP8Weight(w.to(torch.float8_e4m3fn), torch.rand(1, 1, generator=gen), (OUT, IN)),
    }


@pytest.mark.parametrize("tokens", [1, 19])
def test_each_format_equals_the_dequantized_matmul(tokens):
    x = torch.randn(tokens, IN, generator=torch.Generator().manual_seed(1))
    for name, weight in weights(torch.Generator().manual_seed(0)).items():
        weight = weight.to(DEVICE)
        want = F.linear(x, weight.dequantize().cpu())
        got = weight.triton_matmul(x.to(DEVICE)).cpu()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=name)


def test_bad_operands_are_named():
    weight = weights(torch.Generator().manual_seed(0))["int4 symmetric, groups of 12"]
    with pytest.raises(ValueError, match="x must be"):
        weight.triton_matmul(torch.randn(2, IN + 1))
    with pytest.raises(ValueError, match="values must be"):
        triton_quant.fp8_matmul(torch.randn(2, IN), torch.randn(OUT, IN), torch.ones(1, 1), (OUT, IN))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a quantized layer routes to Triton on CUDA only")
def test_a_quantized_layer_on_cuda_routes_to_the_kernels(monkeypatch):
    from baton.engine.worker.quant.linear import QuantizedLinear

    calls = []
    monkeypatch.setattr(triton_quant, "int_matmul", lambda *a, **k: calls.append(1) or torch.zeros(3, OUT,
                                                                                                     device="cuda"))
    layer = QuantizedLinear([weights(torch.Generator().manual_seed(0))["int4, zeros, fp16 scales"]], None).cuda()
    layer(torch.randn(3, IN, device="cuda"))
    assert calls


def _stacks(gen: torch.Generator, experts: int, rows: int, cols: int) -> dict[str, object]:
    """One projection of `experts` experts [experts, rows, cols] in each format."""
    codes = torch.randint(0, 16, (experts, rows, cols), generator=gen, dtype=torch.uint8)
    w = torch.randn(experts, rows, cols, generator=gen)
    scales = torch.rand(experts, rows, cols // 8, generator=gen).half() * 0.1
    zeros = torch.randint(0, 16, (experts, rows, cols // 8), generator=gen)
    act_order = torch.stack([torch.randperm(cols, generator=gen) // 8 for _ in range(experts)])  # each its own
    return {"int4": IntWeight(pack_codes(codes, 4), scales, zeros, 0, 4, 8),
            "int4 act-order": IntWeight(pack_codes(codes, 4), scales, zeros, 0, 4, 8, act_order),
            "fp8": FP8Weight((w * 8).to(torch.float8_e4m3fn), torch.rand(experts, -(-rows // 16), -(-cols // 16),
                                                                         generator=gen) * 0.02, (16, 16)),
            "mxfp4": MXFP4Weight(torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=gen,
                                               dtype=torch.uint8),
                                 torch.randint(120, 126, (experts, rows, cols // 32), generator=gen,
                                               dtype=torch.uint8))}


@pytest.mark.parametrize("fmt", ["int4", "int4 act-order", "fp8", "mxfp4"])
def test_the_fused_moe_over_quantized_experts_equals_the_grouped_path(fmt):
    """Gate, up and down quantized (each with its own scales), gpt-oss's clamped activation and
    biases on MXFP4, silu elsewhere; 7 tokens over 5 experts, top 2."""
    from baton.engine.worker.models.moe import GLU, SWIGLU, grouped_experts
    from baton.engine.worker.quant.linear import ExpertStack, fused_quantized_experts

    gen = torch.Generator().manual_seed(4)
    experts, hidden, inter = 5, 64, 32
    gate, up = _stacks(gen, experts, inter, hidden)[fmt], _stacks(gen, experts, inter, hidden)[fmt]
    down = _stacks(gen, experts, hidden, inter)[fmt]
    gate_up, down = ExpertStack([gate, up], torch.float32).to(DEVICE), ExpertStack([down], torch.float32).to(DEVICE)
    glu = GLU("swiglu_oai", 1.702, 1.0) if fmt == "mxfp4" else SWIGLU
    biases = (torch.randn(experts, 2 * inter, generator=gen) * 0.1, torch.randn(experts, hidden, generator=gen) * 0.1
              ) if fmt == "mxfp4" else (None, None)
    x = torch.randn(7, hidden, generator=gen)
    top, ids = torch.randn(7, experts, generator=gen).topk(2, dim=-1)
    weights = top.softmax(-1)
    whole = (torch.stack([gate_up[e].cpu() for e in range(experts)]), torch.stack([down[e].cpu() for e in
                                                                                 range(experts)]))
    want = grouped_experts(x, weights, ids, *whole, glu, *biases)
    got = fused_quantized_experts(x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE), gate_up, down,
                                  *[b.to(DEVICE) if b is not None else None for b in biases], glu)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", [(16, 32), (1, 80), (37, 80)], ids=["blocks", "per channel", "per tensor"])
def test_w8a8_equals_the_same_activation_quantization_in_float(block):
    """FP8 x FP8 with per-token-group activation scales (the Hopper path): equal to dequantizing
    both operands as quantized (x's groups of 32 here) and multiplying in float32."""
    gen = torch.Generator().manual_seed(6)
    n, k = 37, 80  # K's last tile partial
    values = (torch.randn(n, k, generator=gen) * 4).to(torch.float8_e4m3fn)
    grid = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) + 0.5
    x = torch.randn(5, k, generator=gen) * 3
    group = triton_quant.w8a8_group(k, block[1])
    assert group == (32 if block == (16, 32) else 64)  # (one scale across K: the largest tile within it)
    xq, xs = triton_quant.quantize_activations(x, group)
    x_back = xq.float() * xs.repeat_interleave(group, dim=1)[:, :k]
    assert (x_back - x).abs().max() <= x.abs().max() / 16  # e4m3 keeps 3 mantissa bits
    weight = FP8Weight(values, grid, block)
    want = F.linear(x_back, weight.dequantize())
    got = triton_quant.w8a8_matmul(x.to(DEVICE), values.to(DEVICE), grid.to(DEVICE), block).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
