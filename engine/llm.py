"""The offline API, shaped like vLLM's: LLM(model_dir, **engine_args).generate(prompts, params)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from baton.engine.config import EngineConfig
from baton.engine.errors import check
from baton.engine.llm_engine import LLMEngine
from baton.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0


class LLM:
    def __init__(self, model: str | EngineConfig, **engine_args):
        """model: a checkpoint directory (with engine_args), or a whole EngineConfig."""
        config = model if isinstance(model, EngineConfig) else EngineConfig.from_kwargs(model, **engine_args)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> None:
        """Forget every cached block hash (the next request computes its whole prompt)."""
        self.engine.kv.reset_prefix_cache()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 priority: list[int] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """prompts: a text, a list of token ids, or a list of either. One output per prompt, in order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        check(len(params) == len(prompts), "sampling_params", f"has {len(params)} entries for {len(prompts)} prompts")
        check(priority is None or len(priority) == len(prompts), "priority", "needs one entry per prompt")
        outputs: dict[str, RequestOutput] = {}
        order = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            req_id = str(next(self._ids))
            req = self.engine.add_request(req_id, prompt, p, priority[i] if priority else 0)
            outputs[req_id] = RequestOutput(req_id, list(req.prompt_token_ids))
            order.append(req_id)
        return self._run(outputs, order, use_tqdm)

    def chat(self, conversations: list[list[dict]] | list[dict], sampling_params=None, use_tqdm: bool = False):
        """Chat prompts through the checkpoint's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.engine.apply_chat_template(c) for c in conversations], sampling_params,
                             use_tqdm=use_tqdm)

    def _run(self, outputs: dict[str, RequestOutput], order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(order), desc="requests", unit="req")
        try:
            while self.engine.has_unfinished_requests():
                for step in self.engine.step():
                    out = outputs[step.request_id]
                    out.token_ids.extend(step.new_token_ids)
                    out.text += step.text
                    if step.finished:
                        out.finish_reason = step.finish_reason
                        out.num_cached_tokens = step.num_cached_tokens
                        if bar:
                            bar.update(1)
        finally:
            if bar:
                bar.close()
        return [outputs[r] for r in order]
