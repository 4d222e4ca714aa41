"""The scheduler's encoder budget and cache (engine/core/encoder_cache.py) driven for thousands of
random steps without a model, against a model of the runner's cache (freed digests dropped, then
the step's images encoded): every chunk's images are there when it runs; each image is encoded
only when not held (once per residency); a step never encodes more than its budget nor holds
more than the cache's size; a chunk stops before an image it cannot have and no request waits
for ever; nothing is needed or leaked once every request ended. Prompts share images (the same
picture in several requests, twice in one), and requests are preempted, aborted and cut into
chunks through image spans. Some images come with their embeddings (an encoder tier's): they take
room in the cache and none of the step's budget."""
from __future__ import annotations

import random

import pytest
from test_scheduler import fake_run

from baton.engine.common.config import EngineConfig
from baton.engine.common.core_messages import ImageInput, image_placeholder
from baton.engine.common.errors import InvalidArgument
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.core.encoder_cache import EncoderCache, encoder_cache
from baton.engine.core.kv_cache_manager import KVCacheManager
from baton.engine.core.request import Request
from baton.engine.core.scheduler import Scheduler


def image_prompt(rng: random.Random, pictures: list[int], per_image: int, max_len: int) -> tuple[list, list]:
    """Text and images (digests drawn from `pictures`) in random order, within max_len."""
    ids, images = [], []
    while len(ids) < max_len - per_image - 4:
        if rng.random() < 0.4:
            digest = rng.choice(pictures)
            images.append(ImageInput(digest, len(ids), per_image, b"\0", [3, 1, 1], [], rng.random() < 0.3))
            ids += [image_placeholder(digest)] * per_image
        else:
            ids += [rng.randrange(2) for _ in range(rng.randint(1, 9))]
        if rng.random() < 0.3:
            break
    return ids, images


@pytest.mark.parametrize("seed", range(16))
def test_randomized_encoder_budget_and_cache(tmp_path, seed):
    rng = random.Random(seed)
    per_image = rng.choice([3, 5, 8])
    size, budget = rng.choice([per_image, 2 * per_image, 5 * per_image]), rng.choice([per_image, 3 * per_image, 64])
    whole = seed % 2 == 1  # images computed in one step (Gemma 3's): steps and chunks that can hold one
    config = EngineConfig(model=str(tmp_path), block_size=4, max_num_seqs=rng.randint(1, 5),
                          max_num_batched_tokens=rng.choice([8, 16, 64] if whole else [6, 16, 64]), max_model_len=64,
                          enable_prefix_caching=rng.random() < 0.7,
                          long_prefill_token_threshold=rng.choice([0, 8] if whole else [0, 4]))
    kv = KVCacheManager(rng.randint(16, 40), config.block_size, config.enable_prefix_caching)
    encoder = EncoderCache(size, budget, whole)
    sched = Scheduler(config, kv, encoder=encoder)
    pictures = [rng.getrandbits(60) for _ in range(rng.randint(1, 4))]
    pending = []
    for i in range(rng.randint(6, 18)):
        ids, images = image_prompt(rng, pictures, per_image, 56)
        request = Request(f"r{i}", ids, SamplingParams(max_tokens=rng.randint(1, 6)))
        request.images = images
        pending.append(request)
    held: dict[int, int] = {}  # the runner's cache: digest -> tokens
    encoded = 0
    for _ in range(3000):
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop())
        if sched.requests and rng.random() < 0.03:
            sched.finish_requests([rng.choice(list(sched.requests))])
        out = sched.schedule()
        for digest in out.freed_images:
            del held[digest]
            assert not any(image.digest == digest and image.offset < r.num_computed_tokens < image.offset + image.length
                           for r in sched.requests.values() for image in r.images
                           if r.request_id not in out.num_scheduled_tokens), "evicted while a request is inside it"
        step = 0
        for req_id, indices in out.encoder_inputs.items():
            for index in indices:
                image = sched.requests[req_id].images[index]
                assert image.digest not in held, "an image encoded while it was held"
                held[image.digest] = image.length
                step += 0 if image.encoded else image.length
                encoded += 1
        assert step <= budget and sum(held.values()) <= size
        for req_id, n in out.num_scheduled_tokens.items():
            request = sched.requests[req_id]
            start = request.num_computed_tokens - n
            for image in request.images:
                if image.offset < start + n and image.offset + image.length > start:
                    assert image.digest in held, f"{req_id}'s chunk [{start}, {start + n}) reads an image not held"
                assert not (whole and image.offset < start + n < image.offset + image.length), "an image cut"
        sched.update_from_output(out, fake_run(sched, out, rng))
        if not pending and not sched.requests:
            break
    assert not sched.requests and not pending, "requests left unfinished"
    assert not encoder.needed and sum(encoder.idle.values()) == sum(held.values()) == size - encoder.num_free
    assert encoded >= 1


def test_a_chunk_stops_before_an_image_the_step_cannot_encode(tmp_path):
    """Budget for one image a step: a prompt of two images is computed up to the second, which
    the next step encodes; a request starting inside an image with none of it left waits."""
    config = EngineConfig(model=str(tmp_path), block_size=4, max_num_batched_tokens=64, max_model_len=64)
    kv = KVCacheManager(32, 4, True)
    sched = Scheduler(config, kv, encoder=EncoderCache(size=16, budget=8))
    request = Request("a", [1, 2] + [image_placeholder(7)] * 8 + [3] + [image_placeholder(9)] * 8 + [4],
                      SamplingParams(max_tokens=1))
    request.images = [ImageInput(7, 2, 8, b"\0", [3, 1, 1]), ImageInput(9, 11, 8, b"\0", [3, 1, 1])]
    sched.add_request(request)
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 11} and first.encoder_inputs == {"a": [0]}
    sched.update_from_output(first, fake_run(sched, first, random.Random(0)))
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"a": 9} and second.encoder_inputs == {"a": [1]}


def test_the_sizes_are_checked_naming_the_field(tmp_path):
    config = EngineConfig(model=str(tmp_path), max_num_batched_tokens=64)
    assert encoder_cache(config, None) is None
    cache = encoder_cache(config, 576)
    assert (cache.size, cache.budget) == (576, 576)
    for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
        with pytest.raises(InvalidArgument) as err:
            encoder_cache(EngineConfig(model=str(tmp_path), **{name: 100}), 576)
        assert err.value.field == name
        with pytest.raises(InvalidArgument) as err:
            EngineConfig(model=str(tmp_path), **{name: 0})
        assert err.value.field == name
    for name in ("max_num_batched_tokens", "long_prefill_token_threshold"):  # an image computed in one step
        with pytest.raises(InvalidArgument) as err:
            encoder_cache(EngineConfig(model=str(tmp_path), **{name: 100}), 256, whole_images=True)
        assert err.value.field == name
