"""The engine step loop: scheduler -> model runner -> scheduler, plus text for the callers."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch

from baton.engine.config import EngineConfig
from baton.engine.detokenizer import TextStream
from baton.engine.errors import InvalidArgument, check
from baton.engine.kv_cache_manager import KVCacheManager
from baton.engine.loader import load_model, read_config
from baton.engine.memory import measure_kv_cache_bytes, memory_before_loading
from baton.engine.model import ModelArgs
from baton.engine.model_runner import ModelRunner
from baton.engine.request import Request, RequestStatus
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler import Scheduler
from baton.engine.stats import EngineSnapshot, StepEvents
from baton.engine.tokenizer import apply_chat_template, load_tokenizer
from baton.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker

_CPU_KV_BUDGET = 1 << 30


@dataclass(slots=True)
class StepOutput:
    """One request's progress in one step."""
    request_id: str
    new_token_ids: list[int]
    text: str  # the text that became complete this step
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    kv_transfer_params: dict | None = None  # when finished: the connector's handle (prefill side)
    logprobs: list | None = None  # one TokenLogprobs per new token, when asked for
    prompt_logprobs: list | None = None  # with the first token, when asked for: None, then one per prompt token
    stop_reason: str | int | None = None  # when finished by a stop string or stop token id


@dataclass(slots=True)
class StepTimes:
    """Wall time spent, for the benchmark's scheduler share."""
    steps: int = 0
    step_s: float = 0.0
    scheduler_s: float = 0.0  # schedule() + update_from_output()


def _eos_token_ids(model_dir: str, tokenizer) -> frozenset[int]:
    path = os.path.join(model_dir, "generation_config.json")
    eos = None
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
    if eos is None:
        eos = read_config(model_dir).get("eos_token_id", tokenizer.eos_token_id)
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])


