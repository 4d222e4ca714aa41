"""Runs one SchedulerOutput through the model: encodes the step's images (a vision-language
model's, as the scheduler's encoder cache says), builds the flat batch (batch_builder.py) and
runs it (a decode step on a GPU replays a CUDA graph: cuda_graphs.py), samples the next tokens
(or, for requests with drafts, verifies them: step_sampling.py), and drafts the next step's
(spec_decode/).

The runner keeps its own per-request state (token ids, block ids, RNG, images) and the images'
embeddings by digest, updated from each step's plain output, as vLLM v1's does; it never
decides what to run.
"""
from __future__ import annotations

import os
from contextlib import nullcontext

import numpy as np
import torch

from baton.engine.common.config import EngineConfig, read_config
from baton.engine.common.kv_groups import KVGroups, group_layers
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.common.scheduler_output import ModelRunnerOutput, SchedulerOutput
from baton.engine.worker import block_tables
from baton.engine.worker.attention_backend import choose_backend
from baton.engine.worker.batch_builder import BatchBuilder, StepBatch
from baton.engine.worker.cuda_graphs import DecodeGraphs, capture_sizes, graphs_off_because
from baton.engine.worker.host_kv_copier import HostKVCopier
from baton.engine.worker.image_embeddings import ImageEmbeddings
from baton.engine.worker.kv_calibration import model_kv_scales
from baton.engine.worker.loader import (
    checkpoint_fingerprint,
    checkpoint_kv_scales,
    draft_fingerprint,
    peer_fingerprint,
)
from baton.engine.worker.lora.adapter import part_shapes
from baton.engine.worker.lora.layers import LoRASlots
from baton.engine.worker.models import CausalLM, model_args, mrope
from baton.engine.worker.parallel.tensor_parallel import ParallelLMHead
from baton.engine.worker.queued_step import PinnedRing, QueuedStep
from baton.engine.worker.sampler import sample_on_device, skip_draws, token_logprobs
from baton.engine.worker.spec_decode import make_proposer
from baton.engine.worker.spec_decode.drafting import Drafting, model_proposer
from baton.engine.worker.step_sampling import StepSampler
from baton.kernels.kv_quant import convert_kv, is_fp8
from baton.kv_transfer.base import KVConnectorWorker, KVFormat

# Set to "1": a CPU engine with the Triton backend runs its decode steps through the graphs'
# bookkeeping without capturing (the padded batches eagerly), its tensor-parallel ranks too.
CPU_GRAPHS_FOR_TESTS = "BATON_TEST_CPU_GRAPHS"
PROMPT_LOGPROB_ROWS = 256  # prompt positions whose full-vocabulary logits are materialized at once
_IDLE_WAIT_S = 0.002  # a step with nothing to compute waits this long for host-tier copies rather than spin


def kv_attention(args) -> str:
    """The attention kind a KV block holds, for KVFormat: "mha" (K and V per KV head), or MLA's
    latent and RoPE sizes."""
    if args.attention == "mla":
        return f"mla(kv_lora_rank={args.kv_lora_rank}, qk_rope_head_dim={args.qk_rope_head_dim})"
    return "mha"


