"""Load a Hugging Face checkpoint directory (config.json + safetensors, sharded or not). Experts come
one tensor per expert and projection (Mixtral, Qwen, DeepSeek) or stacked (gpt-oss: gate and up
interleaved, transposed). A quantized checkpoint's layers stay in its format (quant/: FP8, GPTQ,
AWQ, compressed-tensors, gpt-oss's MXFP4 experts)."""
from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os

import torch
from safetensors import safe_open

from baton.engine.common.config import read_config
from baton.engine.common.errors import InvalidArgument
from baton.engine.worker.models import CausalLM, ModelArgs, llava, model_args, qwen2_5_vl, qwen3_vl
from baton.engine.worker.models.basic import MLP
from baton.engine.worker.models.layers import VISION_ENCODERS, Attention
from baton.engine.worker.models.moe import SparseMoE
from baton.engine.worker.models.qwen2_5_vl import QwenVisionArgs
from baton.engine.worker.models.qwen3_vl import Qwen3VisionArgs
from baton.engine.worker.quant.formats import MXFP4, CheckpointFormat, checkpoint_format
from baton.engine.worker.quant.placement import QuantizedPlacement

# checkpoint name -> (our parameter, index of the slice in a merged projection)
_MERGED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# Mixtral's names for what the others call mlp and an expert's gate, up and down projections;
# gpt-oss's for the router.
_ALIASES = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", "router": "gate"}


def _safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise InvalidArgument("model", f"{model_dir!r} has no model.safetensors or model.safetensors.index.json")


def tensors_under(model_dir: str, prefix: str):
    """(name, tensor) for each of a checkpoint's tensors whose name starts with `prefix`, read from
    the shards that hold them only (as model.safetensors.index.json says): one layer of a model
    whose other shards are never opened (DeepSeek-V3's MTP layer, spec_decode/mtp.py)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted({shard for name, shard in json.load(f)["weight_map"].items() if name.startswith(prefix)})
        paths = [os.path.join(model_dir, s) for s in shards]
    else:
        paths = _safetensors_files(model_dir)
    for path in paths:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    yield name, f.get_tensor(name)


def checkpoint_bytes(model_dir: str) -> dict[str, int]:
    """The bytes of a checkpoint's tensors by safetensors dtype ("F8_E4M3", "I32", "BF16"...), read
    from the files' headers alone (no weight is read)."""
    sizes: dict[str, int] = {}
    for path in _safetensors_files(model_dir):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                sizes[entry["dtype"]] = sizes.get(entry["dtype"], 0) + end - start
    return sizes


def checkpoint_fingerprint(model_dir: str) -> str:
    """A short digest of a checkpoint's contents: its config.json, and each weight file's size
    and ranges spread over it. The same checkpoint gives the same digest wherever it is
    mounted; fine-tunes of one base (equal configs and shapes) differ in their weights."""
    return files_fingerprint(os.path.join(model_dir, "config.json"), _safetensors_files(model_dir))


def peer_fingerprint(checkpoint: str) -> str:
    """accept_kv_from's entry as a fingerprint: a checkpoint directory's, or the entry itself."""
    return checkpoint_fingerprint(checkpoint) if os.path.isdir(checkpoint) else checkpoint


def weight_files(model_dir: str) -> list[str]:
    """A checkpoint folder's weight files, whatever their names: *.safetensors, else
    pytorch_model*.bin (as EAGLE's heads are published)."""
    return (sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
            or sorted(glob.glob(os.path.join(model_dir, "pytorch_model*.bin"))))


def draft_fingerprint(model_dir: str) -> str:
    """checkpoint_fingerprint's digest over whichever weight files a folder has: a draft model's,
    an EAGLE head's, or the checkpoint an MTP layer is read from (what a P/D pair compares before
    shipping their KV)."""
    return files_fingerprint(os.path.join(model_dir, "config.json"), weight_files(model_dir))


