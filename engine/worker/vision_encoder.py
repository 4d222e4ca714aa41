"""An encoder tier's model (E/P/D): a vision-language checkpoint's image encoder alone, without
its language model, run over processed images (engine/front/images.py's ImageInput) as a
prefill's runner runs it, so that its embeddings are the ones a prefill computes itself."""
from __future__ import annotations

import torch

from baton.engine.common.core_messages import ImageInput
from baton.engine.worker.image_embeddings import encode_images
from baton.engine.worker.loader import load_vision


class VisionEncoder:
    def __init__(self, model_dir: str, dtype: torch.dtype, device: str):
        self.model, args = load_vision(model_dir, dtype, device)  # (InvalidArgument for a text model)
        self.vision = args.vision  # (its image token and tokens per image: what the front's processor needs)
        self.max_image_tokens = self.vision.most_tokens(model_dir)  # the largest image the processor makes
        # An image token's values: its embedding, and each DeepStack level's features (Qwen3-VL's)
        self.hidden = args.hidden_size * (1 + self.vision.deepstack_levels)
        self.dtype, self.device = dtype, torch.device(device)

    @torch.inference_mode()
    def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's embeddings [tokens, hidden], in order (Qwen3-VL's [tokens, (1 + levels) x
        hidden]: the embeddings, then each DeepStack level's features, as CausalLM.forward takes them)."""
        by_digest = {image.digest: embeds for image, embeds in encode_images(self.model, images, self.device)}
        return [by_digest[image.digest] for image in images]