class RequestState:
    __slots__ = ("token_ids", "block_ids", "sampling_params", "generator", "num_prompt_tokens", "prompt_logprobs",
                 "matcher", "lora_id", "draft_computed", "proposer_state", "hold_for_remote", "num_pending",
                 "pending_index", "images", "mrope")

    def __init__(self, token_ids, block_ids, sampling_params: SamplingParams, generator, num_prompt_tokens,
                 prompt_logprobs: list | None, lora_id: int = 0, hold_for_remote: bool = False):
        self.token_ids = token_ids
        self.block_ids = block_ids
        self.sampling_params = sampling_params
        self.generator = generator
        self.num_prompt_tokens = num_prompt_tokens
        self.prompt_logprobs = prompt_logprobs  # accumulating over chunks; None: not asked, or sent
        self.matcher = None  # structured output: where the request is in its grammar
        self.lora_id = lora_id
        self.draft_computed = 0  # a draft model's KV is right for its first this many tokens
        self.proposer_state = None  # the speculative proposer's, for this request (suffix: its tree)
        self.hold_for_remote = hold_for_remote  # a prefill's: its blocks (its draft's KV too) go to a decode peer
        # Async scheduling: its tokens sampled in queued steps not taken yet (token_ids lacks them),
        # the last one's row in the runner's last_sampled.
        self.num_pending, self.pending_index = 0, -1
        self.images: list = []  # a vision-language model's (core_messages.ImageInput), in prompt order
        self.mrope: tuple | None = None  # M-RoPE with images: the prompt's positions and the delta after (mrope.py)


