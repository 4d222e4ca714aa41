"""A LoRA adapter in PEFT's format, read and checked against the base model.

PEFT saves `adapter_config.json` and `adapter_model.safetensors`, whose tensors are named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight`: A is
[rank, in], B is [out, rank], and a projection's output gains `B(A(x)) * scaling` with
scaling = lora_alpha / rank (lora_alpha / sqrt(rank) under rsLoRA). Baton merges q/k/v and
gate/up into one matmul each, so the adapter is laid out per merged projection: one A of the
targeted parts side by side ([in, parts * rank]) and one B that puts each part's rows under
its own output columns ([parts * rank, out], zero elsewhere): a shrink and an expand matmul
per projection, whatever the parts.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open

from baton.engine.common.errors import InvalidArgument, check
from baton.engine.worker.loader import files_fingerprint
from baton.engine.worker.models import ModelArgs

# Each merged projection of a decoder layer, its parts in output order.
PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
# Fused in the checkpoint (Phi-3): an adapter of the fused projection is one A and one B
# spanning its parts, which the merged layout takes as they are.
FUSED = {"qkv_proj", "gate_up_proj"}
ATTENTION = {"qkv_proj", "o_proj", *PROJECTIONS["qkv_proj"]}  # (the rest are an MLP's)
MODULES = {part for parts in PROJECTIONS.values() for part in parts} | FUSED
_TENSOR = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# PEFT options that change what an adapter computes beyond plain LoRA: refused, not ignored.
_UNSUPPORTED = ("use_dora", "modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern",
                "layer_replication", "trainable_token_indices", "use_qalora", "alora_invocation_tokens")


def part_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """Each adaptable module's (in, out) features in this model."""
    q, kv, h, i = (args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim, args.hidden_size,
                   args.intermediate_size)
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h), "qkv_proj": (h, q + 2 * kv),
            "gate_up_proj": (h, 2 * i)}


def adapter_bytes(args: ModelArgs, rank: int, element_size: int) -> int:
    """The most one adapter of `rank` takes on the device (every projection adapted)."""
    shapes = part_shapes(args)
    per_layer = sum(shapes[names[0]][0] * len(names) * rank + len(names) * rank * sum(shapes[n][1] for n in names)
                    for names in PROJECTIONS.values())
    return per_layer * args.num_layers * element_size


@dataclass
class LoRAWeights:
    """One adapter's tensors, per layer and merged projection: (A [in, parts*r], B [parts*r, out]),
    absent where the adapter leaves a projection alone. Scaling is applied after B, as PEFT does."""
    rank: int
    scaling: float
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]

    def to(self, device, dtype) -> LoRAWeights:
        return LoRAWeights(self.rank, self.scaling, [{k: (a.to(device, dtype), b.to(device, dtype))
                                                      for k, (a, b) in layer.items()} for layer in self.layers])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.layers for a, b in layer.values())


@dataclass
class AdapterConfig:
    """What adapter_config.json says that Baton uses."""
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: list[str]
    base_model: str

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def read_adapter_config(path: str, max_rank: int, architecture: str) -> AdapterConfig:
    check(os.path.isdir(path), "lora_path", f"{path!r} is not a directory")
    config_path = os.path.join(path, "adapter_config.json")
    check(os.path.isfile(config_path), "lora_path", f"{path!r} has no adapter_config.json")
    with open(config_path) as f:
        cfg = json.load(f)
    check(cfg.get("peft_type", "LORA") == "LORA", "peft_type", f"must be LORA, got {cfg.get('peft_type')!r}")
    rank = cfg.get("r")
    check(isinstance(rank, int) and rank >= 1, "r", f"must be an integer >= 1, got {rank!r}")
    check(rank <= max_rank, "r", f"the adapter's rank {rank} is above max_lora_rank {max_rank}")
    for name in _UNSUPPORTED:
        check(not cfg.get(name), name, f"is not supported (got {cfg[name]!r})" if name in cfg else "")
    check(cfg.get("bias", "none") == "none" and not cfg.get("lora_bias"), "bias", "LoRA biases are not supported")
    check(not cfg.get("fan_in_fan_out"), "fan_in_fan_out", "must be false for Llama and Qwen2 projections")
    targets = cfg.get("target_modules") or []
    # A regular expression over module paths: the tensors say which modules it took.
    targets = [] if isinstance(targets, str) else [t.rsplit(".", 1)[-1] for t in targets]
    unknown = sorted(set(targets) - MODULES)
    check(not unknown, "target_modules", f"{unknown} are not projections of this model (it has {sorted(MODULES)})")
    # The base it was trained on: its class when PEFT wrote it (a name or path cannot be compared:
    # a hub id at training, a local directory here); the tensors' shapes are checked on load.
    trained_on = (cfg.get("auto_mapping") or {}).get("base_model_class")
    check(trained_on in (None, architecture), "base_model_class",
          f"the adapter was trained on a {trained_on} ({cfg.get('base_model_name_or_path') or 'unnamed'}), "
          f"this model is a {architecture}")
    alpha = cfg.get("lora_alpha", rank)
    check(isinstance(alpha, (int, float)) and not isinstance(alpha, bool), "lora_alpha",
          f"must be a number, got {alpha!r}")
    return AdapterConfig(rank, float(alpha), bool(cfg.get("use_rslora")), sorted(set(targets)),
                         str(cfg.get("base_model_name_or_path") or ""))


