"""Rotary position embeddings: the frequencies of each scaling kind, computed as transformers
computes them (so float32 matches bit for bit), and the factor some apply to cos and sin."""
from __future__ import annotations

import math

import torch

from baton.engine.common.errors import InvalidArgument

KINDS = ("default", "linear", "llama3", "yarn")


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
        if kind == "yarn":  # transformers' defaults, as it reads them
            scaling = {"original_max_position_embeddings": cfg.get("max_position_embeddings", 2048), **scaling}
        if kind == "default":
            scaling = None
    return theta, scaling, partial


def inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies, and the factor cos and sin are multiplied by (YaRN's)."""
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
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


def _yarn(dim: int, theta: float, s: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): frequencies past the original context interpolated by `factor`,
    the fast ones kept, a linear ramp between; cos and sin scaled by the attention factor."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
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
