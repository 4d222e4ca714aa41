"""How much GPU memory the KV cache gets: vLLM's `gpu_memory_utilization`, measured.

The engine may use `utilization` × the device's memory in all: weights, the activations of its
largest step, memory outside torch's allocator (the CUDA context's growth, kernel modules), and
the KV cache, which gets what is left. The largest step is measured, not estimated: one dummy
step of the whole token budget, spread over as many prompts as may run, each sampled with
min-p, top-k/top-p and the most logprobs, the first with prompt logprobs over a full chunk of
rows (the sampler's largest temporaries). The PyTorch reference's decode gathers, which grow
with context, are added by count (the Triton kernels read in place). Per instance, as in vLLM:
two engines on one GPU each take their own fraction, and each must find its fraction free
when it starts. Not counted: what NIXL/UCX allocate on the device when the cache registers.
"""
from __future__ import annotations

import dataclasses
import gc

import torch

from baton.engine.common.config import EngineConfig
from baton.engine.common.errors import check
from baton.engine.common.sampling_params import MAX_LOGPROBS, SamplingParams
from baton.engine.common.scheduler_output import NewRequestData, SchedulerOutput
from baton.engine.worker.model_runner import PROMPT_LOGPROB_ROWS, ModelRunner

_GIB = 1 << 30


def kv_cache_bytes(total: int, free_at_start: int, utilization: float, weights: int, peak_activations: int,
                   non_torch: int, device: str) -> int:
    """The KV cache's share of `utilization` × `total` bytes, once the rest is paid for."""
    budget = int(total * utilization)
    check(budget <= free_at_start, "gpu_memory_utilization",
          f"{utilization:g} of {device} is {budget / _GIB:.2f} GiB, but only {free_at_start / _GIB:.2f} GiB were free "
          f"at start (other processes hold the rest); lower it")
    kv = budget - weights - peak_activations - max(non_torch, 0)
    check(kv > 0, "gpu_memory_utilization",
          f"{utilization:g} of {device} ({budget / _GIB:.2f} GiB) leaves nothing for the KV cache after the weights "
          f"({weights / _GIB:.2f} GiB), the largest step's activations ({peak_activations / _GIB:.2f} GiB) and "
          f"memory outside torch ({max(non_torch, 0) / _GIB:.2f} GiB); raise it, or lower max_num_batched_tokens")
    return kv


def profile_batch(config: EngineConfig) -> tuple[SchedulerOutput, int]:
    """The largest step the scheduler may emit, as dummy prompts: the token budget over up to
    max_num_seqs prompts, none longer than max_model_len. Returns it and the blocks it needs."""
    tokens = min(config.max_num_batched_tokens, config.max_num_seqs * config.max_model_len)
    num_seqs = min(config.max_num_seqs, tokens)
    # The first prompt long enough for a full chunk of prompt-logprob rows; the rest even.
    first = max(tokens // num_seqs + (tokens % num_seqs > 0),
                min(PROMPT_LOGPROB_ROWS + 1, config.max_model_len, tokens - (num_seqs - 1)))
    rest, others = tokens - first, num_seqs - 1
    lengths = [first] + [rest // others + (i < rest % others) for i in range(others)]
    params = SamplingParams(max_tokens=1, temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, logprobs=MAX_LOGPROBS)
    sched, next_block = SchedulerOutput(), 0
    for i, n in enumerate(lengths):
        blocks = list(range(next_block, next_block + -(-n // config.block_size)))
        next_block += len(blocks)
        p = params if i else dataclasses.replace(params, prompt_logprobs=MAX_LOGPROBS)
        sched.scheduled_new_reqs.append(NewRequestData(f"profile-{i}", [0] * n, [blocks], 0, p, n))
        sched.num_scheduled_tokens[f"profile-{i}"] = n
    sched.total_num_scheduled_tokens = tokens
    return sched, next_block


def memory_before_loading(device: str) -> tuple[int, int]:
    """(free, total) bytes of the device before the model loads, with the calling thread set
    to it (no stray context on device 0) and what an engine dropped earlier in this process
    left cached given back."""
    torch.cuda.set_device(device)
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


def measure_kv_cache_bytes(model, config: EngineConfig, free_at_start: int, total: int) -> int:
    """Run the largest step on a throwaway runner and size the KV cache from what it used."""
    device = torch.device(config.device)
    torch.cuda.synchronize(device)
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    sched, num_blocks = profile_batch(config)
    runner = ModelRunner(model, config, num_blocks, frozenset())
    runner.execute_model(sched)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - weights - runner.kv_cache.numel() * runner.kv_cache.element_size()
    if runner.attention_backend == "torch":  # a layer's decodes gathered at full context, K and V
        args = model.args
        peak += (config.max_num_seqs * config.max_model_len * 2 * args.num_kv_heads * args.head_dim
                 * model.embed_tokens.weight.element_size())  # (an FP8 cache's are widened to it)
    del runner
    torch.cuda.empty_cache()
    non_torch = free_at_start - torch.cuda.mem_get_info(device)[0] - torch.cuda.memory_reserved(device)
    return kv_cache_bytes(total, free_at_start, config.gpu_memory_utilization, weights, peak, non_torch,
                          config.device)
