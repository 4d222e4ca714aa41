"""vLLM v1's token-centric scheduler: every request catches up on `num_tokens - num_computed_tokens`.

A step: (1) running requests get their tokens first, preempting (by recompute, or by swapping
their blocks to the host KV tier: preemption_mode) when the pool is full; (2) waiting requests
are admitted (with prefix-cache and remote KV lookups) only when nothing was preempted; (3) one
plain SchedulerOutput goes to the model runner. After the model runs, `update_from_output`
appends tokens, applies stop conditions and frees finished requests.

Speculative decoding: a decoding request's drafts (proposed by the runner after its last step)
are scheduled after its last token, as more tokens to compute (slots allocated, budget counted);
the runner verifies them in the same forward and returns the accepted ones and one more, and the
rejected drafts' positions count as not computed again (their KV is overwritten later; blocks
are only ever hashed for a request's real tokens, so it is never cached or shipped).
"""
from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Callable

from baton.engine.common.config import EngineConfig
from baton.engine.common.scheduler_output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from baton.engine.common.stats import EventType, RequestEvent, SpecDecodeStats
from baton.engine.core.encoder_cache import EncoderCache
from baton.engine.core.host_kv_tier import HostKVTier
from baton.engine.core.kv_arrivals import RemoteKVArrivals
from baton.engine.core.kv_cache_manager import KVCacheManager, num_hits
from baton.engine.core.request import Request, RequestStatus, RequestUpdate
from baton.kv_transfer.base import KVConnectorScheduler


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, connector: KVConnectorScheduler | None = None,
                 host: HostKVTier | None = None, encoder: EncoderCache | None = None):
        """`encoder`: a vision-language model's encoder cache (its chunks over images scheduled
        with their images' encodings)."""
        self.config = config
        self.encoder = encoder
        self.kv = kv
        self.connector = connector
        self.host = host  # the host KV tier, when kv_offloading_size > 0
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.by_priority = config.scheduling_policy == "priority"
        self._finished_ids: set[str] = set()  # finished since the last schedule()
        self.arrivals = RemoteKVArrivals(kv, host, self.record, self._free)  # held requests; KV that lands
        self.num_preemptions = 0
        # Prompts of requests that got their first token here, by where their KV came from
        # (vLLM's prompt_tokens[_by_source]), and tokens sampled.
        self.num_prompt_tokens = self.num_prompt_tokens_cached = self.num_prompt_tokens_external = 0
        self.num_generation_tokens = 0
        self.events: list[RequestEvent] | None = None  # recorded when a list is set (LLMEngine.record_events)
        self._chunks: list[tuple[Request, int]] = []  # prompt chunks scheduled this step (when recording)
        self._now = 0.0  # this step's schedule() time
        self.last_step_time = 0.0  # when the last step's tokens were sampled
        # LongRoPE (Phi-3): a request that grows past `recompute_at` tokens has its KV computed
        # again from its first token (transformers' Phi-3 recomputes its cache there), under the
        # block-hash root `rekey` gives it. Set by the engine for such models.
        self.recompute_at: int | None = None
        self.rekey: Callable[[Request], None] = lambda request: None
        self._to_recompute: list[Request] = []
        self.speculative = config.speculative_config
        self.spec_stats = SpecDecodeStats()  # since start
        # Slots past a caught-up request's tokens that its drafting writes (a draft model's KV).
        self.lookahead = self.speculative.lookahead if self.speculative is not None else 0
        # Async scheduling: a step may be scheduled before the last one's tokens came back, each
        # request then counting the tokens on their way (Request.num_pending_tokens).
        self.ahead = config.async_scheduling
        self.num_host_bound = 0  # live requests whose next step needs their tokens on the host first
        self.refused: list[Request] = []  # ended for images not sent (_refuse), until the engine takes them

    def record(self, request: Request | None, kind: EventType, when: float, **fields) -> None:
        if self.events is not None and request is not None:
            self.events.append(RequestEvent(request.request_id, request.key, kind, when, **fields))

    # ---- requests in and out --------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.num_host_bound += request.sampling_params.needs_host_between_steps
        self._enqueue(request)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        if self.by_priority:  # waiting stays sorted by (priority, arrival)
            keys = [r.priority_key() for r in self.waiting]
            self.waiting.insert(bisect.bisect(keys, request.priority_key()), request)
        elif front:  # behind requests whose blocks are in place (landed loads): they can run, it may not
            i = 0
            while i < len(self.waiting) and self.waiting[i].request_id in self.kv.req_blocks:
                i += 1
            self.waiting.insert(i, request)
        else:
            self.waiting.append(request)

    def finish_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[Request]:
        """Abort (or fail) requests wherever they are; returns those that were still live."""
        done = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            done.append(request)
        return done

    def _refuse(self, request: Request) -> None:
        """End a request whose images must be encoded here and were not sent (ImagesNotSent)."""
        self._finish(request, RequestStatus.FINISHED_ERROR)
        self.refused.append(request)

    def take_refused(self) -> list[Request]:
        refused, self.refused = self.refused, []
        return refused

    def _finish(self, request: Request, status: RequestStatus) -> None:
        was_loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        request.status = status
        request.finished_time = time.monotonic()
        self._finished_ids.add(request.request_id)
        del self.requests[request.request_id]
        self.num_host_bound -= request.sampling_params.needs_host_between_steps
        if self.encoder is not None:
            self.encoder.release(request)
        hold = was_loading  # freed when the worker reports the load over, not before
        if not was_loading and self.connector is not None:
            hold, request.kv_handle = self.connector.request_finished(request, self.kv.block_ids(request.request_id))
        if hold:
            self.arrivals.hold(request, needing=itertools.chain(self.running, self.waiting))
        else:
            self._free(request)
        if self.events is not None:
            self.record(request, EventType.FINISHED, request.finished_time, stats=request.stats())

    def _free(self, request: Request) -> None:
        if self.host is not None:  # its cached blocks written back, host blocks it owns (swapped, or held) let go
            self.host.store_freed(request)
            self.host.release_owned(request)
        self.kv.free(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = set()
        self._now = time.monotonic()
        for request in self._to_recompute:
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                self._preempt(request, out, for_room=False)
                self.rekey(request)
        self._to_recompute.clear()
        if self.encoder is not None:
            self.encoder.begin_step()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted_req_ids:
            budget = self._schedule_waiting(out, budget)
        out.total_num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        out.propose_drafts = self._speculating()
        chunks = self._chunks if self.events is not None else None
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.requests[req_id]
            if chunks is not None and request.num_computed_tokens < request.num_prompt_tokens:
                chunks.append((request, n))
            if self.ahead and request.num_computed_tokens + n >= request.num_tokens + request.num_pending_tokens:
                request.num_pending_tokens += 1  # it samples in this step
            request.num_computed_tokens += n
            if self.encoder is not None and request.images:  # (after the whole step: see encoder_cache.py)
                self.encoder.computed(request, request.num_computed_tokens)
        if self.encoder is not None:
            out.encoder_inputs, out.freed_images = self.encoder.to_encode, self.encoder.take_freed()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        if self.host is not None:
            out.host_kv_ops = self.host.build_ops()
        return out

    def _speculating(self) -> bool:
        """Whether drafts run this step: speculation is on and the batch is below disable_by_batch_size."""
        spec = self.speculative
        limit = spec.disable_by_batch_size if spec is not None else None
        return spec is not None and (limit is None or len(self.running) < limit)

    def _drafts(self, request: Request) -> list[int]:
        """The drafts to verify with a decoding request's next token: as many as fit its
        max_tokens (one more token comes after them) and the model's length."""
        room = min(self.config.max_model_len - request.num_tokens,
                   request.sampling_params.max_tokens - request.num_output_tokens - 1)
        if room <= 0 or request.num_tokens - request.num_computed_tokens != 1:
            return []
        return request.spec_token_ids[:room]

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        scheduled: list[CachedRequestData] = out.scheduled_cached_reqs
        threshold, allocate = self.config.long_prefill_token_threshold, self.kv.allocate_slots  # hot loop
        speculating = self._speculating()
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            pending = request.num_pending_tokens
            if pending and self._ends_with_pending(request):  # nothing more to compute for it
                i += 1
                continue
            drafts = self._drafts(request) if speculating and request.spec_token_ids else ()
            n = min(request.num_tokens + pending - request.num_computed_tokens + len(drafts), budget,
                    threshold or budget)
            encode = ()
            if request.images and self.encoder is not None:
                n, encode = self.encoder.plan(request, request.num_computed_tokens, n)
                if encode and self.encoder.unsent(request, encode):
                    self._refuse(self.running.pop(i))
                    continue
                if n == 0:  # it would start inside an image that cannot be encoded now
                    i += 1
                    continue
            extra = self.lookahead if request.num_computed_tokens + n >= request.num_tokens else 0
            while (new_blocks := allocate(request, n + extra)) is None:
                victim = self._preempt_one(out)
                if victim is request:
                    break
                if victim.request_id in out.num_scheduled_tokens:  # priority policy: undo its turn
                    budget += out.num_scheduled_tokens.pop(victim.request_id)
                    out.scheduled_spec_tokens.pop(victim.request_id, None)
                    scheduled[:] = [c for c in scheduled if c.req_id != victim.request_id]
                    i -= 1
            if new_blocks is None:
                break
            scheduled.append(CachedRequestData(request.request_id, new_blocks, request.num_computed_tokens))
            if request.images and self.encoder is not None:
                self.encoder.commit(request, encode, request.num_computed_tokens, n)
            out.num_scheduled_tokens[request.request_id] = n
            if n > 1 and drafts:  # (a budget may cut them short)
                out.scheduled_spec_tokens[request.request_id] = list(drafts[:n - 1])
            request.spec_token_ids = []
            budget -= n
            i += 1
        return budget

    def _ends_with_pending(self, request: Request) -> bool:
        """Whether the tokens on their way take a request to its max_tokens or the model's length."""
        length = request.num_tokens + request.num_pending_tokens
        return (request.num_output_tokens + request.num_pending_tokens >= request.sampling_params.max_tokens
                or length >= self.config.max_model_len)

    def _preempt_one(self, out: SchedulerOutput) -> Request:
        """Preempt the lowest running request (FCFS: the latest) for room."""
        if self.by_priority:
            victim = max(self.running, key=Request.priority_key)
            self.running.remove(victim)
        else:
            victim = self.running.pop()
        return self._preempt(victim, out)

    def _preempt(self, victim: Request, out: SchedulerOutput, for_room: bool = True) -> Request:
        """Free the victim's blocks (swapped to the host tier first, as preemption_mode says) and
        send it back to waiting, to recompute or load them. Not `for_room`: its KV must be
        computed again (LongRoPE), so nothing is swapped and no preemption counted."""
        if self.host is not None and for_room:
            self.host.preempt(victim)
        self.kv.free(victim)
        if self.encoder is not None:
            self.encoder.release(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        if for_room:
            victim.num_preemptions += 1
            self.num_preemptions += 1
            self.record(victim, EventType.PREEMPTED, self._now)
        out.preempted_req_ids.add(victim.request_id)
        self._enqueue(victim, front=True)
        return victim

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        skipped: list[Request] = []
        # LoRA: at most max_loras distinct adapters run at once; a request whose adapter would
        # exceed it waits, the others pass it (vLLM's rule).
        loras = {r.lora_id for r in self.running if r.lora_id} if self.config.enable_lora else None
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:  # its load is still under way
                skipped.append(self.waiting.popleft())
                continue
            if (loras is not None and request.lora_id and request.lora_id not in loras
                    and len(loras) >= self.config.max_loras):
                skipped.append(self.waiting.popleft())
                continue
            computed, num_external, load_async = self._lookup(request)
            num_computed = request.num_computed_tokens + num_hits(computed) * self.kv.block_size + num_external
            n = 0 if load_async else min(request.num_tokens - num_computed, budget,
                                         self.config.long_prefill_token_threshold or budget)
            encode = ()
            if request.images and self.encoder is not None and n:
                n, encode = self.encoder.plan(request, num_computed, n)
                if encode and self.encoder.unsent(request, encode):
                    self._refuse(self.waiting.popleft())
                    continue
                if n == 0:  # it would start inside an image that cannot be encoded now: the others pass it
                    skipped.append(self.waiting.popleft())
                    continue
            # A host-tier load reserves the rest of the request too: once its blocks landed it can
            # run, never holding blocks while it waits for more (two such would deadlock).
            from_host = self.host is not None and self.host.has_match(request)
            if from_host and load_async:
                n = request.num_tokens - num_computed
            elif not self.config.enable_chunked_prefill and num_computed + n < request.num_tokens:
                break  # a prompt that does not fit whole waits for a step with room
            extra = self.lookahead if not load_async and num_computed + n == request.num_tokens else 0
            if self.kv.allocate_slots(request, n + num_external + extra, computed, cache=not load_async) is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_computed
            if request.images and self.encoder is not None and n:
                self.encoder.commit(request, encode, num_computed, n)
            block_ids = self.kv.block_ids(request.request_id)
            if from_host:  # the host tier is a local cache: its tokens count as cached, not external
                self.host.load_after_alloc(request, block_ids[0], num_hits(computed))
                num_external = 0
            elif self.connector is not None:
                self.connector.update_state_after_alloc(request, block_ids, num_external)
            if request.num_cached_tokens < 0:  # local prefix-cache hits at first admission
                request.num_cached_tokens = num_computed - num_external
                request.num_external_tokens = num_external
            if load_async:
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.record(request, EventType.KV_WAIT, self._now)
                skipped.append(request)
                continue
            request.status = RequestStatus.RUNNING
            if loras is not None and request.lora_id:
                loras.add(request.lora_id)
            if request.scheduled_time is None:
                request.scheduled_time = self._now
            self.record(request, EventType.SCHEDULED, self._now, num_tokens=num_computed)
            self.running.append(request)
            out.scheduled_new_reqs.append(NewRequestData(
                request.request_id, list(request.all_token_ids), self.kv.block_ids(request.request_id),
                num_computed, request.sampling_params, request.num_prompt_tokens, request.lora_id,
                request.hold_for_remote, request.draft_start, request.images))
            request.draft_start = -1  # (once: a preempted request's draft starts afresh)
            out.num_scheduled_tokens[request.request_id] = n
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _lookup(self, request: Request):
        """Prefix-cache hits and remote tokens for a request being admitted."""
        if request.request_id in self.kv.req_blocks:  # its blocks came with a remote load
            return [], 0, False
        if self.host is not None and request.request_id in self.host.swapped:  # swapped out: load them back
            if num_host := self.host.match(request, 0):
                return [], num_host, False  # copied back before this step's forward: it runs now
            self.host.release_owned(request)  # nothing worth loading: computed again
        # A request that wants its prompt's logprobs computes every prompt token (vLLM does so too).
        wants_logprobs = request.sampling_params.prompt_logprobs is not None
        computed, num_local = self.kv.get_computed_blocks(request) if not wants_logprobs else ([], 0)
        if self.connector is not None:
            num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
            if num_external or request.remote_kv is not None:  # a peer's KV is pulled, not the host's
                return computed, num_external, load_async
        if self.host is not None and not wants_logprobs:
            num_host = self.host.match(request, num_hits(computed))
            return computed, num_host, num_host > 0
        return computed, 0, False

    # ---- after the model ran ----------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestUpdate]:
        updates = []
        now = self.last_step_time = time.monotonic()
        for request, n in self._chunks:
            self.record(request, EventType.PREFILL_CHUNK, now, num_tokens=n)
        self._chunks.clear()
        for req_id, start in result.draft_start.items():  # before they end: the handle names it
            if req_id in self.requests:
                self.requests[req_id].draft_start = start
        for req_id, token_ids in result.sampled_token_ids.items():
            request = self.requests.get(req_id)
            if request is None:  # aborted while the step ran (or, scheduled ahead, ended in the step before)
                continue
            request.num_pending_tokens = max(request.num_pending_tokens - 1, 0)
            drafts = sched.scheduled_spec_tokens.get(req_id)
            if drafts:  # the rejected drafts' positions are computed again, with the tokens that replace them
                request.num_computed_tokens -= len(drafts) + 1 - len(token_ids)
                request.num_draft_tokens += len(drafts)
                request.num_accepted_tokens += len(token_ids) - 1
                self.spec_stats.add(len(drafts), len(token_ids) - 1)
            if request.first_token_time is None:
                request.first_token_time = now
                self.num_prompt_tokens += request.num_prompt_tokens
                self.num_prompt_tokens_cached += request.num_cached_tokens
                self.num_prompt_tokens_external += request.num_external_tokens
            request.last_token_time = now
            new, status = self._append(request, token_ids)
            if status is None and req_id in result.grammar_ended:  # ignore_eos cannot go past the grammar's end
                status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                # (Scheduled ahead, a request preempted for the next step ends waiting.)
                (self.running if request.status == RequestStatus.RUNNING else self.waiting).remove(request)
                self._finish(request, status)
                if self.arrivals.output_waits(req_id):  # it goes out with the handle, once the copy landed
                    continue
            else:
                request.spec_token_ids = result.spec_token_ids.get(req_id, [])
            updates.append(RequestUpdate(request, new, status is not None))
        if result.kv_connector_output is not None:
            for request in self.arrivals.connector_reported(result.kv_connector_output, self.requests, now,
                                                            self.recompute_at):
                self.rekey(request)  # restarted long (LongRoPE): its blocks hash under a root of their own
        if self.host is not None and result.host_kv_finished:
            loaded, handed_off = self.host.finished(result.host_kv_finished)
            for request in self.arrivals.host_loaded(loaded, self.requests):  # first in line (see there)
                self.waiting.remove(request)
                self.waiting.appendleft(request)
            updates += map(self.arrivals.handed_off, handed_off)
        return updates

    def _append(self, request: Request, token_ids: list[int]) -> tuple[list[int], RequestStatus | None]:
        """The step's tokens appended up to the first that ends the request: (those, how it ended)."""
        for i, token_id in enumerate(token_ids):
            request.append_output_token(token_id)
            if request.num_tokens - 1 == self.recompute_at and request.num_prompt_tokens <= self.recompute_at:
                self._to_recompute.append(request)  # (a prompt past it was computed long from the start)
            self.num_generation_tokens += 1
            if (status := self._stop_status(request, token_id)) is not None:
                return token_ids[:i + 1], status
        return token_ids, None

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params, n = request.sampling_params, request.num_output_tokens
        if n > params.min_tokens:  # the first min_tokens outputs cannot stop (the runner masks them too)
            if token_id in request.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_token_id = token_id
                return RequestStatus.FINISHED_STOPPED
        if n >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None
