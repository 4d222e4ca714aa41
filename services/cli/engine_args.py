"""The engine's arguments as `baton` flags (vLLM's spelling): the flags, the EngineConfig they
make, and the same flags again for the engines `baton up` starts."""
from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULT_MODELS_DIR = os.environ.get("BATON_MODELS_DIR", "models")

# Engine arguments as flags (vLLM's spelling), each with what it does.
ENGINE_FLAGS = {
    "device": (str, "cpu, cuda, cuda:N or auto (a GPU when there is one)"),
    "dtype": (str, "float32, bfloat16, float16 or auto (float32 on CPU, the checkpoint's half type on GPU)"),
    "max_num_seqs": (int, "most requests running at once (default 64)"),
    "max_num_batched_tokens": (int, "token budget of one engine step (default 2048)"),
    "max_model_len": (int, "longest prompt + output, in tokens (default: the model's, capped at 8192)"),
    "block_size": (int, "tokens per KV cache block (default 16)"),
    "num_kv_blocks": (int, "KV cache blocks in the pool (default: from --kv-cache-memory-bytes)"),
    "kv_cache_memory_bytes": (int, "memory for the KV cache (default 1 GiB on CPU; on a GPU, what "
                                   "--gpu-memory-utilization leaves)"),
    "gpu_memory_utilization": (float, "share of the GPU's memory this engine may use for weights, activations and "
                                      "KV cache (default 0.9; measured at start, as vLLM does)"),
    "attention_backend": (str, "auto, cpu (the C++ kernel), triton or torch (the PyTorch reference); auto: cpu on "
                               "CPU, triton on CUDA"),
    "long_prefill_token_threshold": (int, "most prompt tokens one request gets per step (0: no cap)"),
    "scheduling_policy": (str, "fcfs (first come, first served) or priority (lowest value first)"),
    "kv_offloading_size": (float, "GiB of host memory for a second KV cache tier: prefix blocks evicted from the "
                                  "device are kept there and loaded back, not recomputed (default 0: none)"),
    "preemption_mode": (str, "recompute, swap (a preempted request's KV goes to the host tier and back) or auto "
                             "(swap when recomputing would cost more than half a step); default recompute"),
    "tensor_parallel_size": (int, "split the model over this many ranks, one process and device each, meeting over "
                                  "torch.distributed: gloo on CPU, NCCL on GPUs (default 1)"),
    "seed": (int, "seed for requests that sample without their own seed (default 0)"),
    "max_loras": (int, "LoRA: most distinct adapters in one step, and on the device (default 1)"),
    "max_lora_rank": (int, "LoRA: highest adapter rank accepted (default 16)"),
    "max_cpu_loras": (int, "LoRA: adapters whose weights stay in host memory (default: --max-loras)"),
}


def add_engine_flags(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", help="Hugging Face checkpoint directory (default: the prepared SmolLM2 demo model)")
    g.add_argument("--models-dir", default=DEFAULT_MODELS_DIR, help="where prepare-models put the demo model")
    for name, (kind, text) in ENGINE_FLAGS.items():
        if name not in skip:
            g.add_argument("--" + name.replace("_", "-"), type=kind, help=text)
    g.add_argument("--no-prefix-caching", action="store_true", help="turn off prefix caching")
    g.add_argument("--no-chunked-prefill", action="store_true", help="run each prompt in one step")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (implied by --lora-modules)")
    g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="sliding-window layers keep every KV block, as full-attention layers do")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tensor-parallel-size: spread a mixture of experts' experts whole over the ranks "
                        "rather than split each")
    g.add_argument("--enforce-eager", action="store_true",
                   help="on a GPU, launch every step's kernels rather than replay CUDA graphs of decode steps")
    g.add_argument("--async-scheduling", action="store_true",
                   help="prepare each step while the device runs the one before (requests without logprobs, "
                        "penalties, grammars or min_tokens; not with speculative decoding, tensor parallelism, a KV "
                        "connector or the host KV tier)")
    g.add_argument("--cudagraph-capture-sizes", nargs="+", type=int, metavar="N",
                   help="decode batch sizes to capture CUDA graphs for (default: 1 2 4, then every multiple of 8 up to "
                        "--max-num-seqs, at most 512)")
    g.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", default=[],
                   help="LoRA adapters (PEFT directories) to load at start; requests pick one by name")
    g.add_argument("--speculative-config", metavar="JSON",
                   help='speculative decoding, as vLLM takes it: e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 2}\'')


def model_dir(args) -> str:
    """--model, or the demo model that prepare-models wrote."""
    from baton.services.cli.demo_models import SMOLLM2_DIR_NAME

    return args.model or os.path.join(args.models_dir, SMOLLM2_DIR_NAME)


def engine_config(args):
    from baton.engine.common.config import EngineConfig

    model = model_dir(args)
    kwargs = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name, None) is not None}
    modules = getattr(args, "lora_modules", [])
    bad = next((m for m in modules if "=" not in m or not m.split("=", 1)[0]), None)
    if bad is not None:
        sys.exit(f"baton serve: --lora-modules: expected NAME=PATH, got {bad!r}")
    spec = getattr(args, "speculative_config", None)
    if spec is not None:
        try:
            kwargs["speculative_config"] = json.loads(spec)
        except json.JSONDecodeError as e:
            sys.exit(f"baton serve: --speculative-config: not JSON ({e}): {spec!r}")
    return EngineConfig.from_kwargs(model, enable_prefix_caching=not args.no_prefix_caching,
                                    enable_chunked_prefill=not args.no_chunked_prefill,
                                    enable_lora=getattr(args, "enable_lora", False),
                                    disable_hybrid_kv_cache_manager=getattr(args, "disable_hybrid_kv_cache_manager",
                                                                            False),
                                    enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
                                    enforce_eager=getattr(args, "enforce_eager", False),
                                    async_scheduling=getattr(args, "async_scheduling", False),
                                    cudagraph_capture_sizes=getattr(args, "cudagraph_capture_sizes", None),
                                    lora_modules=dict(m.split("=", 1) for m in modules), **kwargs)


def engine_argv(args) -> list[str]:
    """The engine flags given, as `baton serve` takes them (every engine of a `baton up` stack)."""
    argv = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in ENGINE_FLAGS
            if getattr(args, name, None) is not None]
    argv += [flag for flag, on in (("--no-prefix-caching", args.no_prefix_caching),
                                   ("--no-chunked-prefill", args.no_chunked_prefill),
                                   ("--enable-lora", args.enable_lora),
                                   ("--disable-hybrid-kv-cache-manager", args.disable_hybrid_kv_cache_manager),
                                   ("--enable-expert-parallel", args.enable_expert_parallel),
                                   ("--enforce-eager", args.enforce_eager),
                                   ("--async-scheduling", args.async_scheduling)) if on]
    if args.cudagraph_capture_sizes:
        argv += ["--cudagraph-capture-sizes", *map(str, args.cudagraph_capture_sizes)]
    if args.lora_modules:  # every engine of the stack serves the adapters
        argv += ["--lora-modules", *args.lora_modules]
    if getattr(args, "speculative_config", None):
        argv += ["--speculative-config", args.speculative_config]
    return argv
