"""CUDA graphs for decode steps: the model's forward captured once per padded batch size and
replayed, so a decode step costs one launch from Python instead of hundreds (vLLM's
cudagraph_capture_sizes; enforce_eager turns it off).

A decode step is one whose every row is sampled: one-token decodes, and requests verifying
drafts, whose k + 1 rows (the last token, then each draft) run as k + 1 one-token decodes of the
same sequence at consecutive positions, each over its own context length (the layer writes every
row's K and V before any row attends, so row j reads the drafts before it). A step of B rows runs
the graph of the smallest captured size P >= B. Its inputs live in persistent buffers the
graphs read (token ids, positions, and per KV cache group the slots and block tables; the
context lengths shared; with LoRA each row's adapter slot, lora/layers.py's stacks): the step
writes its rows into pinned host copies and one copy per buffer brings them to the device.
Padding rows B..P-1 hold token 0 at position 0, slot -1 (the KV write skips a negative slot), no
adapter, and a context of one key, block 0's first (finite, whatever it holds, and never
written), so they compute something harmless that nobody reads.
The tables are as wide as max_model_len: the decode kernels share each sequence's own key tiles
over the grid's splits (kernels/triton_attention.py), so one grid serves every context length.

Only the forward is captured: logits, sampling, verification and the proposers run eagerly
after it. A step with prefill chunks, prompt logprobs, rows in an image's span, or more rows
than the largest size runs eagerly, as do engines with RoPE that depends on the sequence's
length or an attention backend other than Triton's. Under tensor parallelism every rank
captures the same sizes in the same order at start, NCCL's collectives inside (the eager run
before each capture has made the communicator), and every rank takes the same steps through
them: the ranks' batches are the same.

`capture=False` keeps the bookkeeping and runs the padded batch through the model eagerly: a
CPU (Triton under its interpreter) checks the padding that way in CI.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np
import torch

from baton.engine.worker import block_tables
from baton.engine.worker.batch_builder import StepBatch
from baton.kernels.attention import AttentionMetadata, TritonBatch

# (input_ids, positions, one AttentionMetadata per KV cache group, each row's LoRA slot or None
# without LoRA) -> the hidden states and what else of the forward a step reads (EAGLE-3's layer
# inputs, CausalLM.aux_hidden; else empty).
Forward = Callable[[torch.Tensor, torch.Tensor, list[AttentionMetadata], torch.Tensor | None],
                   tuple[torch.Tensor, list[torch.Tensor]]]


class _Buffer:
    """A persistent device tensor the graphs read, and its host copies (pinned on a GPU) that a
    step fills; `upload(rows)` copies its first rows over. Two host copies, a step's each in turn:
    under async scheduling a step is filled while the copy of the step before may still wait on
    the device. On a CPU host and device are one tensor."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        on_gpu = device.type == "cuda"
        hosts = [torch.zeros(shape, dtype=dtype, pin_memory=on_gpu) for _ in range(2 if on_gpu else 1)]
        self.device = hosts[0].to(device) if on_gpu else hosts[0]
        self.hosts, self.arrays = hosts, [h.numpy() for h in hosts]
        self.turn = 0

    @property
    def array(self) -> np.ndarray:
        return self.arrays[self.turn]

    def flip(self) -> None:
        """The next step's host copy (the other one, where there are two)."""
        self.turn = (self.turn + 1) % len(self.hosts)

    def upload(self, rows: int) -> None:
        host = self.hosts[self.turn]
        if self.device is not host:
            self.device[:rows].copy_(host[:rows], non_blocking=True)


