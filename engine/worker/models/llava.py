"""LLaVA-1.5 (LlavaForConditionalGeneration): a CLIP ViT encodes each image into patch features,
a two-layer projector maps them into the language model's embeddings, and a Llama-family decoder
reads them where the prompt holds the image's placeholder tokens (one per projected feature).
LLaVA-NeXT (LlavaNextForConditionalGeneration) runs the same ViT and projector over an image's
tiles and packs their features (engine/common/anyres.py), each row ended by `image_newline`.

The language model is the families' own (its config is `text_config`); the vision side is here,
named as the checkpoint names it under `model.vision_tower` and `model.multi_modal_projector`
(loader.py). Images reach the model as pixel values the front made with the checkpoint's own
image processor (engine/front/images.py); the runner merges the features into the step's
embeddings (CausalLM.forward's `image_rows`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.common import anyres
from baton.engine.common.errors import InvalidArgument
from baton.engine.worker.models import llama, mistral
from baton.engine.worker.models.args import ModelArgs, VisionArgs

# The language models LLaVA checkpoints are published over, by text_config.model_type (Mistral's
# sliding window read as its family reads it).
_LANGUAGE_MODELS = {"llama": llama.args, "mistral": mistral.args}
# The ViTs' MLP activations by their config names (CLIP's, SigLIP's, Qwen2-VL's).
ACTIVATIONS = {"gelu": F.gelu, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


def args(cfg: dict) -> ModelArgs:
    text, vision = cfg.get("text_config") or {}, cfg.get("vision_config") or {}
    language = _LANGUAGE_MODELS.get(text.get("model_type", "llama"))
    if language is None:
        raise InvalidArgument("model", f"LLaVA over a {text.get('model_type')!r} language model is not supported "
                                       f"({', '.join(_LANGUAGE_MODELS)})")
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise InvalidArgument("model", f"LLaVA's vision tower {vision.get('model_type')!r} is not supported (CLIP)")
    if vision.get("hidden_act", "quick_gelu") != "quick_gelu" or cfg.get("projector_hidden_act", "gelu") != "gelu":
        raise InvalidArgument("model", "LLaVA's activations must be CLIP's quick_gelu and the projector's gelu")
    strategy = cfg.get("vision_feature_select_strategy", "default")
    layer = cfg.get("vision_feature_layer", -2)
    if strategy not in ("default", "full") or not isinstance(layer, int):
        raise InvalidArgument("model", f"vision_feature_select_strategy {strategy!r} with vision_feature_layer "
                                       f"{layer!r} is not supported (one layer, default or full)")
    out = language({**text, "architectures": cfg.get("architectures"),
                    "tie_word_embeddings": cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))})
    heads = vision.get("num_attention_heads", 12)
    next_ = (cfg.get("architectures") or [""])[0] == "LlavaNextForConditionalGeneration"
    out.vision = VisionArgs(
        hidden_size=vision.get("hidden_size", 768), intermediate_size=vision.get("intermediate_size", 3072),
        num_layers=vision.get("num_hidden_layers", 12), num_heads=heads, image_size=vision.get("image_size", 224),
        patch_size=vision.get("patch_size", 32), layer_norm_eps=vision.get("layer_norm_eps", 1e-5),
        feature_layer=layer, keep_class_token=strategy == "full",
        projector_bias=cfg.get("multimodal_projector_bias", True), image_token_id=cfg.get("image_token_index", 32000),
        grid_pinpoints=[list(p) for p in cfg.get("image_grid_pinpoints") or ()] if next_ else [])
    if next_ and (not out.vision.grid_pinpoints or out.vision.keep_class_token):
        raise InvalidArgument("model", "LLaVA-NeXT needs image_grid_pinpoints and vision_feature_select_strategy "
                                       "'default'")
    return out


class _Embeddings(nn.Module):
    def __init__(self, v: VisionArgs):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(v.hidden_size))
        self.patch_embedding = nn.Conv2d(3, v.hidden_size, v.patch_size, v.patch_size, bias=False)
        self.position_embedding = nn.Embedding((v.image_size // v.patch_size) ** 2 + 1, v.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class _Attention(nn.Module):
    def __init__(self, v: VisionArgs):
        super().__init__()
        self.heads = v.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(v.hidden_size, v.hidden_size)
                                                                for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = (p(x).view(n, t, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(n, t, d))


class FcMLP(nn.Module):
    """A ViT's MLP: fc1, the config's activation, fc2."""

    def __init__(self, v: VisionArgs):
        super().__init__()
        self.act = v.hidden_act
        self.fc1, self.fc2 = nn.Linear(v.hidden_size, v.intermediate_size), nn.Linear(v.intermediate_size,
                                                                                     v.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(ACTIVATIONS[self.act](self.fc1(x)))


class EncoderLayer(nn.Module):
    """A CLIP (or SigLIP) ViT layer: pre-norm attention over every patch, then the MLP."""

    def __init__(self, v: VisionArgs):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.self_attn = _Attention(v)
        self.layer_norm2 = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.mlp = FcMLP(v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, v: VisionArgs, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(v) for _ in range(layers))


class CLIPVisionTower(nn.Module):
    """CLIP's ViT up to the layer whose output LLaVA takes (the layers after it are not built)."""

    def __init__(self, v: VisionArgs):
        super().__init__()
        self.vision = v
        # hidden_states[i] is the input of layer i (0: the embeddings), so layer -2 is layers[:-1]'s output.
        self.num_run = v.feature_layer if v.feature_layer >= 0 else v.num_layers + 1 + v.feature_layer
        self.embeddings = _Embeddings(v)
        self.pre_layrnorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)  # (CLIP's spelling)
        self.encoder = _Encoder(v, self.num_run)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixels))
        for layer in self.encoder.layers:
            x = layer(x)
        return x if self.vision.keep_class_token else x[:, 1:]


