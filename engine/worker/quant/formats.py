"""The quantized checkpoint formats Baton reads, each from config.json's `quantization_config` as
transformers and vLLM read it, and each layer's tensors of that format turned into a weight of
weights.py, its bytes kept (4-bit codes repacked two to a byte, the row-major layout every
reader here shares):

- "fp8": block FP8 (DeepSeek-V3/R1, Qwen3-FP8): float8 `weight` [out, in] and float32
  `weight_scale_inv` [ceil(out / bo), ceil(in / bi)] multiplying each block; without
  weight_block_size, one `weight_scale` per tensor.
- "compressed-tensors" (llm-compressor): "float-quantized" FP8 and "int-quantized" INT8 `weight`
  with `weight_scale` per tensor, channel, group or block, and "pack-quantized" INT4/INT8
  `weight_packed` (int32, eight 4-bit values each, the low bits first, shifted to unsigned) with
  `weight_scale` per group and, asymmetric, `weight_zero_point` packed likewise along the rows.
- "gptq" (AutoGPTQ, GPTQModel): `qweight` int32 [in * bits / 32, out] packed along the input,
  `qzeros` [groups, out * bits / 32] (format v1 stores zero - 1), `scales` [groups, out],
  `g_idx` [in] (act-order's groups).
- "awq" (AutoAWQ GEMM): `qweight` int32 [in, out / 8] and `qzeros` [groups, out / 8], eight
  values each in AWQ's order (0, 2, 4, 6, 1, 3, 5, 7), `scales` [groups, out].
- "mxfp4" (gpt-oss): the experts' `<proj>_blocks` and `<proj>_scales`.

Which layers are quantized is what the checkpoint holds: a layer with its format's tensors is
read quantized, one with a float `weight` (an ignored module, the router, lm_head) as usual.
"""
from __future__ import annotations

import re

import torch

from baton.engine.common.errors import InvalidArgument, check
from baton.engine.worker.quant.weights import FP8_DTYPES, FP8Weight, IntWeight, MXFP4Weight, QuantizedWeight

_FIELD = "quantization_config"


class CheckpointFormat:
    """One quantization method's reader. `fields`: the tensor names (after the module's) it
    takes; a `weight` only where its dtype is the format's."""
    method: str
    fields: frozenset[str] = frozenset()
    weight_dtypes: tuple[torch.dtype, ...] = ()

    def split(self, name: str, tensor: torch.Tensor) -> tuple[str, str] | None:
        """(module, field) where a checkpoint tensor is one of this format's, else None."""
        module, _, field = name.rpartition(".")
        if field in self.fields or (field == "weight" and tensor.dtype in self.weight_dtypes):
            return module, field
        return None

    def read(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        raise NotImplementedError

    def describe(self) -> str:
        return self.method


def checkpoint_format(config: dict) -> CheckpointFormat | None:
    """The reader of a checkpoint's quantization_config (None: not quantized); an unknown or
    unsupported setting is refused naming quantization_config.<field>."""
    q = config.get(_FIELD)
    if q is None:
        return None
    check(isinstance(q, dict), _FIELD, "must be an object")
    method = q.get("quant_method")
    reader = _FORMATS.get(method)
    check(reader is not None, f"{_FIELD}.quant_method", f"{method!r} is not supported ({', '.join(_FORMATS)})")
    return reader(q)


def _need(tensors: dict[str, torch.Tensor], module: str, field: str) -> torch.Tensor:
    t = tensors.get(field)
    if t is None:
        raise InvalidArgument("model", f"checkpoint lacks {module}.{field} (quantized {module} needs it)")
    return t


def _shaped(t: torch.Tensor, want: tuple[int, ...], module: str, field: str) -> torch.Tensor:
    if tuple(t.shape) != want:
        raise InvalidArgument("model", f"{module}.{field} has shape {tuple(t.shape)}, its format needs {want}")
    return t


def _positive_int(q: dict, key: str, default=None, allowed: tuple[int, ...] | None = None) -> int:
    value = q.get(key, default)
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    choices = ", ".join(map(str, allowed)) if allowed else "a positive integer"
    check(ok and (allowed is None or value in allowed), f"{_FIELD}.{key}", f"{value!r} is not supported ({choices})")
    return value


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, count: int) -> torch.Tensor:
    """Values of `bits` packed into int32s along `dim`, the low bits first: uint8 codes, `count`
    of them along `dim`."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    moved = packed.movedim(dim, -1)
    codes = ((moved[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)[..., :count]
    return codes.to(torch.uint8).movedim(-1, dim).contiguous()


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [out, in] as IntWeight keeps them: 4-bit two to a byte (the low nibble the
    even column; an odd last column padded), 8-bit as they are."""
    if bits == 8:
        return codes.contiguous()
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