class DecodeGraphs:
    def __init__(self, forward: Forward, num_groups: int, sizes: list[int], max_blocks: int, block_size: int,
                 device: torch.device, capture: bool, lora: bool = False):
        """`sizes`: the batch sizes to capture (sorted); `max_blocks`: a table row's width
        (max_model_len's blocks); `capture`: false where the padded batch runs eagerly; `lora`:
        each row's adapter slot is an input too (lora/layers.py's stacks)."""
        self.forward, self.sizes, self.block_size, self.device = forward, sizes, block_size, device
        self.capture = capture
        self.enabled = True  # bench/gpu_perf.py times the eager path of the same engine by turning it off
        most = sizes[-1]
        self.input_ids = _Buffer((most,), torch.int64, device)
        self.positions = _Buffer((most,), torch.int64, device)
        self.lens = _Buffer((most,), torch.int32, device)
        self.slots = [_Buffer((most,), torch.int32, device) for _ in range(num_groups)]
        self.tables = [_Buffer((most, max_blocks), torch.int32, device) for _ in range(num_groups)]
        self.adapters = _Buffer((most,), torch.int64, device) if lora else None  # -1: the base model
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, list[torch.Tensor]]]] = {}

    def padded_size(self, num_decodes: int) -> int | None:
        """The captured size a batch of num_decodes runs at (None: larger than any)."""
        i = bisect.bisect_left(self.sizes, num_decodes)
        return self.sizes[i] if i < len(self.sizes) else None

    def takes(self, batch: StepBatch) -> bool:
        """Whether a graph runs a step: every row sampled (one-token decodes, and drafts to
        verify with the token before them: no prompt chunk), none for prompt logprobs or in an
        image's span, no more rows than the largest size."""
        n = len(batch.input_ids)
        return (self.enabled and len(batch.sample_rows) == n and not batch.prompt_rows and not batch.image_rows
                and self.padded_size(n) is not None)

    def _metas(self, size: int) -> list[AttentionMetadata]:
        """Each group's metadata for a batch of `size` decodes: views of the persistent buffers."""
        empty = self.lens.device[:0]
        return [AttentionMetadata(num_decodes=size, triton=TritonBatch(
            slot_mapping=slots.device[:size], decode_tables=table.device[:size], decode_lens=self.lens.device[:size],
            prefill_tables=table.device[:0], q_starts=empty, q_lens=empty, ctx_lens=empty, max_q_len=0))
            for slots, table in zip(self.slots, self.tables)]

    def _pad(self, start: int, size: int) -> None:
        """Rows start..size-1 as padding (see the module's docstring)."""
        self.input_ids.array[start:size] = 0
        self.positions.array[start:size] = 0
        self.lens.array[start:size] = 1
        if self.adapters is not None:
            self.adapters.array[start:size] = -1
        for slots, table in zip(self.slots, self.tables):
            slots.array[start:size] = -1
            table.array[start:size, 0] = 0

    def _buffers(self) -> list[_Buffer]:
        return [self.input_ids, self.positions, self.lens, *self.slots, *self.tables,
                *([self.adapters] if self.adapters is not None else [])]

    def _args(self, size: int) -> tuple:
        """The forward's arguments for a batch of `size` rows: views of the persistent buffers."""
        return (self.input_ids.device[:size], self.positions.device[:size], self._metas(size),
                None if self.adapters is None else self.adapters.device[:size])

    def _upload(self, size: int) -> None:
        for buffer in self._buffers():
            buffer.upload(size)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """A graph per size, largest first, all in one memory pool (a smaller batch's
        activations fit in a larger's), each after one eager run that compiles its kernels."""
        if not self.capture:
            return
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._pad(0, size)
            self._upload(size)
            args = self._args(size)
            self.forward(*args)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    outputs = self.forward(*args)
            except RuntimeError as e:
                raise RuntimeError(f"capturing the CUDA graph of decode steps of {size} rows failed: {e} "
                                   f"(enforce_eager runs every step eagerly)") from e
            self.graphs[size] = (graph, outputs)
        torch.cuda.synchronize(self.device)

    def run(self, input_ids: list[int], positions: list[int], group_spans: list[list[block_tables.Span]],
            unknown: tuple[torch.Tensor, torch.Tensor] | None = None, adapter_slots: list[int] | None = None
            ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The forward's outputs for a step of B rows (B <= the largest size), padded to the
        captured size (the first B rows are theirs): their token ids, positions, and per KV cache
        group each request's span (as the batch builder makes them: start, end, block ids; a
        request verifying drafts spans its k + 1 rows); `unknown`: (rows, tokens) of rows whose
        token is on the device only (async scheduling); `adapter_slots`: each row's LoRA slot
        (-1: none), where the graphs take them."""
        n = len(input_ids)
        size = self.padded_size(n)
        if n != len(group_spans[0]):  # drafts to verify: a span per row
            group_spans = [row_spans(spans) for spans in group_spans]
        for buffer in self._buffers():
            buffer.flip()
        self.input_ids.array[:n] = input_ids
        self.positions.array[:n] = positions
        if self.adapters is not None:
            self.adapters.array[:n] = adapter_slots
        bs = self.block_size
        self.lens.array[:n] = [end for _, end, _ in group_spans[0]]
        for spans, slots, table in zip(group_spans, self.slots, self.tables):
            slots.array[:n] = block_tables.slots(spans, bs)
            rows = table.array
            for row, (_, end, blocks) in enumerate(spans):
                used = -(-end // bs)
                rows[row, :used] = blocks[:used]
        self._pad(n, size)
        self._upload(size)
        if unknown is not None:  # after the upload, on the same stream
            self.input_ids.device.index_copy_(0, *unknown)
        if size not in self.graphs:  # not captured (capture=False): the same padded batch, eagerly
            return self.forward(*self._args(size))
        graph, outputs = self.graphs[size]
        graph.replay()
        return outputs


def row_spans(spans: list[block_tables.Span]) -> list[block_tables.Span]:
    """Each request's span cut into one-token spans, a row each (over the same blocks)."""
    return [(p, p + 1, blocks) for start, end, blocks in spans for p in range(start, end)]


def capture_sizes(config_sizes: list[int], max_rows: int) -> list[int]:
    """The configured sizes a batch can reach (at most max_rows rows: max_num_seqs decodes, each
    with its drafts; the smallest size above it kept, so a full batch has a graph)."""
    sizes = [s for s in config_sizes if s <= max_rows]
    above = [s for s in config_sizes if s > max_rows]
    return sizes + above[:1] if above and (not sizes or sizes[-1] < max_rows) else sizes


def graphs_off_because(on_cuda: bool, enforce_eager: bool, backend: str, rope_by_length: bool) -> str | None:
    """Why an engine runs every step eagerly (None: it captures decode graphs)."""
    for reason, off in (("not on a GPU", not on_cuda), ("enforce_eager", enforce_eager),
                        (f"attention backend {backend}", backend != "triton"),
                        ("RoPE by sequence length", rope_by_length)):
        if off:
            return reason
    return None

