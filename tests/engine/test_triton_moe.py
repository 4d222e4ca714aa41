"""The Triton fused mixture-of-experts (kernels/triton_moe.py) equals a per-token PyTorch loop:
shapes that are no power of two, one token and several M-blocks of one expert, experts no token
picks, a token routed to one expert twice, biases on and off, silu and gpt-oss's clamped
swiglu (a small limit, so the clamps bite). Without CUDA the kernels run under Triton's
interpreter on CPU tensors; with CUDA, on the GPU. bfloat16 is left to a GPU: the interpreter's
tl.dot multiplies bf16 bit patterns as if they were other numbers."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from baton.engine.worker.models.moe import naive_experts

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
triton = pytest.importorskip("triton")
triton_moe = pytest.importorskip("baton.kernels.triton_moe")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTER, EXPERTS, TOP_K = 40, 24, 5, 2


def reference(x, weights, ids, gate_up, down, gate_up_bias=None, down_bias=None, activation="silu", alpha=1.702,
              limit=7.0):
    """Token by token, pair by pair, in float32: (the output [T, H], every pair's gate and up
    before the activation)."""
    x, gate_up, down = x.float().cpu(), gate_up.float().cpu(), down.float().cpu()
    ids, weights = ids.cpu(), weights.float().cpu()
    out, pre = torch.zeros(x.shape), []
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            h = gate_up[e] @ x[t] + (gate_up_bias[e].float().cpu() if gate_up_bias is not None else 0.0)
            gate, up = h.chunk(2)
            pre.append((gate, up))
            if activation == "silu":
                act = F.silu(gate) * up
            else:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                act = (up + 1) * gate * torch.sigmoid(alpha * gate)
            y = down[e] @ act + (down_bias[e].float().cpu() if down_bias is not None else 0.0)
            out[t] += weights[t, j] * y
    return out, pre


def case(num_tokens, bias=False, dtype=torch.float32, seed=0):
    """Routings over the first EXPERTS - 2 experts (the last two get no token); token 0 takes
    one expert twice."""
    gen = torch.Generator().manual_seed(seed + num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.3
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.3
    ids = torch.randint(0, EXPERTS - 2, (num_tokens, TOP_K), generator=gen)
    ids[0, 1] = ids[0, 0]
    weights = torch.rand(num_tokens, TOP_K, generator=gen)
    biases = (torch.randn(EXPERTS, 2 * INTER, generator=gen), torch.randn(EXPERTS, HIDDEN, generator=gen))
    move = [t.to(DEVICE) for t in (x.to(dtype), weights, ids, gate_up.to(dtype), down.to(dtype))]
    return move + ([b.to(dtype).to(DEVICE) for b in biases] if bias else [None, None])


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_fused_moe_equals_the_per_token_loop(num_tokens, bias, activation):
    """33 tokens × 2 over three experts: runs of about 22 pairs, two 16-row blocks each."""
    args = case(num_tokens, bias)
    limit = 0.5  # well inside the pre-activations' spread: both clamps bite (swiglu_oai)
    got = triton_moe.fused_moe(*args, activation=activation, limit=limit)
    want, pre = reference(*args, activation=activation, limit=limit)
    assert got.dtype == torch.float32 and got.shape == (num_tokens, HIDDEN)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)
    if activation == "swiglu_oai":
        gates, ups = torch.stack([g for g, _ in pre]), torch.stack([u for _, u in pre])
        assert (gates > limit).any() and (ups > limit).any() and (ups < -limit).any()


@pytest.mark.parametrize("block_m,block_n,block_k", [(16, 16, 16), (32, 64, 16), (64, 32, 64)])
def test_tile_sizes_do_not_change_the_sum(block_m, block_n, block_k):
    """Tiles wider than H and I (masked), narrower ones (several N-blocks and K-steps), an
    M-block taller than any expert's run; x a strided view (read in place)."""
    x, *rest = case(33, bias=True, seed=4)
    wide = torch.zeros(x.shape[0], 2 * HIDDEN, device=DEVICE)
    wide[:, 1::2] = x
    got = triton_moe.fused_moe(wide[:, 1::2], *rest, activation="swiglu_oai", block_m=block_m, block_n=block_n,
                               block_k=block_k)
    torch.testing.assert_close(got.cpu(), reference(x, *rest, activation="swiglu_oai")[0], atol=2e-5, rtol=2e-5)


