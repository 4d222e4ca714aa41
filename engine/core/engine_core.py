"""The engine core: the half of an engine that owns the device. Scheduler -> model runner ->
scheduler, the KV cache, and the KV connector's worker half (its NIXL agent lives with the
cache), as engine_builder.py builds them from the config. It takes validated, tokenized
requests (CoreRequest) and gives token ids back (CoreOutput); text, stop strings and every RPC
are its front's. In a server it runs in a process of its own (process.py); the offline engine
(engine/offline/llm_engine.py) holds it in-process.
"""
from __future__ import annotations

import logging
import os
import time

from baton.engine.common.block_hashes import hash_block
from baton.engine.common.config import EngineConfig
from baton.engine.common.core_messages import (
    AdapterInfo,
    CallError,
    CoreFailure,
    CoreOutput,
    CoreRequest,
    CoreStats,
    EngineFacts,
    ErrorKind,
    LoadAdapter,
)
from baton.engine.common.errors import InvalidArgument, check
from baton.engine.common.kv_cache_events import KVEventLog
from baton.engine.common.scheduler_output import ModelRunnerOutput, SchedulerOutput
from baton.engine.common.stats import EngineSnapshot, EventType, StepEvents
from baton.engine.core.engine_builder import build_engine
from baton.engine.core.request import Request, RequestStatus, RequestUpdate
from baton.engine.core.step_loop import StepTimes
from baton.engine.worker.lora.registry import LoRARegistry
from baton.engine.worker.parallel.rank_messages import RankAdapter
from baton.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig,
                 kv_connector: tuple[KVConnectorScheduler, KVConnectorWorker] | None = None):
        """`kv_connector`: the scheduler and worker halves of a KV connector, or None (colocated)."""
        self.config = config
        parts = build_engine(config, kv_connector)
        self.eos_token_ids, self.vocab_size = parts.eos_token_ids, parts.vocab_size
        self.workers, self.loras, self.connector = parts.workers, parts.loras, parts.connector
        self.kv_groups, self.num_kv_blocks, self.kv = parts.kv_groups, parts.num_kv_blocks, parts.kv
        self.num_host_blocks, self.host = parts.num_host_blocks, parts.host
        self.scheduler, self.runner, self.loop = parts.scheduler, parts.runner, parts.loop
        self.grammars = parts.grammars
        if self.runner.model.rope_recompute_at is not None:  # LongRoPE: see Scheduler.recompute_at
            self.scheduler.recompute_at = self.runner.model.rope_recompute_at
            self.scheduler.rekey = self._rope_rekey
        self.awaiting_grammar: list[Request] = []  # WAITING_FOR_FSM: held back until their grammar compiled
        self.failures: list[CoreFailure] = []  # requests refused after add (a grammar that does not compile)
        self.num_taken = 0  # requests taken in since start
        self._step_tokens: list[int] | None = None  # per step, while events are recorded

    def facts(self) -> EngineFacts:
        return EngineFacts(self.config.max_model_len, self.vocab_size, sorted(self.eos_token_ids),
                           self.config.block_size, self.num_kv_blocks,
                           str(self.runner.model.embed_tokens.weight.dtype).removeprefix("torch."), self.config.device,
                           os.getpid(), self.connector.layout if self.connector is not None else None,
                           self.config.enable_lora, self.list_adapters(), [w or 0 for w in self.kv_groups.windows],
                           str(self.runner.kv_cache.dtype).removeprefix("torch."), self.runner.kv_scales,
                           *self._image_facts())

    def _image_facts(self) -> tuple:
        """EngineFacts' fields from image_token_id on: a vision-language model's (none for a text model)."""
        vision = self.runner.model.args.vision
        if vision is None:
            return ()
        return (vision.image_token_id, vision.tokens_per_image, self.scheduler.encoder.max_image_tokens,
                vision.prompt_wrap, vision.prompt_padding)

    # ---- events -----------------------------------------------------------------------------
    def record_events(self) -> None:
        """From now on keep each request's events (for spans and metrics) until `take_events`."""
        self.scheduler.events = []
        self._step_tokens = []

    def take_events(self) -> StepEvents:
        """The events and step sizes recorded since the last call."""
        taken = StepEvents(self.scheduler.events, self._step_tokens, self.scheduler.last_step_time)
        self.scheduler.events, self._step_tokens = [], []
        return taken

    def record_kv_events(self) -> KVEventLog:
        """From now on record the KV cache's events (blocks stored, removed): the log to take them from."""
        self.kv.events = KVEventLog()
        return self.kv.events

    def kv_block_hashes(self) -> list[int]:
        """The hashes of the blocks the prefix cache holds now (what its KV events describe)."""
        return list(self.kv.cached)

    def _rope_rekey(self, request: Request) -> None:
        """Where a sequence's lengths change its KV (dynamic NTK, LongRoPE), its block hashes start
        from a root of their own, so prefix caching never shares KV turned otherwise."""
        if rope_key := self.runner.model.rope_key(request.num_prompt_tokens, request.num_tokens):
            request.hash_root = hash_block(request.hash_root, (rope_key,))
            request.block_hashes.clear()

    # ---- requests ---------------------------------------------------------------------------
    def add(self, msg: CoreRequest) -> Request:
        """Queue a request (validated by its front already)."""
        check(msg.request_id not in self.scheduler.requests, "request_id", f"{msg.request_id!r} is already running")
        request = Request(msg.request_id, msg.prompt_token_ids, msg.sampling_params, self.eos_token_ids,
                          msg.priority, msg.arrival_time, msg.key)
        request.hold_for_remote, request.remote_kv, request.images = msg.hold_for_remote, msg.remote_kv, msg.images
        for token in msg.output_token_ids:
            request.append_output_token(token)
        if msg.lora_name:
            info = self._registry("adapter").get(msg.lora_name, "adapter")
            request.lora_id, request.hash_root = info.adapter_id, info.hash_root
        self._rope_rekey(request)
        so = msg.sampling_params.structured_output
        if so is not None:
            request.grammar = self.grammars.compile(so)
            request.status = RequestStatus.WAITING_FOR_FSM
            self.awaiting_grammar.append(request)
        else:
            self.scheduler.add_request(request)
        self.num_taken += 1
        return request

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled go to the scheduler; those whose grammar failed are
        refused (a CoreFailure naming the field)."""
        waiting = []
        for request in self.awaiting_grammar:
            e = request.grammar.exception() if request.grammar.done() else None
            if not request.grammar.done():
                waiting.append(request)
            elif e is not None:  # Grammars names the field; anything else (the tokenizer) is the constraint's
                field, reason = (e.field, e.reason) if isinstance(e, InvalidArgument) else ("structured_output", str(e))
                self.failures.append(CoreFailure(request.key, CallError(ErrorKind.INVALID_ARGUMENT, reason, field)))
            else:
                request.status = RequestStatus.WAITING
                self.scheduler.record(request, EventType.GRAMMAR_READY, time.monotonic(),
                                      detail=request.sampling_params.structured_output.kind)
                self.scheduler.add_request(request)
        self.awaiting_grammar = waiting

    def take_failures(self) -> list[CoreFailure]:
        failures, self.failures = self.failures, []
        return failures + [CoreFailure(r.key, CallError(
            ErrorKind.IMAGES_NOT_SENT, f"request {r.request_id} came with its images' spans only (a prefill's KV "
                                       f"handle) and must compute KV over one of them here"))
            for r in self.scheduler.take_refused()]

    def abort(self, request_ids) -> list[CoreOutput]:
        """End live requests (their last outputs, finish reason "abort"), and let go of blocks
        that finished ones hold for a decode peer that will not come now."""
        ids = set(request_ids)
        dropped = [r for r in self.awaiting_grammar if r.request_id in ids]
        self.awaiting_grammar = [r for r in self.awaiting_grammar if r.request_id not in ids]
        for request in dropped:
            request.status = RequestStatus.FINISHED_ABORTED
        ended = self.scheduler.finish_requests(request_ids) + dropped
        for req_id in set(request_ids) - {r.request_id for r in ended}:
            self.release_hold(req_id)
        return [CoreOutput(r.key, [], r.status.finish_reason, num_cached_tokens=max(r.num_cached_tokens, 0))
                for r in ended]

    def release_hold(self, request_id: str) -> bool:
        """Let go of the blocks a finished prefill request holds for a decode peer; false when it
        holds none."""
        held = self.scheduler.arrivals.held.get(request_id)
        if held is None or held.kv_handle is None:  # (a decode aborted mid-load holds until it lands)
            return False
        self.connector.release(request_id)
        return True

    # ---- LoRA adapters ------------------------------------------------------------------------
    def _registry(self, field: str) -> LoRARegistry:
        check(self.loras is not None, field, "LoRA is not enabled on this engine (start it with enable_lora)")
        return self.loras

    def load_adapter(self, msg: LoadAdapter) -> AdapterInfo:
        info = self._registry("lora_name").load(msg.name, msg.path)
        if self.workers is not None:  # the other ranks load it too, under the same id
            self.workers.send(RankAdapter(info.name, info.path, info.adapter_id))
        return info

    def unload_adapter(self, name: str) -> AdapterInfo:
        """Forget an adapter; refused (InUse) while requests use it."""
        loras = self._registry("lora_name")
        adapter_id = loras.get(name, "lora_name").adapter_id
        live = list(self.scheduler.requests.values()) + self.awaiting_grammar
        info = loras.unload(name, sum(1 for r in live if r.lora_id == adapter_id))
        self.runner.lora.forget(info.adapter_id)
        if self.workers is not None:
            self.workers.send(RankAdapter(info.name, "", info.adapter_id, unload=True))
        return info

    def list_adapters(self) -> list[AdapterInfo]:
        return list(self.loras.adapters.values()) if self.loras is not None else []

    def reset_prefix_cache(self) -> None:
        """Forget every cached block, in both tiers."""
        self.kv.reset_prefix_cache()
        if self.host is not None:
            self.host.reset_prefix_cache()

    def add_peer(self, layout) -> None:
        """Learn a KV peer's layout (the KV handshake); raises KVFormatMismatch naming what differs."""
        self.connector.add_peer(layout)
        if self.workers is not None:
            self.workers.add_peer(layout)

    def close(self) -> None:
        """Stop everything that runs beside the steps: the other tensor-parallel ranks, the KV
        connector (its progress thread; its agent lets go of the cache), the grammar compiler's
        thread and the host tier's copier. Twice is once. What is left (the model, the caches) is
        freed with this object: nothing of it refers back to the core from a thread or a cycle."""
        if self.workers is not None:
            self.workers.close()
        if self.connector is not None:
            self.connector.close()
        self.grammars.close()
        self.runner.close()

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.num_unfinished > 0 or bool(self.awaiting_grammar) or self.host_copies_pending
                or self.step_in_flight)

    @property
    def host_copies_pending(self) -> bool:
        """Copies to or from the host KV tier not settled yet (the loop steps until they are)."""
        return self.host is not None and self.host.has_pending

    @property
    def num_waiting(self) -> int:
        """Requests not running yet: queued, or waiting for their grammar."""
        return len(self.scheduler.waiting) + len(self.awaiting_grammar)

    @property
    def num_held_requests(self) -> int:
        """Finished requests whose blocks wait for a transfer (the loop keeps stepping)."""
        return len(self.scheduler.arrivals.held)

    def snapshot(self) -> EngineSnapshot:
        """Load and running totals."""
        sched, kv, held = self.scheduler, self.kv, self.scheduler.arrivals.held
        return EngineSnapshot(
            num_running=len(sched.running), num_waiting=self.num_waiting,
            num_waiting_for_kvs=sum(1 for r in sched.waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS),
            num_held_requests=len(held),
            num_held_blocks=sum(b is not None for req_id in held for blocks in kv.req_blocks.get(req_id, ())
                                for b in blocks),
            num_kv_blocks=self.num_kv_blocks, num_free_kv_blocks=kv.num_free_blocks,
            prefix_cache_queries=kv.prefix_queries, prefix_cache_hits=kv.prefix_hits,
            num_preemptions=sched.num_preemptions, num_failed_loads=sched.arrivals.num_failed_loads,
            num_prompt_tokens=sched.num_prompt_tokens, num_prompt_tokens_cached=sched.num_prompt_tokens_cached,
            num_prompt_tokens_external=sched.num_prompt_tokens_external,
            num_generation_tokens=sched.num_generation_tokens, **self._host_figures(), **self._lora_figures(),
            num_spec_drafts=sched.spec_stats.num_drafts, num_spec_draft_tokens=sched.spec_stats.num_draft_tokens,
            num_spec_accepted_tokens=sched.spec_stats.num_accepted_tokens,
            spec_accepted_per_pos=tuple(sched.spec_stats.accepted_per_pos))

    def _lora_figures(self) -> dict[str, int]:
        if self.loras is None:
            return {}
        return {"num_loras": len(self.loras.adapters), "num_lora_device_loads": self.runner.lora.num_loads,
                "num_running_loras": len({r.lora_id for r in self.scheduler.running} - {0})}

    def _host_figures(self) -> dict[str, int]:
        h = self.host
        if h is None:
            return {}
        return {"num_host_kv_blocks": h.num_blocks, "num_empty_host_kv_blocks": h.num_empty_blocks,
                "num_cached_host_kv_blocks": len(h.cached), "host_kv_cache_hits": h.num_hits,
                "num_host_kv_stored_blocks": h.num_stored_blocks, "num_host_kv_loaded_blocks": h.num_loaded_blocks,
                "num_swapped": len(h.swapped), "num_swap_preemptions": h.num_swapped_out,
                "num_host_hand_offs": h.num_handed_off, "num_free_host_kv_blocks": h.num_free_blocks}

    def stats(self) -> CoreStats:
        worker = self.connector
        if worker is None:
            return CoreStats(self.snapshot(), "", 0, 0, self.num_taken)
        return CoreStats(self.snapshot(), worker.engine_id, worker.num_expired_holds, worker.num_blocks_pulled,
                         self.num_taken, worker.num_bytes_pulled)

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[CoreOutput]:
        """The outputs of the steps that ended now (under async scheduling, the step before's:
        the next one was queued first; StepLoop)."""
        if self.awaiting_grammar:
            self._admit_compiled()
        return [out for done in self.loop.step() for out in self._outputs(*done)]

    @property
    def step_in_flight(self) -> bool:
        """A step queued on the device whose tokens were not taken yet (async scheduling)."""
        return self.loop.in_flight is not None

    @property
    def times(self) -> StepTimes:
        return self.loop.times

    def _outputs(self, sched: SchedulerOutput, result: ModelRunnerOutput, updates: list[RequestUpdate]
                 ) -> list[CoreOutput]:
        if self._step_tokens is not None and sched.total_num_scheduled_tokens:
            self._step_tokens.append(sched.total_num_scheduled_tokens)
        logprobs, prompt_logprobs = result.logprobs, result.prompt_logprobs
        outputs = []
        for u in updates:
            req = u.request
            lp = logprobs.get(req.request_id) if logprobs else None
            first = req.first_token_time == self.scheduler.last_step_time  # its first token sampled here
            out = CoreOutput(req.key, u.new_token_ids, num_cached_tokens=max(req.num_cached_tokens, 0),
                             logprobs=None if lp is None else lp[:len(u.new_token_ids)],
                             prompt_logprobs=prompt_logprobs.get(req.request_id) if prompt_logprobs else None,
                             ready_time=(req.kv_ready_time or req.scheduled_time) if first else None)
            if u.finished:
                out.finish_reason, out.stop_token_id, out.kv_handle = (req.status.finish_reason, req.stop_token_id,
                                                                       req.kv_handle)
            outputs.append(out)
        return outputs

