"""A front's second half: an engine core's token outputs turned into what callers stream. Text
is detokenized incrementally and cut at the first stop string; a request a stop string ends
is finished here and aborted in the core, as vLLM v1's output processor does (the core may
run it a step or two more meanwhile: those tokens are dropped). Torch-free, like the input
processor."""
from __future__ import annotations

from dataclasses import dataclass

from baton.engine.common.core_messages import CoreOutput, CoreRequest, TokenLogprobs
from baton.engine.front.detokenizer import TextStream
from baton.kv_transfer.base import KVHandle


@dataclass(slots=True)
class StepOutput:
    """One request's progress in one step, as callers see it."""
    request_id: str
    new_token_ids: list[int]
    text: str  # the text that became complete this step
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    kv_handle: KVHandle | None = None  # when a prefill's request finished: where its blocks wait
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked for
    prompt_logprobs: list | None = None  # with the first token, when asked for: None, then one per prompt token
    stop_reason: str | int | None = None  # when finished by a stop string or stop token id
    key: int = 0  # the request's key (CoreRequest.key)
    time: float = 0.0  # when the step sampled these tokens (time.monotonic())
    ready_time: float | None = None  # with a request's first sampled token: when it could run


class _Tracked:
    __slots__ = ("request_id", "num_prompt_tokens", "num_output_tokens", "num_cached_tokens", "min_tokens", "stream",
                 "hands_over")

    def __init__(self, request: CoreRequest, stream: TextStream | None, min_tokens: int):
        self.request_id = request.request_id
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_output_tokens = len(request.output_token_ids)
        self.num_cached_tokens = 0  # as its outputs last said (a plain token says nothing of it)
        self.min_tokens = min_tokens
        self.stream = stream
        # A prefill's request ends at its first token and goes on at a decode: its text is not final.
        self.hands_over = request.hold_for_remote

    def plain_output(self, key: int, token_id: int, text: str, step_time: float, stop: str | None) -> StepOutput:
        """A plain token (OutputProcessor.token's) as an output: its last where a stop string ended it."""
        return StepOutput(self.request_id, [token_id], text, stop is not None, None if stop is None else "stop",
                          self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens, stop_reason=stop,
                          key=key, time=step_time)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[int, _Tracked] = {}  # by key

    def add(self, request: CoreRequest, detokenize: bool = True, min_tokens: int | None = None) -> None:
        """Track a request sent to the core. `min_tokens`: the request's own, where the core was
        given less (a prefill runs one token); no stop string ends it before that many."""
        p = request.sampling_params
        stream = None
        if detokenize or p.stop:
            stream = TextStream(self.tokenizer, request.prompt_token_ids, p.stop, p.include_stop_str_in_output,
                                p.skip_special_tokens)
            # Outputs sampled elsewhere (a prefill peer, a failed instance) and sent already: replayed
            # silently, a token at a time as they were streamed there (the detokenizer holds back
            # partial characters, so chunking changes what it has emitted). No stop string ended
            # the request there, so none is looked for: an earlier one, before min_tokens, must not
            # drop the text held back at the end.
            for token in request.output_token_ids:
                stream.push([token], look_for_stops=False)
        self.requests[request.key] = _Tracked(request, stream, p.min_tokens if min_tokens is None else min_tokens)

    def drop(self, key: int) -> None:
        """Forget a request whose caller left."""
        self.requests.pop(key, None)

    def process(self, outputs: list[CoreOutput], step_time: float) -> tuple[list[StepOutput], list[str]]:
        """The step's outputs for callers, and the ids of requests a stop string ended that the
        core must abort (it still runs them, or holds their blocks for a decode peer)."""
        steps, stopped = [], []
        for out in outputs:
            tracked = self.requests.get(out.key)
            if tracked is None:  # its caller left, or a stop string ended it a step ago
                continue
            finish, stop_reason, handle = out.finish_reason, out.stop_token_id, out.kv_handle
            tracked.num_cached_tokens = out.num_cached_tokens
            tokens, logprobs, text = out.new_token_ids, out.logprobs, ""
            if tracked.stream is not None:
                final = finish is not None and not (tracked.hands_over and finish == "length")
                text, stop, kept = self._push(tracked, tokens, final)
                if stop is not None:
                    if finish is None or handle is not None:
                        stopped.append(tracked.request_id)
                    finish, stop_reason, handle = "stop", stop, None
                    tokens, logprobs = tokens[:kept], logprobs[:kept] if logprobs is not None else None
            else:
                tracked.num_output_tokens += len(tokens)
            if finish is not None:
                del self.requests[out.key]
            steps.append(StepOutput(tracked.request_id, tokens, text, finish is not None, finish,
                                    tracked.num_prompt_tokens, tracked.num_output_tokens, out.num_cached_tokens,
                                    handle, logprobs, out.prompt_logprobs, stop_reason, out.key, step_time,
                                    out.ready_time))
        return steps, stopped

    def token(self, key: int, token_id: int, step_time: float, stopped: list[str]) -> str | StepOutput | None:
        """A plain token of a step (CoreStep's columns): the text it completes; or, where a stop
        string ended its request there, the request's last output (its id added to `stopped`);
        None where its request is not tracked."""
        tracked = self.requests.get(key)
        if tracked is None:
            return None
        if tracked.stream is None:
            tracked.num_output_tokens += 1
            return ""
        text, stop, _ = self._push(tracked, [token_id], False)
        if stop is None:
            return text
        del self.requests[key]
        stopped.append(tracked.request_id)
        return tracked.plain_output(key, token_id, text, step_time, stop)

    def token_output(self, key: int, token_id: int, text: str, step_time: float) -> StepOutput:
        """A plain token (token()'s text) as an output, for a caller that takes outputs."""
        return self.requests[key].plain_output(key, token_id, text, step_time, None)

    @staticmethod
    def _push(tracked: _Tracked, tokens: list[int], final: bool) -> tuple[str, str | None, int]:
        """A step's tokens into the request's text: (the text to emit, the stop string that ended
        it, how many of the tokens came before the end). Several tokens in one step (speculative
        decoding's kept drafts) go in one at a time, so none past a stop string's is kept."""
        stream = tracked.stream
        if len(tokens) <= 1 or not stream.stops:
            tracked.num_output_tokens += len(tokens)
            text, stop = stream.push(tokens, final, tracked.num_output_tokens >= tracked.min_tokens)
            return text, stop, len(tokens)
        texts = []
        for i, token in enumerate(tokens):
            tracked.num_output_tokens += 1
            text, stop = stream.push([token], final and i == len(tokens) - 1,
                                     tracked.num_output_tokens >= tracked.min_tokens)
            texts.append(text)
            if stop is not None:
                return "".join(texts), stop, i + 1
        return "".join(texts), None, len(tokens)
