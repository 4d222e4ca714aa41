"""The offline API, shaped like vLLM's: LLM(model_dir, **engine_args).generate(prompts, params)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from baton.engine.common.config import EngineConfig
from baton.engine.common.errors import check
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.front.images import chat_with_images
from baton.engine.offline.llm_engine import LLMEngine, StepOutput


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a prompt (a request with n > 1 has n)."""
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list | None = None  # one TokenLogprobs per token, when asked for


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list | None = None  # None for the first token, then one TokenLogprobs per token
    num_cached_tokens: int = 0

    # The first completion's, for the usual n = 1.
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class LLM:
    def __init__(self, model: str | EngineConfig, **engine_args):
        """model: a checkpoint directory (with engine_args), or a whole EngineConfig."""
        config = model if isinstance(model, EngineConfig) else EngineConfig.from_kwargs(model, **engine_args)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's other processes (its tensor-parallel ranks; they also end with this
        process) and threads (LLMEngine.close). Twice is once."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block hash (the next request computes its whole prompt)."""
        self.engine.core.reset_prefix_cache()

    def load_adapter(self, name: str, path: str) -> None:
        """Serve a LoRA adapter (a PEFT directory) under `name`, for generate's lora_request."""
        self.engine.load_adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        self.engine.unload_adapter(name)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 priority: list[int] | None = None, use_tqdm: bool = False,
                 lora_request: str | list[str | None] | None = None) -> list[RequestOutput]:
        """prompts: a text, a list of token ids, or a list of either; or, as vLLM takes them, dicts of
        "prompt" (a text) or "prompt_token_ids", and "multi_modal_data": {"image": an image or a
        list of them} (PIL images or [H, W, 3] uint8 arrays, one per image token of the prompt) for
        a vision-language model. One output per prompt, in order.
        lora_request: a loaded adapter's name for every prompt, or one per prompt (None: the base)."""
        if (isinstance(prompts, (str, dict))
                or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))):
            prompts = [prompts]
        params = (sampling_params if isinstance(sampling_params, list)
                  else [sampling_params or SamplingParams()] * len(prompts))
        adapters = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        check(len(params) == len(prompts), "sampling_params", f"has {len(params)} entries for {len(prompts)} prompts")
        check(priority is None or len(priority) == len(prompts), "priority", "needs one entry per prompt")
        check(len(adapters) == len(prompts), "lora_request", f"has {len(adapters)} entries for {len(prompts)} prompts")
        outputs: list[RequestOutput] = []
        children: dict[str, tuple[RequestOutput, CompletionOutput]] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            req_id = str(next(self._ids))
            prompt, images = _prompt_and_images(prompt, i)
            out = None
            for index in range(p.n):  # the later ones find the prompt's blocks in the prefix cache
                req = self.engine.add_request(f"{req_id}-{index}" if p.n > 1 else req_id, prompt,
                                              p.child(index), priority[i] if priority else 0,
                                              adapter=adapters[i] or "", images=images)
                out = out or RequestOutput(req_id, self._shown(req.prompt_token_ids))
                out.outputs.append(CompletionOutput(index))
                children[req.request_id] = (out, out.outputs[-1])
            outputs.append(out)
        self._run(children, use_tqdm)
        return outputs

    def _shown(self, token_ids: list[int]) -> list[int]:
        """A prompt's token ids as its output shows them: an image's positions as the model's image
        token (as transformers' processors expand it), not its placeholder ids."""
        images = self.engine.inputs.images
        return [t if t >= 0 else images.image_token_id for t in token_ids] if images is not None else list(token_ids)

    def chat(self, conversations: list[list[dict]] | list[dict], sampling_params=None, use_tqdm: bool = False):
        """Chat prompts through the checkpoint's chat template. A message's content may be parts, as
        OpenAI's and vLLM's: text, and for a vision-language model images (image_url with a data:
        URL, or image_pil), which go before the message's text."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        images = self.engine.inputs.images
        prompts = []
        for c in conversations:
            messages, pictures = chat_with_images(c, images.image_text if images is not None else "")
            ids = self.engine.apply_chat_template(messages)
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": pictures}} if pictures else ids)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, children: dict[str, tuple[RequestOutput, CompletionOutput]], use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(children), desc="requests", unit="req")
        try:
            while self.engine.has_unfinished_requests():
                for step in self.engine.step():
                    out, completion = children[step.request_id]
                    _add_step(out, completion, step)
                    if step.finished and bar:
                        bar.update(1)
            if self.engine.failed:  # a request the core ended unfinished (the others ran to their end)
                failed, self.engine.failed = self.engine.failed, []
                raise failed[0]
        finally:
            if bar:
                bar.close()


def _prompt_and_images(prompt, i: int) -> tuple[str | list[int], list | None]:
    """A prompt as generate takes it: its text or token ids, and its images (None: none)."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
    check(not unknown, f"prompts[{i}]", f"has keys {unknown}; it takes prompt or prompt_token_ids, and "
                                        f"multi_modal_data")
    text = prompt.get("prompt", prompt.get("prompt_token_ids"))
    check(text is not None, f"prompts[{i}]", "has neither prompt nor prompt_token_ids")
    data = prompt.get("multi_modal_data") or {}
    check(isinstance(data, dict) and set(data) <= {"image"}, f"prompts[{i}].multi_modal_data",
          "takes images only: {'image': an image or a list of them}")
    images = data.get("image")
    return text, None if images is None else (images if isinstance(images, list) else [images])


def _add_step(out: RequestOutput, completion: CompletionOutput, step: StepOutput) -> None:
    completion.token_ids.extend(step.new_token_ids)
    completion.text += step.text
    if step.logprobs is not None:
        if completion.logprobs is None:
            completion.logprobs = []
        completion.logprobs.extend(step.logprobs)
    if step.prompt_logprobs is not None:
        out.prompt_logprobs = step.prompt_logprobs
    if step.finished:
        completion.finish_reason, completion.stop_reason = step.finish_reason, step.stop_reason
        out.num_cached_tokens = step.num_cached_tokens
