"""Vision-language models (LLaVA-1.5: CLIP ViT, projector, Llama), a checkpoint of random weights
written from transformers' own classes with its image processor: images of odd sizes through the
checkpoint's processor, their features merged where the prompt holds their placeholders. Greedy
output equals transformers' (LlavaForConditionalGeneration.generate on the same pixels), batched
with text-only prompts and several images per prompt, with chunked prefill cutting through image
spans; the prefix cache hits on the same image and misses on another with the same text; bad
input is refused naming the field."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import random_images as images
from helpers import random_prompts

from baton import LLM, SamplingParams
from baton.engine.common.errors import InvalidArgument
from baton.testing.checkpoints import write_random_llava

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> str:
    return write_random_llava(str(tmp_path_factory.mktemp("llava") / "llava"), seed=3)


def hf_greedy(model_dir: str, token_ids: list[int], pictures: list[np.ndarray], n: int) -> list[int]:
    """transformers' greedy continuation: its processor's pixels, the image token expanded as its
    processor would."""
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = model.config
    per_image = (config.vision_config.image_size // config.vision_config.patch_size) ** 2
    ids = [t for token in token_ids for t in ([token] * per_image if token == config.image_token_index else [token])]
    kwargs = {}
    if pictures:
        processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
        kwargs["pixel_values"] = torch.from_numpy(processor(images=pictures, return_tensors="np")["pixel_values"])
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, **kwargs)
    return out[0, len(ids):].tolist()


def image_token(model_dir: str) -> int:
    import json
    import os

    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["image_token_index"]


# The default encoder budget and cache (64 tokens: two images a step), and room for one image only
# (each step encodes one, and the next image's evicts the last).
@pytest.mark.parametrize("encoder", [{}, {"max_num_encoder_input_tokens": 25, "encoder_cache_size": 25}])
def test_images_in_prompts_equal_transformers(llava, encoder):
    """Text-only, one image, two images, and an image at the prompt's start, in one batch; 32-token
    chunks cut through the 25-token image spans; the outputs equal transformers', and the images
    change them."""
    img = image_token(llava)
    text = random_prompts([7, 12, 5, 9, 20], seed=5)
    pictures = images(1, [(37, 45), (64, 30), (30, 30), (41, 33)])
    prompts = [
        {"prompt_token_ids": text[0]},
        {"prompt_token_ids": text[1][:4] + [img] + text[1][4:], "multi_modal_data": {"image": pictures[0]}},
        {"prompt_token_ids": text[2] + [img] + text[3] + [img] + [5, 6],
         "multi_modal_data": {"image": [pictures[1], pictures[2]]}},
        {"prompt_token_ids": [img] + text[4], "multi_modal_data": {"image": [pictures[3]]}},
    ]
    llm = LLM(llava, dtype="float32", device="cpu", max_num_batched_tokens=32, **encoder)
    outs = llm.generate(prompts, GREEDY)
    wants = [hf_greedy(llava, p["prompt_token_ids"], [pictures[0]] if i == 1 else
                       [pictures[1], pictures[2]] if i == 2 else [pictures[3]] if i == 3 else [], GREEDY.max_tokens)
             for i, p in enumerate(prompts)]
    assert [o.token_ids for o in outs] == wants
    other = llm.generate({"prompt_token_ids": prompts[1]["prompt_token_ids"],
                          "multi_modal_data": {"image": pictures[2]}}, GREEDY)[0]
    assert other.token_ids != outs[1].token_ids  # another image, another output (else this test could not fail)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_llava_over_mistral_with_a_sliding_window_equals_transformers(tmp_path):
    """The language model read as its family reads it: Mistral's 16-token window, which the
    image's 25 tokens and the text around them cross."""
    model_dir = write_random_llava(str(tmp_path / "llava-mistral"), seed=4, text_model="MistralConfig",
                                   text={"sliding_window": 16})
    img = image_token(model_dir)
    ids = random_prompts([9], seed=2)[0] + [img] + random_prompts([14], seed=3)[0]
    picture = images(4, [(35, 29)])
    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=16)
    assert llm.engine.runner.model.args.sliding_window == 16
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": picture}}, GREEDY)[0]
    assert out.token_ids == hf_greedy(model_dir, ids, picture, GREEDY.max_tokens)


