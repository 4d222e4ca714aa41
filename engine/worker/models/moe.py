"""The mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, gpt-oss): a
router picks each token's top-k experts, and the chosen experts' SwiGLU outputs are summed by the
router's weights; Qwen2-MoE adds a shared expert behind a sigmoid gate, DeepSeek shared experts
every token takes as they are; gpt-oss's router and experts have biases and its SwiGLU is
clamped (GLU).

The experts run grouped: the step's (token, expert) pairs are sorted by expert, and each expert
that has any does one matmul over its rows (the LoRA path's idea), gathered once and summed back
with one index_add, rather than a pass over every token or every expert. On CUDA, where Triton is
installed, kernels/triton_moe.py does the same in two launches (no matmul per expert, no count
per expert read back to the host). Expert weights are
stacked ([experts, 2 · intermediate, hidden] and [experts, hidden, intermediate]); the loader fills
them from the checkpoints' per-expert tensors.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.worker.models.basic import MLP, Linear
from baton.engine.worker.quant.linear import fused_quantized_experts

ROUTINGS = ("softmax", "group_limited_greedy", "noaux_tc", "topk_softmax")


@dataclass(frozen=True, slots=True)
class GLU:
    """An expert's gated activation of its gate and up halves: "silu" (SwiGLU: silu(gate) · up), or
    "swiglu_oai" (gpt-oss): gate clamped above at `limit`, up to ±limit, then
    (up + 1) · gate · sigmoid(alpha · gate)."""
    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


SWIGLU = GLU()


def route(logits: torch.Tensor, top_k: int, renormalize: bool, scaling: float = 1.0, method: str = "softmax",
          num_groups: int = 1, top_groups: int = 1, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing, in float32: ([T, k] weights, [T, k] expert ids). `renormalize`: the k
    weights rescaled to sum to 1 (Mixtral; Qwen's norm_topk_prob); `scaling`: then multiplied by it
    (DeepSeek's routed_scaling_factor). "softmax": the softmax's top k. "group_limited_greedy"
    (DeepSeek-V2): the experts in `num_groups` groups, a token's picks only from the `top_groups`
    groups of highest best score. "noaux_tc" (DeepSeek-V3): sigmoid scores; the picks by score +
    `bias` (e_score_correction_bias), from the groups whose two best such sum highest; the
    weights the picks' scores without the bias. "topk_softmax" (gpt-oss): the top k logits, then
    their softmax."""
    if method == "topk_softmax":
        top, ids = torch.topk(logits.float(), top_k, dim=-1)
        return top.softmax(dim=-1), ids
    if method == "noaux_tc":
        return _route_noaux_tc(logits.float().sigmoid(), top_k, renormalize, scaling, num_groups, top_groups, bias)
    scores = logits.float().softmax(dim=-1)
    if method == "group_limited_greedy":
        grouped = scores.view(scores.shape[0], num_groups, -1)
        best = torch.topk(grouped.max(dim=-1).values, top_groups, dim=-1).indices
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=scores.device).scatter_(1, best, True)
        scores = grouped.masked_fill(~keep[..., None], 0.0).view(scores.shape)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scaling if scaling != 1.0 else weights, ids


