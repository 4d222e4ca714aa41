"""The engine's arguments as `baton` flags (vLLM's spelling): the flags, the EngineConfig they
make, and the same flags again for the engines `baton up` starts.

Every engine flag sets the EngineConfig field of its name (its argparse dest), and defaults to
None: "the config's default". EngineConfig is the one source of the defaults (the help shows
them, read from it), and `engine_kwargs` the one place a parsed command line becomes the
config's keyword arguments: only the flags given, so a flag left out leaves the field to the
config, and `baton up` passes its engines only what was given."""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from baton.engine.common.config import EngineConfig

DEFAULT_MODELS_DIR = os.environ.get("BATON_MODELS_DIR", "models")


def _adapters(given: list[str]) -> dict[str, str]:
    bad = next((m for m in given if "=" not in m or not m.split("=", 1)[0]), None)
    if bad is not None:
        raise ValueError(f"expected NAME=PATH, got {bad!r}")
    return dict(m.split("=", 1) for m in given)


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e}): {text!r}") from None


@dataclass(frozen=True, slots=True)
class Flag:
    field: str  # the EngineConfig field it sets, and its dest
    help: str  # what it does; the help adds the field's default where that is a value (None: the text says)
    type: Callable | None = None  # None: a switch, which sets the field to the opposite of its default
    nargs: str | None = None
    metavar: str | None = None
    spelling: str | None = None  # the flag, where it is not --field-name
    to_config: Callable | None = None  # the parsed value to the field's (ValueError: malformed); None: as is
    to_argv: Callable | None = None  # the field's value back to the flag's arguments; None: str of each

    @property
    def flag(self) -> str:
        return self.spelling or "--" + self.field.replace("_", "-")

    def argv(self, value, default) -> list[str]:
        """The arguments that give the field `value` (none where it is the default of a switch)."""
        if self.type is None:
            return [self.flag] if value != default else []
        values = self.to_argv(value) if self.to_argv else list(map(str, value)) if self.nargs else [str(value)]
        if self.nargs:
            return [self.flag, *values] if values else []
        return [f"{self.flag}={values[0]}"]  # one argument: a value that starts with '-' stays the flag's


# In the order `engine_argv` writes them (values, switches, then the lists and JSON).
FLAGS = (
    Flag("device", "cpu, cuda, cuda:N or auto (a GPU when there is one)", str),
    Flag("dtype", "float32, bfloat16, float16 or auto (float32 on CPU, the checkpoint's half type on GPU)", str),
    Flag("max_num_seqs", "most requests running at once", int),
    Flag("max_num_batched_tokens", "token budget of one engine step", int),
    Flag("max_model_len", "longest prompt + output, in tokens (default: the model's, capped at 8192)", int),
    Flag("block_size", "tokens per KV cache block", int),
    Flag("num_kv_blocks", "KV cache blocks in the pool (default: from --kv-cache-memory-bytes)", int),
    Flag("kv_cache_memory_bytes", "memory for the KV cache (default 1 GiB on CPU; on a GPU, what "
                                  "--gpu-memory-utilization leaves)", int),
    Flag("gpu_memory_utilization", "share of the GPU's memory this engine may use for weights, activations and KV "
                                   "cache, measured at start, as vLLM does", float),
    Flag("attention_backend", "auto, cpu (the C++ kernel), triton or torch (the PyTorch reference); auto: cpu on CPU, "
                              "triton on CUDA", str),
    Flag("kv_cache_dtype", "the KV cache's element type: auto (the compute dtype), float32, bfloat16, float16, fp8 "
                           "(= fp8_e4m3) or fp8_e5m2: half a bfloat16 cache's bytes, K and V scaled per head by the "
                           "checkpoint's k_scale/v_scale (else 1.0, or --calculate-kv-scales); a P/D peer of "
                           "another is converted on landing",
         str),
    Flag("long_prefill_token_threshold", "most prompt tokens one request gets per step; 0: no cap", int),
    Flag("max_num_encoder_input_tokens", "a vision-language model's image tokens encoded per step at most "
                                         "(default: --max-num-batched-tokens, or one image's)", int),
    Flag("encoder_cache_size", "a vision-language model's image embeddings kept, in tokens (default: "
                               "--max-num-batched-tokens, or one image's)", int),
    Flag("scheduling_policy", "fcfs (first come, first served) or priority (lowest value first)", str),
    Flag("kv_offloading_size", "GiB of host memory for a second KV cache tier: prefix blocks evicted from the device "
                               "are kept there and loaded back, not recomputed; 0: none", float),
    Flag("preemption_mode", "recompute, swap (a preempted request's KV goes to the host tier and back) or auto (swap "
                            "when recomputing would cost more than half a step)", str),
    Flag("tensor_parallel_size", "split the model over this many ranks, one process and device each, meeting over "
                                 "torch.distributed: gloo on CPU, NCCL on GPUs", int),
    Flag("seed", "seed for requests that sample without their own seed", int),
    Flag("max_loras", "LoRA: most distinct adapters in one step, and on the device", int),
    Flag("max_lora_rank", "LoRA: highest adapter rank accepted", int),
    Flag("max_cpu_loras", "LoRA: adapters whose weights stay in host memory (default: --max-loras)", int),
    Flag("enable_prefix_caching", "turn off prefix caching", spelling="--no-prefix-caching"),
    Flag("enable_chunked_prefill", "run each prompt in one step", spelling="--no-chunked-prefill"),
    Flag("enable_lora", "serve LoRA adapters (implied by --lora-modules)"),
    Flag("calculate_kv_scales", "with an FP8 --kv-cache-dtype and a checkpoint without k_scale/v_scale: compute "
                                "each layer's K and V scales per KV head at start, from a calibration text, rather "
                                "than use 1.0"),
    Flag("disable_hybrid_kv_cache_manager", "sliding-window layers keep every KV block, as full-attention layers do"),
    Flag("enable_expert_parallel", "with --tensor-parallel-size: spread a mixture of experts' experts whole over the "
                                   "ranks rather than split each"),
    Flag("enforce_eager", "on a GPU, launch every step's kernels rather than replay CUDA graphs of decode steps"),
    Flag("async_scheduling", "prepare each step while the device runs the one before (requests without logprobs, "
                             "penalties, grammars or min_tokens; not with speculative decoding)"),
    Flag("accept_kv_from", "P/D: other checkpoints (directories, or the fingerprints `baton models` prints) whose KV "
                           "this engine's peers may send or take as this model's: another quantization of the same "
                           "model", str, "+", "CHECKPOINT"),
    Flag("cudagraph_capture_sizes", "decode step sizes, in rows, to capture CUDA graphs for (default: 1 2 4, then "
                                    "every multiple of 8 up to --max-num-seqs x (1 + drafts), at most 512)", int,
         "+", "N"),
    Flag("lora_modules", "LoRA adapters (PEFT directories) to load at start; requests pick one by name",
         str, "+", "NAME=PATH", to_config=_adapters,
         to_argv=lambda modules: [f"{name}={path}" for name, path in modules.items()]),
    Flag("speculative_config", 'speculative decoding, as vLLM takes it: e.g. \'{"method": "ngram", '
                               '"num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 2}\'',
         str, metavar="JSON", to_config=_json, to_argv=lambda spec: [json.dumps(spec)]),
)


