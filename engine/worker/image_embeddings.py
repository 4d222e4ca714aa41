"""A vision-language model's image embeddings on the runner: held by digest as the scheduler's
encoder cache says (engine/core/encoder_cache.py: the digests to let go, then the step's images
to encode, one pass of the encoder per pixel shape), and the step's rows inside image spans
given theirs for the forward (CausalLM.forward's `image_rows`)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from baton.engine.common.core_messages import ImageInput


def encode_images(encode: Callable, images: list[ImageInput], device: torch.device
                  ) -> list[tuple[ImageInput, torch.Tensor]]:
    """Each image with its embeddings [tokens, hidden]: one pass of `encode` per pixel shape."""
    by_shape: dict[tuple, list[ImageInput]] = {}
    for image in images:
        by_shape.setdefault(tuple(image.shape), []).append(image)
    out = []
    for shape, same in by_shape.items():
        pixels = torch.stack([torch.frombuffer(bytearray(image.pixels), dtype=torch.float32).view(shape)
                              for image in same]).to(device)
        out += zip(same, encode(pixels, [image.size for image in same]))
    return out


class ImageEmbeddings:
    def __init__(self, encode: Callable[[torch.Tensor, list], torch.Tensor | list[torch.Tensor]], device: torch.device,
                 dtype: torch.dtype):
        """`encode`: pixels [images, *shape] and the images' sizes -> each image's embeddings
        [tokens, hidden] (the model's vision; with DeepStack, Qwen3-VL's, [tokens, (1 + levels) x
        hidden], held and handed to the forward as one); `dtype`: theirs."""
        self.encode, self.device, self.dtype = encode, device, dtype
        self.held: dict[int, torch.Tensor] = {}

    def update(self, freed: list[int], images: list[ImageInput]) -> None:
        """The digests let go, then `images` encoded (or, an encoder tier's, taken as they are)."""
        for digest in freed:
            del self.held[digest]
        for image in images:
            if image.encoded:  # (an encoder tier's embeddings)
                embeds = torch.frombuffer(bytearray(image.pixels), dtype=torch.float32).view(image.length, -1)
                self.held[image.digest] = embeds.to(self.device, self.dtype)
        for image, embeds in encode_images(self.encode, [i for i in images if not i.encoded], self.device):
            self.held[image.digest] = embeds

    def rows(self, image_rows: list[tuple[int, ImageInput, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, embeddings) for (first row, image, its first embedding row, how many) spans."""
        rows = torch.cat([torch.arange(first, first + count) for first, _, _, count in image_rows])
        parts = [self.held[image.digest][start:start + count] for _, image, start, count in image_rows]
        return rows.to(self.device), torch.cat(parts)
