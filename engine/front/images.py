"""A vision-language model's images, as its front takes them: each processed into pixels by the
checkpoint's own image processor (transformers', PIL backend: preprocessor_config.json beside
config.json), digested, and its placeholder in the prompt (the model's image token, once per
image) expanded into the span of positions its embeddings take, each holding the image's
placeholder id (core_messages.image_placeholder), so block hashes name the image."""
from __future__ import annotations

import base64
import binascii
import hashlib
import io

import msgspec
import numpy as np

from baton.engine.common import anyres
from baton.engine.common.config import read_config
from baton.engine.common.core_messages import EngineFacts, ImageInput, image_placeholder
from baton.engine.common.errors import InvalidArgument, check


def data_url_bytes(url: str, field: str) -> bytes:
    """A data: URL's bytes (data:image/...;base64,...); raises InvalidArgument naming `field`."""
    head, _, payload = url.partition(",")
    check(head.startswith("data:") and head.endswith(";base64"), field,
          "a data: URL must be base64 (data:image/...;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as e:
        raise InvalidArgument(field, f"is not base64 ({e})") from None


def chat_with_images(messages: list[dict], image_text: str, field: str = "messages") -> tuple[list[dict], list]:
    """OpenAI-style chat messages whose content may be parts (text; image_url with a data: URL;
    vLLM's image_pil) as a chat template takes them, each message's images as `image_text`
    before its text (ImageProcessor.image_text), and the images in order (PIL images, or encoded bytes)."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        texts, mine = [], []
        for j, part in enumerate(content):
            kind, name = part.get("type") if isinstance(part, dict) else None, f"{field}[{i}].content[{j}]"
            if kind == "text":
                texts.append(part.get("text", ""))
            elif kind == "image_pil":
                mine.append(part.get("image_pil"))
            elif kind == "image_url":
                url = (part.get("image_url") or {}).get("url") if isinstance(part.get("image_url"), dict) else None
                check(isinstance(url, str) and url.startswith("data:"), name,
                      "an image_url offline must be a data: URL (or give a PIL image as image_pil)")
                mine.append(data_url_bytes(url, name))
            else:
                raise InvalidArgument(name, f"unknown content part type {kind!r} (text, image_url, image_pil)")
        images += mine
        out.append({**message, "content": image_text * len(mine) + "".join(texts)})
    return out, images


def image_processor(model_dir: str, tokenizer, facts: EngineFacts) -> ImageProcessor | None:
    """A vision-language model's image processor, as its core's facts describe the model (None:
    a text model)."""
    if facts.image_token_id < 0:
        return None
    # An image in a chat turn as the model's processor writes it: LLaVA's "<image>\n"; Qwen2.5-VL's
    # "<|vision_start|><|image_pad|><|vision_end|>"; Gemma 3's "\n\n<start_of_image>...<end_of_image>\n\n".
    image, wrap = tokenizer.convert_ids_to_tokens(facts.image_token_id), facts.image_wrap
    start, end = tokenizer.convert_ids_to_tokens(wrap) if wrap else ("", "")
    before, after = facts.image_padding or ("", "")
    image_text = before + start + image + end + after
    return ImageProcessor(model_dir, facts.image_token_id, facts.tokens_per_image, facts.max_image_tokens,
                          image_text)


class ImageProcessor:
    def __init__(self, model_dir: str, image_token_id: int, tokens_per_image: int, max_image_tokens: int,
                 image_text: str):
        """`tokens_per_image`: the tokens every image takes (0: each image's own, by its size, at
        most `max_image_tokens`); `image_text`: an image in a chat turn's text, its image token
        where the image's tokens go."""
        self.model_dir, self.image_token_id, self.tokens_per_image = model_dir, image_token_id, tokens_per_image
        self.max_image_tokens, self.image_text = max_image_tokens, image_text
        self._processor = None  # loaded at the first image (transformers' import is slow)
        self._layout: tuple | None = None  # LLaVA-NeXT's (grid resolutions, tile pixels, patches a side)

    def expand(self, token_ids: list[int], images: list, field: str) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each image token expanded into its image's span, and the images; raises
        InvalidArgument naming `field` (or `field[i]`) for what cannot be taken. An image may be
        an ImageInput without pixels (a decode's, from its prefill's KV handle) or with its embeddings
        (an encoder tier's): its span as given."""
        at = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        check(len(at) == len(images), field, f"has {len(images)} images for {len(at)} image tokens "
                                             f"({self.image_token_id}) in the prompt")
        processed = [image if isinstance(image, ImageInput) else self.processed(image, f"{field}[{i}]")
                     for i, image in enumerate(images)]
        out, inputs, last = [], [], 0
        for position, image in zip(at, processed):
            out += token_ids[last:position]
            inputs.append(msgspec.structs.replace(image, offset=len(out)))
            out += [image_placeholder(image.digest)] * image.length
            last = position + 1
        return out + token_ids[last:], inputs

    def processed(self, image, field: str) -> ImageInput:
        """One image as the model takes it (its span's offset not known yet: 0)."""
        pixels, tokens, size = self._pixels(image, field)
        check(tokens <= self.max_image_tokens, field,
              f"takes {tokens} tokens at {size[1]}x{size[0]}, more than the {self.max_image_tokens} an image may "
              f"take here (max_num_encoder_input_tokens, encoder_cache_size)")
        digest = int.from_bytes(hashlib.blake2b(pixels.tobytes(), digest_size=8).digest()) >> 4
        return ImageInput(digest, 0, tokens, pixels.tobytes(), list(pixels.shape), size if self._layout else [])

    @staticmethod
    def decode(data: bytes, field: str):
        """An encoded image file's bytes (PNG, JPEG, ...) as a PIL image; raises InvalidArgument
        naming `field` when they are not one."""
        from PIL import Image, UnidentifiedImageError

        try:
            image = Image.open(io.BytesIO(data))
            image.load()
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            raise InvalidArgument(field, f"does not decode as an image ({e})") from None
        return image.convert("RGB")

    def _pixels(self, image, field: str) -> tuple[np.ndarray, int, list[int]]:
        """One image (a PIL image, an array [H, W, 3] of uint8, or an encoded file's bytes) as the
        model's pixels (LLaVA's [3, H, W]; LLaVA-NeXT's tiles [n, 3, H, W]; Qwen2.5-VL's patches
        [grid_t, grid_h, grid_w, values], in the processor's order), the tokens its embeddings
        take, and its own [height, width]."""
        from PIL import Image

        if isinstance(image, bytes):
            image = self.decode(image, field)
        if isinstance(image, np.ndarray):
            check(image.ndim == 3 and image.shape[2] == 3 and image.dtype == np.uint8, field,
                  f"an array image must be [height, width, 3] uint8, got {image.shape} {image.dtype}")
            image = Image.fromarray(image)
        check(isinstance(image, Image.Image), field,
              f"must be a PIL image or a uint8 array, got {type(image).__name__}")
        if self._processor is None:
            self._load()
        out, size = self._processor(images=[image], return_tensors="np"), [image.height, image.width]
        pixels = np.ascontiguousarray(out["pixel_values"][0], dtype=np.float32)
        if self.tokens_per_image:
            return pixels, self.tokens_per_image, size
        if self._layout is not None:  # LLaVA-NeXT: tiles at the grid its size picks (anyres.py)
            pinpoints, tile, side = self._layout
            return pixels, anyres.num_tokens(*size, pinpoints, tile, side), size
        grid = [int(n) for n in out["image_grid_thw"][0]]  # Qwen2.5-VL: its size in patches decides its tokens
        tokens = grid[0] * grid[1] * grid[2] // self._processor.merge_size ** 2
        return np.ascontiguousarray(out["pixel_values"], dtype=np.float32).reshape(*grid, -1), tokens, size

    def _load(self) -> None:
        """The checkpoint's image processor, and LLaVA-NeXT's tiling (its grid resolutions, the
        ViT's size and its patches a side) from config.json."""
        from transformers import AutoImageProcessor

        self._processor = AutoImageProcessor.from_pretrained(self.model_dir, backend="pil")
        cfg = read_config(self.model_dir)
        if cfg.get("image_grid_pinpoints") and not self.tokens_per_image:
            vision = cfg.get("vision_config") or {}
            tile = vision.get("image_size", 336)
            self._layout = (cfg["image_grid_pinpoints"], tile, tile // vision.get("patch_size", 14))