def add_engine_flags(p: argparse.ArgumentParser, helps: dict[str, str] | None = None) -> None:
    """Every engine flag, each defaulting to None (the config's default, which its help shows).
    `helps`: a command's own help for a field's flag, in place of the engine's and its default."""
    defaults = EngineConfig.defaults()
    g = p.add_argument_group("engine")
    g.add_argument("--model", help="Hugging Face checkpoint directory (default: the prepared SmolLM2 demo model)")
    g.add_argument("--models-dir", default=DEFAULT_MODELS_DIR, help="where prepare-models put the demo model")
    for f in FLAGS:
        default, own = defaults[f.field], (helps or {}).get(f.field)
        text = own or f.help
        if f.type is None:
            if not isinstance(default, bool):
                raise TypeError(f"{f.field}: a switch needs a true/false field, its default is {default!r}")
            g.add_argument(f.flag, dest=f.field, action="store_const", const=not default, default=None, help=text)
            continue
        if own is None and default is not None and default != {}:
            text += f" (default: {default})"
        g.add_argument(f.flag, dest=f.field, type=f.type, nargs=f.nargs, metavar=f.metavar, default=None, help=text)


def model_dir(args) -> str:
    """--model, or the demo model that prepare-models wrote."""
    from baton.services.cli.demo_models import SMOLLM2_DIR_NAME

    return args.model or os.path.join(args.models_dir, SMOLLM2_DIR_NAME)


def engine_kwargs(args) -> dict:
    """The engine flags given, as EngineConfig's keyword arguments (--lora-modules a dict,
    --speculative-config the JSON's value); exits naming the flag where one is malformed."""
    given = {}
    for f in FLAGS:
        value = vars(args)[f.field]
        if value is None:
            continue
        try:
            given[f.field] = f.to_config(value) if f.to_config else value
        except ValueError as e:
            sys.exit(f"baton {args.command}: {f.flag}: {e}")
    return given


def engine_config(args) -> EngineConfig:
    return EngineConfig.from_kwargs(model_dir(args), **engine_kwargs(args))


def config_argv(kwargs: dict) -> list[str]:
    """EngineConfig keyword arguments as the flags that make them (engine_kwargs' inverse): what
    a `baton serve` started with them gets. ValueError names a field that has no flag."""
    unknown = set(kwargs) - {f.field for f in FLAGS}
    if unknown:
        raise ValueError(f"{', '.join(sorted(unknown))}: no engine flag sets it")
    defaults = EngineConfig.defaults()
    return [a for f in FLAGS if kwargs.get(f.field) is not None for a in f.argv(kwargs[f.field], defaults[f.field])]


def engine_argv(args, leave_out: tuple[str, ...] = ()) -> list[str]:
    """The engine flags given, as `baton serve` takes them (every engine of a `baton up` stack),
    less the fields in `leave_out`."""
    return config_argv({k: v for k, v in engine_kwargs(args).items() if k not in leave_out})