class LlavaProjector(nn.Module):
    def __init__(self, v: VisionArgs, text_hidden: int):
        super().__init__()
        self.linear_1 = nn.Linear(v.hidden_size, text_hidden, bias=v.projector_bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=v.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class LlavaVision(nn.Module):
    """Pixels [images, 3, H, W] -> each image's embeddings [images, tokens_per_image, hidden]; for
    LLaVA-NeXT pixels [images, tiles, 3, H, W] (the base first) and each image's [height, width] ->
    each image's embeddings [tokens, hidden] (engine/common/anyres.py)."""

    def __init__(self, v: VisionArgs, text_hidden: int):
        super().__init__()
        self.vision = v
        self.tower = CLIPVisionTower(v)
        self.projector = LlavaProjector(v, text_hidden)
        if v.grid_pinpoints:  # LLaVA-NeXT: the token that ends each row of its tiles' features
            self.image_newline = nn.Parameter(torch.empty(text_hidden))

    def forward(self, pixels: torch.Tensor, sizes: list | None = None) -> torch.Tensor | list[torch.Tensor]:
        if not self.vision.grid_pinpoints:
            return self.projector(self.tower(pixels))
        return [self._packed(self.projector(self.tower(tiles)), size) for tiles, size in zip(pixels, sizes)]

    def _packed(self, features: torch.Tensor, size: list[int]) -> torch.Tensor:
        """One image's tiles' features [tiles, side^2, hidden] as its tokens: the base's, then the
        tiles' as one grid, its padding cut, each row ended by the newline (transformers' order)."""
        v, (height, width) = self.vision, size
        side = v.image_size // v.patch_size
        grid_h, grid_w = anyres.tile_grid(height, width, v.grid_pinpoints, v.image_size)
        grid = features[1:].view(grid_h, grid_w, side, side, -1).permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)
        cut, axis = anyres.unpadded(height, width, grid.shape[1], grid.shape[2])
        grid = grid.narrow(1 + axis, cut, grid.shape[1 + axis] - 2 * cut)
        rows = torch.cat((grid, self.image_newline[:, None, None].expand(-1, grid.shape[1], 1).to(grid.dtype)), dim=-1)
        return torch.cat((features[0], rows.flatten(1, 2).transpose(0, 1)))


# The checkpoint's prefixes (as the Hub's llava-hf checkpoints and transformers 5 write them) of
# the vision side, and this module's names for them; of the language model, and a text model's.
CHECKPOINT_PREFIXES = {"model.vision_tower.": "vision.tower.", "model.multi_modal_projector.": "vision.projector.",
                       "vision_tower.vision_model.": "vision.tower.", "vision_tower.": "vision.tower.",
                       "multi_modal_projector.": "vision.projector.", "model.image_newline": "vision.image_newline",
                       "image_newline": "vision.image_newline"}  # (the first prefix that matches)
LANGUAGE_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                     "language_model.lm_head.": "lm_head."}
