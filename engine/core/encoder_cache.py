"""The scheduler's half of a vision-language model's encoder cache (vLLM v1's EncoderCacheManager
and its per-step encoder budget): which images' embeddings the runner holds, by digest; which
live requests still need each; and how much of the encoder a step may run.

A chunk [start, start + n) of a request that overlaps an image's span needs the image's
embeddings on the runner in that step: held already (another request's, or this one's before a
preemption), or encoded in this step, which takes the image's tokens out of the step's encoder
budget (`max_num_encoder_input_tokens`) and of the cache's room (`encoder_cache_size`). Where an
image can do neither, the chunk stops before it (or the request waits a step when the chunk
would start inside it), as vLLM's _try_schedule_encoder_inputs does. An image stays needed until
the request's computed tokens pass its span (released when the step that computes its last rows
is scheduled, after the whole step is: no image a step reads is evicted for that step), or the
request ends or is preempted; an image nobody needs keeps its room until another needs the room
(least recently freed first), so a second request with the same image finds it. Evicted digests
go to the runner with the next step (SchedulerOutput.freed_images), before it encodes or runs."""
from __future__ import annotations

from collections import OrderedDict

from baton.engine.common.config import EngineConfig
from baton.engine.common.errors import check
from baton.engine.core.request import Request


class EncoderCache:
    def __init__(self, size: int, budget: int, whole_images: bool = False):
        """`size`: the tokens of embeddings the runner holds at most; `budget`: the tokens of
        images a step may encode; `whole_images`: a chunk never ends inside an image's span (an
        image whose tokens attend to each other both ways, Gemma 3's, is computed in one step)."""
        self.size, self.budget, self.whole_images = size, budget, whole_images
        self.needed: dict[int, set[str]] = {}  # digest -> the requests that still need it
        self.idle: OrderedDict[int, int] = OrderedDict()  # held, needed by nobody: digest -> tokens, oldest first
        self.tokens: dict[int, int] = {}  # every held image's tokens
        self.num_free = size
        self.step_budget = budget
        self.freed: list[int] = []  # evicted since the last step went out
        self.to_encode: dict[str, list[int]] = {}  # this step's: request -> its images' indices

    @property
    def max_image_tokens(self) -> int:
        """The most tokens one image may take: what a step may encode, and the cache hold."""
        return min(self.size, self.budget)

    def begin_step(self) -> None:
        self.step_budget, self.to_encode = self.budget, {}

    def plan(self, request: Request, start: int, n: int) -> tuple[int, list[int]]:
        """How many of the n tokens from `start` the request may compute this step, and which of
        its images (indices) it must encode for them; nothing is taken until `commit`."""
        overlapping = [i for i, image in enumerate(request.images)
                       if image.offset < start + n and image.offset + image.length > start]
        held = {request.images[i].digest for i in overlapping}  # idle ones among them are not room
        encode, digests, budget = [], set(), self.step_budget
        room = self.num_free + sum(t for digest, t in self.idle.items() if digest not in held)
        for index in overlapping:
            image = request.images[index]
            if image.digest in self.tokens or image.digest in digests:  # held, or twice in the prompt
                continue
            cost = _encoder_cost(image)
            if cost > budget or image.length > room:
                return max(0, image.offset - start), encode
            encode.append(index)
            digests.add(image.digest)
            budget -= cost
            room -= image.length
        if self.whole_images:
            n = self._uncut(request, start, n)
            encode = [i for i in encode if request.images[i].offset < start + n]
        return n, encode

    @staticmethod
    def _uncut(request: Request, start: int, n: int) -> int:
        """n, or fewer so that the chunk from `start` ends before an image it would cut (0: it
        starts inside one it cannot finish this step)."""
        for image in request.images:
            if image.offset < start + n < image.offset + image.length:
                return max(0, image.offset - start)
        return n

    @staticmethod
    def unsent(request: Request, encode: list[int]) -> bool:
        """Whether an image `plan` says to encode came without its pixels (a decode's: errors.ImagesNotSent)."""
        return any(not request.images[i].pixels for i in encode)

    def commit(self, request: Request, encode: list[int], start: int, n: int) -> None:
        """Take what `plan` said (the chunk's KV slots are allocated): the request noted as needing
        every image its chunk overlaps, then its encodings scheduled, room made for them."""
        for image in request.images:
            if image.offset < start + n and image.offset + image.length > start and image.digest in self.tokens:
                self._claim(image.digest, request.request_id)
        for index in encode:
            image = request.images[index]
            while self.num_free < image.length:  # the longest idle first
                digest, tokens = self.idle.popitem(last=False)
                del self.tokens[digest]
                self.num_free += tokens
                self.freed.append(digest)
            self.num_free -= image.length
            self.tokens[image.digest] = image.length
            self.step_budget -= _encoder_cost(image)
            self.to_encode.setdefault(request.request_id, []).append(index)
            self._claim(image.digest, request.request_id)

    def _claim(self, digest: int, req_id: str) -> None:
        if digest in self.idle:
            del self.idle[digest]
        self.needed.setdefault(digest, set()).add(req_id)

    def computed(self, request: Request, upto: int) -> None:
        """The request's tokens up to `upto` are computed (scheduled): images whose span ends
        there are no longer needed by it, unless the same picture's span later in the prompt is
        under way (it must stay held through that one's last chunk)."""
        inside = {image.digest for image in request.images if image.offset < upto < image.offset + image.length}
        for image in request.images:
            if image.offset + image.length <= upto and image.digest not in inside:
                self._release(image.digest, request.request_id)

    def release(self, request: Request) -> None:
        """The request ended, or was preempted: it needs none of its images now."""
        for image in request.images:
            self._release(image.digest, request.request_id)

    def _release(self, digest: int, req_id: str) -> None:
        users = self.needed.get(digest)
        if users is None or req_id not in users:
            return
        users.discard(req_id)
        if not users:
            del self.needed[digest]
            self.idle[digest] = self.tokens[digest]

    def take_freed(self) -> list[int]:
        freed, self.freed = self.freed, []
        return freed


def _encoder_cost(image) -> int:
    """The tokens of a step's encoder budget an image takes: its own, or none when it came with
    its embeddings (an encoder tier's: nothing to run)."""
    return 0 if image.encoded else image.length


def encoder_cache(config: EngineConfig, tokens_per_image: int | None, whole_images: bool = False
                  ) -> EncoderCache | None:
    """A vision-language model's encoder cache as the config sizes it (its defaults: the step's
    token budget, or the most tokens one image takes, `tokens_per_image`, where that is more);
    None for a text model (`tokens_per_image` None)."""
    if tokens_per_image is None:
        return None
    budget = config.max_num_encoder_input_tokens or max(config.max_num_batched_tokens, tokens_per_image)
    size = config.encoder_cache_size or max(config.max_num_batched_tokens, tokens_per_image)
    check(budget >= tokens_per_image, "max_num_encoder_input_tokens",
          f"is {budget}, less than one image's {tokens_per_image} tokens: no image could be encoded")
    check(size >= tokens_per_image, "encoder_cache_size",
          f"is {size}, less than one image's {tokens_per_image} tokens: no image's embeddings would fit")
    if whole_images:  # (else a request would wait for a step with room for an image forever)
        for name, most in (("max_num_batched_tokens", config.max_num_batched_tokens),
                           ("long_prefill_token_threshold", config.long_prefill_token_threshold)):
            check(not most or most >= tokens_per_image, name, f"is {most}, less than one image's {tokens_per_image} "
                                                               f"tokens, which this model computes in one step")
    return EncoderCache(size, budget, whole_images)
