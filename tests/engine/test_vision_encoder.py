"""An encoder tier's model (engine/worker/vision_encoder.py): a vision-language checkpoint's image
encoder alone, loaded without its language model. An engine given its embeddings (ImageInput
.encoded, as a prefill reads them from an encoder tier) computes a prompt as from the pixels:
the same digests, tokens and log-probabilities, in 16-token chunks that cut through the images
(Gemma 3's aside: it never cuts one), for each family's way with images: Qwen2.5-VL's M-RoPE,
Qwen3-VL's DeepStack features (riding in the embeddings, [tokens, 3 x hidden]), Gemma 3's
bidirectional images, LLaVA-NeXT's tiles by the image's size."""
from __future__ import annotations

import msgspec
import pytest
import torch
from helpers import random_images as images

from baton import LLM, SamplingParams
from baton.engine.common.errors import InvalidArgument
from baton.engine.front.images import ImageProcessor
from baton.testing.checkpoints import (
    write_random_gemma3_vl,
    write_random_llava,
    write_random_qwen2_5_vl,
    write_random_qwen3_vl,
)

WRITERS = {"qwen": lambda d: write_random_qwen2_5_vl(d, seed=8),
           "qwen3": lambda d: write_random_qwen3_vl(d, seed=8),
           "gemma": lambda d: write_random_gemma3_vl(d, seed=8),
           "llava-next": lambda d: write_random_llava(d, seed=8, image_size=16, patch_size=4,
                                                      grid_pinpoints=[[16, 32], [32, 16], [32, 32]])}


@pytest.mark.parametrize("family", WRITERS)
def test_an_engine_given_an_encoder_s_embeddings_computes_as_from_the_pixels(family, tmp_path):
    from baton.engine.worker.vision_encoder import VisionEncoder

    model = WRITERS[family](str(tmp_path / family))
    pictures = images(8, [(37, 45), (29, 50)])
    encoder = VisionEncoder(model, torch.float32, "cpu")
    v = encoder.vision
    processor = ImageProcessor(model, v.image_token_id, v.tokens_per_image, encoder.max_image_tokens, "")
    processed = [processor.processed(picture, "image") for picture in pictures]
    encoded = [msgspec.structs.replace(image, pixels=embeds.numpy().tobytes(), encoded=True)
               for image, embeds in zip(processed, encoder.encode(processed), strict=True)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = []
    for given in (pictures, encoded):  # (an engine each: the second must not find the first's blocks)
        llm = LLM(model, dtype="float32", device="cpu", max_num_batched_tokens=16 if family != "gemma" else 64)
        inputs = llm.engine.inputs
        ids = inputs.apply_chat_template([{"role": "user", "content": inputs.images.image_text * 2 + "Compare."}])
        outs.append(llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": given}}, params)[0])
        assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
    from_pixels, from_embeddings = outs
    assert from_embeddings.token_ids == from_pixels.token_ids
    for a, b in zip(from_pixels.outputs[0].logprobs, from_embeddings.outputs[0].logprobs, strict=True):
        assert a.top_token_ids == b.top_token_ids and a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-5)
    assert len(from_pixels.prompt_token_ids) > sum(i.length for i in processed) > 16  # (chunks cut the spans)


def test_a_text_model_has_no_image_encoder(tiny_llama):
    from baton.engine.worker.vision_encoder import VisionEncoder

    with pytest.raises(InvalidArgument, match="not a vision-language model") as e:
        VisionEncoder(tiny_llama, torch.float32, "cpu")
    assert e.value.field == "model"
