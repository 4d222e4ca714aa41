"""Engine arguments (vLLM's names where vLLM has one), validated with errors that name the
field, and the checkpoint's config.json. Torch-free: a server's front process makes the config
and validates it; its engine core resolves the device (`resolve_device`) where torch lives."""
from __future__ import annotations

import json
import os
import re
from dataclasses import MISSING, dataclass, field, fields

from baton.engine.common.errors import InvalidArgument, check
from baton.engine.common.speculative import SpeculativeConfig

DTYPES = ("float32", "bfloat16", "float16")
# kv_cache_dtype's values (vLLM's): "auto" is the compute dtype; "fp8" is e4m3.
KV_CACHE_DTYPES = ("auto", *DTYPES, "fp8", "fp8_e4m3", "fp8_e5m2")
ATTENTION_BACKENDS = ("auto", "cpu", "triton", "torch")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
_FINGERPRINT = re.compile(r"[0-9a-f]{32}")  # engine/worker/loader.checkpoint_fingerprint's
PREEMPTION_MODES = ("recompute", "swap", "auto")
_GIB = 1 << 30


def available_host_bytes() -> int:
    """Host memory that can be had now without swapping: MemAvailable (free + reclaimable
    caches), or the free pages where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def read_config(model_dir: str) -> dict:
    """The checkpoint's config.json."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise InvalidArgument("model", f"{model_dir!r} has no config.json")
    with open(path) as f:
        return json.load(f)


