"""What a model is, read from its config.json: the shape and the switches the shared layers
take. Each family (llama.py, qwen2.py, ...) reads its own config into one of these."""
from __future__ import annotations

from dataclasses import dataclass, field

from baton.engine.common.errors import InvalidArgument
from baton.engine.worker.models.moe import GLU, SWIGLU
from baton.engine.worker.models.rope import rope_settings


@dataclass(slots=True)
class ImageEncoderArgs:
    """What every vision-language model's image side says of its prompts and its attention (each
    family's args override what differs): the tokens around its image token, the text around
    those in a chat turn, how many tokens an image takes at most, and whether an image's tokens
    attend to each other both ways. Each has `tokens_per_image`: every image's, or 0 where each
    image takes its own count, by its size."""

    @property
    def prompt_wrap(self) -> list[int]:
        """The tokens around the image token in a prompt."""
        return []

    @property
    def prompt_padding(self) -> list[str]:
        """The text before and after an image in a chat turn, as the model's processor writes it."""
        return ["", ""]

    def most_tokens(self, model_dir: str) -> int:
        """The most tokens one image takes: every image's."""
        return self.tokens_per_image

    @property
    def bidirectional(self) -> bool:
        """Whether an image's tokens attend to each other both ways (else causally, as text does)."""
        return False

    @property
    def deepstack_levels(self) -> int:
        """How many more feature sets an image's tokens carry beside their embeddings, each added
        to the hidden states after the decoder layer of its level (DeepStack: Qwen3-VL); 0: none."""
        return 0


