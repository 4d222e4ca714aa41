"""A front's first half: a prompt and its parameters validated (errors name the field) and
tokenized into the CoreRequest its engine core takes. Torch-free: it runs in a server's
front process, beside gRPC, while the core steps in its own."""
from __future__ import annotations

import itertools
import time

from baton.engine.common.core_messages import AdapterInfo, CoreRequest, EngineFacts
from baton.engine.common.errors import NotFound, check
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.common.tokenizer import apply_chat_template
from baton.engine.front.images import ImageProcessor
from baton.kv_transfer.base import KVHandle


class InputProcessor:
    def __init__(self, tokenizer, facts: EngineFacts, images: ImageProcessor | None = None):
        """`images`: a vision-language model's (None: prompts are text only)."""
        self.tokenizer = tokenizer
        self.images = images
        self.max_model_len = facts.max_model_len
        self.vocab_size = facts.vocab_size
        self.enable_lora = facts.enable_lora
        self._adapters: dict[str, AdapterInfo] = {a.name: a for a in facts.adapters}
        self._keys = itertools.count(1)

    # The adapters the core has loaded, as the front saw its load and unload calls answered.
    def adapter_loaded(self, info: AdapterInfo) -> None:
        self._adapters[info.name] = info

    def adapter_unloaded(self, name: str) -> None:
        self._adapters.pop(name, None)

    def loaded_adapters(self) -> list[AdapterInfo]:
        return list(self._adapters.values())

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return apply_chat_template(self.tokenizer, messages, tools)

    def core_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                     priority: int = 0, arrival_time: float | None = None, hold_for_remote: bool = False,
                     remote_kv: KVHandle | None = None, resumed_output: list[int] = (),
                     adapter: str = "", images: list | None = None) -> CoreRequest:
        """`hold_for_remote`: a prefill's request, whose blocks wait for a decode peer once it
        ends. `remote_kv`: a decode's, whose prompt KV a prefill peer holds (its first token
        is then an output already, unless it resumes). `resumed_output`: tokens another instance
        generated and streamed already (it failed); they become this request's first outputs,
        recomputed with the prompt (after it, with `remote_kv`), so the rest continues as an
        uninterrupted run would. `adapter`: a loaded LoRA
        adapter's name ("": the base model); raises NotFound naming `adapter` when none is.
        `images`: a vision-language model's, one per image token in the prompt (images.py)."""
        check(isinstance(request_id, str) and request_id != "", "request_id", "must be a non-empty string")
        if adapter:
            self.adapter(adapter)
        check(isinstance(priority, int), "priority", f"must be an integer, got {priority!r}")
        if isinstance(prompt, str):
            check(prompt != "", "prompt", "must not be empty")
            token_ids = self.tokenize(prompt)
        else:
            token_ids = list(prompt)
            self._check_token_ids("prompt_token_ids", token_ids)
        check(len(token_ids) > 0, "prompt", "has no tokens")
        params = params or SamplingParams()
        image_inputs = []
        if images:
            check(self.images is not None, "multi_modal_data", "this model takes no images (it is not a "
                                                               "vision-language model)")
            check(params.prompt_logprobs is None, "prompt_logprobs", "are not given for prompts with images")
            token_ids, image_inputs = self.images.expand(token_ids, list(images), "multi_modal_data.image")
        check(len(token_ids) <= self.max_model_len, "prompt",
              f"has {len(token_ids)} tokens, more than max_model_len {self.max_model_len}")
        params.check_vocab(self.vocab_size)
        # The prefill peer's first token, unless the request resumes (the tokens already streamed,
        # from an instance that failed, whose first is the first token that prefill gave then).
        outputs = [remote_kv.first_token] if remote_kv is not None and not resumed_output else []
        if resumed_output:
            self._check_token_ids("resumed_output", resumed_output)
            check(len(resumed_output) < params.max_tokens, "resumed_output",
                  f"has {len(resumed_output)} tokens, max_tokens is {params.max_tokens}: nothing is left to generate")
            check(len(token_ids) + len(resumed_output) < self.max_model_len, "resumed_output",
                  f"with the prompt reaches max_model_len {self.max_model_len}")
            outputs += resumed_output
        return CoreRequest(next(self._keys), request_id, token_ids, params,
                           time.monotonic() if arrival_time is None else arrival_time, priority, outputs,
                           hold_for_remote, remote_kv, adapter, image_inputs)

    def adapter(self, name: str, field: str = "adapter") -> AdapterInfo:
        """A loaded adapter; raises NotFound naming `field` (InvalidArgument when LoRA is off)."""
        check(self.enable_lora, field, f"asks for LoRA adapter {name!r} but LoRA is not enabled (enable_lora)")
        info = self._adapters.get(name)
        if info is None:
            raise NotFound(field, f"no LoRA adapter named {name!r} is loaded "
                                  f"(loaded: {', '.join(sorted(self._adapters)) or 'none'})")
        return info

    def _check_token_ids(self, field: str, token_ids) -> None:
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        check(bad is None, field, f"must be integers in [0, {self.vocab_size}), got {bad!r}")