def _route_noaux_tc(scores, top_k, renormalize, scaling, num_groups, top_groups, bias):
    choice = scores + bias.float()
    grouped = choice.view(scores.shape[0], num_groups, -1)
    best = torch.topk(grouped.topk(2, dim=-1).values.sum(dim=-1), top_groups, dim=-1).indices
    keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=scores.device).scatter_(1, best, True)
    ids = torch.topk(grouped.masked_fill(~keep[..., None], float("-inf")).view(scores.shape), top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, glu: GLU = SWIGLU, gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k weights[t, k] · expert_{ids[t, k]}(x[t]) for every token t: x [T, H], weights and ids
    [T, k], gate_up [E, 2I, H] (the gate's rows, then up's), down [E, H, I], biases [E, 2I] and
    [E, H] or None. One matmul pair per expert that has tokens."""
    num_tokens, top_k = ids.shape
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    tokens = order // top_k  # the token of each sorted pair
    rows = x[tokens]
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            gate, up = F.linear(rows[start:start + n], gate_up[expert], _row(gate_up_bias, expert)).chunk(2, dim=-1)
            out[start:start + n] = F.linear(glu(gate, up), down[expert], _row(down_bias, expert))
            start += n
    scaled = (out * weights.flatten()[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, scaled)


def _row(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if bias is None else bias[expert]


def naive_experts(x, weights, ids, gate_up, down, glu: GLU = SWIGLU, gate_up_bias=None, down_bias=None):
    """The same sum token by token, pair by pair: the grouped path's oracle (tests, bench)."""
    out = torch.zeros_like(x)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = F.linear(x[t], gate_up[e], _row(gate_up_bias, e)).chunk(2, dim=-1)
            out[t] += (F.linear(glu(gate, up), down[e], _row(down_bias, e)) * weights[t, k]).to(x.dtype)
    return out


class Experts(nn.Module):
    """Every expert's weights stacked (see grouped_experts), with biases where `biased` (gpt-oss)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, biased: bool = False, glu: GLU = SWIGLU):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate)) if biased else None
        self.down_bias = nn.Parameter(torch.empty(num_experts, hidden)) if biased else None
        self.intermediate, self.glu = intermediate, glu

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda" and _TRITON and isinstance(self.gate_up, torch.Tensor):
            from baton.kernels.triton_moe import fused_moe  # imported where used only: triton is optional
            return fused_moe(x, weights, ids, self.gate_up, self.down, self.gate_up_bias, self.down_bias,
                             self.glu.kind, self.glu.alpha, self.glu.limit)
        if x.device.type == "cuda" and _TRITON:  # quantized experts (quant/linear.ExpertStack), dequantized in-kernel
            out = fused_quantized_experts(x, weights, ids, self.gate_up, self.down, self.gate_up_bias,
                                          self.down_bias, self.glu)
            if out is not None:
                return out
        return grouped_experts(x, weights, ids, self.gate_up, self.down, self.glu, self.gate_up_bias, self.down_bias)


_TRITON = importlib.util.find_spec("triton") is not None


class Router(nn.Module):
    """The router's weight; DeepSeek-V3's bias on the scores it picks by; gpt-oss's on its logits."""

    def __init__(self, hidden: int, num_experts: int, corrected: bool, biased: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts)) if biased else None
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts)) if corrected else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class SparseMoE(nn.Module):
    """Named as the checkpoints name its parts (`gate` the router, gpt-oss's `router` read into it;
    `experts`, `shared_expert`)."""

    def __init__(self, args):
        super().__init__()
        self.top_k, self.renormalize = args.num_experts_per_tok, args.norm_topk_prob
        self.routing = dict(scaling=args.routed_scaling_factor, method=args.routing, num_groups=args.num_expert_groups,
                            top_groups=args.top_expert_groups)
        self.gate = Router(args.hidden_size, args.num_experts, args.routing == "noaux_tc", args.moe_bias)
        self.experts = Experts(args.num_experts, args.hidden_size, args.moe_intermediate_size, args.moe_bias,
                               args.expert_glu)
        # Qwen2-MoE: one more expert every token takes, gated
        gated = args.shared_expert_intermediate_size
        self.shared_expert = MLP(args, gated) if gated else None
        self.shared_expert_gate = Linear(args.hidden_size, 1, bias=False) if gated else None
        # DeepSeek: experts every token takes, as one MLP, ungated
        self.shared_experts = (MLP(args, args.moe_intermediate_size * args.num_shared_experts)
                               if args.num_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, **self.routing,
                             bias=self.gate.e_score_correction_bias)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
