"""Tiny random checkpoints of any transformers family, written to disk for tests and benchmarks.

Nothing is downloaded from a hub: each gets a byte-level BPE tokenizer trained here with
`tokenizers` on a small built-in corpus, and random weights from transformers' own classes.
"""
from __future__ import annotations

import os

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_WORDS = ("the a of to and in is it that for on with as was at by an be this from or have are not but "
          "what which one all were when we there can been has more if will would who about up out them "
          "so some into time very then make like him could than first water been call people may down "
          "side did get come made long little over new sound take only work know place year live back "
          "give most very after thing our just name good sentence man think say great where help through "
          "much before line right too mean old any same tell boy follow came want show also around form "
          "three small set put end does another well large must big even such because turn here why ask "
          "went men read need land different home us move try kind hand picture again change off play "
          "spell air away animal house point page letter mother answer found study still learn should "
          "Paris France capital city river north south east west café naïve Zürich 東京 😀").split()


def _corpus(n_lines: int = 4000):
    import random
    rng = random.Random(0)
    for _ in range(n_lines):
        yield " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) + rng.choice([".", "?", "!", ","])
    yield "0 1 2 3 4 5 6 7 8 9 ( ) [ ] { } < > = + - * / \\ ' \" : ; # @ & % $ ~ ^ _ |"


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer (GPT-2 style) trained on a small built-in corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    return fast