class LLMEngine:
    def __init__(self, config: EngineConfig,
                 kv_connector: tuple[KVConnectorScheduler, KVConnectorWorker] | None = None):
        """`kv_connector`: the scheduler and worker halves of a KV connector, or None (colocated)."""
        self.config = config
        args = ModelArgs.from_hf_config(read_config(config.model))
        config.resolve_model_len(args.max_position_embeddings)
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = _eos_token_ids(config.model, self.tokenizer)
        torch.manual_seed(config.seed)
        on_gpu = torch.device(config.device).type == "cuda"
        free_at_start, total = memory_before_loading(config.device) if on_gpu else (0, 0)
        model = load_model(config.model, config.torch_dtype(args.torch_dtype), config.device)
        if on_gpu and config.num_kv_blocks is None and config.kv_cache_memory_bytes is None:
            config.kv_cache_memory_bytes = measure_kv_cache_bytes(model, config, free_at_start, total)
        self.num_kv_blocks = self._num_kv_blocks(args, model.embed_tokens.weight.element_size())
        self.kv = KVCacheManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        connector_scheduler, connector_worker = kv_connector or (None, None)
        self.scheduler = Scheduler(config, self.kv, connector_scheduler)
        self.scheduler.on_token = self._on_token
        self.runner = ModelRunner(model, config, self.num_kv_blocks, self.eos_token_ids, connector_worker)
        self.vocab_size = args.vocab_size
        self.text_streams: dict[str, TextStream] = {}
        self._stop_text: dict[str, str] = {}  # this step's text of requests with stop strings (_on_token)
        self.times = StepTimes()
        self._step_tokens: list[int] | None = None  # per step, while events are recorded

    def record_events(self) -> None:
        """From now on keep each request's events (for spans and metrics) until `take_events`."""
        self.scheduler.events = []
        self._step_tokens = []

    def take_events(self) -> StepEvents:
        """The events and step sizes recorded since the last call (step-loop thread only)."""
        taken = StepEvents(self.scheduler.events, self._step_tokens, self.scheduler.last_step_time)
        self.scheduler.events, self._step_tokens = [], []
        return taken

    def _num_kv_blocks(self, args: ModelArgs, dtype_bytes: int) -> int:
        c = self.config
        if c.num_kv_blocks is None:
            block_bytes = args.num_layers * 2 * c.block_size * args.num_kv_heads * args.head_dim * dtype_bytes
            budget = _CPU_KV_BUDGET if c.kv_cache_memory_bytes is None else c.kv_cache_memory_bytes
            # Never more than every sequence slot at full length needs (plus prefix-cache slack).
            most = 2 * c.max_num_seqs * -(-c.max_model_len // c.block_size)
            c.num_kv_blocks = min(budget // block_bytes, most)
        check(c.num_kv_blocks * c.block_size >= c.max_model_len, "num_kv_blocks",
              f"{c.num_kv_blocks} blocks of {c.block_size} tokens cannot hold one request of max_model_len "
              f"{c.max_model_len}; raise num_kv_blocks (or kv_cache_memory_bytes) or lower max_model_len")
        return c.num_kv_blocks

    # ---- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return apply_chat_template(self.tokenizer, messages)

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                     priority: int = 0, arrival_time: float | None = None,
                     kv_transfer_params: dict | None = None, resumed_output: list[int] = ()) -> Request:
        """Validate and tokenize a request. Reads no mutable engine state, so a service's RPC
        threads may call it while the step loop runs. `resumed_output`: tokens another instance
        generated and streamed already (it failed); they become this request's first outputs,
        recomputed with the prompt, so the rest continues as an uninterrupted run would."""
        check(isinstance(request_id, str) and request_id != "", "request_id", "must be a non-empty string")
        check(isinstance(priority, int), "priority", f"must be an integer, got {priority!r}")
        if isinstance(prompt, str):
            check(prompt != "", "prompt", "must not be empty")
            token_ids = self.tokenize(prompt)
        else:
            token_ids = list(prompt)
            self._check_token_ids("prompt_token_ids", token_ids)
        check(len(token_ids) > 0, "prompt", "has no tokens")
        check(len(token_ids) <= self.config.max_model_len, "prompt",
              f"has {len(token_ids)} tokens, more than max_model_len {self.config.max_model_len}")
        params = params or SamplingParams()
        params.check_vocab(self.vocab_size)
        request = Request(request_id, token_ids, params, self.eos_token_ids, priority, arrival_time)
        request.kv_transfer_params = kv_transfer_params  # for the connector: a remote handle in, or a request out
        first_token = (kv_transfer_params or {}).get("first_token")
        if first_token is not None:  # sampled by the prefill peer: an output already, not re-sent
            request.append_output_token(first_token)
        if resumed_output:
            self._check_token_ids("resumed_output", resumed_output)
            check(len(resumed_output) < params.max_tokens, "resumed_output",
                  f"has {len(resumed_output)} tokens, max_tokens is {params.max_tokens}: nothing is left to generate")
            check(len(token_ids) + len(resumed_output) < self.config.max_model_len, "resumed_output",
                  f"with the prompt reaches max_model_len {self.config.max_model_len}")
            for token in resumed_output:
                request.append_output_token(token)
        return request

    def _check_token_ids(self, field: str, token_ids) -> None:
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        check(bad is None, field, f"must be integers in [0, {self.vocab_size}), got {bad!r}")

    def add(self, request: Request, detokenize: bool = True) -> None:
        """Queue a request made by make_request (step-loop thread only)."""
        check(request.request_id not in self.scheduler.requests, "request_id",
              f"{request.request_id!r} is already running")
        self.scheduler.add_request(request)
        p = request.sampling_params
        if detokenize or p.stop:
            stream = self.text_streams[request.request_id] = TextStream(
                self.tokenizer, request.prompt_token_ids, p.stop, p.include_stop_str_in_output, p.skip_special_tokens)
            # A prefill's request ends at its first token and goes on at a decode: its text is not final.
            stream.hands_over = bool((request.kv_transfer_params or {}).get("do_remote_decode"))
            # Outputs sampled elsewhere (a prefill peer, a failed instance) and sent already: replayed
            # silently, a token at a time as they were streamed there (the detokenizer holds back
            # partial characters, so chunking changes what it has emitted). No stop string ended
            # the request there, so none is looked for: an earlier one, before min_tokens, must not
            # drop the text held back at the end.
            for token in request.output_token_ids:
                stream.push([token], look_for_stops=False)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, detokenize: bool = True,
                    kv_transfer_params: dict | None = None) -> Request:
        request = self.make_request(request_id, prompt, params, priority, arrival_time, kv_transfer_params)
        self.add(request, detokenize)
        return request

    def abort_request(self, request_ids) -> list[StepOutput]:
        """Abort live requests; returns the last output of each (finish reason "abort")."""
        outputs = []
        for request in self.scheduler.finish_requests(request_ids):
            self.text_streams.pop(request.request_id, None)
            self._stop_text.pop(request.request_id, None)
            outputs.append(StepOutput(request.request_id, [], "", True, request.status.finish_reason,
                                      request.num_prompt_tokens, request.num_output_tokens,
                                      max(request.num_cached_tokens, 0)))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_held_requests(self) -> int:
        """Finished requests whose blocks wait for a transfer (the loop keeps stepping)."""
        return len(self.scheduler.held)

    def snapshot(self) -> EngineSnapshot:
        """Load and running totals (step-loop thread only: the scheduler is not thread-safe)."""
        sched, kv = self.scheduler, self.kv
        held = sum(len(kv.req_blocks.get(req_id, ())) for req_id in sched.held)
        return EngineSnapshot(
            len(sched.running), len(sched.waiting),
            sum(1 for r in sched.waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS), len(sched.held),
            held, self.num_kv_blocks, kv.num_free_blocks, kv.prefix_queries, kv.prefix_hits, sched.num_preemptions,
            sched.num_failed_loads, sched.num_prompt_tokens, sched.num_prompt_tokens_cached,
            sched.num_prompt_tokens_external, sched.num_generation_tokens)

    # ---- text ---------------------------------------------------------------------------------
    def _on_token(self, request: Request, status: RequestStatus | None) -> bool:
        """The scheduler's hook, for requests with stop strings: their text now, because a stop
        string found in it ends the request in this very step."""
        stream = self.text_streams[request.request_id]
        text, stop = stream.push(request.output_token_ids[-1:], self._final(stream, status),
                                 request.num_output_tokens >= request.sampling_params.min_tokens)
        self._stop_text[request.request_id] = text
        if stop is not None:
            request.stop_reason = stop
        return stop is not None

    @staticmethod
    def _final(stream: TextStream, status: RequestStatus | None) -> bool:
        return status is not None and not (stream.hands_over and status == RequestStatus.FINISHED_LENGTH_CAPPED)

    def _text(self, request: Request, new_token_ids: list[int], finished: bool) -> str:
        req_id = request.request_id
        if req_id in self._stop_text:
            text = self._stop_text.pop(req_id)
        else:
            stream = self.text_streams.get(req_id)
            text = stream.push(new_token_ids, self._final(stream, request.status if finished else None))[0] if stream else ""
        if finished:
            self.text_streams.pop(req_id, None)
        return text

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        result = self.runner.execute_model(sched)
        t2 = time.perf_counter()
        updates = self.scheduler.update_from_output(sched, result)
        t3 = time.perf_counter()
        if self._step_tokens is not None and sched.total_num_scheduled_tokens:
            self._step_tokens.append(sched.total_num_scheduled_tokens)
        self.times.steps += 1
        self.times.step_s += t3 - t0
        self.times.scheduler_s += (t1 - t0) + (t3 - t2)
        outputs = []
        logprobs, prompt_logprobs = result.logprobs, result.prompt_logprobs
        for u in updates:
            req = u.request
            lp = logprobs.get(req.request_id) if logprobs else None
            outputs.append(StepOutput(req.request_id, u.new_token_ids, self._text(req, u.new_token_ids, u.finished),
                                      u.finished, req.status.finish_reason, req.num_prompt_tokens,
                                      req.num_output_tokens, max(req.num_cached_tokens, 0),
                                      req.kv_transfer_params if u.finished else None, None if lp is None else [lp],
                                      prompt_logprobs.get(req.request_id) if prompt_logprobs else None,
                                      req.stop_reason if u.finished else None))
        return outputs


__all__ = ["LLMEngine", "StepOutput", "RequestStatus", "InvalidArgument"]