def files_fingerprint(config_path: str, weight_paths: list[str], samples: int = 8, sample_bytes: int = 1 << 16) -> str:
    """A digest of a config file (whole) and weight files (each one's size and `samples` ranges
    spread over it): under a MiB read per file, milliseconds however large the weights."""
    digest = hashlib.sha256()
    with open(config_path, "rb") as f:
        digest.update(f.read())
    for path in weight_paths:
        size = os.path.getsize(path)
        digest.update(size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            for i in range(samples):
                f.seek(size * i // samples)
                digest.update(f.read(sample_bytes))
    return digest.hexdigest()[:32]


def load_model(model_dir: str, dtype: torch.dtype, device: str) -> CausalLM:
    config = read_config(model_dir)
    args, fmt = model_args(config), checkpoint_format(config)
    # Allocated in place, in the target dtype, and left uninitialized (see models/layers.Linear): the
    # checkpoint fills it. Built in float32 and cast, a bf16 model would peak at three times
    # its size. (The meta device + to_empty would make torch import sympy: seconds of start-up.)
    # A quantized checkpoint's model is built in host memory, where the float layers it replaces
    # are never written (their pages never touched), and moved once it holds what it keeps.
    with torch.device("cpu" if fmt is not None else device), default_dtype(dtype):
        model = CausalLM(args)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()  # checkpoint names
    filled: set[str] = set()  # our parameters written (a merged one by any of its parts)
    quantized: dict[str, dict[str, torch.Tensor]] = {}  # a quantized layer's tensors, by module and field
    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for stored in f.keys():
                name, vision = _vision_or_language(stored, args)
                if vision is not None:  # a vision-language model's image side: as it is named here
                    if vision in params:
                        with torch.no_grad():
                            params[vision].copy_(f.get_tensor(stored))
                        filled.add(vision)
                    continue  # (else a ViT layer past the one the projector reads)
                if "rotary_emb" in name or _skipped(name, args) or _kv_scale_of(name) is not None:
                    continue  # (an FP8 KV cache's scales: checkpoint_kv_scales)
                tensor = f.get_tensor(stored)
                field = None if fmt is None else fmt.split(name, tensor)
                if field is not None:
                    quantized.setdefault(field[0], {})[field[1]] = tensor
                    continue
                target, rows, layout = _target(model, params, name)
                if target is None:
                    raise InvalidArgument("model", f"unexpected weight {name!r} in {os.path.basename(path)}")
                if layout is not None:
                    tensor = layout(tensor)
                with torch.no_grad():
                    (params[target] if rows is None else params[target][rows]).copy_(tensor)
                loaded.add(name)
                filled.add(target)
    if quantized:
        for name, target in install_quantized(model, params, fmt, quantized, dtype):
            loaded.add(name)
            filled.add(target)
    _check_complete(model, args, loaded, filled, params)
    _check_vision(params, filled)
    scales, model.kv_scales_source = checkpoint_kv_scales(model_dir, args)
    for layer, layer_scales in zip(model.layers, scales, strict=True):
        layer.self_attn.kv_scales.copy_(layer_scales[:, :layer.self_attn.kv_scales.shape[1]])
    model.eval()
    return model if fmt is None else model.to(device)


def load_vision(model_dir: str, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, ModelArgs]:
    """A vision-language checkpoint's image encoder alone, without its language model (an
    encoder tier's: pixels [images, *shape] and their sizes -> each image's embeddings), and the
    checkpoint's args."""
    args = model_args(read_config(model_dir))
    if args.vision is None:
        raise InvalidArgument("model", f"{model_dir!r} is not a vision-language model: it has no image encoder")
    with torch.device(device), default_dtype(dtype):
        vision = VISION_ENCODERS[type(args.vision)](args.vision, args.hidden_size)
    params = {"vision." + name: p for name, p in vision.named_parameters()}
    filled: set[str] = set()
    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for stored in f.keys():
                ours = _vision_or_language(stored, args)[1]
                if ours in params:
                    with torch.no_grad():
                        params[ours].copy_(f.get_tensor(stored))
                    filled.add(ours)
    _check_vision(params, filled)
    return vision.eval(), args


def _check_vision(params: dict, filled: set[str]) -> None:
    missing = next((n for n in params if n.startswith("vision.") and n not in filled), None)
    if missing is not None:
        raise InvalidArgument("model", f"checkpoint lacks the vision weight {missing!r}")


# An FP8 KV cache's scales as checkpoints name them (after _canonical): compressed-tensors'
# self_attn.k_scale, ModelOpt's self_attn.k_proj.k_scale (vLLM reads both).
_KV_SCALE_NAMES = {("self_attn", "k_scale"): 0, ("self_attn", "v_scale"): 1, ("k_proj", "k_scale"): 0,
                   ("v_proj", "v_scale"): 1}


def _kv_scale_of(name: str) -> tuple[int, int] | None:
    """(layer, 0 for K or 1 for V) where `name` is a KV cache scale, else None."""
    parts = _canonical(name).split(".")
    part = _KV_SCALE_NAMES.get(tuple(parts[-2:]))
    if part is None or len(parts) < 4 or parts[0] != "layers" or not parts[1].isdigit():
        return None
    return int(parts[1]), part


def checkpoint_kv_scales(model_dir: str, args: ModelArgs) -> tuple[torch.Tensor, str]:
    """An FP8 KV cache's scales [layers, 2 (K, V), kv_heads] (float32) as the checkpoint gives
    them (one per tensor, or one per KV head), and where they came from: "checkpoint", or
    "default" (1.0) where it has none. MLA caches one row per token: its one scale is K's,
    used for both (vLLM's reading). Only the scale tensors are read."""
    heads = 1 if args.attention == "mla" else args.num_kv_heads
    scales = torch.ones(args.num_layers, 2, heads)
    found = False
    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                where = _kv_scale_of(name)
                if where is None or where[0] >= args.num_layers or (args.attention == "mla" and where[1]):
                    continue
                value = f.get_tensor(name).float().flatten()
                if value.numel() not in (1, heads) or not bool(torch.isfinite(value).all() and (value > 0).all()):
                    raise InvalidArgument("model", f"{name} holds {value.tolist()}: a KV cache scale is one positive "
                                                   f"number, or one per KV head ({heads})")
                for part in (0, 1) if args.attention == "mla" else (where[1],):
                    scales[where[0], part] = value
                found = True
    return scales, "checkpoint" if found else "default"


def install_quantized(model: CausalLM, params: dict, fmt: CheckpointFormat, tensors: dict[str, dict[str, torch.Tensor]],
                      dtype: torch.dtype) -> list[tuple[str, str]]:
    """Each quantized layer's weight (weights.py), read by `fmt` from its tensors, put where the
    float one would have gone: a projection becomes a QuantizedLinear of its checkpoint parts,
    experts ExpertStacks. Returns (checkpoint weight name, our parameter) of each."""
    placed = QuantizedPlacement(model, dtype)
    done = []
    for module, fields in tensors.items():
        # What the float checkpoint would call this layer's weight (gpt-oss's stacked experts: the module).
        name = module if isinstance(fmt, MXFP4) else f"{module}.weight"
        target, rows, layout = _target(model, params, name)
        if target is None:
            raise InvalidArgument("model", f"unexpected quantized weight {module!r} ({', '.join(sorted(fields))})")
        weight = fmt.read(module, fields)  # (stacked experts come [experts, out, in] already)
        if layout is not None and target.endswith(".gate_up"):  # gpt-oss's gate/up rows interleaved: gate's, up's
            rows = torch.arange(weight.out_features)
            placed.add_stacked(target, [weight.take_rows(rows[0::2]), weight.take_rows(rows[1::2])])
        else:
            placed.add(target, rows, weight)
        done.append((name, target))
    placed.install()
    return done


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Modules built inside allocate their parameters in `dtype` (the checkpoint fills them)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _skipped(name: str, args: ModelArgs) -> bool:
    """Whether a tensor belongs to a layer past the model's that Baton does not run (DeepSeek-V3's
    multi-token-prediction layers)."""
    parts = _canonical(name).split(".")
    return (args.skipped_layers > 0 and len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit()
            and args.num_layers <= int(parts[1]) < args.num_layers + args.skipped_layers)


# The families whose checkpoints name their vision side otherwise than LLaVA's, by their vision
# args' type (Gemma 3's are LLaVA's names): the family's prefixes, and its renaming of the rest
# (Qwen3-VL's modules reuse others', named theirs).
_VISION_NAMES = {QwenVisionArgs: (qwen2_5_vl, None), Qwen3VisionArgs: (qwen3_vl, qwen3_vl.vision_name)}


def _vision_or_language(name: str, args: ModelArgs) -> tuple[str, str | None]:
    """A vision-language checkpoint's tensor: its language model's named as a text model's is
    (model.language_model.X -> model.X), or the vision side's name here (llava.py, qwen2_5_vl.py,
    qwen3_vl.py: its own names under the prefix)."""
    if args.vision is None:
        return name, None
    family, rename = _VISION_NAMES.get(type(args.vision), (llava, None))
    for prefix, text in family.LANGUAGE_PREFIXES.items():
        if name.startswith(prefix):
            return text + name.removeprefix(prefix), None
    for prefix, ours in family.CHECKPOINT_PREFIXES.items():
        if name.startswith(prefix):
            ours += name.removeprefix(prefix)
            return name, rename(ours) if rename is not None else ours
    return name, None


def _canonical(name: str) -> str:
    """A checkpoint tensor's name as the Llama family spells it, without the model. prefix."""
    parts = name.removeprefix("model.").split(".")
    return ".".join(_ALIASES.get(p, p) if i < len(parts) - 1 else p for i, p in enumerate(parts))


def _deinterleaved(t: torch.Tensor) -> torch.Tensor:
    """gpt-oss's fused gate/up outputs alternate (gate, up, gate, ...) on dim 1: gate's, then up's."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


# gpt-oss's stacked experts ([experts, in, out]) -> (our parameter, the layout change into it)
_STACKED = {"gate_up_proj": ("gate_up", lambda t: _deinterleaved(t.transpose(1, 2))),
            "gate_up_proj_bias": ("gate_up_bias", _deinterleaved),
            "down_proj": ("down", lambda t: t.transpose(1, 2)), "down_proj_bias": ("down_bias", None)}


def _target(model: CausalLM, params: dict, name: str) -> tuple[str | None, slice | tuple | None, object]:
    """Map a checkpoint tensor name to our parameter name, the index of its part there, and the
    layout change (None, or a function) it takes to get there."""
    target, rows = _part(model, params, name)
    if target is not None:
        return target, rows, None
    parts = _canonical(name).split(".")
    if len(parts) >= 2 and parts[-2] == "experts" and parts[-1] in _STACKED:
        ours, layout = _STACKED[parts[-1]]
        target = ".".join(parts[:-1] + [ours])
        if target in params:
            return target, None, layout
    return None, None, None


def parameter_for(model: torch.nn.Module, params: dict, name: str) -> tuple[str | None, slice | tuple | None]:
    """Where a checkpoint tensor goes in a module named as checkpoints are (a CausalLM, an EAGLE
    head): its parameter among `params` and the rows of it (a merged projection's part); None."""
    return _part(model, params, name)


def _part(model: CausalLM, params: dict, name: str) -> tuple[str | None, slice | tuple | None]:
    key = _canonical(name)
    parts = key.split(".")
    if len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit() and parts[-1] == "weight":
        prefix, expert = ".".join(parts[:-3]), int(parts[-3])  # layers.i.mlp.experts.j.<proj>.weight
        size = model.get_submodule(prefix).intermediate
        if parts[-2] == "down_proj":
            return f"{prefix}.down", (expert,)
        index = ("gate_proj", "up_proj").index(parts[-2]) if parts[-2] in ("gate_proj", "up_proj") else None
        if index is None:
            return None, None
        return f"{prefix}.gate_up", (expert, slice(index * size, (index + 1) * size))
    merged, index = _MERGED.get(parts[-2], (None, 0)) if len(parts) >= 2 else (None, 0)
    prefix = ".".join(parts[:-2])
    module = model.get_submodule(prefix) if merged is not None else None
    if isinstance(module, (Attention, MLP)):  # the layers with merged projections (MLA's q_proj stays its own)
        if merged == "qkv_proj":
            sizes = [module.q_size, module.kv_size, module.kv_size]
        else:
            sizes = [module.gate_up_proj.out_features // 2] * 2
        start = sum(sizes[:index])
        return f"{prefix}.{merged}.{parts[-1]}", slice(start, start + sizes[index])
    if key in params:
        return key, None
    return None, None


def _check_complete(model: CausalLM, args: ModelArgs, loaded: set[str], filled: set[str], params: dict) -> None:
    have = {_canonical(n) for n in loaded}
    if "lm_head.weight" not in have and not args.tie_word_embeddings:
        raise InvalidArgument("model", "checkpoint has no lm_head.weight and does not tie embeddings")
    # A merged projection is whole when the checkpoint has it fused (Phi-3) or has every part;
    # stacked experts when every expert's three are there.
    for i in range(args.num_layers):
        mlp = model.layers[i].mlp
        sparse = isinstance(mlp, SparseMoE)
        stacked = {f"layers.{i}.mlp.experts.{p}" for p in ("gate_up_proj", "down_proj")} <= have  # (gpt-oss's)
        for j in range(args.num_experts if sparse and not stacked else 0):
            for part in ("gate_proj", "up_proj", "down_proj"):
                if f"layers.{i}.mlp.experts.{j}.{part}.weight" not in have:
                    raise InvalidArgument("model", f"checkpoint lacks weight layers.{i}.mlp.experts.{j}.{part}.weight")
        # The MLP with merged projections: the dense one, or a sparse layer's shared expert(s).
        mlps = ([f"mlp.{name}" for name, part in (("shared_expert", mlp.shared_expert),
                                                  ("shared_experts", mlp.shared_experts)) if part is not None]
                if sparse else ["mlp"])
        dense = [(f"{m}.{fused}", tuple(f"{m}.{p}" for p in parts))
                 for m in mlps for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ()))]
        attention = () if args.attention == "mla" else (  # (MLA's parts: every parameter filled, below)
            ("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("self_attn.o_proj", ()))
        for fused, parts in (*attention, *dense):
            has_bias = model.get_submodule(f"layers.{i}.{fused}").bias is not None
            for kind in ("weight", "bias") if has_bias else ("weight",):
                if f"layers.{i}.{fused}.{kind}" in have:
                    continue
                for part in parts or (fused,):
                    if f"layers.{i}.{part}.{kind}" not in have:
                        raise InvalidArgument("model", f"checkpoint lacks weight layers.{i}.{part}.{kind}")
    for name in params:  # the rest (norms, QK-norms, embeddings): nothing starts half-loaded
        if name not in filled and not (name == "lm_head.weight" and args.tie_word_embeddings):
            raise InvalidArgument("model", f"checkpoint lacks weight {name}")