class ModelRunner:
    def __init__(self, model: CausalLM, config: EngineConfig, num_blocks: int, eos_token_ids: frozenset[int],
                 connector: KVConnectorWorker | None = None, lora: LoRASlots | None = None,
                 num_host_blocks: int = 0, kv_groups: KVGroups | None = None, draft: torch.nn.Module | None = None,
                 driver: bool = True, draft_format: tuple = ()):
        """`lora`: the adapters on the device (attached to the model already), when LoRA is on;
        `num_host_blocks`: the host KV tier's size (0: none); `kv_groups`: which layers share a
        block (default: one group of every layer); `draft`: the draft model, for draft_model
        speculation, or the EAGLE or MTP head (spec_decode/eagle.py, mtp.py); `driver`: false for a
        tensor-parallel rank other than 0, which runs every forward (and its collectives) but
        samples nothing: rank 0's tokens reach it (`mirror`); `draft_format`: such a rank's KV
        format's draft fields, rank 0's (whose draft or head alone drafts)."""
        self.model = model
        self.driver = driver
        self.lora = lora
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.eos_token_ids = eos_token_ids
        args = model.args
        self.kv_groups = groups = kv_groups or group_layers([None] * args.num_layers)
        compute_dtype = model.embed_tokens.weight.dtype
        # (FP8 elements where kv_cache_dtype says: kernels/kv_quant.py, scales in each attention layer)
        self.kv_cache = torch.zeros(num_blocks, groups.layers_per_block, args.kv_parts, config.block_size,
                                    args.num_kv_heads, args.head_dim, dtype=config.kv_torch_dtype(compute_dtype),
                                    device=self.device)
        # Each layer's K and V cache (its slot in every block; MLA's latent is both) and its group's
        # metadata index.
        slots = groups.slot_of()
        self.layer_caches = [(self.kv_cache[:, slot, 0], self.kv_cache[:, slot, args.kv_parts - 1])
                             for _, slot in slots]
        self.layer_group = [group for group, _ in slots]
        model.prepare(config.max_model_len)
        self.host_kv = HostKVCopier(self.kv_cache, num_host_blocks) if num_host_blocks else None
        whole = model_args(read_config(config.model))  # (args: this rank's share under tensor parallelism)
        # An FP8 cache's scales, the whole model's [layers, 2, kv heads] (a rank's layers hold their
        # heads' share of the checkpoint's), and where they came from (CausalLM.kv_scales_source);
        # "" for a cache of values.
        fp8, self.kv_scales = is_fp8(self.kv_cache.dtype), ""
        if fp8:
            self.kv_scales = model.kv_scales_source
            scales = (model_kv_scales(model) if config.tensor_parallel_size == 1
                      else checkpoint_kv_scales(config.model, whole)[0])
        self.states: dict[str, RequestState] = {}
        self.sampling = StepSampler(self.states, eos_token_ids)
        self.default_generator = torch.Generator(self.device).manual_seed(config.seed)
        # A vision-language model's image embeddings, by digest (image_embeddings.py).
        self.images = (ImageEmbeddings(model.vision, self.device, compute_dtype) if model.vision is not None
                       else None)
        self.last_sampled: torch.Tensor | None = None  # async scheduling: the last queued step's tokens, on the device
        self.token_ring = PinnedRing(config.max_num_seqs, self.device)  # (async scheduling's)
        self.grammars = None  # structured_output.Grammars, set by the engine core
        spec = config.speculative_config
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.connector = connector
        # "cpu" (the C++ kernel), "triton" or "torch" (the reference).
        self.attention_backend = choose_backend(config.attention_backend, compute_dtype, self.device,
                                                args.num_heads, args.num_kv_heads, args.head_dim,
                                                latent=args.attention == "mla", kv_dtype=self.kv_cache.dtype)
        self.batches = BatchBuilder(model, groups, config.block_size, self.device, self.attention_backend,
                                    compute_dtype, lora is not None)
        proposer = None if spec is None else make_proposer(spec) if draft is None else model_proposer(
            draft, model, config, self.device, self.kv_cache.dtype, self.batches.metadata, groups.windows.index(None),
            num_blocks)
        self.drafting = None if proposer is None else Drafting(proposer, self.num_spec_tokens, self.states, self.device)
        self.whole_args = whole
        off = graphs_off_because(self.device.type == "cuda", config.enforce_eager, self.attention_backend,
                                 model.rope_by_length)
        # Decode steps replay CUDA graphs (captured by capture_graphs, once the engine is built; on
        # every rank at once under tensor parallelism: their collectives are in the graphs). A
        # test's CPU engine (and its ranks) may run the bookkeeping without capturing.
        cpu_graphs = (os.environ.get(CPU_GRAPHS_FOR_TESTS) == "1" and self.device.type == "cpu"
                      and self.attention_backend == "triton" and not config.enforce_eager)
        sizes = capture_sizes(config.cudagraph_capture_sizes, config.max_num_seqs * (1 + self.num_spec_tokens))
        self.graphs = self.make_graphs(sizes, capture=not cpu_graphs) if off is None or cpu_graphs else None
        self.graphs_off = off  # why not, for the log
        # A draft's or head's KV goes to a decode peer with the prompt's (an engine with a connector's).
        draft_cache = proposer.cache if draft is not None and connector is not None else None
        self.draft_format = draft_format if draft_cache is None else (
            spec.method, draft_fingerprint(spec.model or config.model), tuple(draft_cache.shape[1:]))
        if connector is not None:
            connector.register_kv_caches(self.kv_cache, KVFormat(
                checkpoint_fingerprint(config.model), str(self.kv_cache.dtype).removeprefix("torch."), args.num_layers,
                whole.num_kv_heads, args.head_dim, config.block_size, self.attention_backend, groups.layers,
                tuple(w or 0 for w in groups.windows), kv_attention(args), config.tensor_parallel_size,
                *self.draft_format, accepts_models=tuple(map(peer_fingerprint, config.accept_kv_from)),
                kv_scales=tuple(scales[:, :args.kv_parts].flatten().tolist()) if fp8 else ()),
                host_cache=self.host_kv.host_cache if self.host_kv is not None else None, draft_cache=draft_cache,
                convert=convert_kv)

    def close(self) -> None:
        """Stop the host tier's copier thread (where there is a host tier)."""
        if self.host_kv is not None:
            self.host_kv.close()

    def make_graphs(self, sizes: list[int], capture: bool) -> DecodeGraphs:
        """The decode graphs of `sizes` (`capture`: false to run the padded batches eagerly, as a
        CPU does in the tests), LoRA's slots then kept as stacks they read."""
        if self.lora is not None:
            self.lora.use_stacks(part_shapes(self.whole_args), self.config.max_lora_rank)
        config = self.config
        return DecodeGraphs(self._graph_forward, len(self.kv_groups.layers), sizes,
                            -(-config.max_model_len // config.block_size), config.block_size, self.device, capture,
                            lora=self.lora is not None)

    def capture_graphs(self) -> None:
        """Capture the decode steps' CUDA graphs (where this runner uses them)."""
        if self.graphs is not None:
            with self._on_device():
                self.graphs.capture_all()

    def _graph_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metas: list,
                       adapters: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if self.lora is not None:
            self.lora.use_rows(adapters)
        hidden = self.model(input_ids, positions, self.layer_caches, [metas[g] for g in self.layer_group])
        return hidden, list(self.model.aux_hidden) if self.model.aux_layers else []

    def _add_request(self, new) -> None:
        params = new.sampling_params
        generator = self.default_generator
        old = self.states.get(new.req_id)  # resumed after preemption
        # Prompt logprobs from the first prompt token (prefix-cache hits are not taken for such a
        # request), once: not again after a preemption that came once they were sent.
        prompt_logprobs = ([None] if params.prompt_logprobs is not None and new.num_computed_tokens == 0
                           and (old is None or old.prompt_logprobs is not None) else None)
        if params.seed is not None:
            if old is not None:  # resumed after preemption: keep the stream where it was
                generator = old.generator
            else:
                generator = torch.Generator(self.device).manual_seed(params.seed)
                if not params.greedy:  # outputs sampled elsewhere (a prefill peer) used their draws
                    skip_draws(generator, len(new.token_ids) - new.num_prompt_tokens, self.model.args.vocab_size,
                               self.device)
        # A sliding group's blocks out of its window (-1) read as block 0: masked, never used.
        block_ids = [np.maximum(np.asarray(ids, dtype=np.int32), 0) for ids in new.block_ids]
        state = self.states[new.req_id] = RequestState(list(new.token_ids), block_ids, params, generator,
                                                       new.num_prompt_tokens, prompt_logprobs, new.lora_id,
                                                       new.hold_for_remote)
        state.images = new.images
        if new.images and self.model.args.mrope_section:
            state.mrope = mrope.prompt_positions(new.images, new.num_prompt_tokens,
                                                 self.model.args.vision.spatial_merge_size)
        if new.draft_start >= 0 and self.driver:  # a peer's load brought the draft's KV of what is computed
            self.drafting.proposer.loaded(state, new.num_computed_tokens, new.draft_start)
        # The matcher (the driver's only): resumed, where it was; else after past outputs made elsewhere.
        if params.structured_output is not None and self.driver:
            state.matcher = old.matcher if old is not None else self.grammars.matcher(
                params.structured_output, new.token_ids[new.num_prompt_tokens:])

    def mirror(self, sampled: dict[str, list[int]]) -> None:
        """A rank that does not sample: the tokens the driver sampled (and kept) last step."""
        for req_id, tokens in sampled.items():
            state = self.states.get(req_id)
            if state is not None:
                state.token_ids.extend(tokens)

    def _on_device(self):
        # Triton launches on the calling thread's current CUDA device, whatever the tensors':
        # make it this engine's (cuda:1 stepped from a thread whose current device is 0).
        return torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        with self._on_device():
            return self._execute(sched)

    @torch.inference_mode()
    def submit(self, sched: SchedulerOutput) -> QueuedStep:
        """A step of async scheduling (its requests plain: no logprobs, penalties, grammar,
        min_tokens, drafts), queued on the device: a request whose last token is still
        on its way reads it there. The tokens come back by a non-blocking copy to pinned memory,
        taken with QueuedStep.result(), with the KV connector's and the host tier's transfers
        that ended by the time the step was queued (one that ends later is seen a step later).
        The host tier's copies keep their order with the step in flight: on a GPU on the
        compute stream or a side stream that waits for it; on a CPU that step is done."""
        with self._on_device():
            self._start(sched)
            queued = self._queue(sched)
            queued.transfers = self._ended(sched, ModelRunnerOutput({}))
            return queued

    def _queue(self, sched: SchedulerOutput) -> QueuedStep:
        if not sched.total_num_scheduled_tokens:
            return QueuedStep([], None, self._take_tokens)
        batch = self.batches.rows(sched, self.states)
        hidden, sample_rows = self._forward(batch, sched)
        if not batch.sample_req_ids:  # prompt chunks only: nothing to sample (nor to index by)
            return QueuedStep([], None, self._take_tokens)
        states = [self.states[r] for r in batch.sample_req_ids]
        logits = self.model.compute_logits(hidden[sample_rows])  # (a collective under TP)
        if self.driver:
            tokens = sample_on_device(logits, [s.sampling_params for s in states], [s.generator for s in states])
        else:  # rank 0's, below: a rank that does not sample keeps no generator in step with it
            tokens = torch.empty(len(states), dtype=torch.int64, device=self.device)
        if isinstance(self.model.lm_head, ParallelLMHead):  # every rank reads them on its device next step
            self.model.lm_head.tp.broadcast(tokens)
        for i, state in enumerate(states):
            state.num_pending += 1
            state.pending_index = i
        self.last_sampled = tokens
        return QueuedStep(batch.sample_req_ids, tokens, self._take_tokens, self.token_ring)

    def _take_tokens(self, req_ids: list[str], tokens: list[int]) -> ModelRunnerOutput:
        """A queued step's tokens, come back: each request's (one dropped meanwhile gets none)."""
        for req_id, token in zip(req_ids, tokens):
            state = self.states.get(req_id)
            if state is not None and state.num_pending:
                state.token_ids.append(token)
                state.num_pending -= 1
        return ModelRunnerOutput({req_id: [token] for req_id, token in zip(req_ids, tokens)})

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._start(sched)
        return self._ended(sched, self._run(sched) if sched.total_num_scheduled_tokens else ModelRunnerOutput({}))

    def _start(self, sched: SchedulerOutput) -> None:
        """The step's changes to the requests, then its copies and loads started (before the
        forward: a swap-out's device blocks are reused in it)."""
        self._apply(sched)
        if sched.freed_images or sched.encoder_inputs:
            self.images.update(sched.freed_images, [self.states[r].images[i] for r, indices in
                                                    sched.encoder_inputs.items() for i in indices])
        if sched.host_kv_ops is not None:
            self.host_kv.submit(sched.host_kv_ops)
        if self.connector is not None:
            self.connector.start_load_kv(sched.kv_connector_metadata)

    def _ended(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> ModelRunnerOutput:
        """`out` with the connector's and the host tier's transfers that ended by now (a step
        with nothing to compute waits a little for the host tier's rather than spin)."""
        if self.connector is not None:
            out.kv_connector_output = self.connector.get_finished()
        if self.host_kv is not None:
            out.host_kv_finished = self.host_kv.poll(0.0 if sched.total_num_scheduled_tokens else _IDLE_WAIT_S)
        return out

    def _apply(self, sched: SchedulerOutput) -> None:
        """The step's changes to the requests: ended ones dropped, new ones added, blocks grown."""
        for req_id in sched.finished_req_ids:
            state = self.states.pop(req_id, None)
            if self.drafting is not None and state is not None:
                self.drafting.proposer.finished(state)
        for new in sched.scheduled_new_reqs:
            self._add_request(new)
        for cached in sched.scheduled_cached_reqs:
            if any(cached.new_block_ids):
                state = self.states[cached.req_id]
                state.block_ids = [block_tables.grow(blocks, new) for blocks, new in zip(state.block_ids,
                                                                                         cached.new_block_ids)]

    def _forward(self, batch: StepBatch, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor | slice]:
        """The step's hidden states (a decode graph's, or an eager forward's) and the rows sampled."""
        unknown = None
        if batch.unknown_inputs:  # (async scheduling) those rows' tokens, from the last step's on the device
            rows, picks = zip(*batch.unknown_inputs)
            unknown = (torch.tensor(rows, device=self.device),
                       self.last_sampled[torch.tensor(picks, device=self.device)])
        if self.graphs is not None and self.graphs.takes(batch):
            slots = (None if self.lora is None else
                     self.lora.graph_rows(batch.adapter_spans, len(batch.input_ids)))
            positions = batch.positions if batch.rope_positions is None else batch.rope_positions[0]  # (text rows)
            hidden, aux = self.graphs.run(batch.input_ids, positions, batch.group_spans, unknown, slots)
            if aux:
                self.model.aux_hidden = aux
            return hidden, slice(0, len(batch.input_ids))  # (every row sampled; hidden is padded to the graph's size)
        tensors = self.batches.tensors(batch)
        if unknown is not None:
            tensors.input_ids.index_copy_(0, *unknown)
        if self.lora is not None:
            self.lora.prepare(batch.adapter_spans)
        hidden = self.model(tensors.input_ids, tensors.positions if tensors.rope_positions is None
                            else tensors.rope_positions, self.layer_caches,
                            [tensors.metas[g] for g in self.layer_group], tensors.rope_lengths,
                            self.images.rows(batch.image_rows) if batch.image_rows else None)
        return hidden, tensors.sample_rows

    def _run(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        batch = self.batches.rows(sched, self.states)
        hidden, sample_rows = self._forward(batch, sched)
        out = ModelRunnerOutput({})
        if batch.prompt_rows:
            out.prompt_logprobs = self._prompt_logprobs(hidden, batch.prompt_rows)
        sampled_ids = batch.sample_req_ids
        drafting = self.drafting if self.driver else None
        keep_hidden = drafting is not None and drafting.proposer.wants_hidden  # (an EAGLE head's)
        if not sampled_ids:
            if keep_hidden:
                drafting.keep_hidden(batch, hidden, sched, out)
            return out
        all_logits = self.model.compute_logits(hidden[sample_rows])  # (a collective under TP)
        if not self.driver:
            return out
        spans = batch.sample_spans
        if any(n > 1 for _, n in spans):  # drafts to verify: those requests apart
            self.sampling.verify(all_logits, spans, sampled_ids, sched.scheduled_spec_tokens, out)
            keep = [i for i, (_, n) in enumerate(spans) if n == 1]
            sampled_ids = [sampled_ids[i] for i in keep]
            all_logits = all_logits[[spans[i][0] for i in keep]]
        if sampled_ids:
            self.sampling.sample(all_logits, sampled_ids, out)
        if keep_hidden:
            drafting.keep_hidden(batch, hidden, sched, out)
        if self.draft_format:
            drafting.complete_draft_kv(out)
        # (not for LongRoPE models, whose verify rows would need lengths of their own)
        if sched.propose_drafts and drafting is not None and self.model.rope_recompute_at is None:
            drafting.propose(batch.sample_req_ids, out, self.grammars)
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, prompt_rows: list[tuple[str, int, int, int]]) -> dict[str, list]:
        """Each prompt token's logprob given the tokens before it, from the rows of this step's
        chunk (position p predicts token p + 1); a request's list goes out once complete."""
        done = {}
        for req_id, row0, start, end in prompt_rows:
            state = self.states[req_id]
            end = min(end, state.num_prompt_tokens - 1)  # the last prompt position predicts an output
            for a in range(start, end, PROMPT_LOGPROB_ROWS):
                b = min(a + PROMPT_LOGPROB_ROWS, end)
                logprobs = self.model.compute_logits(hidden[row0 + a - start:row0 + b - start]).float().log_softmax(-1)
                state.prompt_logprobs += token_logprobs(logprobs, state.token_ids[a + 1:b + 1],
                                                        state.sampling_params.prompt_logprobs)
            if len(state.prompt_logprobs) == state.num_prompt_tokens:
                done[req_id], state.prompt_logprobs = state.prompt_logprobs, None
        return done
