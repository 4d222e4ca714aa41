"""Llama and Qwen2 decoder models in plain PyTorch, running on a flat token batch.

The architectures differ only in switches read from config.json: Qwen2 has a bias on q/k/v,
either may tie the LM head to the embeddings, and Llama 3 scales RoPE frequencies.
q/k/v and gate/up projections are merged into one matmul each when weights are loaded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.common.errors import InvalidArgument
from baton.kernels.attention import AttentionMetadata, paged_attention

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


@dataclass(slots=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    torch_dtype: str | None

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelArgs:
        arch = (cfg.get("architectures") or [""])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise InvalidArgument("model", f"architecture {arch!r} is not supported "
                                           f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        if cfg.get("hidden_act", "silu") != "silu":
            raise InvalidArgument("model", f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        # transformers >= 5 writes rope settings under rope_parameters; older checkpoints at top level.
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        scaling = rope if rope.get("rope_type", "default") != "default" else cfg.get("rope_scaling")
        heads = cfg["num_attention_heads"]
        is_qwen2 = SUPPORTED_ARCHITECTURES[arch] == "qwen2"
        return cls(
            architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(rope_theta), rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=True if is_qwen2 else cfg.get("attention_bias", False),
            o_bias=False if is_qwen2 else cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "") or None,
        )


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Per-pair inverse frequencies, computed as transformers does (so float32 matches bit for bit)."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise InvalidArgument("model", f"rope_type {kind!r} is not supported (default, linear, llama3)")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32, as transformers does, whatever the weights' dtype.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        """No random init: every weight comes from the checkpoint (and initializing, even on
        the meta device, makes torch import its compiler: seconds of start-up)."""


class Embedding(nn.Embedding):
    reset_parameters = Linear.reset_parameters


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, half-split layout; x: [T, heads, D], cos/sin: [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size, self.kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = Linear(self.q_size, args.hidden_size, bias=args.o_bias)
        self.scale = args.head_dim ** -0.5

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        # q and k side by side in each row: one RoPE over both heads' sets.
        qk = rotate(qkv[:, :self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim),
                    cos, sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, k_cache, v_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope_cos: torch.Tensor | None = None  # [max positions, D], set by init_rope()
        self.rope_sin: torch.Tensor | None = None

    def init_rope(self, max_len: int) -> None:
        inv_freq = rope_inv_freq(self.args).to(self.embed_tokens.weight.device)
        freqs = torch.outer(torch.arange(max_len, device=inv_freq.device).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = self.embed_tokens.weight.dtype
        self.rope_cos, self.rope_sin = emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [num_blocks, num_layers, 2, block_size, kv_heads, D].
        Returns the final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[:, i, 0], kv_cache[:, i, 1], meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
