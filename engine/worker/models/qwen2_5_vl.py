"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration) and Qwen2-VL (Qwen2VLForConditionalGeneration,
whose ViT has LayerNorms, an fc1/fc2 MLP and no windows): a ViT over images at their own resolution
(each cut into 14-pixel patches, two frames deep), with 2D RoPE over patch rows and columns,
attention within windows of 112 pixels except in a few full-attention layers, and a merger that
folds each 2x2 patch block into one token of the language model; a Qwen2 language model whose
RoPE turns three position streams (M-RoPE: time, height, width; mrope.py). The prompt holds
<|vision_start|><|image_pad|><|vision_end|> per image; the front expands the pad into the
image's (grid_h / 2) x (grid_w / 2) tokens.

Pixels reach the model as the front made them with the checkpoint's own image processor
(Qwen2VLImageProcessor): one row of 3 x 2 x 14 x 14 values per patch, in its order (2x2 merge
blocks contiguous), shaped [grid_t, grid_h, grid_w, row] so the grid travels with them."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.common.errors import InvalidArgument
from baton.engine.worker.models import qwen2
from baton.engine.worker.models.args import ImageEncoderArgs, ModelArgs
from baton.engine.worker.models.basic import RMSNorm
from baton.engine.worker.models.llava import ACTIVATIONS, FcMLP
from baton.engine.worker.models.rope import rotate


@dataclass(slots=True)
class QwenVisionArgs(ImageEncoderArgs):
    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int  # pixels a window's side spans
    full_attention_layers: list[int]  # the layers that attend over the whole image (fullatt_block_indexes)
    out_hidden_size: int
    rope_theta: float
    image_token_id: int  # <|image_pad|>: one per image in a prompt, expanded to the image's tokens
    start_token_id: int  # <|vision_start|>, before it in a prompt
    end_token_id: int  # <|vision_end|>, after it
    # Qwen2-VL's tower: LayerNorms (with biases) in place of RMSNorms, and an fc1/fc2 MLP of this
    # activation in place of the gated SiLU one; no windows (window_size 0).
    qwen2: bool = False
    hidden_act: str = "quick_gelu"

    @property
    def tokens_per_image(self) -> int:
        """0: each image takes as many tokens as its size gives (its grid over spatial_merge_size^2)."""
        return 0

    @property
    def prompt_wrap(self) -> list[int]:
        return [self.start_token_id, self.end_token_id]

    def most_tokens(self, model_dir: str) -> int:
        """The most tokens one image takes: its processor's max_pixels over a token's pixels."""
        path = os.path.join(model_dir, "preprocessor_config.json")
        processor = {}
        if os.path.isfile(path):
            with open(path) as f:
                processor = json.load(f)
        max_pixels = (processor.get("size") or {}).get("longest_edge") or processor.get("max_pixels") or 12845056
        return max_pixels // (self.patch_size * self.spatial_merge_size) ** 2


def language_args(cfg: dict, read, default_theta: float) -> ModelArgs:
    """The language model's args from a Qwen VL config: its text_config read by `read` (a text
    family's reader), with M-RoPE's sections (of the rotary half-dims: time, height, width), which
    ride in the rope parameters as a rope_type "mrope" that is otherwise the default RoPE."""
    text = dict(cfg.get("text_config") or cfg)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or cfg.get("rope_scaling") or {})
    section = rope.pop("mrope_section", None)
    rope.pop("mrope_interleaved", None)  # (Qwen3-VL's: its family interleaves whatever this says)
    if section is None:
        raise InvalidArgument("model", "a Qwen VL config must give rope_parameters.mrope_section")
    if rope.get("rope_type", rope.get("type", "default")) in ("mrope", "default"):
        rope["rope_type"] = "default"
        rope.pop("type", None)
    text.pop("rope_scaling", None)
    text["rope_parameters"] = {"rope_theta": text.get("rope_theta", default_theta), **rope}
    out = read({**text, "architectures": cfg.get("architectures"),
                "tie_word_embeddings": cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))})
    half = out.head_dim // 2
    if sum(section) != half:
        raise InvalidArgument("model", f"mrope_section {section} must sum to half the head dim ({half})")
    out.mrope_section = list(section)
    return out