def test_the_prefix_cache_keys_blocks_by_their_images(llava):
    """The same text with the same image finds its blocks; with another image it finds only the
    blocks before the image; each output as a fresh engine computes it."""
    img = image_token(llava)
    prefix = random_prompts([40], seed=8)[0]
    ids = prefix + [img] + random_prompts([30], seed=9)[0]
    a, b = images(2, [(50, 40), (50, 40)])
    llm = LLM(llava, dtype="float32", device="cpu")
    first = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": a}}, GREEDY)[0]
    again = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": a}}, GREEDY)[0]
    other = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": b}}, GREEDY)[0]
    assert again.token_ids == first.token_ids and again.num_cached_tokens == 80  # 5 of the 6 blocks of 95 tokens
    assert other.num_cached_tokens == 32  # the blocks wholly before the image
    fresh = LLM(llava, dtype="float32", device="cpu")
    assert other.token_ids == fresh.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": b}},
                                             GREEDY)[0].token_ids != first.token_ids
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_the_same_image_is_encoded_once_and_survives_preemption_and_async_scheduling(llava):
    """Four requests with the same picture (and one with another) in a pool that preempts, steps
    queued ahead: the shared picture is encoded once while some request needs it, a preempted
    request finds it again or has it encoded again, and every output equals a roomy synchronous
    engine's; the encoder cache holds nothing needed afterwards."""
    img = image_token(llava)
    a, b = images(6, [(33, 47), (40, 40)])
    texts = random_prompts([20, 31, 9, 26, 14], seed=12)
    prompts = [{"prompt_token_ids": t[:5] + [img] + t[5:], "multi_modal_data": {"image": b if i == 4 else a}}
               for i, t in enumerate(texts)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(llava, dtype="float32", device="cpu").generate(prompts, params)]
    llm = LLM(llava, dtype="float32", device="cpu", num_kv_blocks=9, max_model_len=128, async_scheduling=True,
              max_num_batched_tokens=48)
    runner, encoded = llm.engine.runner, []
    vision = runner.model.vision.forward

    def counted(pixels, sizes):
        encoded.append(pixels.shape[0])
        return vision(pixels, sizes)
    runner.model.vision.forward = counted
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0 and llm.engine.core.loop.ahead
    assert sum(encoded) == 2  # each picture once: the four requests with the same one share it
    assert not scheduler.encoder.needed
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_chat_takes_images_as_content_parts(llava):
    """LLM.chat's content parts (vLLM's image_pil, and image_url with a data: URL) give what
    generate gives the same pictures before the text, through the chat template."""
    import base64
    import io

    from PIL import Image

    picture = Image.fromarray(images(7, [(40, 36)])[0])
    encoded = io.BytesIO()
    picture.save(encoded, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(encoded.getvalue()).decode()
    llm = LLM(llava, dtype="float32", device="cpu")
    ids = llm.engine.inputs.apply_chat_template([{"role": "user", "content": "<image>\nWhat is it?"}])
    want = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": picture}}, GREEDY)[0].token_ids
    for part in ({"type": "image_pil", "image_pil": picture}, {"type": "image_url", "image_url": {"url": url}}):
        out = llm.chat([{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}], GREEDY)
        assert out[0].token_ids == want, part["type"]
    with pytest.raises(InvalidArgument) as err:
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "hi"},
                                               {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}])
    assert err.value.field == "messages[0].content[1]"