# The two tiny checkpoints `baton prepare-models` writes: (transformers config class, shape).
TINY = {
    "llama": ("LlamaConfig", dict(  # untied head, Llama 3 RoPE scaling
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
        tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256})),
    "qwen2": ("Qwen2Config", dict(  # tied head, q/k/v bias
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
        tie_word_embeddings=True, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}


def write_tiny_checkpoint(out_dir: str, arch: str = "llama", seed: int = 0, max_shard_size: str | None = None) -> str:
    """One of the TINY checkpoints, loadable by transformers offline."""
    if arch not in TINY:
        raise ValueError(f"arch: unknown tiny architecture {arch!r} ({', '.join(TINY)})")
    config_class, shape = TINY[arch]
    return write_random_checkpoint(out_dir, config_class, seed=seed, max_shard_size=max_shard_size, **shape)


def write_random_checkpoint(out_dir: str, config_class: str, *, seed: int = 0, spread_norms: bool = False,
                            max_shard_size: str | None = None, **shape) -> str:
    """Random weights of a transformers config class (its name, e.g. "Qwen3Config") in `shape`,
    and a locally trained tokenizer. Biases (zero at init) are drawn too; `spread_norms` draws
    the norms' weights (one at init) so that a QK-norm's weights matter, and attention sinks
    (gpt-oss) wide."""
    import torch
    import transformers

    tokenizer = train_tokenizer()
    config = getattr(transformers, config_class)(**{
        "vocab_size": len(tokenizer), "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "initializer_range": 0.2, **shape})  # wide enough that greedy argmax has clear margins
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif spread_norms and "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("sinks"):  # gpt-oss's attention sinks: wide, so that they take weight
                p.normal_(0, 2.0)
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size or "50GB")
    tokenizer.save_pretrained(out_dir)
    return out_dir


def write_random_llava(out_dir: str, *, seed: int = 0, image_size: int = 30, patch_size: int = 6,
                       strategy: str = "default", vision: dict | None = None, text: dict | None = None,
                       text_model: str = "LlamaConfig", grid_pinpoints: list[list[int]] | None = None) -> str:
    """A LLaVA-1.5 (LlavaForConditionalGeneration) of random weights from transformers' own classes:
    a small CLIP ViT (three layers; the projector reads the second to last's output), the
    projector and a small Llama, its image token "<image>" (a special token added to the locally
    trained tokenizer, as llava-hf's); with CLIP's image processor (PIL backend) sized to `image_size`.
    `vision`, `text`: other sizes for the ViT's and the language model's configs (a benchmark's);
    `text_model`: the language model's config class ("MistralConfig": LLaVA over Mistral);
    `grid_pinpoints`: a LLaVA-NeXT (LlavaNextForConditionalGeneration) tiling images at these
    resolutions in tiles of `image_size`, with its image processor."""
    import transformers
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vocab = len(tokenizer)
    text_config = getattr(transformers, text_model)(**{
        "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 112, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, "initializer_range": 0.2,
        **(text or {})})
    vision_config = transformers.CLIPVisionConfig(**{
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 2,
        "image_size": image_size, "patch_size": patch_size, "initializer_range": 0.2, **(vision or {})})
    common = {"vision_config": vision_config, "text_config": text_config, "vision_feature_layer": -2,
              "image_token_index": tokenizer.convert_tokens_to_ids("<image>"),
              "vision_feature_select_strategy": strategy}
    sizes = {"size": {"shortest_edge": image_size}, "crop_size": {"height": image_size, "width": image_size}}
    if grid_pinpoints:
        config = transformers.LlavaNextConfig(**common, image_grid_pinpoints=grid_pinpoints)
        _save_vision_language(out_dir, transformers.LlavaNextForConditionalGeneration, config, tokenizer, seed,
                              ("multi_modal_projector", "embedding", "image_newline"))
        LlavaNextImageProcessorPil(**sizes, image_grid_pinpoints=grid_pinpoints).save_pretrained(out_dir)
        return out_dir
    config = transformers.LlavaConfig(**common)
    _save_vision_language(out_dir, transformers.LlavaForConditionalGeneration, config, tokenizer, seed,
                          ("multi_modal_projector", "embedding"))
    CLIPImageProcessorPil(**sizes).save_pretrained(out_dir)
    return out_dir


def write_random_qwen2_5_vl(out_dir: str, *, seed: int = 0, patch_size: int = 4, window_size: int = 16,
                            max_pixels: int = 48 * 48, vision: dict | None = None, text: dict | None = None,
                            qwen2: bool = False) -> str:
    """A Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration) of random weights from transformers' own
    classes: a three-block ViT of `patch_size`-pixel patches (the last block full attention, the
    others in windows of `window_size` pixels: two merge blocks a side) and a small Qwen2 with
    M-RoPE; the tokenizer's <|vision_start|>, <|image_pad|> and <|vision_end|> special tokens; and
    Qwen2-VL's image processor (PIL backend) for images of at most `max_pixels` pixels, each resized
    to multiples of 2 x patch_size. `vision`, `text`: other sizes for the configs. `qwen2`: a Qwen2-VL
    (Qwen2VLForConditionalGeneration: its ViT of LayerNorms and fc1/fc2 MLPs, every block full
    attention) instead."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer, ids = _tokenizer_with(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    text_config = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 112,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                   "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "initializer_range": 0.2,
                   "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                   **(text or {})}
    if qwen2:  # (its vision hidden_size is the output's, embed_dim the tower's)
        vision_config = {"depth": 3, "embed_dim": 32, "mlp_ratio": 2, "num_heads": 2, "patch_size": patch_size,
                         "hidden_size": text_config["hidden_size"], "initializer_range": 0.2, **(vision or {})}
    else:
        vision_config = {"depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                         "patch_size": patch_size, "window_size": window_size, "fullatt_block_indexes": [2],
                         "out_hidden_size": text_config["hidden_size"], "initializer_range": 0.2, **(vision or {})}
    config = (transformers.Qwen2VLConfig if qwen2 else transformers.Qwen2_5_VLConfig)(
        text_config=text_config, vision_config=vision_config, image_token_id=ids["<|image_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        video_token_id=ids["<|image_pad|>"] + 100)  # (no video: an id no prompt holds)
    _save_vision_language(out_dir, transformers.Qwen2VLForConditionalGeneration if qwen2
                          else transformers.Qwen2_5_VLForConditionalGeneration, config, tokenizer, seed,
                          ("merger", "patch_embed"))
    Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=2, temporal_patch_size=2,
                             min_pixels=(2 * patch_size) ** 2, max_pixels=max_pixels).save_pretrained(out_dir)
    return out_dir


def write_random_qwen3_vl(out_dir: str, *, seed: int = 0, patch_size: int = 4, max_pixels: int = 48 * 48,
                          vision: dict | None = None, text: dict | None = None) -> str:
    """A Qwen3-VL (Qwen3VLForConditionalGeneration) of random weights from transformers' own
    classes: a four-block ViT of odd sizes (three heads of 12) of `patch_size`-pixel patches, its
    learned position grid 7 x 7 (resampled to every image's grid), DeepStack features taken after
    blocks 0 and 2; a small Qwen3 text model (three layers) with interleaved M-RoPE; the
    tokenizer's <|vision_start|>, <|image_pad|> and <|vision_end|> special tokens; and Qwen3-VL's
    image processor (Qwen2-VL's, PIL backend, merge 2, temporal 2, its mean and std 0.5) for images
    of at most `max_pixels` pixels. `vision`, `text`: other sizes for the configs."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer, ids = _tokenizer_with(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    text_config = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 112,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 3,
                   "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "initializer_range": 0.2,
                   "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                       "mrope_interleaved": True},
                   **(text or {})}
    vision_config = {"depth": 4, "hidden_size": 36, "intermediate_size": 52, "num_heads": 3,
                     "patch_size": patch_size, "num_position_embeddings": 49, "deepstack_visual_indexes": [0, 2],
                     "out_hidden_size": text_config["hidden_size"], "initializer_range": 0.2, **(vision or {})}
    config = transformers.Qwen3VLConfig(
        text_config=text_config, vision_config=vision_config, image_token_id=ids["<|image_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        video_token_id=ids["<|image_pad|>"] + 100)  # (no video: an id no prompt holds)
    _save_vision_language(out_dir, transformers.Qwen3VLForConditionalGeneration, config, tokenizer, seed,
                          ("merger", "patch_embed", "pos_embed"))
    Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=2, temporal_patch_size=2,
                             min_pixels=(2 * patch_size) ** 2, max_pixels=max_pixels, image_mean=[0.5, 0.5, 0.5],
                             image_std=[0.5, 0.5, 0.5]).save_pretrained(out_dir)
    return out_dir


def _tokenizer_with(names: list[str]):
    """The test tokenizer with a vision-language model's special tokens added, and their ids."""
    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": names})
    return tokenizer, {name: tokenizer.convert_tokens_to_ids(name) for name in names}


def _save_vision_language(out_dir: str, model_class, config, tokenizer, seed: int, moving: tuple[str, ...]) -> None:
    """A vision-language model of random weights saved with its tokenizer: biases random too, and
    the weights named by `moving` spread wide, so that images move the output."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = model_class(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif any(part in name for part in moving):
                p.normal_(0, 0.5)
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def write_random_gemma3_vl(out_dir: str, *, seed: int = 0, image_size: int = 32, patch_size: int = 4,
                           tokens_per_image: int = 16, vision: dict | None = None, text: dict | None = None) -> str:
    """A Gemma 3 with images (Gemma3ForConditionalGeneration) of random weights from transformers'
    own classes: a small SigLIP ViT (two layers) of `image_size` pixels in `patch_size` patches,
    pooled to `tokens_per_image` tokens, over a small Gemma 3 text model (a sliding layer of a
    16-token window, then a global one); the tokenizer's <start_of_image>, <image_soft_token> and
    <end_of_image> special tokens; Gemma 3's image processor (PIL backend)."""
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer, ids = _tokenizer_with(["<start_of_image>", "<image_soft_token>", "<end_of_image>"])
    text_config = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 112,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
                   "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "initializer_range": 0.2,
                   "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
                   "tie_word_embeddings": False,
                   "query_pre_attn_scalar": 16, "bos_token_id": tokenizer.bos_token_id,
                   "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, **(text or {})}
    vision_config = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "image_size": image_size, "patch_size": patch_size, "vision_use_head": False, **(vision or {})}
    config = transformers.Gemma3Config(
        text_config=text_config, vision_config=vision_config, mm_tokens_per_image=tokens_per_image,
        image_token_index=ids["<image_soft_token>"], boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], initializer_range=0.2,
        tie_word_embeddings=False)  # (tied, the scaled input embedding dominates: the last token repeats)
    _save_vision_language(out_dir, transformers.Gemma3ForConditionalGeneration, config, tokenizer, seed,
                          ("multi_modal_projector", "embedding"))
    Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}).save_pretrained(out_dir)
    return out_dir
