"""Qwen3-VL (Qwen2-VL's tower with a biased patch embedding and a learned position grid resampled to
each image, DeepStack features added to the image's tokens after the first decoder layers, a Qwen3
with interleaved M-RoPE), a checkpoint of random weights written from transformers' own classes
with its image processor: the image features (the merger's and every DeepStack level's) equal
transformers' get_image_features to the bit, and greedy output equals transformers' generate for
text alone, one image, two images of other sizes, an image at the prompt's start and one at its
end, in one batch whose 16-token chunks cut through the images' spans; two tensor-parallel ranks
equal one; prefill and decode over NIXL equal colocated, the decode never encoding."""
from __future__ import annotations

import time

import pytest
import torch
from helpers import assert_image_prompts_as_reference, random_prompts
from helpers import random_images as images
from test_qwen_vl import hf_greedy, with_images

from baton.engine.front.images import ImageProcessor
from baton.testing.checkpoints import write_random_qwen3_vl


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory) -> str:
    return write_random_qwen3_vl(str(tmp_path_factory.mktemp("qwen3-vl") / "qwen3-vl"), seed=5)


def test_image_features_equal_transformers_to_the_bit(qwen3_vl):
    """Each image's embeddings and DeepStack features (Baton's one [tokens, 3 x hidden] tensor) equal
    transformers' get_image_features' pooler output and deepstack features, for grids smaller and
    larger than the learned 7 x 7 position grid, wide and tall."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from baton.engine.worker.vision_encoder import VisionEncoder

    encoder = VisionEncoder(qwen3_vl, torch.float32, "cpu")
    reference = AutoModelForImageTextToText.from_pretrained(qwen3_vl, dtype=torch.float32).eval()
    hf_processor = AutoImageProcessor.from_pretrained(qwen3_vl, backend="pil")
    v = encoder.vision
    processor = ImageProcessor(qwen3_vl, v.image_token_id, v.tokens_per_image, encoder.max_image_tokens, "")
    pictures = images(3, [(37, 53), (64, 30), (14, 22), (48, 48)])
    grids = set()
    for picture in pictures:
        image = processor.processed(picture, "image")
        started = time.perf_counter()
        ours = encoder.encode([image])[0]
        ours_s = time.perf_counter() - started
        inputs = hf_processor(images=[picture], return_tensors="pt")
        with torch.no_grad():
            started = time.perf_counter()
            out = reference.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
            theirs_s = time.perf_counter() - started
        want = torch.cat([out.pooler_output[0], *(level[0] for level in out.deepstack_features)], dim=-1)
        assert ours.shape == (image.length, 3 * 64) and torch.equal(ours, want)
        grids.add(tuple(image.shape[1:3]))
        print(f"grid {image.shape[1:3]}: Baton {ours_s * 1e3:.2f} ms, transformers {theirs_s * 1e3:.2f} ms")
    assert len(grids) == len(pictures) and any(max(g) > 7 for g in grids) and any(min(g) < 7 for g in grids)


def test_images_in_prompts_equal_transformers(qwen3_vl):
    """Text only; one image; two images of other sizes; an image at the prompt's start and one at
    its end; in one batch, 16-token chunks cutting through the spans (the DeepStack features added
    to whichever of an image's rows a chunk holds). The outputs equal transformers', and another
    image changes them."""
    text = random_prompts([7, 12, 5, 9, 20, 6], seed=5)
    pictures = images(1, [(37, 53), (64, 30), (30, 30), (41, 33), (24, 70)])
    prompts = [([text[0]], []), ([text[1][:4], None, text[1][4:]], pictures[:1]),
               ([text[2], None, text[3], None, [5, 6]], pictures[1:3]), ([None, text[4]], pictures[3:4]),
               ([text[5], None], pictures[4:])]
    assert_image_prompts_as_reference(qwen3_vl, prompts, with_images, hf_greedy, max_num_batched_tokens=16)


def test_prefill_and_decode_over_nixl_equal_colocated_and_the_decode_never_encodes(qwen3_vl):
    """The prefill encodes the images (DeepStack's features go into its KV) and computes the
    prompt; the decode READs the blocks and takes its positions from the images' grids only."""
    from nixl_engines import assert_images_across_pd_as_colocated

    assert_images_across_pd_as_colocated(qwen3_vl, with_images(qwen3_vl, None))


def test_two_tensor_parallel_ranks_equal_one(qwen3_vl):
    """Each rank encodes the step's images with its whole ViT and adds the DeepStack features to its
    replicated hidden states; the language model split over two gloo ranks gives one rank's outputs."""
    from baton import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    pictures = images(10, [(37, 53), (29, 45)])
    texts = random_prompts([9, 14], seed=21)
    requests = [{"prompt_token_ids": with_images(qwen3_vl, t[:4], None, t[4:]), "multi_modal_data": {"image": pic}}
                for t, pic in zip(texts, pictures)]
    want = [o.token_ids for o in LLM(qwen3_vl, dtype="float32", device="cpu").generate(requests, greedy)]
    with LLM(qwen3_vl, dtype="float32", device="cpu", tensor_parallel_size=2, max_num_batched_tokens=16) as llm:
        assert [o.token_ids for o in llm.generate(requests, greedy)] == want
        assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_a_hub_config_reads_with_interleaved_m_rope_and_deepstack():
    """Qwen3-VL-4B's config.json as published (M-RoPE in rope_scaling, the old vision model_type):
    a Qwen3 with per-head QK-norm, its half-dims on t, h, w in turn within the sections (the last
    four on time, as transformers' recomposition leaves them), DeepStack after blocks 5, 11, 17."""
    from baton.engine.worker.models import model_args
    from baton.engine.worker.models.mrope import streams

    text = {"head_dim": 128, "hidden_size": 2560, "intermediate_size": 9728, "num_attention_heads": 32,
            "num_hidden_layers": 36, "num_key_value_heads": 8, "rope_theta": 5000000, "vocab_size": 151936,
            "max_position_embeddings": 262144, "model_type": "qwen3_vl_text", "tie_word_embeddings": True,
            "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"}}
    vision = {"deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh",
              "hidden_size": 1024, "intermediate_size": 4096, "model_type": "qwen3_vl", "num_heads": 16,
              "num_position_embeddings": 2304, "out_hidden_size": 2560, "patch_size": 16}
    args = model_args({"architectures": ["Qwen3VLForConditionalGeneration"], "text_config": text,
                       "vision_config": vision, "tie_word_embeddings": True})
    assert (args.qk_norm, args.rope_theta, args.rope_scaling, args.tie_word_embeddings) == ("head", 5e6, None, True)
    assert args.mrope_section == [24, 20, 20] and args.mrope_interleaved
    assert streams(args.mrope_section, args.mrope_interleaved) == [0, 1, 2] * 20 + [0] * 4
    assert args.vision.deepstack_levels == 3 and args.vision.patch_size == 16 and args.vision.window_size == 0
