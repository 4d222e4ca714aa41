"""Gemma 3 with images (Gemma3ForConditionalGeneration, 4B-27B): a SigLIP ViT over the image
(resized square), its patches average-pooled to mm_tokens_per_image tokens, normed and projected
into the Gemma 3 text model (gemma3.py). An image's tokens attend to each other both ways (every
token of an image sees all of that image, past and future) and causally to everything else; the
scheduler never cuts an image's span between chunks for it (encoder_cache.py), and the step's
attention runs on the reference with those masks (kernels/attention.py's PrefillSeq.open_spans).
The prompt holds <start_of_image><image_soft_token><end_of_image> per image; the front expands the
soft token into the image's tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.common.errors import InvalidArgument
from baton.engine.worker.models import gemma3
from baton.engine.worker.models.args import ImageEncoderArgs, ModelArgs
from baton.engine.worker.models.basic import RMSNorm
from baton.engine.worker.models.llava import EncoderLayer


@dataclass(slots=True)
class SiglipArgs(ImageEncoderArgs):
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    tokens_per_image: int  # mm_tokens_per_image: the pooled patches one image takes
    image_token_id: int  # <image_soft_token>: one per image in a prompt, expanded to tokens_per_image
    start_token_id: int  # <start_of_image>, before it in a prompt
    end_token_id: int  # <end_of_image>, after it
    hidden_act: str = "gelu_pytorch_tanh"

    @property
    def prompt_wrap(self) -> list[int]:
        return [self.start_token_id, self.end_token_id]

    @property
    def prompt_padding(self) -> list[str]:
        return ["\n\n", "\n\n"]

    @property
    def bidirectional(self) -> bool:
        return True


def args(cfg: dict) -> ModelArgs:
    text, vision = cfg.get("text_config") or {}, cfg.get("vision_config") or {}
    if vision.get("model_type", "siglip_vision_model") != "siglip_vision_model" or vision.get("vision_use_head"):
        raise InvalidArgument("model", "Gemma 3's vision tower must be SigLIP's, without its pooling head")
    if vision.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise InvalidArgument("model", f"Gemma 3's vision hidden_act {vision.get('hidden_act')!r} is not supported")
    out = gemma3.args({**text, "architectures": cfg.get("architectures"),
                       "tie_word_embeddings": cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", True))})
    tokens = cfg.get("mm_tokens_per_image", 256)
    patches = vision.get("image_size", 896) // vision.get("patch_size", 14)
    side = round(tokens ** 0.5)
    if side * side != tokens or patches % side:
        raise InvalidArgument("model", f"mm_tokens_per_image {tokens} must be a square whose side divides the "
                                       f"image's {patches} patches a side")
    out.vision = SiglipArgs(
        hidden_size=vision.get("hidden_size", 1152), intermediate_size=vision.get("intermediate_size", 4304),
        num_layers=vision.get("num_hidden_layers", 27), num_heads=vision.get("num_attention_heads", 16),
        image_size=vision.get("image_size", 896), patch_size=vision.get("patch_size", 14),
        layer_norm_eps=vision.get("layer_norm_eps", 1e-6), tokens_per_image=tokens,
        image_token_id=cfg.get("image_token_index", cfg.get("image_token_id", 262144)),
        start_token_id=cfg.get("boi_token_index", 255999), end_token_id=cfg.get("eoi_token_index", 256000))
    return out


class _Embeddings(nn.Module):
    def __init__(self, v: SiglipArgs):
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, v.hidden_size, v.patch_size, v.patch_size)
        self.position_embedding = nn.Embedding((v.image_size // v.patch_size) ** 2, v.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class _Encoder(nn.Module):
    def __init__(self, v: SiglipArgs):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(v) for _ in range(v.num_layers))


class SiglipTower(nn.Module):
    def __init__(self, v: SiglipArgs):
        super().__init__()
        self.embeddings = _Embeddings(v)
        self.encoder = _Encoder(v)
        self.post_layernorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3Projector(nn.Module):
    """Patches [images, n, hidden] -> pooled to tokens_per_image, RMS-normed ((1 + weight)), projected."""

    def __init__(self, v: SiglipArgs, text_hidden: int):
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.empty(v.hidden_size, text_hidden))
        self.mm_soft_emb_norm = RMSNorm(v.hidden_size, v.layer_norm_eps, offset=1.0)
        self.side = v.image_size // v.patch_size
        self.kernel = self.side // round(v.tokens_per_image ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, hidden = x.shape
        grid = x.transpose(1, 2).reshape(n, hidden, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(x)


class Gemma3Vision(nn.Module):
    """Pixels [images, 3, H, W] -> each image's embeddings [images, tokens_per_image, hidden]."""

    def __init__(self, v: SiglipArgs, text_hidden: int):
        super().__init__()
        self.tower = SiglipTower(v)
        self.projector = Gemma3Projector(v, text_hidden)

    def forward(self, pixels: torch.Tensor, sizes: list | None = None) -> torch.Tensor:
        return self.projector(self.tower(pixels))
