"""The engine core: the half of an engine that owns the device. Scheduler -> model runner ->
scheduler, the KV cache, and the KV connector's worker half (its NIXL agent lives with the
cache). It takes validated, tokenized requests (CoreRequest) and gives token ids back
(CoreOutput); text, stop strings and every RPC are its front's. In a server it runs in a
process of its own (process.py); the offline engine (engine/offline/llm_engine.py) holds it in-process.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from baton.engine.common.block_hashes import hash_block
from baton.engine.common.config import EngineConfig, read_config
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
from baton.engine.common.kv_groups import group_layers
from baton.engine.common.scheduler_output import ModelRunnerOutput, SchedulerOutput
from baton.engine.common.stats import EngineSnapshot, EventType, StepEvents
from baton.engine.common.tokenizer import eos_token_ids, load_tokenizer
from baton.engine.core.encoder_cache import encoder_cache
from baton.engine.core.host_kv_tier import HostKVTier
from baton.engine.core.kv_cache_manager import KVCacheManager
from baton.engine.core.request import Request, RequestStatus, RequestUpdate
from baton.engine.core.scheduler import Scheduler
from baton.engine.core.step_loop import StepLoop, StepTimes, async_off_because
from baton.engine.worker.grammar import Grammars
from baton.engine.worker.kv_calibration import calculate_kv_scales
from baton.engine.worker.loader import load_model
from baton.engine.worker.lora.adapter import adapter_bytes
from baton.engine.worker.lora.registry import LoRARegistry, start_lora
from baton.engine.worker.memory import measure_kv_cache_bytes, memory_before_loading
from baton.engine.worker.model_runner import ModelRunner
from baton.engine.worker.models import ModelArgs, model_args
from baton.engine.worker.parallel.rank_messages import RankAdapter, RunnerSetup
from baton.engine.worker.parallel.tensor_parallel import check_split, shard_model
from baton.engine.worker.parallel.workers import TPWorkers
from baton.engine.worker.spec_decode.draft_model import DraftModelProposer
from baton.engine.worker.spec_decode.eagle import load_head
from baton.engine.worker.spec_decode.mtp import load_mtp
from baton.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker

log = logging.getLogger(__name__)

_CPU_KV_BUDGET = 1 << 30


class EngineCore:
    def __init__(self, config: EngineConfig,
                 kv_connector: tuple[KVConnectorScheduler, KVConnectorWorker] | None = None):
        """`kv_connector`: the scheduler and worker halves of a KV connector, or None (colocated)."""
        self.config = config
        config.resolve_device()
        args = model_args(read_config(config.model))
        config.resolve_model_len(args.max_position_embeddings)
        self.eos_token_ids = eos_token_ids(config.model)
        torch.manual_seed(config.seed)
        on_gpu = config.device.startswith("cuda")
        free_at_start, total = memory_before_loading(config.device) if on_gpu else (0, 0)
        dtype = config.torch_dtype(args.torch_dtype)
        self.workers = self._start_ranks(args, kv_connector[1] if kv_connector else None)
        try:
            self._build(config, args, dtype, on_gpu, free_at_start, total, kv_connector)
        except BaseException:
            if self.workers is not None:
                self.workers.close()
            if kv_connector is not None:  # (its cache may be registered already)
                kv_connector[1].close()
            raise

    def _start_ranks(self, args: ModelArgs, connector: KVConnectorWorker | None) -> TPWorkers | None:
        """Under tensor parallelism: the other ranks, started loading their shares."""
        if self.config.tensor_parallel_size == 1:
            return None
        check_split(args, self.config.tensor_parallel_size, self.config.enable_expert_parallel)
        return TPWorkers(self.config, connector)

    def _build(self, config: EngineConfig, args: ModelArgs, dtype, on_gpu: bool, free_at_start: int, total: int,
               kv_connector) -> None:
        # Under tensor parallelism, in host memory first: only this rank's share goes to the device.
        model = load_model(config.model, dtype, config.device if self.workers is None else "cpu")
        # Before the split: a head shares the target's embeddings and LM head, whole (rank 0 drafts alone).
        # (Under tensor parallelism rank 0 holds them twice: its shares, and the whole ones for the head.)
        draft = self._load_draft(args, dtype, model, config.device if self.workers is None else "cpu")
        if self.workers is not None:
            shard_model(model, self.workers.join(torch.device(config.device)), config.enable_expert_parallel)
            model.to(config.device)
            if draft is not None:
                draft.to(config.device)
        self.loras, lora_slots = start_lora(config, args, model, dtype)
        if on_gpu and config.num_kv_blocks is None and config.kv_cache_memory_bytes is None:
            config.kv_cache_memory_bytes = measure_kv_cache_bytes(model, config, free_at_start, total)
            if config.enable_lora:  # the device slots fill later: their room is kept now
                reserve = config.max_loras * adapter_bytes(args, config.max_lora_rank, dtype.itemsize)
                check(config.kv_cache_memory_bytes > reserve, "max_loras",
                      f"{config.max_loras} adapters of rank {config.max_lora_rank} need {reserve / 2**30:.2f} GiB, "
                      f"more than the KV cache's {config.kv_cache_memory_bytes / 2**30:.2f} GiB")
                config.kv_cache_memory_bytes -= reserve
        # The host tier copies a request's blocks as one list: with it, every layer keeps every block.
        hybrid = not config.disable_hybrid_kv_cache_manager and not config.kv_offloading_size
        self.kv_groups = group_layers(args.layer_windows(config.max_model_len), hybrid)
        check(draft is None or None in self.kv_groups.windows, "speculative_config.method",
              "draft_model and EAGLE heads keep their KV in the blocks of a full-attention layer group, and every "
              "layer of this model slides: set disable_hybrid_kv_cache_manager")
        # Its group's layers' K and V (this rank's KV heads, under tensor parallelism).
        block_bytes = (self.kv_groups.layers_per_block * args.kv_parts * config.block_size
                       * model.args.num_kv_heads * args.head_dim * config.kv_torch_dtype(dtype).itemsize)
        # A draft model's (or EAGLE head's) KV sits in a cache of its own, addressed by the same block ids.
        draft_bytes = 0 if draft is None else DraftModelProposer.block_bytes(draft, config.block_size,
                                                                                   config.kv_torch_dtype(dtype))
        self.num_kv_blocks = self._num_kv_blocks(block_bytes + draft_bytes)
        self.kv = KVCacheManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                 self.kv_groups.windows)
        self.num_host_blocks = self._num_host_blocks(block_bytes)
        self.host = (HostKVTier(self.num_host_blocks, self.kv, config.preemption_mode, config.max_num_batched_tokens)
                     if self.num_host_blocks else None)
        connector_scheduler, connector_worker = kv_connector or (None, None)
        if connector_scheduler is not None:
            connector_scheduler.group_windows = self.kv_groups.windows
        image_tokens = args.vision.most_tokens(config.model) if args.vision else None  # (None: a text model)
        encoder = encoder_cache(config, image_tokens, args.vision is not None and args.vision.bidirectional)
        self.scheduler = Scheduler(config, self.kv, connector_scheduler, self.host, encoder)
        calculate_kv_scales(model, config)
        self.runner = ModelRunner(model, config, self.num_kv_blocks, self.eos_token_ids, connector_worker, lora_slots,
                                  self.num_host_blocks, self.kv_groups, draft)
        scales = self.runner.kv_scales
        log.info("KV cache: %d blocks of %d tokens in %s%s", self.num_kv_blocks, config.block_size,
                 str(self.runner.kv_cache.dtype).removeprefix("torch."),
                 f", scales: {scales}{' (1.0)' if scales == 'default' else ''}" if scales else "")
        self.connector = connector_worker
        if self.workers is not None:
            layouts = self.workers.setup(RunnerSetup(config, self.num_kv_blocks, self.eos_token_ids, self.kv_groups,
                                                     self.num_host_blocks, self.runner.draft_format))
            if connector_worker is not None:
                connector_worker.layout.ranks = layouts
        if self.runner.model.rope_recompute_at is not None:  # LongRoPE: see Scheduler.recompute_at
            self.scheduler.recompute_at = self.runner.model.rope_recompute_at
            self.scheduler.rekey = self._rope_rekey
        # Async scheduling where nothing needs the host between steps (see async_off_because).
        off = async_off_because(config, self.runner.model.rope_by_length)
        if config.async_scheduling and off is not None:
            log.warning("async_scheduling: steps run one at a time with %s", off)
        self.loop = StepLoop(self.scheduler, self.runner, self.workers, ahead=config.async_scheduling and off is None)
        start = time.perf_counter()
        self.runner.capture_graphs()
        if self.runner.graphs is not None:
            log.info("CUDA graphs for decode steps of %s rows captured in %.1f s",
                     ", ".join(map(str, self.runner.graphs.sizes)), time.perf_counter() - start)
        else:
            log.info("decode steps run eagerly (%s)", self.runner.graphs_off)
        self.vocab_size = args.vocab_size
        self.grammars = self.runner.grammars = Grammars(config.model, args.vocab_size, self.eos_token_ids)
        self.awaiting_grammar: list[Request] = []  # WAITING_FOR_FSM: held back until their grammar compiled
        self.failures: list[CoreFailure] = []  # requests refused after add (a grammar that does not compile)
        self.num_taken = 0  # requests taken in since start
        self._step_tokens: list[int] | None = None  # per step, while events are recorded

    def _load_draft(self, args: ModelArgs, dtype, model, device: str):
        """draft_model's checkpoint, once it is known to speak the target's tokens: the same
        vocabulary and tokenizer, a context as long as max_model_len; or an EAGLE head fitting
        `model` (spec_decode/eagle.py), which shares its embeddings; or DeepSeek's MTP layer
        (spec_decode/mtp.py), by default from the target's own checkpoint; on `device`. Refused
        naming the field."""
        spec = self.config.speculative_config
        if spec is None or spec.method not in ("draft_model", "eagle", "eagle3", "mtp"):
            return None
        if spec.method != "draft_model":
            if spec.method == "mtp":
                return load_mtp(spec.model, self.config.model, model, dtype, device)
            return load_head(spec.method, spec.model, model, dtype, device)
        field = "speculative_config.model"
        draft_args = model_args(read_config(spec.model))
        check(draft_args.vocab_size == args.vocab_size, field,
              f"its vocabulary has {draft_args.vocab_size} tokens, the target's {args.vocab_size}")
        check(load_tokenizer(spec.model).get_vocab() == load_tokenizer(self.config.model).get_vocab(), field,
              "its tokenizer is not the target's (the token ids would mean other things)")
        check(draft_args.max_position_embeddings >= self.config.max_model_len, field,
              f"its max_position_embeddings {draft_args.max_position_embeddings} is shorter than max_model_len "
              f"{self.config.max_model_len}")
        return load_model(spec.model, dtype, device)

    def _num_kv_blocks(self, block_bytes: int) -> int:
        c = self.config
        if c.num_kv_blocks is None:
            budget = _CPU_KV_BUDGET if c.kv_cache_memory_bytes is None else c.kv_cache_memory_bytes
            # Never more than every sequence slot at full length needs (plus prefix-cache slack).
            most = 2 * c.max_num_seqs * len(self.kv_groups.windows) * -(-c.max_model_len // c.block_size)
            c.num_kv_blocks = min(budget // block_bytes, most)
        need = self._blocks_for_longest()
        check(c.num_kv_blocks >= need, "num_kv_blocks",
              f"{c.num_kv_blocks} blocks of {c.block_size} tokens cannot hold one request of max_model_len "
              f"{c.max_model_len} ({need} blocks); raise num_kv_blocks (or kv_cache_memory_bytes) or lower "
              f"max_model_len")
        return c.num_kv_blocks

    def _blocks_for_longest(self) -> int:
        """Blocks one request of max_model_len holds at most: a full group's for every token, a
        sliding group's for its window and the largest step's tokens past it."""
        c, bs = self.config, self.config.block_size
        full = -(-c.max_model_len // bs)
        return sum(full if w is None else min(full, -(-(w + c.max_num_batched_tokens) // bs) + 1)
                   for w in self.kv_groups.windows)

    def _num_host_blocks(self, block_bytes: int) -> int:
        c = self.config
        num = int(c.kv_offloading_size * (1 << 30)) // block_bytes
        check(num > 0 or c.kv_offloading_size == 0, "kv_offloading_size",
              f"{c.kv_offloading_size:g} GiB is less than one KV block ({block_bytes} bytes)")
        return num

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

