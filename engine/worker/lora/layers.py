"""Batched LoRA in the forward pass: requests of different adapters and of the base model
share one step. Each merged projection of the model is wrapped: it runs the base matmul over
all rows, then, per adapter present in the step, one shrink (x @ A) and one expand (@ B)
matmul over that adapter's rows, added in place (SGMV's segmentation, done with torch ops).

The runner orders rows by adapter (within decodes, and within prompt chunks), so each adapter's
rows are at most two ranges of the batch, taken as views; the PyTorch reference attention keeps
its own order (longest context first), and there scattered rows are gathered by index.

Why per adapter and not per row (BGMV's gather of each row's A and B): on a CPU the gather
copies in*rank + rank*out values per row per projection, more memory traffic than the base
matmul's compute at small models; per-adapter matmuls read each adapter's weights once per
step. The rows are never split into forward passes: attention, norms and the base
projections run once over the whole batch.

A decode step replayed as a CUDA graph (cuda_graphs.py) cannot choose its matmuls by the step's
adapters, so with graphs on the device slots are stacks (`use_stacks`): per projection one A of
every slot side by side [in, slots*w] and one B [slots*w, out] (w: the projection's parts times
max_lora_rank, an adapter of lower rank zero-padded, its scaling folded into B). A graphed step
computes every row's delta as ((x @ A) masked to the columns of its row's slot) @ B, from a
persistent row -> slot buffer (-1: the base model, or padding): the slots' weights read once, the
mask's waste (slots - 1 of every slot's rank columns) small beside the base matmul. Eager steps
then use views of the stacks.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from baton.engine.worker.lora.adapter import PROJECTIONS, LoRAWeights
from baton.engine.worker.parallel.tensor_parallel import RowParallelLinear


@dataclass(slots=True)
class LoRABatch:
    """The step's adapters: each one's rows, as ranges of the batch (the runner puts an adapter's
    rows together) or as an index tensor where they are scattered, and its weights."""
    groups: list[tuple[list[tuple[int, int]] | torch.Tensor, LoRAWeights]] = field(default_factory=list)


_MAX_RANGES = 2  # an adapter's decode rows and its prompt rows; more scattered ranges: one gather instead


class LoRALinear(nn.Module):
    """A projection plus the deltas of the step's adapters."""

    def __init__(self, base: nn.Linear, layer: int, name: str, state: LoRASlots):
        super().__init__()
        self.base, self.layer, self.name, self.state = base, layer, name, state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A row-parallel projection (tensor parallelism): the deltas join this rank's partial
        # sum, which the ranks then add up (x here is this rank's share of the input).
        row_parallel = isinstance(self.base, RowParallelLinear)
        y = self.base.partial(x) if row_parallel else self.base(x)
        state = self.state
        if state.batch is not None:
            self._add_deltas(x, y, state.batch)
        elif state.row_slots is not None:  # a graphed step: every slot's columns, masked by row
            a, b = state.stacks[self.layer, self.name]
            y.add_((x @ a).mul_(state.row_mask(a.shape[1])) @ b)
        return self.base.reduce(y) if row_parallel else y

    def _add_deltas(self, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> None:
        for rows, weights in batch.groups:
            ab = weights.layers[self.layer].get(self.name)
            if ab is None:  # this adapter leaves this projection alone
                continue
            a, b = ab
            if isinstance(rows, list):  # views: no copy in or out
                for start, end in rows:
                    y[start:end].addmm_(x[start:end] @ a, b, alpha=weights.scaling)
            else:
                y.index_add_(0, rows, x.index_select(0, rows) @ a @ b, alpha=weights.scaling)


class LoRASlots:
    """The adapters on the engine's device: at most `max_loras` (the scheduler never puts more in
    one step), the least recently used idle one replaced when another is needed. Host copies
    come from `host_weights(adapter_id)` (the registry's, bounded by max_cpu_loras)."""

    def __init__(self, max_loras: int, host_weights: Callable[[int], LoRAWeights], device: torch.device,
                 dtype: torch.dtype):
        self.max_loras = max_loras
        self.host_weights = host_weights
        self.device, self.dtype = device, dtype
        self.resident: OrderedDict[int, LoRAWeights] = OrderedDict()  # adapter id -> device weights, LRU first
        self.batch: LoRABatch | None = None  # this step's, while the model runs
        self.num_loads = 0
        # With use_stacks (CUDA graphs): per (layer, projection) the stacked A and B, the slot each
        # resident adapter fills, each row's slot in a graphed step, and that step's column masks.
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.slot_of: dict[int, int] = {}
        self.row_slots: torch.Tensor | None = None
        self._masks: dict[int, torch.Tensor] = {}
        self.wrapped: list[tuple[int, str]] = []  # the projections attach wrapped
        # Under tensor parallelism, per (layer, projection): the rows of A (a row-parallel
        # projection's input columns) and the columns of B (a split projection's output rows)
        # this rank keeps; None where it keeps them all.
        self.shares: dict[tuple[int, str], tuple[slice | None, torch.Tensor | None]] = {}

    def attach(self, model: nn.Module) -> None:
        """Wrap every merged projection of the model (a mixture of experts' layer has none in its
        MLP), after any tensor-parallel split: an adapter is then split as each projection is."""
        for i, layer in enumerate(model.layers):
            for name in PROJECTIONS:
                parent = layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp
                if hasattr(parent, name):
                    base = getattr(parent, name)
                    share = ((base.columns, None) if isinstance(base, RowParallelLinear)
                             else (None, base.kept_rows))
                    if share != (None, None):
                        self.shares[i, name] = share
                    setattr(parent, name, LoRALinear(base, i, name, self))
                    self.wrapped.append((i, name))

    def use_stacks(self, shapes: dict[str, tuple[int, int]], max_rank: int) -> None:
        """Keep the device slots as stacks (see the module's docstring), for CUDA graphs: `shapes`,
        each merged projection's whole (in, out) features (adapter.part_shapes)."""
        self.resident.clear()
        for i, name in self.wrapped:
            (whole_in, whole_out), width = shapes[name], len(PROJECTIONS[name]) * max_rank
            rows, columns = self.shares.get((i, name), (None, None))
            n_in = whole_in if rows is None else len(range(whole_in)[rows])
            n_out = whole_out if columns is None else len(columns)
            self.stacks[i, name] = (torch.zeros(n_in, self.max_loras * width, dtype=self.dtype, device=self.device),
                                    torch.zeros(self.max_loras * width, n_out, dtype=self.dtype, device=self.device))

    def graph_rows(self, spans: list[tuple[int, int, int]], rows: int) -> list[int]:
        """A graphed step's row -> slot (-1: the base model) from its rows' adapter spans (as
        `prepare` takes them), each adapter made resident first."""
        in_step = {adapter_id for adapter_id, _, _ in spans if adapter_id}
        if len(in_step) > self.max_loras:
            raise RuntimeError(f"{len(in_step)} adapters in one step, max_loras is {self.max_loras}")
        slots = [-1] * rows
        for adapter_id, start, end in spans:
            if adapter_id:
                self._resident(adapter_id, in_step)
                slots[start:end] = [self.slot_of[adapter_id]] * (end - start)
        return slots

    def use_rows(self, row_slots: torch.Tensor | None) -> None:
        """The forward that follows is a graphed step's (None: an eager one, after `prepare`)."""
        self.row_slots, self._masks = row_slots, {}
        if row_slots is not None:
            self.batch = None

    def row_mask(self, columns: int) -> torch.Tensor:
        """[rows, columns]: 1 where a column of the stack is the row's slot's (each slot columns // max_loras)."""
        mask = self._masks.get(columns)
        if mask is None:
            owner = torch.arange(columns, device=self.device) // (columns // self.max_loras)
            mask = self._masks[columns] = (owner[None, :] == self.row_slots[:, None]).to(self.dtype)
        return mask

    def _split(self, weights: LoRAWeights) -> LoRAWeights:
        """This rank's part of an adapter (the whole adapter without tensor parallelism)."""
        if not self.shares:
            return weights
        layers = []
        for i, layer in enumerate(weights.layers):
            kept = {}
            for name, (a, b) in layer.items():
                rows, columns = self.shares.get((i, name), (None, None))
                kept[name] = (a if rows is None else a[rows], b if columns is None else b[:, columns])
            layers.append(kept)
        return LoRAWeights(weights.rank, weights.scaling, layers)

    def prepare(self, spans: list[tuple[int, int, int]]) -> None:
        """Set the step's batch from its rows' adapters: (adapter id, first row, end row) spans, in
        row order (0: the base model)."""
        self.row_slots = None
        runs: dict[int, list[tuple[int, int]]] = {}  # adapter id -> its rows' ranges, consecutive ones joined
        for adapter_id, start, end in spans:
            if adapter_id:
                ranges = runs.setdefault(adapter_id, [])
                if ranges and ranges[-1][1] == start:
                    ranges[-1] = (ranges[-1][0], end)
                else:
                    ranges.append((start, end))
        if not runs:
            self.batch = None
            return
        if len(runs) > self.max_loras:
            raise RuntimeError(f"{len(runs)} adapters in one step, max_loras is {self.max_loras}")
        batch = LoRABatch()
        for adapter_id, ranges in runs.items():
            rows = ranges if len(ranges) <= _MAX_RANGES else torch.cat(
                [torch.arange(s, e) for s, e in ranges]).to(self.device)
            batch.groups.append((rows, self._resident(adapter_id, runs)))
        self.batch = batch

    def _resident(self, adapter_id: int, in_step) -> LoRAWeights:
        weights = self.resident.get(adapter_id)
        if weights is not None:
            self.resident.move_to_end(adapter_id)
            return weights
        if len(self.resident) >= self.max_loras:
            idle = next(i for i in self.resident if i not in in_step)
            del self.resident[idle]
            del self.slot_of[idle]
        slot = min(set(range(self.max_loras)) - set(self.slot_of.values()))
        weights = self._split(self.host_weights(adapter_id))
        weights = self.resident[adapter_id] = (self._fill(slot, weights) if self.stacks else
                                               weights.to(self.device, self.dtype))
        self.slot_of[adapter_id] = slot
        self.num_loads += 1
        return weights

    def _fill(self, slot: int, weights: LoRAWeights) -> LoRAWeights:
        """Write an adapter into a slot of the stacks (zeros where it has no projection, past its
        rank, or past its parts); returns it as views of them, its scaling folded in."""
        layers = [{} for _ in weights.layers]
        for (i, name), (a_stack, b_stack) in self.stacks.items():
            width = a_stack.shape[1] // self.max_loras
            a_slot, b_slot = a_stack[:, slot * width:(slot + 1) * width], b_stack[slot * width:(slot + 1) * width]
            a_slot.zero_()
            b_slot.zero_()
            ab = weights.layers[i].get(name)
            if ab is not None:
                a, b = ab
                a_slot[:, :a.shape[1]].copy_(a)
                b_slot[:b.shape[0]].copy_(b * weights.scaling)
                layers[i][name] = (a_slot[:, :a.shape[1]], b_slot[:b.shape[0]])
        return LoRAWeights(weights.rank, 1.0, layers)

    def forget(self, adapter_id: int) -> None:
        """An unloaded adapter's device copy goes (ids are never reused)."""
        self.resident.pop(adapter_id, None)
        self.slot_of.pop(adapter_id, None)
