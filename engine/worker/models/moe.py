"""The mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3): a router
picks each token's top-k experts, and the chosen experts' SwiGLU outputs are summed by the
router's weights; Qwen2-MoE adds a shared expert behind a sigmoid gate, DeepSeek shared experts
every token takes as they are.

The experts run grouped: the step's (token, expert) pairs are sorted by expert, and each expert
that has any does one matmul over its rows (the LoRA path's idea), gathered once and summed back
with one index_add, rather than a pass over every token or every expert. Expert weights are
stacked ([experts, 2 · intermediate, hidden] and [experts, hidden, intermediate]); the loader fills
them from the checkpoints' per-expert tensors.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.worker.models.basic import MLP, Linear


ROUTINGS = ("softmax", "group_limited_greedy", "noaux_tc")


def route(logits: torch.Tensor, top_k: int, renormalize: bool, scaling: float = 1.0, method: str = "softmax",
          num_groups: int = 1, top_groups: int = 1, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing, in float32: ([T, k] weights, [T, k] expert ids). `renormalize`: the k
    weights rescaled to sum to 1 (Mixtral; Qwen's norm_topk_prob); `scaling`: then multiplied by it
    (DeepSeek's routed_scaling_factor). "softmax": the softmax's top k. "group_limited_greedy"
    (DeepSeek-V2): the experts in `num_groups` groups, a token's picks only from the `top_groups`
    groups of highest best score. "noaux_tc" (DeepSeek-V3): sigmoid scores; the picks by score +
    `bias` (e_score_correction_bias), from the groups whose two best such sum highest; the
    weights the picks' scores without the bias."""
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
                    down: torch.Tensor, act=F.silu) -> torch.Tensor:
    """sum_k weights[t, k] · expert_{ids[t, k]}(x[t]) for every token t: x [T, H], weights and ids
    [T, k], gate_up [E, 2I, H], down [E, H, I]. One matmul pair per expert that has tokens."""
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
            gate, up = F.linear(rows[start:start + n], gate_up[expert]).chunk(2, dim=-1)
            out[start:start + n] = F.linear(act(gate) * up, down[expert])
            start += n
    scaled = (out * weights.flatten()[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, scaled)


def naive_experts(x, weights, ids, gate_up, down, act=F.silu) -> torch.Tensor:
    """The same sum token by token, pair by pair: the grouped path's oracle (tests, bench)."""
    out = torch.zeros_like(x)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            gate, up = F.linear(x[t], gate_up[ids[t, k]]).chunk(2, dim=-1)
            out[t] += (F.linear(act(gate) * up, down[ids[t, k]]) * weights[t, k]).to(x.dtype)
    return out


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.intermediate = intermediate


class Router(nn.Module):
    """The router's weight, and DeepSeek-V3's bias on the scores it picks by."""

    def __init__(self, hidden: int, num_experts: int, corrected: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        if corrected:
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoE(nn.Module):
    """Named as the checkpoints name its parts (`gate` the router, `experts`, `shared_expert`)."""

    def __init__(self, args):
        super().__init__()
        self.top_k, self.renormalize = args.num_experts_per_tok, args.norm_topk_prob
        self.routing = dict(scaling=args.routed_scaling_factor, method=args.routing, num_groups=args.num_expert_groups,
                            top_groups=args.top_expert_groups)
        self.gate = Router(args.hidden_size, args.num_experts, args.routing == "noaux_tc")
        self.experts = Experts(args.num_experts, args.hidden_size, args.moe_intermediate_size)
        if args.shared_expert_intermediate_size:  # Qwen2-MoE: one more expert every token takes, gated
            self.shared_expert = MLP(args, args.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(args.hidden_size, 1, bias=False)
        if args.num_shared_experts:  # DeepSeek: experts every token takes, as one MLP, ungated
            self.shared_experts = MLP(args, args.moe_intermediate_size * args.num_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize, **self.routing,
                             bias=getattr(self.gate, "e_score_correction_bias", None))
        out = grouped_experts(x, weights, ids, self.experts.gate_up, self.experts.down)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out