def test_bad_images_are_refused_naming_the_field(llava, tiny_llama):
    img = image_token(llava)
    llm = LLM(llava, dtype="float32", device="cpu")
    picture = images(3, [(20, 20)])[0]
    for prompt, field in (
            ({"prompt_token_ids": [5, img, 6], "multi_modal_data": {"image": [picture, picture]}},
             "multi_modal_data.image"),
            ({"prompt_token_ids": [5, img, 6], "multi_modal_data": {"image": np.zeros((4, 4), np.uint8)}},
             "multi_modal_data.image[0]"),
            ({"prompt_token_ids": [5, img, 6], "multi_modal_data": {"image": "cat.png"}}, "multi_modal_data.image[0]"),
            ({"prompt_token_ids": [5, img], "multi_modal_data": {"audio": picture}}, "prompts[0].multi_modal_data"),
            ({"prompt_token_ids": [5], "images": [picture]}, "prompts[0]")):
        with pytest.raises(InvalidArgument) as err:
            llm.generate(prompt, GREEDY)
        assert err.value.field == field, (field, err.value)
    with pytest.raises(InvalidArgument, match="prompt_logprobs"):
        llm.generate({"prompt_token_ids": [5, img, 6], "multi_modal_data": {"image": picture}},
                     SamplingParams(max_tokens=2, prompt_logprobs=1))
    with pytest.raises(InvalidArgument) as err:
        LLM(tiny_llama, dtype="float32", device="cpu").generate(
            {"prompt_token_ids": [5, 6], "multi_modal_data": {"image": picture}}, GREEDY)
    assert err.value.field == "multi_modal_data"
    assert llm.generate({"prompt_token_ids": [5, img, 6], "multi_modal_data": {"image": picture}},
                        GREEDY)[0].token_ids  # the engine carries on
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_prefill_and_decode_over_nixl_equal_colocated_and_the_decode_never_encodes(llava):
    """The prefill encodes the images and computes the prompt; the decode READs the blocks (their
    hashes name the images, on both sides alike) and never runs its encoder."""
    from nixl_engines import assert_images_across_pd_as_colocated

    assert_images_across_pd_as_colocated(llava, [image_token(llava)])


PINPOINTS = [[16, 32], [32, 16], [32, 32], [48, 16]]


def test_llava_next_tiles_images_at_their_own_aspect_equal_to_transformers(tmp_path):
    """LLaVA-NeXT: each image tiled at the grid resolution its size picks, plus the whole image; its
    tiles' features unpadded with a newline a row, so images of other sizes take other counts of
    tokens (36 to 88 here). Batched with a text prompt, in 24-token chunks, equal to transformers'
    (LlavaNextForConditionalGeneration.generate on the same tiles and sizes)."""
    from transformers import AutoImageProcessor, LlavaNextForConditionalGeneration

    from baton.engine.common import anyres

    model_dir = write_random_llava(str(tmp_path / "llava-next"), seed=3, image_size=16, patch_size=4,
                                   grid_pinpoints=PINPOINTS)
    img = image_token(model_dir)
    sizes = [(37, 53), (60, 20), (16, 16), (33, 33)]
    pictures = images(12, sizes)
    texts = random_prompts([6, 9, 4, 11], seed=16)
    prompts = [{"prompt_token_ids": texts[0]},
               {"prompt_token_ids": texts[1][:3] + [img] + texts[1][3:], "multi_modal_data": {"image": pictures[0]}},
               {"prompt_token_ids": [img] + texts[2] + [img] + [7], "multi_modal_data": {"image": pictures[1:3]}},
               {"prompt_token_ids": texts[3] + [img], "multi_modal_data": {"image": pictures[3]}}]
    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=24)
    outs = llm.generate(prompts, GREEDY)
    model = LlavaNextForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    for out, prompt, mine in zip(outs, prompts, [[], [0], [1, 2], [3]]):
        counts = iter([anyres.num_tokens(*sizes[i], PINPOINTS, 16, 4) for i in mine])
        ids = [t for token in prompt["prompt_token_ids"] for t in ([token] * next(counts) if token == img else [token])]
        assert len(ids) == len(out.prompt_token_ids)  # (the engine's spans as transformers' processor counts them)
        kwargs = {}
        if mine:
            processed = processor(images=[pictures[i] for i in mine], return_tensors="pt")
            kwargs = {"pixel_values": processed["pixel_values"], "image_sizes": processed["image_sizes"]}
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=GREEDY.max_tokens, min_new_tokens=GREEDY.max_tokens,
                                  do_sample=False, eos_token_id=None, **kwargs)[0, len(ids):].tolist()
        assert out.token_ids == want, mine
    other = llm.generate({**prompts[1], "multi_modal_data": {"image": pictures[3]}}, GREEDY)[0]
    assert other.token_ids != outs[1].token_ids  # another image, another output
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
