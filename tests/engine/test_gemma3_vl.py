"""Gemma 3 with images (a SigLIP ViT pooled to 16 tokens an image, over a Gemma 3 text model of a
16-token sliding layer and a global one), a checkpoint of random weights written from
transformers' own classes with its image processor. An image's tokens attend to each other both
ways: greedy output equals transformers' (Gemma3ForConditionalGeneration.generate with the
image tokens marked), batched with a text-only prompt and several images per prompt, with chunks
that stop before an image rather than cut it; a prefill and a decode over NIXL equal colocated."""
from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import assert_image_prompts_as_reference, random_prompts
from helpers import random_images as images

from baton import LLM, SamplingParams
from baton.engine.common.errors import InvalidArgument
from baton.testing.checkpoints import write_random_gemma3_vl

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma_vl(tmp_path_factory) -> str:
    return write_random_gemma3_vl(str(tmp_path_factory.mktemp("gemma3-vl") / "gemma3-vl"), seed=2)


def with_images(model_dir: str, *parts) -> list[int]:
    """A prompt of token lists and None (an image: start, soft token, end)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    image = [cfg["boi_token_index"], cfg["image_token_index"], cfg["eoi_token_index"]]
    return [t for part in parts for t in (image if part is None else part)]


def hf_greedy(model_dir: str, token_ids: list[int], pictures: list, n: int) -> list[int]:
    """transformers' greedy continuation: its processor's pixels, each soft token expanded to the
    image's tokens, and those marked (token_type_ids) for the bidirectional mask."""
    from transformers import AutoImageProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    soft, per_image = model.config.image_token_index, model.config.mm_tokens_per_image
    ids = [t for token in token_ids for t in ([token] * per_image if token == soft else [token])]
    kwargs = {}
    if pictures:
        processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
        kwargs = {"pixel_values": processor(images=pictures, return_tensors="pt")["pixel_values"],
                  "token_type_ids": torch.tensor([[int(t == soft) for t in ids]])}
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, **kwargs)
    return out[0, len(ids):].tolist()


def test_images_in_prompts_equal_transformers(gemma_vl):
    """Text only; one image; two images; an image at the prompt's start; in one batch of 16-token
    chunks, which stop before an image's 16 tokens rather than cut them. The outputs equal
    transformers', whose image tokens see each other both ways, and another image changes them."""
    text = random_prompts([7, 12, 5, 9, 20], seed=5)
    pictures = images(1, [(37, 53), (64, 30), (30, 30), (41, 33)])
    prompts = [([text[0]], []), ([text[1][:4], None, text[1][4:]], pictures[:1]),
               ([text[2], None, text[3], None, [5, 6]], pictures[1:3]), ([None, text[4]], pictures[3:])]
    assert_image_prompts_as_reference(gemma_vl, prompts, with_images, hf_greedy, max_num_batched_tokens=16)


def test_a_step_too_small_for_an_image_is_refused_at_start(gemma_vl):
    with pytest.raises(InvalidArgument) as err:
        LLM(gemma_vl, dtype="float32", device="cpu", max_num_batched_tokens=12)
    assert err.value.field == "max_num_batched_tokens"


def test_prefill_and_decode_over_nixl_equal_colocated(gemma_vl):
    from nixl_engines import assert_images_across_pd_as_colocated

    assert_images_across_pd_as_colocated(gemma_vl, with_images(gemma_vl, None))


def test_a_chunk_stops_before_an_image_rather_than_cut_it(gemma_vl):
    """Under 16-token steps a prompt with an image at position 6 is computed as [0, 6) and then the
    image's span whole: its log-probabilities equal one step's (a cut image's first tokens would
    not have seen its last: 0.08 off, the same argmax, on this model)."""
    picture = images(1, [(37, 53)])
    prompt = {"prompt_token_ids": with_images(gemma_vl, [5, 6, 7, 8, 9], None, [10, 11, 12, 13]),
              "multi_modal_data": {"image": picture}}
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    whole = LLM(gemma_vl, dtype="float32", device="cpu").generate(prompt, params)[0].outputs[0]
    llm = LLM(gemma_vl, dtype="float32", device="cpu", max_num_batched_tokens=16)
    chunks, schedule = [], llm.engine.scheduler.schedule

    def recorded():
        out = schedule()
        chunks.extend(out.num_scheduled_tokens.values())
        return out
    llm.engine.scheduler.schedule = recorded
    chunked = llm.generate(prompt, params)[0].outputs[0]
    assert chunks[:2] == [6, 16]  # the text before the image, then the image with what fits after it
    assert chunked.token_ids == whole.token_ids
    assert [lp.logprob for lp in chunked.logprobs] == pytest.approx([lp.logprob for lp in whole.logprobs], abs=1e-4)


def test_chat_writes_each_image_as_gemma3s_processor_does(gemma_vl):
    """LLM.chat's image parts become "\\n\\n<start_of_image><image_soft_token><end_of_image>\\n\\n"
    before the text (Gemma3Processor's full image sequence), and give transformers' output."""
    from PIL import Image

    picture = Image.fromarray(images(7, [(40, 36)])[0])
    llm = LLM(gemma_vl, dtype="float32", device="cpu")
    assert llm.engine.inputs.images.image_text == "\n\n<start_of_image><image_soft_token><end_of_image>\n\n"
    ids = llm.engine.inputs.apply_chat_template([{"role": "user", "content": llm.engine.inputs.images.image_text
                                                  + "What is it?"}])
    out = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": picture},
                                                 {"type": "text", "text": "What is it?"}]}], GREEDY)
    assert out[0].token_ids == hf_greedy(gemma_vl, ids, [picture], GREEDY.max_tokens)