def args(cfg: dict) -> ModelArgs:
    vision = cfg.get("vision_config") or {}
    v2 = (cfg.get("architectures") or [""])[0] == "Qwen2VLForConditionalGeneration"
    act = vision.get("hidden_act", "quick_gelu" if v2 else "silu")
    if act not in (ACTIVATIONS if v2 else ("silu",)):
        raise InvalidArgument("model", f"the vision tower's hidden_act {act!r} is not supported")
    out = language_args(cfg, qwen2.args, 1_000_000.0)
    vision_rope = vision.get("rope_parameters") or {}
    depth = vision.get("depth", vision.get("num_hidden_layers", 32))
    if v2:  # (its vision hidden_size is the language model's: embed_dim is the tower's own)
        width = vision.get("embed_dim", 1280)
        shape = {"hidden_size": width, "intermediate_size": int(width * vision.get("mlp_ratio", 4)), "window_size": 0,
                 "full_attention_layers": list(range(depth)), "out_hidden_size": vision.get("hidden_size", 3584)}
    else:
        shape = {"hidden_size": vision.get("hidden_size", 3584),
                 "intermediate_size": vision.get("intermediate_size", 3420),
                 "window_size": vision.get("window_size", 112),
                 "full_attention_layers": list(vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
                 "out_hidden_size": vision.get("out_hidden_size", out.hidden_size)}
    out.vision = QwenVisionArgs(
        **shape, depth=depth, num_heads=vision.get("num_heads", vision.get("num_attention_heads", 16)),
        patch_size=vision.get("patch_size", 14), temporal_patch_size=vision.get("temporal_patch_size", 2),
        spatial_merge_size=vision.get("spatial_merge_size", 2),
        rope_theta=float(vision_rope.get("rope_theta", 10000.0)), image_token_id=cfg.get("image_token_id", 151655),
        start_token_id=cfg.get("vision_start_token_id", 151652), end_token_id=cfg.get("vision_end_token_id", 151653),
        qwen2=v2, hidden_act=act)
    if out.vision.out_hidden_size != out.hidden_size:
        raise InvalidArgument("model", f"vision_config.out_hidden_size {out.vision.out_hidden_size} must be the "
                                       f"language model's hidden_size {out.hidden_size}")
    return out


class _Attention(nn.Module):
    def __init__(self, v: QwenVisionArgs):
        super().__init__()
        self.heads = v.num_heads
        self.qkv = nn.Linear(v.hidden_size, 3 * v.hidden_size)
        self.proj = nn.Linear(v.hidden_size, v.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """x [seq, hidden]; attention within each of the consecutive runs of `lengths` patches."""
        seq = x.shape[0]
        q, k, v = self.qkv(x).view(seq, 3, self.heads, -1).unbind(1)
        q, k = (rotate(t.float(), cos, sin).to(t.dtype) for t in (q, k))  # in float32
        # [1, heads, n, D] each: SDPA's fused CPU kernel takes 4D inputs (3D ones take its ~8x slower math path)
        out = [F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in parts))[0].transpose(0, 1)
               for parts in zip(*(t.split(lengths) for t in (q, k, v)))]
        return self.proj(torch.cat(out).reshape(seq, -1))


