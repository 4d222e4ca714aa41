"""Quantized checkpoints in the formats their tools publish, made from a float checkpoint, with the
float32 checkpoint of exactly the values they hold (dequantized), for tests and benchmarks.

Each quantized layer of the float checkpoint (the decoder layers' projections and experts; not
routers, embeddings, norms or lm_head) is scaled by a random factor per output row first
(`spread`, for tests of random models), so that channels, groups and blocks get scales of their
own and a reader that picks the wrong one shows; a real model is quantized as it is. The
reference is computed from the stored values (fp16 scales widened, codes and zero points as
stored), never from the original floats.

- "fp8-block": quant_method fp8 (DeepSeek-V3, Qwen3-FP8): float8_e4m3fn `weight`, float32
  `weight_scale_inv` per (bo, bi) block (`block`), partial blocks at the edges.
- "ct-fp8-channel", "ct-fp8-tensor", "ct-fp8-static" (per tensor, with a static `input_scale`),
  "ct-w8a8-int": compressed-tensors float-quantized / int-quantized `weight` and `weight_scale`.
- "ct-w4a16", "ct-w4a16-asym": compressed-tensors pack-quantized, `weight_packed` int32 (eight
  4-bit values, the low bits first, shifted by 8 to unsigned), `weight_scale` per group,
  `weight_shape`, and for asym `weight_zero_point` packed likewise along the rows.
- "gptq-4", "gptq-8", "gptq-4-actorder": GPTQ v1 (`qweight` packed along the input, `qzeros`
  stored minus one, fp16 `scales`, `g_idx`; act-order groups columns by a permutation).
- "awq": AutoAWQ GEMM (`qweight` [in, out / 8] and `qzeros` in AWQ's nibble order, fp16 scales).
- "mxfp4": gpt-oss's experts as `_blocks` / `_scales` (random codes and exponents; the reference
  from transformers' own convert_moe_packed_tensors).
"""
from __future__ import annotations

import json
import os
import re
import shutil

import torch

SCHEMES = ("fp8-block", "ct-fp8-channel", "ct-fp8-tensor", "ct-fp8-static", "ct-w8a8-int", "ct-w4a16",
           "ct-w4a16-asym", "gptq-4", "gptq-8", "gptq-4-actorder", "awq", "mxfp4")
# The layers quantized: decoder projections and per-expert weights (Mixtral's w1/w2/w3 too).
_QUANTIZED = re.compile(r"(^|\.)layers\.\d+\..*(_proj|\.w[123]|_mqa)\.weight$")
_NOT_QUANTIZED = re.compile(r"shared_expert_gate|mlp\.gate\.weight$|\.router\.")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an int32 holds column 8c + _AWQ_ORDER[i]
_FP8_MAX = 448.0


