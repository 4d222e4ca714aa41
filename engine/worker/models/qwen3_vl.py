"""Qwen3-VL (Qwen3VLForConditionalGeneration): Qwen2-VL's tower (LayerNorms, an fc1/fc2 MLP, every
block attending over the whole image, a 2D RoPE over patch rows and columns, 2x2 patches merged
into one token) with a biased patch embedding and a learned square grid of position embeddings
resampled (bilinearly, corners aligned) to each image's grid; a Qwen3 language model (qwen3.py)
whose M-RoPE interleaves the time, height and width frequencies (mrope.py); and DeepStack: the
outputs of a few tower blocks (deepstack_visual_indexes), merged each by a merger of its own that
norms after the 2x2 shuffle, are added to the image's tokens' hidden states after the first
decoder layers, level i after layer i (CausalLM.forward).

An image's embeddings are one tensor [tokens, (1 + levels) x hidden]: the merger's, then each
level's, so the runner's cache (image_embeddings.py) and an encoder tier's (ImageInput.encoded)
carry them as they carry any family's. Pixels and prompts are Qwen2.5-VL's (qwen2_5_vl.py: the
Qwen2-VL image processor, here of 16-pixel patches; <|vision_start|><|image_pad|><|vision_end|>;
the prompt's M-RoPE positions as transformers' get_rope_index gives them). No video."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from baton.engine.common.errors import InvalidArgument
from baton.engine.worker.models import qwen2_5_vl, qwen3
from baton.engine.worker.models.args import ModelArgs
from baton.engine.worker.models.llava import ACTIVATIONS
from baton.engine.worker.models.qwen2_5_vl import QwenVision, QwenVisionArgs, _Layout, _Merger, _PatchEmbed


@dataclass(slots=True)
class Qwen3VisionArgs(QwenVisionArgs):
    num_position_embeddings: int = 2304  # the learned position grid's (a square)
    deepstack_layers: list[int] = field(default_factory=list)  # deepstack_visual_indexes

    @property
    def deepstack_levels(self) -> int:
        return len(self.deepstack_layers)


def args(cfg: dict) -> ModelArgs:
    vision = cfg.get("vision_config") or {}
    act = vision.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise InvalidArgument("model", f"the vision tower's hidden_act {act!r} is not supported")
    out = qwen2_5_vl.language_args(cfg, qwen3.args, 500_000.0)
    out.mrope_interleaved = True
    depth = vision.get("depth", vision.get("num_hidden_layers", 27))
    positions = vision.get("num_position_embeddings", 2304)
    side = round(positions ** 0.5)
    deepstack = list(vision.get("deepstack_visual_indexes", (8, 16, 24)))
    if side * side != positions:
        raise InvalidArgument("model", f"vision_config.num_position_embeddings {positions} must be a square")
    if any(not 0 <= i < depth for i in deepstack) or len(set(deepstack)) != len(deepstack):
        raise InvalidArgument("model", f"vision_config.deepstack_visual_indexes {deepstack} must be distinct "
                                       f"blocks of the tower's {depth}")
    out.vision = Qwen3VisionArgs(
        hidden_size=vision.get("hidden_size", 1152), intermediate_size=vision.get("intermediate_size", 4304),
        depth=depth, num_heads=vision.get("num_heads", vision.get("num_attention_heads", 16)),
        patch_size=vision.get("patch_size", 16), temporal_patch_size=vision.get("temporal_patch_size", 2),
        spatial_merge_size=vision.get("spatial_merge_size", 2), window_size=0,
        full_attention_layers=list(range(depth)), out_hidden_size=vision.get("out_hidden_size", out.hidden_size),
        rope_theta=float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        image_token_id=cfg.get("image_token_id", 151655), start_token_id=cfg.get("vision_start_token_id", 151652),
        end_token_id=cfg.get("vision_end_token_id", 151653), qwen2=True, hidden_act=act,
        num_position_embeddings=positions, deepstack_layers=deepstack)
    if out.vision.out_hidden_size != out.hidden_size:
        raise InvalidArgument("model", f"vision_config.out_hidden_size {out.vision.out_hidden_size} must be the "
                                       f"language model's hidden_size {out.hidden_size}")
    return out


class _PostShuffleMerger(_Merger):
    """A DeepStack level's merger: its LayerNorm over the 2x2 patches' concatenation."""

    def __init__(self, v: Qwen3VisionArgs):
        super().__init__(v)
        self.ln_q = nn.LayerNorm(self.width, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x.view(-1, self.width)))


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear interpolation with corners aligned of a `side`-long axis onto a `size`-long one:
    each of `index`'s two source taps and their weights ([n, 2] each), computed in float32 as
    transformers' vision_utils computes them (so the resampled embeddings match to the bit)."""
    src = index.float() * (side - 1) / torch.tensor(max(size - 1, 1), device=index.device)
    floor = torch.floor(src)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class Qwen3Vision(QwenVision):
    """Pixels [images, grid_t, grid_h, grid_w, row] (images of one grid) -> each image's
    embeddings and DeepStack features [images, tokens, (1 + levels) x hidden]."""

    def __init__(self, v: Qwen3VisionArgs, text_hidden: int):
        super().__init__(v, text_hidden)
        self.patch_embed = _PatchEmbed(v, bias=True)
        self.pos_embed = nn.Embedding(v.num_position_embeddings, v.hidden_size)
        self.side = round(v.num_position_embeddings ** 0.5)
        self.deepstack_merger_list = nn.ModuleList(_PostShuffleMerger(v) for _ in v.deepstack_layers)

    def positions(self, layout: _Layout, h: int, w: int) -> torch.Tensor:
        """[patches, hidden]: the learned grid resampled to the image's h x w patches, in the
        processor's order (each 2x2 merge block's patches together), repeated for every frame."""
        device = self.pos_embed.weight.device
        row, col = layout.rowcol.to(device).unbind(1)
        (h_taps, h_weights), (w_taps, w_weights) = _axis_taps(row, h, self.side), _axis_taps(col, w, self.side)
        taps = (h_taps[:, :, None] * self.side + w_taps[:, None, :]).flatten(1)
        weights = (h_weights[:, :, None] * w_weights[:, None, :]).flatten(1)
        return (self.pos_embed(taps) * weights[:, :, None]).sum(1)

    def forward(self, pixels: torch.Tensor, sizes: list | None = None) -> torch.Tensor:
        t, h, w = pixels.shape[1:4]
        v = self.vision
        layout = _Layout(v, t, h, w)  # (no windows: every block attends within each frame, in order)
        cos, sin = self.rotary(layout, pixels.device)
        positions = self.positions(layout, h, w)
        out = []
        for image in pixels:
            x = self.patch_embed(image.reshape(t * h * w, -1))
            x = x + positions.to(x.dtype)
            levels = []
            for i, block in enumerate(self.blocks):
                x = block(x, cos, sin, layout.frames)
                if i in v.deepstack_layers:
                    levels.append(self.deepstack_merger_list[v.deepstack_layers.index(i)](x))
            out.append(torch.cat([self.merger(x), *levels], dim=-1))
        return torch.stack(out)


# The checkpoint's prefixes are Qwen2.5-VL's; its names under them are this module's but for the
# blocks' MLPs (llava.FcMLP's fc1, fc2) and the mergers (qwen2_5_vl's: ln_q, mlp.0, mlp.2).
CHECKPOINT_PREFIXES = qwen2_5_vl.CHECKPOINT_PREFIXES
LANGUAGE_PREFIXES = qwen2_5_vl.LANGUAGE_PREFIXES
_MLP_NAMES = {"linear_fc1": "fc1", "linear_fc2": "fc2"}
_MERGER_NAMES = {"norm": "ln_q", "linear_fc1": "mlp.0", "linear_fc2": "mlp.2"}


def vision_name(name: str) -> str:
    """A vision tensor's name here (vision.X) for the checkpoint's vision.X."""
    parts = name.rsplit(".", 2)
    if len(parts) < 3:
        return name
    head, module, leaf = parts  # (vision.blocks.N.mlp, vision.merger, vision.deepstack_merger_list.N)
    names = _MLP_NAMES if head.endswith(".mlp") else _MERGER_NAMES if "merger" in head else {}
    return f"{head}.{names.get(module, module)}.{leaf}"
