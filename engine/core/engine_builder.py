"""An engine core's parts, built from its config: the model (and a draft model, an EAGLE head or
an MTP layer) loaded and, under tensor parallelism, split over the ranks; the KV cache sized to
what the device holds, every field that decides it checked by name; the scheduler, the model
runner and the step loop wired together. EngineCore (engine_core.py) runs what this builds."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from baton.engine.common.config import EngineConfig, read_config
from baton.engine.common.errors import check
from baton.engine.common.kv_groups import KVGroups, group_layers
from baton.engine.common.tokenizer import eos_token_ids, load_tokenizer
from baton.engine.core.encoder_cache import encoder_cache
from baton.engine.core.host_kv_tier import HostKVTier
from baton.engine.core.kv_cache_manager import KVCacheManager
from baton.engine.core.scheduler import Scheduler
from baton.engine.core.step_loop import StepLoop, async_off_because
from baton.engine.worker.grammar import Grammars
from baton.engine.worker.kv_calibration import calculate_kv_scales
from baton.engine.worker.loader import load_model
from baton.engine.worker.lora.adapter import adapter_bytes
from baton.engine.worker.lora.registry import LoRARegistry, start_lora
from baton.engine.worker.memory import measure_kv_cache_bytes, memory_before_loading
from baton.engine.worker.model_runner import ModelRunner
from baton.engine.worker.models import ModelArgs, model_args
from baton.engine.worker.parallel.rank_messages import RunnerSetup
from baton.engine.worker.parallel.tensor_parallel import check_split, shard_model
from baton.engine.worker.parallel.workers import TPWorkers
from baton.engine.worker.spec_decode.draft_model import DraftModelProposer
from baton.engine.worker.spec_decode.eagle import load_head
from baton.engine.worker.spec_decode.mtp import load_mtp
from baton.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker

log = logging.getLogger(__name__)

_CPU_KV_BUDGET = 1 << 30


@dataclass(slots=True)
class EngineParts:
    """What an engine core runs, built (build_engine)."""
    eos_token_ids: frozenset[int]
    vocab_size: int
    workers: TPWorkers | None  # the other ranks, under tensor parallelism
    loras: LoRARegistry | None  # (None: LoRA off)
    kv_groups: KVGroups
    num_kv_blocks: int
    kv: KVCacheManager
    num_host_blocks: int
    host: HostKVTier | None  # the host-memory tier of the KV cache (kv_offloading_size)
    scheduler: Scheduler
    runner: ModelRunner
    connector: KVConnectorWorker | None
    loop: StepLoop
    grammars: Grammars


def build_engine(config: EngineConfig,
                 kv_connector: tuple[KVConnectorScheduler, KVConnectorWorker] | None) -> EngineParts:
    """The parts of an engine core for `config` (its device and max_model_len resolved here).
    `kv_connector`: the scheduler and worker halves of a KV connector, or None (colocated). What
    it started (ranks, the connector's registrations) is let go when it fails."""
    config.resolve_device()
    args = model_args(read_config(config.model))
    config.resolve_model_len(args.max_position_embeddings)
    eos = eos_token_ids(config.model)
    torch.manual_seed(config.seed)
    # (what the device has free before anything of this engine is on it: the KV cache's share)
    free_at_start = memory_before_loading(config.device) if config.device.startswith("cuda") else None
    workers = _start_ranks(config, args, kv_connector[1] if kv_connector else None)
    try:
        return _build(config, args, eos, free_at_start, workers, kv_connector)
    except BaseException:
        if workers is not None:
            workers.close()
        if kv_connector is not None:  # (its cache may be registered already)
            kv_connector[1].close()
        raise


def _start_ranks(config: EngineConfig, args: ModelArgs, connector: KVConnectorWorker | None) -> TPWorkers | None:
    """Under tensor parallelism: the other ranks, started loading their shares."""
    if config.tensor_parallel_size == 1:
        return None
    check_split(args, config.tensor_parallel_size, config.enable_expert_parallel)
    return TPWorkers(config, connector)


def _build(config: EngineConfig, args: ModelArgs, eos: frozenset[int], free_at_start: tuple[int, int] | None,
           workers: TPWorkers | None, kv_connector) -> EngineParts:
    """`free_at_start`: a GPU's free and total bytes before loading (None on a CPU)."""
    dtype = config.torch_dtype(args.torch_dtype)
    # Under tensor parallelism, in host memory first: only this rank's share goes to the device.
    model = load_model(config.model, dtype, config.device if workers is None else "cpu")
    # Before the split: a head shares the target's embeddings and LM head, whole (rank 0 drafts alone).
    # (Under tensor parallelism rank 0 holds them twice: its shares, and the whole ones for the head.)
    draft = _load_draft(config, args, dtype, model, config.device if workers is None else "cpu")
    if workers is not None:
        shard_model(model, workers.join(torch.device(config.device)), config.enable_expert_parallel)
        model.to(config.device)
        if draft is not None:
            draft.to(config.device)
    loras, lora_slots = start_lora(config, args, model, dtype)
    if free_at_start is not None and config.num_kv_blocks is None and config.kv_cache_memory_bytes is None:
        config.kv_cache_memory_bytes = measure_kv_cache_bytes(model, config, *free_at_start)
        if config.enable_lora:  # the device slots fill later: their room is kept now
            reserve = config.max_loras * adapter_bytes(args, config.max_lora_rank, dtype.itemsize)
            check(config.kv_cache_memory_bytes > reserve, "max_loras",
                  f"{config.max_loras} adapters of rank {config.max_lora_rank} need {reserve / 2**30:.2f} GiB, "
                  f"more than the KV cache's {config.kv_cache_memory_bytes / 2**30:.2f} GiB")
            config.kv_cache_memory_bytes -= reserve
    # The host tier copies a request's blocks as one list: with it, every layer keeps every block.
    hybrid = not config.disable_hybrid_kv_cache_manager and not config.kv_offloading_size
    kv_groups = group_layers(args.layer_windows(config.max_model_len), hybrid)
    check(draft is None or None in kv_groups.windows, "speculative_config.method",
          "draft_model and EAGLE heads keep their KV in the blocks of a full-attention layer group, and every "
          "layer of this model slides: set disable_hybrid_kv_cache_manager")
    # Its group's layers' K and V (this rank's KV heads, under tensor parallelism).
    block_bytes = (kv_groups.layers_per_block * args.kv_parts * config.block_size
                   * model.args.num_kv_heads * args.head_dim * config.kv_torch_dtype(dtype).itemsize)
    # A draft model's (or EAGLE head's) KV sits in a cache of its own, addressed by the same block ids.
    draft_bytes = 0 if draft is None else DraftModelProposer.block_bytes(draft, config.block_size,
                                                                         config.kv_torch_dtype(dtype))
    num_kv_blocks = _num_kv_blocks(config, kv_groups, block_bytes + draft_bytes)
    kv = KVCacheManager(num_kv_blocks, config.block_size, config.enable_prefix_caching, kv_groups.windows)
    num_host_blocks = _num_host_blocks(config, block_bytes)
    host = (HostKVTier(num_host_blocks, kv, config.preemption_mode, config.max_num_batched_tokens)
            if num_host_blocks else None)
    connector_scheduler, connector_worker = kv_connector or (None, None)
    if connector_scheduler is not None:
        connector_scheduler.group_windows = kv_groups.windows
    image_tokens = args.vision.most_tokens(config.model) if args.vision else None  # (None: a text model)
    encoder = encoder_cache(config, image_tokens, args.vision is not None and args.vision.bidirectional)
    scheduler = Scheduler(config, kv, connector_scheduler, host, encoder)
    calculate_kv_scales(model, config)
    runner = ModelRunner(model, config, num_kv_blocks, eos, connector_worker, lora_slots, num_host_blocks, kv_groups,
                         draft)
    scales = runner.kv_scales
    log.info("KV cache: %d blocks of %d tokens in %s%s", num_kv_blocks, config.block_size,
             str(runner.kv_cache.dtype).removeprefix("torch."),
             f", scales: {scales}{' (1.0)' if scales == 'default' else ''}" if scales else "")
    if workers is not None:
        layouts = workers.setup(RunnerSetup(config, num_kv_blocks, eos, kv_groups, num_host_blocks,
                                            runner.draft_format))
        if connector_worker is not None:
            connector_worker.layout.ranks = layouts
    # Async scheduling where nothing needs the host between steps (see async_off_because).
    off = async_off_because(config, runner.model.rope_by_length)
    if config.async_scheduling and off is not None:
        log.warning("async_scheduling: steps run one at a time with %s", off)
    loop = StepLoop(scheduler, runner, workers, ahead=config.async_scheduling and off is None)
    start = time.perf_counter()
    runner.capture_graphs()
    if runner.graphs is not None:
        log.info("CUDA graphs for decode steps of %s rows captured in %.1f s",
                 ", ".join(map(str, runner.graphs.sizes)), time.perf_counter() - start)
    else:
        log.info("decode steps run eagerly (%s)", runner.graphs_off)
    grammars = runner.grammars = Grammars(config.model, args.vocab_size, eos)
    return EngineParts(eos, args.vocab_size, workers, loras, kv_groups, num_kv_blocks, kv, num_host_blocks, host,
                       scheduler, runner, connector_worker, loop, grammars)


def _load_draft(config: EngineConfig, args: ModelArgs, dtype, model, device: str):
    """draft_model's checkpoint, once it is known to speak the target's tokens: the same
    vocabulary and tokenizer, a context as long as max_model_len; or an EAGLE head fitting
    `model` (spec_decode/eagle.py), which shares its embeddings; or DeepSeek's MTP layer
    (spec_decode/mtp.py), by default from the target's own checkpoint; on `device`. Refused
    naming the field."""
    spec = config.speculative_config
    if spec is None or spec.method not in ("draft_model", "eagle", "eagle3", "mtp"):
        return None
    if spec.method != "draft_model":
        if spec.method == "mtp":
            return load_mtp(spec.model, config.model, model, dtype, device)
        return load_head(spec.method, spec.model, model, dtype, device)
    field = "speculative_config.model"
    draft_args = model_args(read_config(spec.model))
    check(draft_args.vocab_size == args.vocab_size, field,
          f"its vocabulary has {draft_args.vocab_size} tokens, the target's {args.vocab_size}")
    check(load_tokenizer(spec.model).get_vocab() == load_tokenizer(config.model).get_vocab(), field,
          "its tokenizer is not the target's (the token ids would mean other things)")
    check(draft_args.max_position_embeddings >= config.max_model_len, field,
          f"its max_position_embeddings {draft_args.max_position_embeddings} is shorter than max_model_len "
          f"{config.max_model_len}")
    return load_model(spec.model, dtype, device)


def _num_kv_blocks(c: EngineConfig, kv_groups: KVGroups, block_bytes: int) -> int:
    if c.num_kv_blocks is None:
        budget = _CPU_KV_BUDGET if c.kv_cache_memory_bytes is None else c.kv_cache_memory_bytes
        # Never more than every sequence slot at full length needs (plus prefix-cache slack).
        most = 2 * c.max_num_seqs * len(kv_groups.windows) * -(-c.max_model_len // c.block_size)
        c.num_kv_blocks = min(budget // block_bytes, most)
    need = _blocks_for_longest(c, kv_groups.windows)
    check(c.num_kv_blocks >= need, "num_kv_blocks",
          f"{c.num_kv_blocks} blocks of {c.block_size} tokens cannot hold one request of max_model_len "
          f"{c.max_model_len} ({need} blocks); raise num_kv_blocks (or kv_cache_memory_bytes) or lower "
          f"max_model_len")
    return c.num_kv_blocks


def _blocks_for_longest(c: EngineConfig, windows: list[int | None]) -> int:
    """Blocks one request of max_model_len holds at most: a full group's for every token, a
    sliding group's for its window and the largest step's tokens past it."""
    full = -(-c.max_model_len // c.block_size)
    return sum(full if w is None else min(full, -(-(w + c.max_num_batched_tokens) // c.block_size) + 1)
               for w in windows)


def _num_host_blocks(c: EngineConfig, block_bytes: int) -> int:
    num = int(c.kv_offloading_size * (1 << 30)) // block_bytes
    check(num > 0 or c.kv_offloading_size == 0, "kv_offloading_size",
          f"{c.kv_offloading_size:g} GiB is less than one KV block ({block_bytes} bytes)")
    return num