@dataclass(slots=True)
class VisionArgs(ImageEncoderArgs):
    """A vision-language model's image side (llava.py): a CLIP ViT and the projector into the
    language model's embeddings."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    feature_layer: int  # the ViT layer whose output the projector takes (negative: from the last)
    keep_class_token: bool  # vision_feature_select_strategy "full" (else "default": patches only)
    projector_bias: bool
    image_token_id: int  # the prompt's placeholder for one image, expanded to tokens_per_image
    projector_act: str = "gelu"
    hidden_act: str = "quick_gelu"  # the ViT's MLP's
    # LLaVA-NeXT's resolutions an image is tiled at (engine/common/anyres.py); empty: LLaVA-1.5's one
    # resized image.
    grid_pinpoints: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_image(self) -> int:
        """0: each image takes as many as its size gives (LLaVA-NeXT)."""
        return 0 if self.grid_pinpoints else self.patches_per_tile

    @property
    def patches_per_tile(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + (1 if self.keep_class_token else 0)

    def most_tokens(self, model_dir: str) -> int:
        """The most tokens one image takes: every image's, or LLaVA-NeXT's at its largest grid (its
        base, and every tile's patches with a newline a row)."""
        if not self.grid_pinpoints:
            return self.tokens_per_image
        side = self.image_size // self.patch_size
        return side * side + max(h // self.image_size * side * (w // self.image_size * side + 1)
                                 for h, w in self.grid_pinpoints)

    @property
    def prompt_padding(self) -> list[str]:
        return ["", "\n"]


@dataclass(slots=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # may differ from hidden_size // num_heads (Qwen3)
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # rope_type and its parameters; None: plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    torch_dtype: str | None
    # RMSNorm over q and k before RoPE: "head" over each head's dims (Qwen3), "whole" over the whole
    # projection (OLMo 2); "" none.
    qk_norm: str = ""
    # "pre": each block's input normed (Llama); "post": each block's output normed before the
    # residual add (OLMo 2: post_attention_layernorm, post_feedforward_layernorm).
    norm_placement: str = "pre"
    rotary_dim: int = 0  # the head dims RoPE turns (partial_rotary_factor); 0: all of them
    sliding_window: int | None = None  # sliding layers attend to at most this many tokens (None: all)
    # Each layer's kind, "full_attention" or "sliding_attention" (empty: every layer full, unless a
    # sliding_window is set, then every layer slides).
    layer_types: list[str] = field(default_factory=list)
    local_rope_theta: float | None = None  # sliding layers' own RoPE base (Gemma 3); None: the same
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight): Gemma's norms store weight - 1
    activation: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0  # embeddings multiplied by it (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # attention's score scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores become cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits likewise
    # Mixture of experts (moe.py): which layers are sparse (empty: none), the experts, how many
    # each token takes, their hidden size, whether the k weights are renormalized, and a shared
    # expert's size (0: none).
    sparse_layers: list[bool] = field(default_factory=list)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    num_shared_experts: int = 0  # DeepSeek's, ungated, moe_intermediate_size each
    routing: str = "softmax"  # moe.ROUTINGS
    routed_scaling_factor: float = 1.0
    num_expert_groups: int = 1
    top_expert_groups: int = 1
    moe_bias: bool = False  # the router and the experts have biases (gpt-oss)
    expert_glu: GLU = SWIGLU  # the experts' gated activation (gpt-oss: clamped)
    attn_sinks: bool = False  # a learned sink score per query head in each softmax (gpt-oss)
    # Multi-head latent attention (mla.py; DeepSeek): "mla", else "mha" (GQA and MQA included).
    # With MLA the cache holds one head of kv_lora_rank + qk_rope_head_dim per token (num_kv_heads
    # 1, head_dim that), and `q_lora_rank` (0: none) compresses the query too.
    attention: str = "mha"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleaved: bool = True  # MLA's RoPE on adjacent pairs (DeepSeek's); else on halves
    skipped_layers: int = 0  # layers past num_layers the target does not load (DeepSeek-V3's MTP: a draft head's)
    # A vision-language model's image encoder (llava.py, qwen2_5_vl.py, qwen3_vl.py, gemma3_vl.py); None: text only.
    vision: ImageEncoderArgs | None = None
    # M-RoPE (Qwen2.5-VL; mrope.py): how many of the rotary half-dims turn with each of the time,
    # height and width positions; empty: one position per token. Interleaved (Qwen3-VL): the
    # half-dims take the streams in turn (t, h, w, t, ...) rather than in contiguous sections.
    mrope_section: list[int] = field(default_factory=list)
    mrope_interleaved: bool = False

    @property
    def kv_parts(self) -> int:
        """What the cache keeps per token and head: K and V, or (MLA) the latent alone, its own values."""
        return 1 if self.attention == "mla" else 2

    def sliding_layers(self) -> list[bool]:
        """Which layers slide: as layer_types says, else every layer when there is a window."""
        return [kind == "sliding_attention" for kind in self.layer_types] or (
            [self.sliding_window is not None] * self.num_layers)

    def layer_windows(self, max_model_len: int) -> list[int | None]:
        """Each layer's sliding window in contexts of at most max_model_len (None: it sees every
        position, as a window that holds the whole context does)."""
        window = self.sliding_window
        if window is not None and window >= max_model_len:
            window = None
        return [window if slides else None for slides in self.sliding_layers()]


ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def decoder_args(cfg: dict, *, qkv_bias: bool | None = None, o_bias: bool | None = None, qk_norm: str = "",
                 norm_placement: str = "pre", sliding_window: int | None = None, rope: dict | None = None,
                 **switches) -> ModelArgs:
    """The Llama-shaped decoder's args from a config (the families set what differs; `rope`:
    the rope parameters of full layers when the config keeps one set per layer type)."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise InvalidArgument("model", f"hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    theta, scaling, partial = rope_settings(cfg if rope is None else {**cfg, "rope_parameters": rope})
    bias = cfg.get("attention_bias", False)
    return ModelArgs(
        architecture=(cfg.get("architectures") or [""])[0], vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta, rope_scaling=scaling, max_position_embeddings=max_context(cfg, scaling),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        qkv_bias=bias if qkv_bias is None else qkv_bias, o_bias=bias if o_bias is None else o_bias,
        mlp_bias=cfg.get("mlp_bias", False),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "") or None,
        qk_norm=qk_norm, norm_placement=norm_placement, rotary_dim=int(head_dim * partial),
        sliding_window=sliding_window, activation=ACTIVATIONS[act], **switches)


def max_context(cfg: dict, scaling: dict | None) -> int:
    """The longest context the model takes: max_position_embeddings, times the factor for dynamic
    NTK, whose frequencies stretch past it (vLLM derives max_model_len so too)."""
    max_len = cfg.get("max_position_embeddings", 2048)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "dynamic":
        return int(max_len * scaling["factor"])
    return max_len