def adapter_fingerprint(path: str) -> int:
    """A 60-bit digest of the adapter's files (loader.files_fingerprint): the root of its
    requests' block-hash chains, so two adapters (or an adapter and the base) never share KV,
    and equal files on two instances name equal prefixes alike. Ints hash alike in every
    process, unlike strings."""
    digest = files_fingerprint(os.path.join(path, "adapter_config.json"),
                               [os.path.join(path, "adapter_model.safetensors")])
    return int(digest[:15], 16)


def load_adapter(path: str, args: ModelArgs, max_rank: int) -> tuple[AdapterConfig, LoRAWeights]:
    """Read and check an adapter (float32, on CPU); raises InvalidArgument naming the field."""
    cfg = read_adapter_config(path, max_rank, args.architecture)
    weights_path = os.path.join(path, "adapter_model.safetensors")
    check(os.path.isfile(weights_path), "lora_path", f"{path!r} has no adapter_model.safetensors")
    shapes = part_shapes(args)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(weights_path, framework="pt") as f:
        for name in f.keys():
            m = _TENSOR.fullmatch(name)
            check(".experts." not in name, "target_modules", f"the adapter has {name!r}: LoRA on a mixture of "
                                                            f"experts' experts is not supported (on attention it is)")
            if m is None:
                raise InvalidArgument("target_modules", f"the adapter has a tensor {name!r} that is not a LoRA A or B "
                                                        f"of a projection in {sorted(MODULES)}")
            layer, module, which = int(m[1]), m[2], m[3]
            check(module in MODULES, "target_modules", f"{module!r} is not a projection of this model")
            check(not (args.sparse_layers and args.sparse_layers[layer] and module not in ATTENTION), "target_modules",
                  f"layer {layer}'s MLP is a mixture of experts: LoRA on it is not supported (on attention it is)")
            check(layer < args.num_layers, "base_model_name_or_path",
                  f"the adapter has layer {layer}, the model {args.num_layers} layers: it was made for another base "
                  f"({cfg.base_model or 'unnamed'})")
            tensor = f.get_tensor(name).float()
            want = (cfg.rank, shapes[module][0]) if which == "A" else (shapes[module][1], cfg.rank)
            check(tuple(tensor.shape) == want, "base_model_name_or_path",
                  f"the adapter's layer {layer} {module}.lora_{which} is {list(tensor.shape)}, this model needs "
                  f"{list(want)}: it was made for another base ({cfg.base_model or 'unnamed'})")
            parts.setdefault((layer, module), {})[which] = tensor
    missing = sorted(f"layers.{layer}.{mod}" for (layer, mod), ab in parts.items() if len(ab) != 2)
    check(not missing, "lora_path", f"the adapter lacks A or B for {missing[:3]}")
    check(parts, "lora_path", "the adapter has no LoRA tensors")
    return cfg, LoRAWeights(cfg.rank, cfg.scaling, [_merge_layer(parts, i, shapes, cfg.rank)
                                                    for i in range(args.num_layers)])


def _merge_layer(parts, layer: int, shapes, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    merged = {}
    for proj, names in PROJECTIONS.items():
        present = [(i, n) for i, n in enumerate(names) if (layer, n) in parts]
        if proj in FUSED and (layer, proj) in parts:
            check(not present, "target_modules", f"the adapter has both {proj} and its parts {names} in layer {layer}")
            merged[proj] = (parts[layer, proj]["A"].T.contiguous(), parts[layer, proj]["B"].T.contiguous())
            continue
        if not present:
            continue
        in_features = shapes[names[0]][0]
        offsets = [0]
        for n in names:
            offsets.append(offsets[-1] + shapes[n][1])
        a = torch.empty(in_features, len(present) * rank)
        b = torch.zeros(len(present) * rank, offsets[-1])
        for j, (i, n) in enumerate(present):
            a[:, j * rank:(j + 1) * rank] = parts[layer, n]["A"].T
            b[j * rank:(j + 1) * rank, offsets[i]:offsets[i + 1]] = parts[layer, n]["B"].T
        merged[proj] = (a, b)
    return merged
