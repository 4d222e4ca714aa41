"""The building blocks every layer is made of: RMSNorm (Gemma's offset form too), linear layers
and embeddings that the checkpoint fills (no random init), and the SwiGLU or GeGLU MLP (its
gate and up projections merged into one matmul when weights are loaded)."""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # (args.py imports moe.py, which imports this)
    from baton.engine.worker.models.args import ModelArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        """`offset`: Gemma's norms scale by (1 + weight), in float32."""
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32, as transformers does, whatever the weights' dtype.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


def norm(args: ModelArgs, dim: int | None = None) -> RMSNorm:
    return RMSNorm(dim or args.hidden_size, args.rms_norm_eps, args.norm_offset)


class Linear(nn.Linear):
    # The rows of the whole layer this one keeps, where a tensor-parallel split took a share of
    # them (a LoRA adapter's B keeps the same columns).
    kept_rows: torch.Tensor | slice | None = None

    def reset_parameters(self) -> None:
        """No random init: every weight comes from the checkpoint (and initializing, even on
        the meta device, makes torch import its compiler: seconds of start-up)."""


class Embedding(nn.Embedding):
    reset_parameters = Linear.reset_parameters


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, intermediate_size: int | None = None):
        super().__init__()
        size = intermediate_size or args.intermediate_size
        self.gate_up_proj = Linear(args.hidden_size, 2 * size, bias=args.mlp_bias)
        self.down_proj = Linear(size, args.hidden_size, bias=args.mlp_bias)
        self.act = F.silu if args.activation == "silu" else partial(F.gelu, approximate="tanh")

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