@dataclass(slots=True)
class EngineConfig:
    model: str
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the checkpoint's max_position_embeddings, capped at 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: no per-request cap beyond the step budget
    # A vision-language model's (vLLM's names; engine/core/encoder_cache.py): the image tokens a step
    # may encode, and the image tokens of embeddings kept for chunks and requests to come. None:
    # max_num_batched_tokens, or one image's tokens where that is more.
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority"
    dtype: str = "auto"  # "auto": float32 on CPU, the checkpoint's dtype (or bfloat16) on CUDA
    device: str = "auto"  # "auto": cuda when there is one, else cpu; resolved to cpu or cuda:N by resolve_device
    seed: int = 0
    num_kv_blocks: int | None = None  # default: sized from kv_cache_memory_bytes
    kv_cache_memory_bytes: int | None = None  # default: 1 GiB on CPU; on CUDA, from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9  # the share of the GPU's memory this engine may use (weights, activations, KV)
    attention_backend: str = "auto"  # "auto" | "cpu" (C++ kernel) | "triton" | "torch" (the reference)
    # LoRA adapters (vLLM's names): `lora_modules` (name -> PEFT directory) are loaded at start
    # and imply enable_lora; more can be loaded at run time.
    enable_lora: bool = False
    max_loras: int = 1  # distinct adapters in one step (and on the device)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters whose weights stay in host memory (default: max_loras)
    lora_modules: dict[str, str] = field(default_factory=dict)
    kv_offloading_size: float = 0  # GiB of host memory for a second KV tier (0: none); pinned when on a GPU
    preemption_mode: str = "recompute"  # "recompute" | "swap" (to the host tier) | "auto" (by the request's cost)
    # Sliding-window layers keep every block, as full-attention ones do (vLLM's flag): the hybrid
    # KV cache manager (engine/common/kv_groups.py) is off. The host KV tier turns it off too.
    disable_hybrid_kv_cache_manager: bool = False
    # Speculative decoding (vLLM's --speculative-config): a SpeculativeConfig or its dict; None: off.
    speculative_config: SpeculativeConfig | dict | None = None
    # Tensor parallelism (vLLM's name): the model split over this many ranks, one process and
    # device each (rank 0 in the engine core's process), meeting over torch.distributed.
    tensor_parallel_size: int = 1
    # Expert parallelism (vLLM's name): under tensor parallelism, a mixture of experts' routed
    # experts spread whole over the ranks rather than each split. Ignored with one rank (every
    # expert is on it) and by a model without experts, as vLLM does: a stack's tiers share it.
    enable_expert_parallel: bool = False
    # CUDA graphs (vLLM's names): a decode step (drafts verified too) replays a graph captured for
    # its rows padded up to the next of cudagraph_capture_sizes (default: 1, 2, 4, then every
    # multiple of 8 up to max_num_seqs x (1 + num_speculative_tokens), at most 512); enforce_eager:
    # never (every step launches its kernels).
    enforce_eager: bool = False
    cudagraph_capture_sizes: list[int] | None = None
    # vLLM's name: the scheduler prepares step N+1 while the device runs step N (the tokens N samples
    # reach the next step on the device), for steps whose requests need nothing of the host between
    # (engine/core/step_loop.py, async_off_because, says which); others step one at a time.
    async_scheduling: bool = False
    # Other checkpoints whose KV a P/D peer may send this engine (or take from it) as if it were
    # this one's: another quantization of the same model (a bf16 prefill before an FP8 decode),
    # by directory or by the fingerprint `baton models` prints. Empty: a peer serves this very
    # checkpoint, or the handshake refuses it naming kv_layout.format.model.
    accept_kv_from: list[str] = field(default_factory=list)
    # The KV cache's element type (vLLM's --kv-cache-dtype): "auto" is the compute dtype; "fp8"
    # (= "fp8_e4m3") or "fp8_e5m2" stores K and V divided by per-head scales (the checkpoint's
    # k_scale/v_scale where it has them, else computed at start from a calibration text where
    # calculate_kv_scales, else 1.0), half a bf16 cache's bytes.
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False

    def __post_init__(self):
        check(isinstance(self.model, (str, os.PathLike)) and os.path.isdir(self.model), "model",
              f"must be a checkpoint directory, got {self.model!r}")
        self.model = os.fspath(self.model)
        for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1), name,
                  f"must be an integer >= 1, got {value!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name,
                  f"must be an integer >= 1, got {value!r}")
        check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256), "block_size",
              f"must be a power of two <= 256, got {self.block_size}")
        check(self.max_model_len is None or (isinstance(self.max_model_len, int) and self.max_model_len >= 1),
              "max_model_len", f"must be an integer >= 1, got {self.max_model_len!r}")
        check(isinstance(self.long_prefill_token_threshold, int) and self.long_prefill_token_threshold >= 0,
              "long_prefill_token_threshold", f"must be an integer >= 0, got {self.long_prefill_token_threshold!r}")
        check(self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy",
              f"must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        check(self.dtype == "auto" or self.dtype in DTYPES, "dtype",
              f"must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
              f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        check(self.num_kv_blocks is None or (isinstance(self.num_kv_blocks, int) and self.num_kv_blocks >= 1),
              "num_kv_blocks", f"must be an integer >= 1, got {self.num_kv_blocks!r}")
        check(self.kv_cache_memory_bytes is None
              or (isinstance(self.kv_cache_memory_bytes, int) and self.kv_cache_memory_bytes > 0),
              "kv_cache_memory_bytes", f"must be a positive integer, got {self.kv_cache_memory_bytes!r}")
        check(isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1,
              "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}")
        check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
              f"must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        check(isinstance(self.device, str) and _DEVICE.fullmatch(self.device) is not None, "device",
              f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        self._check_lora()
        self._check_host_tier()
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self._check_parallel()
        self._check_graphs()

    def _check_graphs(self) -> None:
        for name in ("enforce_eager", "async_scheduling"):
            check(isinstance(getattr(self, name), bool), name, f"must be true or false, got {getattr(self, name)!r}")
        sizes = self.cudagraph_capture_sizes
        if sizes is None:
            spec = self.speculative_config  # (each decode verifies up to its k drafts: k + 1 rows)
            most = min(self.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0)), 512)
            sizes = [n for n in (1, 2, 4) if n < most] + list(range(8, most, 8)) + [most]
        check(isinstance(sizes, (list, tuple)) and len(sizes) > 0
              and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes),
              "cudagraph_capture_sizes", f"must be a non-empty list of integers >= 1, got {sizes!r}")
        self.cudagraph_capture_sizes = sorted(set(sizes))

    def _check_parallel(self) -> None:
        tp = self.tensor_parallel_size
        check(isinstance(tp, int) and not isinstance(tp, bool) and 1 <= tp <= 64, "tensor_parallel_size",
              f"must be an integer in [1, 64], got {tp!r}")
        check(isinstance(self.enable_expert_parallel, bool), "enable_expert_parallel",
              f"must be true or false, got {self.enable_expert_parallel!r}")
        peers = self.accept_kv_from
        check(isinstance(peers, (list, tuple)) and all(
            isinstance(p, str) and (os.path.isdir(p) or _FINGERPRINT.fullmatch(p)) for p in peers), "accept_kv_from",
              f"must list checkpoint directories or their fingerprints (32 hex digits, `baton models`), got {peers!r}")
        self.accept_kv_from = list(peers)
        check(isinstance(self.calculate_kv_scales, bool), "calculate_kv_scales",
              f"must be true or false, got {self.calculate_kv_scales!r}")
        check(not (self.calculate_kv_scales and tp > 1), "calculate_kv_scales",
              "scales are calculated by one rank's run over the whole model: with tensor_parallel_size > 1, use a "
              "checkpoint that has k_scale/v_scale (or 1.0: leave it off)")

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name,
                  f"must be an integer >= 1, got {value!r}")
        check(self.max_cpu_loras is None
              or (isinstance(self.max_cpu_loras, int) and self.max_cpu_loras >= self.max_loras),
              "max_cpu_loras", f"must be an integer >= max_loras ({self.max_loras}), got {self.max_cpu_loras!r}")
        check(isinstance(self.lora_modules, dict) and all(isinstance(k, str) and k and isinstance(v, (str, os.PathLike))
                                                          for k, v in self.lora_modules.items()),
              "lora_modules", "must map adapter names to PEFT adapter directories")
        self.lora_modules = {k: os.fspath(v) for k, v in self.lora_modules.items()}
        self.enable_lora = bool(self.enable_lora or self.lora_modules)

    def _check_host_tier(self) -> None:
        size = self.kv_offloading_size
        check(isinstance(size, (int, float)) and not isinstance(size, bool) and size >= 0, "kv_offloading_size",
              f"must be a number of GiB >= 0, got {size!r}")
        available = available_host_bytes()
        check(size * _GIB <= available, "kv_offloading_size",
              f"{size:g} GiB asked for, but the host has only {available / _GIB:.2f} GiB available")
        check(self.preemption_mode in PREEMPTION_MODES, "preemption_mode",
              f"must be one of {', '.join(PREEMPTION_MODES)}, got {self.preemption_mode!r}")
        check(self.preemption_mode == "recompute" or size > 0, "preemption_mode",
              f"{self.preemption_mode!r} swaps to the host KV tier: set kv_offloading_size > 0")

    def resolve_device(self) -> None:
        """`auto` and plain `cuda` made explicit: cpu, or cuda:N, N the current CUDA device (an
        index is what torch.cuda.set_device and a KV layout's device id need). Raises
        InvalidArgument naming device when the GPU asked for is not there."""
        import torch

        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cpu":
            return
        check(torch.cuda.is_available(), "device", f"{self.device} was asked for but no GPU is visible")
        if self.device == "cuda":
            self.device = f"cuda:{torch.cuda.current_device()}"
        index, count = int(self.device.split(":")[1]), torch.cuda.device_count()
        check(index < count, "device", f"{self.device} was asked for but {count} GPU(s) are visible")

    @classmethod
    def defaults(cls) -> dict[str, object]:
        """Every field's default by name (a fresh value where a factory makes it; `model` has none):
        what a caller that leaves a field out gets, for a command line's help and its own choices."""
        return {f.name: f.default_factory() if f.default_factory is not MISSING else f.default
                for f in fields(cls) if f.default is not MISSING or f.default_factory is not MISSING}

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        for name in kwargs:
            if name not in known:
                raise InvalidArgument(name, "is not an engine argument "
                                            f"(known: {', '.join(sorted(known - {'model'}))})")
        return cls(model=model, **kwargs)

    def torch_dtype(self, checkpoint_dtype: str | None):
        """The torch dtype of weights and KV cache (after resolve_device)."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if self.device == "cpu":
            return torch.float32
        # On a GPU keep a half-precision checkpoint's dtype; float32 checkpoints run in bfloat16.
        return getattr(torch, checkpoint_dtype) if checkpoint_dtype in ("bfloat16", "float16") else torch.bfloat16

    def kv_torch_dtype(self, compute_dtype):
        """The KV cache's torch dtype, given the weights' (after resolve_device)."""
        import torch

        return {"auto": compute_dtype, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                "fp8_e5m2": torch.float8_e5m2}[self.kv_cache_dtype]

    def resolve_model_len(self, max_position_embeddings: int) -> None:
        """Called once the checkpoint's config is known."""
        if self.max_model_len is None:
            self.max_model_len = min(max_position_embeddings, 8192)
        check(self.max_model_len <= max_position_embeddings, "max_model_len",
              f"{self.max_model_len} exceeds the model's max_position_embeddings {max_position_embeddings}")
        if not self.enable_chunked_prefill:
            check(self.max_num_batched_tokens >= self.max_model_len, "max_num_batched_tokens",
                  f"must be >= max_model_len ({self.max_model_len}) when chunked prefill is off, "
                  f"got {self.max_num_batched_tokens}")