class FP8Block(CheckpointFormat):
    method = "fp8"
    fields = frozenset({"weight_scale_inv", "weight_scale", "input_scale"})
    weight_dtypes = FP8_DTYPES

    def __init__(self, q: dict):
        block = q.get("weight_block_size")
        check(block is None or (isinstance(block, list) and len(block) == 2
                                and all(isinstance(b, int) and b > 0 for b in block)),
              f"{_FIELD}.weight_block_size", f"{block!r} is not [rows, columns] of positive integers")
        self.block = None if block is None else tuple(block)
        scheme = q.get("activation_scheme", "dynamic")
        check(scheme in ("dynamic", "static"), f"{_FIELD}.activation_scheme", f"{scheme!r} is not dynamic or static")
        fmt = q.get("fmt", "e4m3")
        check(fmt in ("e4m3", "e5m2", "float8_e4m3fn"), f"{_FIELD}.fmt", f"{fmt!r} is not e4m3 or e5m2")

    def read(self, module, tensors):
        weight = _need(tensors, module, "weight")
        out, cols = weight.shape
        if self.block is None:  # one scale for the tensor
            scale = _need(tensors, module, "weight_scale")
            check(scale.numel() == 1, "model", f"{module}.weight_scale has {scale.numel()} values; per tensor, one")
            return FP8Weight(weight, scale.reshape(1, 1), (out, cols))
        bo, bi = self.block
        scale = _shaped(_need(tensors, module, "weight_scale_inv"), (-(-out // bo), -(-cols // bi)), module,
                        "weight_scale_inv")
        return FP8Weight(weight, scale, self.block)

    def describe(self):
        return "fp8 " + (f"block {self.block[0]}x{self.block[1]}" if self.block else "per tensor")


class CompressedTensors(CheckpointFormat):
    method = "compressed-tensors"
    fields = frozenset({"weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
                        "input_scale", "input_zero_point"})
    weight_dtypes = (*FP8_DTYPES, torch.int8)
    _FORMATS = ("float-quantized", "int-quantized", "pack-quantized", "naive-quantized")
    _STRATEGIES = ("tensor", "channel", "group", "block")

    def __init__(self, q: dict):
        self.format = q.get("format")
        groups = q.get("config_groups")
        check(isinstance(groups, dict) and groups, f"{_FIELD}.config_groups", "must name at least one group")
        self.groups = [(name, self._weights(name, group)) for name, group in groups.items()]

    def _weights(self, name: str, group: dict) -> dict:
        field = f"{_FIELD}.config_groups.{name}"
        check(isinstance(group, dict) and isinstance(group.get("weights"), dict), f"{field}.weights",
              "must be an object (the weights' quantization)")
        w = dict(group["weights"], targets=group.get("targets", ["Linear"]), format=group.get("format", self.format))
        check(w["format"] in self._FORMATS, f"{field}.format", f"{w['format']!r} is not supported "
                                                               f"({', '.join(self._FORMATS)})")
        check(w.get("type", "int") in ("int", "float"), f"{field}.weights.type", f"{w.get('type')!r} is not int or "
                                                                                 f"float")
        bits = w.get("num_bits")
        allowed = (8,) if w.get("type") == "float" else (4, 8)
        check(bits in allowed, f"{field}.weights.num_bits", f"{bits!r} is not supported for {w.get('type', 'int')} "
                                                            f"weights ({', '.join(map(str, allowed))})")
        strategy = w.get("strategy", "tensor")
        check(strategy in self._STRATEGIES, f"{field}.weights.strategy",
              f"{strategy!r} is not supported ({', '.join(self._STRATEGIES)})")
        if strategy == "group":
            check(isinstance(w.get("group_size"), int) and w["group_size"] > 0, f"{field}.weights.group_size",
                  f"{w.get('group_size')!r} is not a positive integer")
        if strategy == "block":
            b = w.get("block_structure")
            check(isinstance(b, list) and len(b) == 2 and all(isinstance(x, int) and x > 0 for x in b),
                  f"{field}.weights.block_structure", f"{b!r} is not [rows, columns]")
        return w

    def _args(self, module: str) -> dict:
        for _, w in self.groups:
            if any(_targets(t, module) for t in w["targets"]):
                return w
        raise InvalidArgument("model", f"{module} is quantized but no {_FIELD}.config_groups target names it")

    def read(self, module, tensors):
        args = self._args(module)
        if "weight_packed" in tensors:
            return self._packed(module, tensors, args)
        weight = _need(tensors, module, "weight")
        out, cols = weight.shape
        scale = _need(tensors, module, "weight_scale")
        if weight.dtype in FP8_DTYPES:
            block = self._block(args, out, cols)
            return FP8Weight(weight, _shaped(scale.reshape(-1, scale.shape[-1]) if scale.dim() else scale.reshape(1, 1),
                                             (-(-out // block[0]), -(-cols // block[1])), module, "weight_scale"),
                             block)
        check(args["strategy"] != "block", "model", f"{module}: int8 weights in blocks are not supported")
        codes = (weight.to(torch.int16) + 128).to(torch.uint8)  # signed, as unsigned codes around 128
        group = self._block(args, out, cols)[1]
        scales = _shaped(scale.reshape(1, 1).expand(out, 1) if scale.numel() == 1 else scale,
                         (out, -(-cols // group)), module, "weight_scale")
        zeros = tensors.get("weight_zero_point")
        if zeros is not None:
            zeros = (zeros.to(torch.int16) + 128).to(torch.uint8).reshape(-1, scales.shape[1]).expand(out, -1)
        return IntWeight(codes, scales, zeros, 128, 8, group)

    def _packed(self, module, tensors, args):
        bits = args["num_bits"]
        out, cols = (int(x) for x in _need(tensors, module, "weight_shape").tolist())
        packed = _shaped(_need(tensors, module, "weight_packed"), (out, -(-cols * bits // 32)), module,
                         "weight_packed")
        codes = unpack_int32(packed, bits, 1, cols)
        group = self._block(args, out, cols)[1]
        check(args["strategy"] != "group" or cols % group == 0, f"{_FIELD}.config_groups.*.weights.group_size",
              f"{group} does not divide {module}'s {cols} input columns")
        scales = _shaped(_need(tensors, module, "weight_scale"), (out, -(-cols // group)), module, "weight_scale")
        zeros = None
        if not args.get("symmetric", True):
            zp = _need(tensors, module, "weight_zero_point")
            zeros = unpack_int32(zp, bits, 0, out)
            _shaped(zeros, tuple(scales.shape), module, "weight_zero_point")
        g_idx = tensors.get("weight_g_idx")
        return IntWeight(pack_codes(codes, bits), scales, zeros, 1 << (bits - 1), bits, group,
                         _nontrivial(g_idx, group), cols)

    @staticmethod
    def _block(args: dict, out: int, cols: int) -> tuple[int, int]:
        """The (rows, columns) each scale covers."""
        strategy = args["strategy"]
        if strategy == "tensor":
            return out, cols
        if strategy == "channel":
            return 1, cols
        if strategy == "group":
            return 1, args["group_size"]
        return tuple(args["block_structure"])

    def describe(self):
        return "compressed-tensors " + ", ".join(f"{w['format']} {w.get('type', 'int')}{w['num_bits']} "
                                                 f"{w.get('strategy', 'tensor')}" for _, w in self.groups)


def _targets(target: str, module: str) -> bool:
    """compressed-tensors' matching of a config group's target: a class name (only Linear layers
    are quantized here), "re:<pattern>" on the module's name, or its name (or last part)."""
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return module == target or module.endswith("." + target)


def _nontrivial(g_idx: torch.Tensor | None, group: int) -> torch.Tensor | None:
    """An act-order g_idx, or None where it is the plain column // group_size."""
    if g_idx is None:
        return None
    plain = torch.arange(g_idx.numel(), dtype=g_idx.dtype) // group
    return None if torch.equal(g_idx, plain) else g_idx.to(torch.int32).contiguous()


class GPTQ(CheckpointFormat):
    method = "gptq"
    fields = frozenset({"qweight", "qzeros", "scales", "g_idx"})

    def __init__(self, q: dict):
        self.bits = _positive_int(q, "bits", allowed=(4, 8))
        size = q.get("group_size", 128)
        check(isinstance(size, int) and (size == -1 or size > 0), f"{_FIELD}.group_size",
              f"{size!r} is not a positive integer or -1")
        self.group_size = size
        fmt = q.get("checkpoint_format", "gptq")
        check(fmt in ("gptq", "gptq_v2"), f"{_FIELD}.checkpoint_format", f"{fmt!r} is not gptq or gptq_v2")
        self.zero_offset = 1 if fmt == "gptq" else 0  # v1 stores each zero point minus one
        self.desc_act = bool(q.get("desc_act", False))

    def read(self, module, tensors):
        qweight = _need(tensors, module, "qweight")
        cols, out = qweight.shape[0] * 32 // self.bits, qweight.shape[1]
        group = cols if self.group_size == -1 else self.group_size
        check(cols % group == 0, f"{_FIELD}.group_size", f"{group} does not divide {module}'s {cols} input columns")
        groups = cols // group
        codes = unpack_int32(qweight, self.bits, 0, cols).T
        scales = _shaped(_need(tensors, module, "scales"), (groups, out), module, "scales").T.contiguous()
        qzeros = _shaped(_need(tensors, module, "qzeros"), (groups, -(-out * self.bits // 32)), module, "qzeros")
        zeros = (unpack_int32(qzeros, self.bits, 1, out).to(torch.int16) + self.zero_offset).T
        g_idx = tensors.get("g_idx")
        if g_idx is not None:
            _shaped(g_idx, (cols,), module, "g_idx")
            check(int(g_idx.min()) >= 0 and int(g_idx.max()) < groups, "model",
                  f"{module}.g_idx names groups outside 0..{groups - 1}")
        return IntWeight(pack_codes(codes, self.bits), scales, zeros, 0, self.bits, group, _nontrivial(g_idx, group),
                         cols)

    def describe(self):
        return f"gptq int{self.bits} group {self.group_size}" + (" act-order" if self.desc_act else "")


_AWQ_ORDER = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # column j of eight is the (this)th nibble


class AWQ(CheckpointFormat):
    method = "awq"
    fields = frozenset({"qweight", "qzeros", "scales"})

    def __init__(self, q: dict):
        self.bits = _positive_int(q, "bits", allowed=(4,))
        self.group_size = _positive_int(q, "group_size", 128)
        version = str(q.get("version", "gemm")).lower()
        check(version == "gemm", f"{_FIELD}.version", f"{q.get('version')!r} is not supported (gemm)")
        check(q.get("zero_point", True) is True, f"{_FIELD}.zero_point", "only AWQ with zero points is supported")

    def read(self, module, tensors):
        qweight = _need(tensors, module, "qweight")
        cols, out = qweight.shape[0], qweight.shape[1] * 8
        check(cols % self.group_size == 0, f"{_FIELD}.group_size",
              f"{self.group_size} does not divide {module}'s {cols} input columns")
        groups = cols // self.group_size
        codes = _awq_unpack(qweight).T
        zeros = _awq_unpack(_shaped(_need(tensors, module, "qzeros"), (groups, out // 8), module, "qzeros")).T
        scales = _shaped(_need(tensors, module, "scales"), (groups, out), module, "scales").T.contiguous()
        return IntWeight(pack_codes(codes, 4), scales, zeros.contiguous(), 0, 4, self.group_size)

    def describe(self):
        return f"awq int4 group {self.group_size}"


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's int32s [rows, n / 8] as uint8 codes [rows, n], undoing its interleaved order."""
    nibbles = unpack_int32(packed, 4, 1, packed.shape[1] * 8).view(packed.shape[0], -1, 8)
    return nibbles[..., _AWQ_ORDER].flatten(1)


class MXFP4(CheckpointFormat):
    method = "mxfp4"

    def __init__(self, q: dict):
        pass

    def split(self, name, tensor):
        for suffix in ("_blocks", "_scales"):
            if name.endswith(suffix):
                return name.removesuffix(suffix), suffix[1:]
        return None

    def read(self, module, tensors):
        for half in ("blocks", "scales"):
            check(half in tensors, "model", f"checkpoint has {module}_{'blocks' if half == 'scales' else 'scales'} "
                                            f"without its other MXFP4 half {module}_{half}")
        blocks, scales = tensors["blocks"], tensors["scales"]
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
            raise InvalidArgument("model", f"MXFP4 {module}_blocks {tuple(blocks.shape)} {blocks.dtype} do not go "
                                           f"with its scales {tuple(scales.shape)} {scales.dtype} (uint8 [..., G, 16] "
                                           f"and [..., G])")
        return MXFP4Weight(blocks, scales)


_FORMATS = {cls.method: cls for cls in (FP8Block, CompressedTensors, GPTQ, AWQ, MXFP4)}
