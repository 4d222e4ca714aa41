"""Qwen2.5-VL (a windowed ViT with 2D RoPE over images at their own resolution, a Qwen2 with
M-RoPE), a checkpoint of random weights written from transformers' own classes with Qwen2-VL's
image processor: images of odd sizes, each taking the tokens its size gives, several per prompt.
Greedy output equals transformers' (Qwen2_5_VLForConditionalGeneration.generate on the same
pixels and grids), batched with a text-only prompt, with chunked prefill cutting through image
spans, and after preemption; a prefill and a decode over NIXL equal colocated with the decode
never encoding (it needs the images' grids for the positions, not their pixels); two tensor-
parallel ranks equal one."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from helpers import assert_image_prompts_as_reference, random_prompts
from helpers import random_images as images

from baton import LLM, SamplingParams
from baton.engine.common.errors import InvalidArgument
from baton.testing.checkpoints import write_random_qwen2_5_vl

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory) -> str:
    return write_random_qwen2_5_vl(str(tmp_path_factory.mktemp("qwen-vl") / "qwen-vl"), seed=5)


def special(model_dir: str) -> tuple[int, int, int]:
    """(vision start, image pad, vision end) token ids."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    return cfg["vision_start_token_id"], cfg["image_token_id"], cfg["vision_end_token_id"]


def with_images(model_dir: str, *parts) -> list[int]:
    """A prompt of token lists and None (an image: start, pad, end)."""
    start, pad, end = special(model_dir)
    return [t for part in parts for t in ([start, pad, end] if part is None else part)]


def hf_greedy(model_dir: str, token_ids: list[int], pictures: list[np.ndarray], n: int) -> list[int]:
    """transformers' greedy continuation: its processor's pixels and grids, each image pad expanded
    to its image's tokens as its processor would, and the image tokens marked for its M-RoPE."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad, kwargs, ids = model.config.image_token_id, {}, list(token_ids)
    if pictures:
        processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
        out = processor(images=pictures, return_tensors="pt")
        counts = iter((out["image_grid_thw"].prod(-1) // 4).tolist())
        ids = [t for token in token_ids for t in ([token] * next(counts) if token == pad else [token])]
        kwargs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"],
                  "mm_token_type_ids": torch.tensor([[int(t == pad) for t in ids]])}
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, **kwargs)
    return out[0, len(ids):].tolist()


def test_images_in_prompts_equal_transformers(qwen_vl):
    """Text only; one image; two images of other sizes (their windows cut short at the edges); an
    image at the prompt's start and one at its end (the positions after it go on from the image's
    larger side); in one batch, 16-token chunks cutting through the spans. The outputs equal
    transformers', and another image changes them."""
    text = random_prompts([7, 12, 5, 9, 20, 6], seed=5)
    pictures = images(1, [(37, 53), (64, 30), (30, 30), (41, 33), (24, 70)])
    prompts = [([text[0]], []), ([text[1][:4], None, text[1][4:]], pictures[:1]),
               ([text[2], None, text[3], None, [5, 6]], pictures[1:3]), ([None, text[4]], pictures[3:4]),
               ([text[5], None], pictures[4:])]
    assert_image_prompts_as_reference(qwen_vl, prompts, with_images, hf_greedy, max_num_batched_tokens=16)


def test_qwen2_vl_equals_transformers(tmp_path):
    """Qwen2-VL: the same tower with LayerNorms, an fc1/fc2 MLP and full attention in every block,
    the same M-RoPE; two images of other sizes and one at the prompt's end, chunked."""
    model_dir = write_random_qwen2_5_vl(str(tmp_path / "qwen2-vl"), seed=4, qwen2=True)
    text = random_prompts([7, 12, 6], seed=6)
    pictures = images(2, [(37, 53), (64, 30), (24, 70)])
    prompts = [([text[0][:3], None, text[0][3:], None], pictures[:2]), ([text[1], None], pictures[2:]),
               ([text[2]], [])]
    assert_image_prompts_as_reference(model_dir, prompts, with_images, hf_greedy, max_num_batched_tokens=16)


