"""Rotary position embeddings: the frequencies of each scaling kind, computed as transformers
computes them (so float32 matches bit for bit), and the factor some apply to cos and sin."""
from __future__ import annotations

import math

import numpy as np
import torch

from baton.engine.common.errors import InvalidArgument

KINDS = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_settings(cfg: dict) -> tuple[float, dict | None, float]:
    """(rope_theta, scaling or None, partial_rotary_factor) from a config: transformers >= 5
    writes them under rope_parameters, older checkpoints at the top level."""
    rope = dict(cfg.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0))
    partial = float(rope.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0)
    scaling = rope if rope.get("rope_type", "default") != "default" else cfg.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in KINDS:
            raise InvalidArgument("rope_scaling", f"rope_type {kind!r} is not supported ({', '.join(KINDS)})")
        max_len = cfg.get("max_position_embeddings", 2048)
        if kind == "yarn":  # transformers' defaults, as it reads them
            scaling = {"original_max_position_embeddings": max_len, **scaling}
        elif kind == "longrope":  # Phi-3 keeps the original context at the top level
            scaling = {"original_max_position_embeddings": cfg.get("original_max_position_embeddings") or max_len,
                       **scaling, "max_position_embeddings": max_len}
        elif kind == "dynamic":  # scaled past max_position_embeddings
            scaling = {**scaling, "max_position_embeddings": max_len}
        if kind == "default":
            scaling = None
    return theta, scaling, partial


def inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies, and the factor cos and sin are multiplied by (YaRN's)."""
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", "dynamic"):  # dynamic: within the original context (RotaryTable scales past it)
        return base, 1.0
    if kind == "linear":
        return base / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(base, scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    raise InvalidArgument("rope_scaling", f"rope_type {kind!r} is not supported ({', '.join(KINDS)})")


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude scaling for a context stretched `scale` times."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, s: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): frequencies past the original context interpolated by `factor`,
    the fast ones kept, a linear ramp between; cos and sin scaled by the attention factor."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = (float(yarn_mscale(factor, m) / yarn_mscale(factor, m_all)) if m and m_all
                            else yarn_mscale(factor))
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))
    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


class RotaryTable:
    """cos and sin of every position up to max_len for one RoPE base and scaling. Dynamic NTK and
    LongRoPE scale by the sequence's length, which transformers takes per forward pass, so each
    token is looked up with a length (`lengths`), whatever the chunking or the engine (prefill,
    decode) that computes it:
    - dynamic NTK (Llama's generate): a prompt's tokens see the prompt's length L, each later
      token its own position + 1: max(p + 1, L);
    - LongRoPE (Phi-3's generate): every token the sequence's length when it is computed, and once
      a sequence grows past the original context its KV is computed again, long, from its first
      token (`recompute_at`)."""

    def __init__(self, dim: int, theta: float, scaling: dict | None, max_len: int, dtype: torch.dtype, device):
        self.dim, self.theta, self.scaling, self.dtype = dim, theta, scaling or {}, dtype
        self.kind = self.scaling.get("rope_type", self.scaling.get("type", "default"))
        # The length past which the scaling changes: LongRoPE's original context, dynamic NTK's maximum.
        self.original = self.scaling.get("original_max_position_embeddings" if self.kind == "longrope"
                                         else "max_position_embeddings")
        self.positions = torch.arange(max_len, device=device).float()
        if self.kind == "longrope":
            self.tables = [self._table(*_longrope(dim, theta, self.scaling, long)) for long in (False, True)]
        else:
            self.tables = [self._table(*inv_freq(dim, theta, scaling))]

    @property
    def by_length(self) -> bool:
        """Whether lookups need each token's sequence length."""
        return self.kind in ("dynamic", "longrope")

    @property
    def recompute_at(self) -> int | None:
        """A sequence longer than this has its KV computed again (LongRoPE: the long factors from
        then on, for every token, as transformers' Phi-3 recomputes its cache)."""
        return self.original if self.kind == "longrope" else None

    def lengths(self, start: int, end: int, prompt_len: int, total_len: int) -> np.ndarray:
        """The lengths positions [start, end) of a request are turned for (see the class)."""
        if self.kind == "longrope":
            return np.full(end - start, total_len)
        return np.maximum(np.arange(start + 1, end + 1), prompt_len)

    def length_key(self, prompt_len: int, total_len: int) -> int:
        """What of a sequence's lengths its KV depends on (0: nothing): LongRoPE's long factors
        once the sequence is past the original context, or dynamic NTK's prompt length past it.
        Prefix caching keeps sequences that differ here apart."""
        if self.kind == "longrope":
            return int(total_len > self.original)
        return prompt_len if self.kind == "dynamic" and prompt_len > self.original else 0

    def _table(self, inv: torch.Tensor, factor: float):
        freqs = torch.outer(self.positions, inv.to(self.positions.device))
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * factor).to(self.dtype), (emb.sin() * factor).to(self.dtype)

    def lookup(self, positions: torch.Tensor, lengths: torch.Tensor | None = None):
        """([T, 1, D] cos, sin) for `positions`; `lengths`: each token's sequence length, where
        the scaling depends on it, on the host (what to look up is decided there: no sync)."""
        cos, sin = self.tables[0]
        cos, sin = cos[positions], sin[positions]
        if self.by_length and lengths is not None:
            longer = lengths > self.original
            if self.kind == "longrope":  # the long factors past the original context
                on_device = longer.to(positions.device, non_blocking=True)[:, None]
                cos = torch.where(on_device, self.tables[1][0][positions], cos)
                sin = torch.where(on_device, self.tables[1][1][positions], sin)
            elif bool(longer.any()):  # dynamic NTK: a base of each length's own, all lengths at once
                lengths_seen, which = torch.unique(lengths[longer], return_inverse=True)
                rows = longer.nonzero().flatten().to(positions.device, non_blocking=True)
                inv = _dynamic(self.dim, self.theta, self.scaling, lengths_seen).to(positions.device)
                freqs = positions[rows].float()[:, None] * inv[which.to(positions.device)]
                emb = torch.cat((freqs, freqs), dim=-1)
                cos, sin = cos.clone(), sin.clone()
                cos[rows], sin[rows] = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def _dynamic(dim: int, theta: float, s: dict, lengths: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK's frequencies [len(lengths), dim / 2] for sequences of `lengths` tokens (past
    the original context), in transformers' float32 arithmetic (its length is a tensor there),
    element by element."""
    factor, original = s["factor"], s["max_position_embeddings"]
    base = theta * ((factor * lengths / original) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base[:, None] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)[None, :])


def _longrope(dim: int, theta: float, s: dict, long: bool) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-pair factors, `long_factor` past the original context, else
    `short_factor`; cos and sin scaled by the attention factor."""
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or s["max_position_embeddings"] / original
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32)
    if ext.numel() != dim // 2:
        raise InvalidArgument("rope_scaling", f"{'long' if long else 'short'}_factor has {ext.numel()} values; the "
                                              f"rotary dimension {dim} takes {dim // 2}")
    return 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), attention_factor


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, half-split layout; x: [T, heads, D], cos/sin: [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs (x[2i], x[2i+1]), as DeepSeek's complex-number form: x [T, heads, D],
    cos/sin [T, 1, D] of the half-split table (their first D / 2 are the pairs' angles)."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half].float(), sin[..., :half].float()
    x0, x1 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).to(x.dtype)