class _GatedMLP(nn.Module):
    def __init__(self, v: QwenVisionArgs):
        super().__init__()
        self.gate_proj = nn.Linear(v.hidden_size, v.intermediate_size)
        self.up_proj = nn.Linear(v.hidden_size, v.intermediate_size)
        self.down_proj = nn.Linear(v.intermediate_size, v.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _norm(v: QwenVisionArgs) -> nn.Module:
    return nn.LayerNorm(v.hidden_size, eps=1e-6) if v.qwen2 else RMSNorm(v.hidden_size, 1e-6)


class _Block(nn.Module):
    def __init__(self, v: QwenVisionArgs):
        super().__init__()
        self.norm1, self.norm2 = _norm(v), _norm(v)
        self.attn, self.mlp = _Attention(v), (FcMLP(v) if v.qwen2 else _GatedMLP(v))

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class _PatchEmbed(nn.Module):
    def __init__(self, v: QwenVisionArgs, bias: bool = False):
        super().__init__()
        self.shape = (3, v.temporal_patch_size, v.patch_size, v.patch_size)
        self.proj = nn.Conv3d(3, v.hidden_size, self.shape[1:], self.shape[1:], bias=bias)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.proj(rows.view(-1, *self.shape).to(self.proj.weight.dtype)).flatten(1)


class _Merger(nn.Module):
    def __init__(self, v: QwenVisionArgs):
        super().__init__()
        self.width = v.hidden_size * v.spatial_merge_size ** 2
        self.ln_q = _norm(v)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width,
                                                                                       v.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class _Layout:
    """What an image's grid fixes for the tower: each patch's (row, column) for the 2D RoPE, the
    order that puts each window's merge blocks together, and the windows' and the image's lengths."""

    def __init__(self, v: QwenVisionArgs, t: int, h: int, w: int):
        m = v.spatial_merge_size
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        blocked = (h // m, m, w // m, m)  # the processor's order: each m x m block's patches together
        self.rowcol = torch.stack([p.reshape(blocked).transpose(1, 2).flatten() for p in (rows, cols)], 1).repeat(t, 1)
        # Windows of `side` x `side` merge blocks, the last row and column of windows cut short
        # (no windows: one a frame, the order unchanged).
        mh, mw = h // m, w // m
        side = v.window_size // m // v.patch_size or max(mh, mw)
        index = torch.arange(t * mh * mw).view(t, mh, mw)
        order, lengths = [], []
        for frame in index:
            for top in range(0, mh, side):
                for left in range(0, mw, side):
                    window = frame[top:top + side, left:left + side].flatten()
                    order.append(window)
                    lengths.append(window.numel() * m * m)
        self.order = torch.cat(order)  # merge blocks, window by window
        self.windows, self.frames = lengths, [h * w] * t


class QwenVision(nn.Module):
    """Pixels [images, grid_t, grid_h, grid_w, row] (images of one grid) -> each image's
    embeddings [images, grid_t * grid_h * grid_w / merge^2, hidden]."""

    def __init__(self, v: QwenVisionArgs, text_hidden: int):
        super().__init__()
        self.vision = v
        self.patch_embed = _PatchEmbed(v)
        self.blocks = nn.ModuleList(_Block(v) for _ in range(v.depth))
        self.merger = _Merger(v)
        spatial = v.hidden_size // v.num_heads // 2  # each axis's frequencies turn a quarter of a head
        self.register_buffer("inv_freq", 1.0 / (v.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float)
                                                                  / spatial)), persistent=False)

    def rotary(self, layout: _Layout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The 2D RoPE's (cos, sin) [patches, 1, head_dim] of each patch in the processor's order:
        a quarter of a head turns with its row, a quarter with its column, and again."""
        freqs = (layout.rowcol.to(device)[..., None].float() * self.inv_freq).flatten(1)  # rows' then cols'
        angles = torch.cat((freqs, freqs), dim=-1)
        return torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]

    def forward(self, pixels: torch.Tensor, sizes: list | None = None) -> torch.Tensor:
        t, h, w = pixels.shape[1:4]
        layout, unit = _Layout(self.vision, t, h, w), self.vision.spatial_merge_size ** 2
        order = layout.order.to(pixels.device)

        def windowed(x: torch.Tensor) -> torch.Tensor:  # merge blocks in window order
            return x.view(-1, unit, *x.shape[1:])[order].flatten(0, 1)
        cos, sin = (windowed(f) for f in self.rotary(layout, pixels.device))
        out = []
        for image in pixels:
            x = windowed(self.patch_embed(image.reshape(t * h * w, -1)))
            for i, block in enumerate(self.blocks):
                x = block(x, cos, sin, layout.frames if i in self.vision.full_attention_layers else layout.windows)
            out.append(self.merger(x)[torch.argsort(order)])
        return torch.stack(out)


# The checkpoint's prefixes of the vision side (transformers 5's, then the Hub's older layout),
# and of the language model (its text-model names).
CHECKPOINT_PREFIXES = {"model.visual.": "vision.", "visual.": "vision."}
LANGUAGE_PREFIXES = {"model.language_model.": "model."}