def test_preemption_and_async_scheduling_keep_images_and_positions(qwen_vl):
    """Requests with images in a pool that preempts, steps queued ahead: each preempted request's
    prompt is computed again with its images' positions (and encodings found or made again), and
    every output equals a roomy synchronous engine's."""
    a, b = images(6, [(33, 47), (40, 24)])
    texts = random_prompts([20, 31, 9, 26], seed=12)
    prompts = [{"prompt_token_ids": with_images(qwen_vl, t[:5], None, t[5:]),
                "multi_modal_data": {"image": b if i % 2 else a}} for i, t in enumerate(texts)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(qwen_vl, dtype="float32", device="cpu").generate(prompts, params)]
    llm = LLM(qwen_vl, dtype="float32", device="cpu", num_kv_blocks=9, max_model_len=128, async_scheduling=True,
              max_num_batched_tokens=48)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.core.loop.ahead
    assert not llm.engine.scheduler.encoder.needed
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_chat_writes_each_image_between_vision_start_and_end(qwen_vl):
    """LLM.chat's image parts become <|vision_start|><|image_pad|><|vision_end|> before the text,
    as Qwen's chat template writes them, and give what generate gives that prompt."""
    from PIL import Image

    picture = Image.fromarray(images(7, [(40, 36)])[0])
    llm = LLM(qwen_vl, dtype="float32", device="cpu")
    ids = llm.engine.inputs.apply_chat_template(
        [{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>What is it?"}])
    start, pad, end = special(qwen_vl)
    assert [start, pad, end] == ids[ids.index(pad) - 1:ids.index(pad) + 2]
    want = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": picture}}, GREEDY)[0].token_ids
    out = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": picture},
                                                 {"type": "text", "text": "What is it?"}]}], GREEDY)
    assert out[0].token_ids == want == hf_greedy(qwen_vl, ids, [np.asarray(picture)], GREEDY.max_tokens)


def test_an_image_over_the_encoder_budget_is_refused_naming_it(qwen_vl):
    """An encoder budget under the largest image the processor makes is refused at start; an image
    the processor makes larger than the engine takes (its max_pixels raised after) is refused by
    the front, naming the image; the engine carries on."""
    with pytest.raises(InvalidArgument) as err:
        LLM(qwen_vl, dtype="float32", device="cpu", max_num_encoder_input_tokens=20)
    assert err.value.field == "max_num_encoder_input_tokens"
    llm = LLM(qwen_vl, dtype="float32", device="cpu")
    processor = llm.engine.inputs.images
    processor.max_image_tokens = 30  # as if the processor's config allowed more than the engine was sized for
    big, small = images(8, [(48, 48), (16, 24)])
    with pytest.raises(InvalidArgument) as err:
        llm.generate({"prompt_token_ids": with_images(qwen_vl, [5], None, [6], None),
                      "multi_modal_data": {"image": [small, big]}}, GREEDY)
    assert err.value.field == "multi_modal_data.image[1]" and "36 tokens" in str(err.value)
    assert llm.generate({"prompt_token_ids": with_images(qwen_vl, [5], None, [6]),
                         "multi_modal_data": {"image": small}}, GREEDY)[0].token_ids
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_prefill_and_decode_over_nixl_equal_colocated_and_the_decode_never_encodes(qwen_vl):
    """The prefill encodes the images and computes the prompt; the decode READs the blocks and
    takes its positions' delta from the images' grids, never running its encoder."""
    from nixl_engines import assert_images_across_pd_as_colocated

    assert_images_across_pd_as_colocated(qwen_vl, with_images(qwen_vl, None))


def test_two_tensor_parallel_ranks_equal_one(qwen_vl):
    """Each rank encodes the step's images with its whole ViT and computes the positions from the
    images' grids itself; the language model split over two gloo ranks gives one rank's outputs."""
    pictures = images(10, [(37, 53), (29, 45)])
    texts = random_prompts([9, 14], seed=21)
    requests = [{"prompt_token_ids": with_images(qwen_vl, t[:4], None, t[4:]), "multi_modal_data": {"image": pic}}
                for t, pic in zip(texts, pictures)]
    want = [o.token_ids for o in LLM(qwen_vl, dtype="float32", device="cpu").generate(requests, GREEDY)]
    with LLM(qwen_vl, dtype="float32", device="cpu", tensor_parallel_size=2, max_num_batched_tokens=16) as llm:
        assert [o.token_ids for o in llm.generate(requests, GREEDY)] == want
        assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_images_without_pixels_are_refused_where_they_must_be_encoded(qwen_vl):
    """A request whose images came as spans only (a decode's, from its prefill's handle) and whose
    KV over them must be computed here (no blocks to load here) ends with ImagesNotSent before any
    encoder runs; the request beside it runs to its end, and the engine carries on."""
    import msgspec

    from baton.engine.common.errors import ImagesNotSent

    llm = LLM(qwen_vl, dtype="float32", device="cpu")
    a, b = images(11, [(37, 53), (29, 45)])
    prompt = with_images(qwen_vl, [5, 6], None, [7])
    _, processed = llm.engine.inputs.images.expand(prompt, [a], "image")
    spans = [msgspec.structs.replace(image, pixels=b"") for image in processed]
    other = {"prompt_token_ids": prompt, "multi_modal_data": {"image": b}}
    want = llm.generate(other, GREEDY)[0].token_ids
    llm.engine.runner.model.vision.forward = lambda pixels, sizes: pytest.fail("an image without pixels was encoded")
    with pytest.raises(ImagesNotSent):
        llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"image": spans}},
                      {"prompt_token_ids": prompt + [8]}], GREEDY)
    assert llm.generate(other, GREEDY)[0].token_ids == want  # (its embeddings still held: no encoder)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks and not llm.engine.scheduler.encoder.needed
