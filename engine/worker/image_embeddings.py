"""A vision-language model's image embeddings on the runner: held by digest as the scheduler's
encoder cache says (engine/core/encoder_cache.py: the digests to let go, then the step's images
to encode, one pass of the encoder per pixel shape), and the step's rows inside image spans
given theirs for the forward (CausalLM.forward's `image_rows`)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from baton.engine.common.core_messages import ImageInput


class ImageEmbeddings:
    def __init__(self, encode: Callable[[torch.Tensor, list], torch.Tensor | list[torch.Tensor]], device: torch.device):
        """`encode`: pixels [images, *shape] and the images' sizes -> each image's embeddings
        [tokens, hidden] (the model's vision)."""
        self.encode, self.device = encode, device
        self.held: dict[int, torch.Tensor] = {}

    def update(self, freed: list[int], images: list[ImageInput]) -> None:
        """The digests let go, then `images` encoded."""
        for digest in freed:
            del self.held[digest]
        by_shape: dict[tuple, list[ImageInput]] = {}
        for image in images:
            by_shape.setdefault(tuple(image.shape), []).append(image)
        for shape, same in by_shape.items():
            pixels = torch.stack([torch.frombuffer(bytearray(image.pixels), dtype=torch.float32).view(shape)
                                  for image in same]).to(self.device)
            for image, embeds in zip(same, self.encode(pixels, [image.size for image in same])):
                self.held[image.digest] = embeds

    def rows(self, image_rows: list[tuple[int, ImageInput, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, embeddings) for (first row, image, its first embedding row, how many) spans."""
        rows = torch.cat([torch.arange(first, first + count) for first, _, _, count in image_rows])
        parts = [self.held[image.digest][start:start + count] for _, image, start, count in image_rows]
        return rows.to(self.device), torch.cat(parts)
