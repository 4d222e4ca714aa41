"""Putting a checkpoint's quantized weights where the model's float ones were: a projection's
checkpoint tensors (q, k and v; gate and up; or one fused) become the parts of a
QuantizedLinear, each expert's become one ExpertStack per projection. Everything is checked
before anything is replaced: parts that leave rows of a layer uncovered, shapes that do not fit,
an expert missing, are refused naming the layer.

MLA's kv_b_proj is the exception: its absorbed decode reads the weight itself (W_UK, W_UV), so it
is dequantized once here, as vLLM does (rank x heads x (nope + v): small).
"""
from __future__ import annotations

import torch
from torch import nn

from baton.engine.common.errors import InvalidArgument
from baton.engine.worker.models.basic import Linear
from baton.engine.worker.models.mla import MLAttention
from baton.engine.worker.models.moe import Experts
from baton.engine.worker.quant.linear import ExpertStack, QuantizedLinear, dequantized
from baton.engine.worker.quant.weights import QuantizedWeight


class QuantizedPlacement:
    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.model, self.dtype = model, dtype
        self.linears: dict[str, list[tuple[int, QuantizedWeight]]] = {}  # a Linear's path -> (first row, part)
        # (an Experts' path, its parameter, part: 0 the gate or the whole, 1 up) -> expert -> weight; -1: all
        self.experts: dict[tuple[str, str, int], dict[int, QuantizedWeight]] = {}

    def add(self, path: str, rows: slice | tuple | None, weight: QuantizedWeight) -> None:
        """`weight` for the parameter at `path` (a Linear, or an Experts' gate_up / down), at
        `rows` as the loader maps a float tensor there (a slice of a merged projection's rows;
        (expert, slice) or (expert,) of stacked experts; None: the whole)."""
        owner, _, param = path.rpartition(".")
        if isinstance(self.model.get_submodule(owner), Experts):
            expert, part = -1, 0
            if rows is not None:
                expert = rows[0]
                part = 0 if len(rows) == 1 else rows[1].start // self.model.get_submodule(owner).intermediate
            self.experts.setdefault((owner, param, part), {})[expert] = weight
            return
        start = 0 if rows is None else rows.start
        self.linears.setdefault(owner if param == "weight" else path, []).append((start, weight))

    def add_stacked(self, path: str, parts: list[QuantizedWeight]) -> None:
        """An Experts' parameter at `path` from stacks of every expert, its parts in order (gpt-oss's
        gate and up, read from one interleaved tensor)."""
        owner, _, param = path.rpartition(".")
        for part, weight in enumerate(parts):
            self.experts.setdefault((owner, param, part), {})[-1] = weight

    def install(self) -> None:
        replacements = [self._linear(path, parts) for path, parts in self.linears.items()]
        replacements += self._expert_stacks()
        for path, module in replacements:  # (only once every layer was checked)
            owner, _, name = path.rpartition(".")
            parent = self.model.get_submodule(owner)
            if isinstance(module, ExpertStack):  # in place of a parameter, which torch keeps a module from taking
                delattr(parent, name)
            setattr(parent, name, module)
        for module in self.model.modules():
            if isinstance(module, MLAttention) and isinstance(module.kv_b_proj, QuantizedLinear):
                module.kv_b_proj = self._dequantized(module.kv_b_proj)

    def _linear(self, path: str, parts: list[tuple[int, QuantizedWeight]]) -> tuple[str, QuantizedLinear]:
        linear = self.model.get_submodule(path)
        parts.sort(key=lambda p: p[0])
        row = 0
        for start, part in parts:
            if start != row or part.in_features != linear.in_features:
                raise InvalidArgument("model", f"{path}: quantized parts do not make its [{linear.out_features}, "
                                               f"{linear.in_features}] weight (a part of {part.out_features} x "
                                               f"{part.in_features} at row {start}); every part of a merged "
                                               f"projection must be quantized alike")
            row += part.out_features
        if row != linear.out_features:
            raise InvalidArgument("model", f"{path}: quantized parts cover {row} of its {linear.out_features} rows")
        layer = QuantizedLinear([p for _, p in parts], None if linear.bias is None else linear.bias.data)
        return path, layer

    def _expert_stacks(self) -> list[tuple[str, ExpertStack]]:
        by_param: dict[tuple[str, str], list[QuantizedWeight]] = {}
        for (owner, param, _), weights in sorted(self.experts.items(), key=lambda item: item[0]):
            num = self.model.get_parameter(f"{owner}.{param}").shape[0]
            if -1 in weights:  # stacked in the checkpoint (gpt-oss)
                stack = weights[-1]
            else:
                missing = sorted(set(range(num)) - set(weights))
                if missing:
                    raise InvalidArgument("model", f"{owner}: expert {missing[0]}'s {param} is not quantized like "
                                                   f"the others (or missing)")
                stack = weights[0].stacked([weights[e] for e in range(1, num)])
            by_param.setdefault((owner, param), []).append(stack)
        stacks = []
        for (owner, param), parts in by_param.items():
            want = tuple(self.model.get_parameter(f"{owner}.{param}").shape)
            stack = ExpertStack(parts, self.dtype)
            if stack.shape != want:
                raise InvalidArgument("model", f"{owner}.{param}: the quantized experts make {stack.shape}, "
                                               f"the model needs {want}")
            stacks.append((f"{owner}.{param}", stack))
        return stacks

    def _dequantized(self, layer: QuantizedLinear) -> Linear:
        weight = dequantized(list(layer.parts)).to(self.dtype)
        linear = Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, dtype=self.dtype)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if layer.bias is not None:
            linear.bias = layer.bias
        return linear