def quantize_checkpoint(float_dir: str, out_dir: str, ref_dir: str, scheme: str, *, group_size: int = 16,
                        block: tuple[int, int] = (32, 16), seed: int = 0, spread: bool = True,
                        lm_head: bool = False) -> tuple[str, str]:
    """Writes out_dir: float_dir's checkpoint in `scheme`'s published format (config.json with its
    quantization_config, the tokenizer's files copied, safetensors sharded as the float one);
    ref_dir: a plain float32 checkpoint transformers loads, every quantized weight replaced by
    exactly the value the quantized one holds; `lm_head`: the LM head quantized too (GPTQ's
    `lm_head: true`). Returns (out_dir, ref_dir)."""
    from safetensors.torch import load_file, save_file

    if scheme not in SCHEMES:
        raise ValueError(f"scheme: {scheme!r} is not one of {', '.join(SCHEMES)}")
    if group_size < 1 or min(block) < 1:
        raise ValueError(f"group_size, block: must be positive, got {group_size}, {block}")
    gen = torch.Generator().manual_seed(seed)
    for d in (out_dir, ref_dir):
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(float_dir, d, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    index_path = os.path.join(float_dir, "model.safetensors.index.json")
    shards = ["model.safetensors"]
    if os.path.isfile(index_path):
        with open(index_path) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    weight_map_q, weight_map_r = {}, {}
    for shard in shards:
        quantized, reference = {}, {}
        for name, w in load_file(os.path.join(float_dir, shard)).items():
            q, ref = _quantize(name, w.float(), scheme, group_size, block, gen if spread else None,
                               lm_head and name == "lm_head.weight")
            quantized.update(q)
            reference.update(ref)
        save_file(quantized, os.path.join(out_dir, shard), metadata={"format": "pt"})
        save_file(reference, os.path.join(ref_dir, shard), metadata={"format": "pt"})
        weight_map_q.update(dict.fromkeys(quantized, shard))
        weight_map_r.update(dict.fromkeys(reference, shard))
    if os.path.isfile(index_path):
        for d, weight_map in ((out_dir, weight_map_q), (ref_dir, weight_map_r)):
            with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = dict(_config(scheme, group_size, block), **({"lm_head": True} if lm_head else {}))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return out_dir, ref_dir


def _quantize(name: str, w: torch.Tensor, scheme: str, group: int, block: tuple[int, int],
              gen: torch.Generator | None, head: bool = False) -> tuple[dict, dict]:
    """(the quantized checkpoint's tensors, the reference's) for one float tensor; `gen`: rows
    spread by random factors (None: as they are)."""
    if scheme == "mxfp4":
        return _mxfp4(name, w, gen or torch.Generator().manual_seed(0))
    if not head and (w.dim() != 2 or not _QUANTIZED.search(name) or _NOT_QUANTIZED.search(name)):
        return {name: w.contiguous()}, {name: w.contiguous()}
    if gen is not None:
        w = w * (0.5 + torch.rand(w.shape[0], 1, generator=gen))  # rows of their own scale
    else:
        gen = torch.Generator().manual_seed(0)  # (act-order's permutation)
    module = name.removesuffix(".weight")
    out, cols = w.shape
    if scheme == "fp8-block":
        scale = _block_amax(w, block) / _FP8_MAX
        q = (w / _spread(scale, block, out, cols)).to(torch.float8_e4m3fn)
        return ({name: q, f"{module}.weight_scale_inv": scale},
                {name: q.float() * _spread(scale, block, out, cols)})
    if scheme.startswith("ct-fp8"):
        per_tensor = scheme != "ct-fp8-channel"
        scale = (w.abs().amax() if per_tensor else w.abs().amax(dim=1, keepdim=True)) / _FP8_MAX
        scale = scale.reshape(1) if per_tensor else scale
        q = (w / scale.reshape(-1, 1)).to(torch.float8_e4m3fn)
        tensors = {name: q, f"{module}.weight_scale": scale}
        if scheme == "ct-fp8-static":
            tensors[f"{module}.input_scale"] = torch.tensor([0.02])
        return tensors, {name: q.float() * scale.reshape(-1, 1)}
    if scheme == "ct-w8a8-int":
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
        return {name: q, f"{module}.weight_scale": scale}, {name: q.float() * scale}
    bits = 8 if scheme == "gptq-8" else 4
    if cols % group:
        raise ValueError(f"group_size: {group} does not divide {name}'s {cols} input columns")
    symmetric = scheme in ("ct-w4a16", "gptq-4", "gptq-8", "gptq-4-actorder")
    g_idx = torch.arange(cols) // group
    if scheme == "gptq-4-actorder":  # act-order: columns grouped by a permutation (GPTQ's desc_act)
        g_idx = torch.argsort(torch.randperm(cols, generator=gen)) // group
    codes, scales, zeros = _int_quantize(w, g_idx, cols // group, bits, symmetric)
    scales = scales.half() if not scheme.startswith("ct-") else scales
    ref = (codes.float() - zeros.float()[:, g_idx]) * scales.float()[:, g_idx]
    if scheme.startswith("ct-"):
        tensors = {f"{module}.weight_packed": _pack_int32(codes, bits, dim=1),
                   f"{module}.weight_scale": scales, f"{module}.weight_shape": torch.tensor([out, cols])}
        if not symmetric:
            tensors[f"{module}.weight_zero_point"] = _pack_int32(zeros, bits, dim=0)
        return tensors, {name: ref}
    if scheme == "awq":
        return ({f"{module}.qweight": _awq_pack(codes.T.contiguous()), f"{module}.qzeros": _awq_pack(zeros.T),
                 f"{module}.scales": scales.T.contiguous()}, {name: ref})
    return ({f"{module}.qweight": _pack_int32(codes.T, bits, dim=0),  # GPTQ v1: zero points stored minus one
             f"{module}.qzeros": _pack_int32((zeros.T - 1) & ((1 << bits) - 1), bits, dim=1),
             f"{module}.scales": scales.T.contiguous(), f"{module}.g_idx": g_idx.to(torch.int32)}, {name: ref})


def _int_quantize(w: torch.Tensor, g_idx: torch.Tensor, groups: int, bits: int, symmetric: bool):
    """Codes [out, in] (0 .. 2^bits - 1), scales and zero points [out, groups]."""
    top = (1 << bits) - 1
    columns = [w[:, g_idx == g] for g in range(groups)]
    if symmetric:
        scales = torch.stack([c.abs().amax(dim=1) for c in columns], dim=1) / (top // 2)
        zeros = torch.full(scales.shape, (top + 1) // 2, dtype=torch.int32)
    else:
        low = torch.stack([c.amin(dim=1).clamp(max=0) for c in columns], dim=1)
        high = torch.stack([c.amax(dim=1).clamp(min=0) for c in columns], dim=1)
        scales = (high - low).clamp(min=1e-8) / top
        zeros = torch.round(-low / scales).clamp(0, top).to(torch.int32)
    codes = torch.round(w / scales[:, g_idx]) + zeros[:, g_idx]
    return codes.clamp(0, top).to(torch.int32), scales, zeros


def _pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values packed 32 // bits to an int32 along `dim`, the low bits first."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    pad = -v.shape[-1] % per
    v = torch.nn.functional.pad(v, (0, pad)).reshape(*v.shape[:-1], -1, per)
    packed = (v << (torch.arange(per) * bits)).sum(dim=-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def _awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[rows, n] 4-bit values as AWQ's int32s [rows, n / 8]: nibble i holds column 8c + order[i]."""
    rows, n = values.shape
    grouped = values.to(torch.int64).reshape(rows, n // 8, 8)[..., list(_AWQ_ORDER)]
    packed = (grouped << (torch.arange(8) * 4)).sum(dim=-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bo, bi = block
    out, cols = w.shape
    padded = torch.nn.functional.pad(w.abs(), (0, -cols % bi, 0, -out % bo))
    grid = padded.reshape(-(-out // bo), bo, -(-cols // bi), bi).amax(dim=(1, 3))
    return grid.clamp(min=1e-8)


def _spread(grid: torch.Tensor, block: tuple[int, int], out: int, cols: int) -> torch.Tensor:
    return grid.repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :cols]


def _mxfp4(name: str, w: torch.Tensor, gen: torch.Generator) -> tuple[dict, dict]:
    """gpt-oss's stacked experts ([experts, in, out]) as random MXFP4 codes and exponents."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return {name: w.contiguous()}, {name: w.contiguous()}
    experts, rows_in, rows_out = w.shape
    if rows_in % 32:
        raise ValueError(f"scheme: mxfp4 takes blocks of 32 inputs, {name} has {rows_in}")
    blocks = torch.randint(0, 256, (experts, rows_out, rows_in // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(122, 127, (experts, rows_out, rows_in // 32), generator=gen, dtype=torch.uint8)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
    return {f"{name}_blocks": blocks, f"{name}_scales": scales}, {name: ref}


def _config(scheme: str, group: int, block: tuple[int, int]) -> dict:
    if scheme == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}
    if scheme == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp"
                                                                    ".router", "model.embed_tokens", "lm_head"]}
    if scheme.startswith("gptq"):
        return {"quant_method": "gptq", "bits": 8 if scheme == "gptq-8" else 4, "group_size": group,
                "desc_act": scheme == "gptq-4-actorder", "sym": True, "checkpoint_format": "gptq"}
    if scheme == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": "channel" if scheme == "ct-fp8-channel" else "tensor"}
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    fmt = "float-quantized"
    if scheme == "ct-fp8-static":
        activations = dict(activations, dynamic=False, strategy="tensor")
    if scheme == "ct-w8a8-int":
        weights = dict(weights, type="int", strategy="channel")
        activations, fmt = dict(activations, type="int"), "int-quantized"
    if scheme.startswith("ct-w4a16"):
        weights = {"num_bits": 4, "type": "int", "symmetric": scheme == "ct-w4a16", "dynamic": False,
                   "strategy": "group", "group_size": group}
        activations, fmt = None, "pack-quantized"
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
            "ignore": ["lm_head"]}