def test_fused_moe_equals_the_models_oracle():
    """silu without biases: moe.py's naive_experts, the grouped path's oracle."""
    x, weights, ids, gate_up, down, _, _ = case(7, seed=2)
    torch.testing.assert_close(triton_moe.fused_moe(x, weights, ids, gate_up, down),
                               naive_experts(x, weights, ids, gate_up, down), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_float16_within_half_precision(bias):
    """The intermediate is rounded to float16 between the kernels, as the PyTorch path rounds
    its matmuls' outputs; the output once, from the float32 sum."""
    args = case(7, bias, dtype=torch.float16, seed=1)
    got = triton_moe.fused_moe(*args, activation="swiglu_oai")
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float().cpu(), reference(*args, activation="swiglu_oai")[0], atol=1e-2, rtol=1e-2)


def test_alignment_pads_each_experts_run_to_whole_blocks():
    ids = torch.tensor([[3, 0], [3, 3], [0, 1], [3, 3]], device=DEVICE)
    sorted_pairs, block_expert = triton_moe.align(ids, 6, 4)
    # Expert 0: pairs 1, 4 (one block); 1: pair 5 (one); 3: five pairs (two); 2, 4, 5: none. Sized
    # for the most blocks 8 pairs can take (no sync): 8 + 6 × 3 rows, 7 blocks; the last ones -1.
    assert block_expert.tolist() == [0, 1, 3, 3, -1, -1, -1]
    sentinel = ids.numel()
    assert sorted_pairs.tolist() == [1, 4, *[sentinel] * 2, 5, *[sentinel] * 3, 0, 2, 3, 6, 7,
                                     *[sentinel] * 3, *[sentinel] * 12]


def test_no_tokens_give_an_empty_output():
    x, weights, ids, gate_up, down, _, _ = case(3)
    got = triton_moe.fused_moe(x[:0], weights[:0], ids[:0], gate_up, down)
    assert got.shape == (0, HIDDEN)


@pytest.mark.parametrize("change,name", [
    # Out of range: checked on a CPU only (on a GPU it would cost every step a sync).
    pytest.param(lambda a: {**a, "ids": a["ids"] + EXPERTS - 2}, "ids",  # past the last expert
                 marks=pytest.mark.skipif(DEVICE == "cuda", reason="ids' range is checked on CPU only")),
    pytest.param(lambda a: {**a, "ids": a["ids"] - 3}, "ids",  # negative
                 marks=pytest.mark.skipif(DEVICE == "cuda", reason="ids' range is checked on CPU only")),
    (lambda a: {**a, "ids": a["ids"][:-1]}, "ids"),
    (lambda a: {**a, "weights": a["weights"][:, :1]}, "weights"),
    (lambda a: {**a, "gate_up": a["gate_up"][:, :-1]}, "gate_up"),  # 2I odd
    (lambda a: {**a, "gate_up": a["gate_up"][..., :-1]}, "gate_up"),  # not x's hidden size
    (lambda a: {**a, "down": a["down"][..., :-2]}, "down"),
    (lambda a: {**a, "down": a["down"].half()}, "down"),
    (lambda a: {**a, "gate_up_bias": a["gate_up_bias"][:, :INTER]}, "gate_up_bias"),
    (lambda a: {**a, "down_bias": a["down_bias"][:-1]}, "down_bias"),
    (lambda a: {**a, "activation": "gelu"}, "activation"),
])
def test_bad_input_is_refused_naming_the_argument(change, name):
    names = ["x", "weights", "ids", "gate_up", "down", "gate_up_bias", "down_bias"]
    args = change(dict(zip(names, case(4, bias=True))))
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        triton_moe.fused_moe(**args)
