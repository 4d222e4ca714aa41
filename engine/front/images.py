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

import numpy as np

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
    before its text, and the images in order (PIL images, or encoded bytes)."""
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
        out.append({**message, "content": "".join(f"{image_text}\n" for _ in mine) + "".join(texts)})
    return out, images


def image_processor(model_dir: str, tokenizer, facts: EngineFacts) -> ImageProcessor | None:
    """A vision-language model's image processor, as its core's facts describe the model (None:
    a text model)."""
    if facts.image_token_id < 0:
        return None
    return ImageProcessor(model_dir, facts.image_token_id, facts.tokens_per_image,
                          tokenizer.convert_ids_to_tokens(facts.image_token_id))


class ImageProcessor:
    def __init__(self, model_dir: str, image_token_id: int, tokens_per_image: int, image_text: str):
        """`image_text`: the image token as the tokenizer writes it ("<image>")."""
        self.model_dir, self.image_token_id, self.tokens_per_image = model_dir, image_token_id, tokens_per_image
        self.image_text = image_text  # (a chat turn's images go where it stands)
        self._processor = None  # loaded at the first image (transformers' import is slow)

    def expand(self, token_ids: list[int], images: list, field: str) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each image token expanded into its image's span, and the images; raises
        InvalidArgument naming `field` (or `field[i]`) for what cannot be taken."""
        at = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        check(len(at) == len(images), field, f"has {len(images)} images for {len(at)} image tokens "
                                             f"({self.image_token_id}) in the prompt")
        pixels = [self._pixels(image, f"{field}[{i}]") for i, image in enumerate(images)]
        out, inputs, last = [], [], 0
        for position, image in zip(at, pixels):
            digest = int.from_bytes(hashlib.blake2b(image.tobytes(), digest_size=8).digest()) >> 4
            out += token_ids[last:position]
            inputs.append(ImageInput(digest, len(out), self.tokens_per_image, image.tobytes(), list(image.shape)))
            out += [image_placeholder(digest)] * self.tokens_per_image
            last = position + 1
        return out + token_ids[last:], inputs

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

    def _pixels(self, image, field: str) -> np.ndarray:
        """One image (a PIL image, an array [H, W, 3] of uint8, or an encoded file's bytes) as the
        model's pixels [3, H, W]."""
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
            from transformers import AutoImageProcessor
            self._processor = AutoImageProcessor.from_pretrained(self.model_dir, backend="pil")
        return np.ascontiguousarray(self._processor(images=[image], return_tensors="np")["pixel_values"][0],
                                    dtype=np.float32)
