"""The step's flat batch and its attention metadata, built from a SchedulerOutput and the
runner's per-request states: token ids, positions, the rows whose logits are sampled (a
request's k + 1 with drafts), and per KV cache group the metadata of the attention backend (the
C++ kernel's, Triton's, or the reference's decode groups and prefill chunks).

A BatchBuilder is the runner's: `rows` makes the step's StepBatch on the host, and `tensors` its
DeviceBatch (a CUDA graph takes the host batch instead: cuda_graphs.py); `metadata` serves the
draft models and heads (spec_decode/), which attend over their own caches with the same blocks."""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch

from baton.engine.common.core_messages import ImageInput
from baton.engine.common.kv_groups import KVGroups
from baton.engine.common.scheduler_output import SchedulerOutput
from baton.engine.worker import block_tables
from baton.engine.worker.models import mrope
from baton.kernels.attention import (
    DECODE_PADDING_ELEMS,
    AttentionMetadata,
    DecodeGroup,
    KernelBatch,
    PrefillSeq,
    TritonBatch,
    group_decodes,
)
from baton.kv_transfer.base import first_needed_block


@dataclass(slots=True)
class StepBatch:
    """One step's rows on the host, in row order: one-token decodes first, then prefill chunks."""
    input_ids: list[int]
    positions: list[int]
    order: list[tuple[str, int]]  # each request's id and rows
    spans: list[tuple[int, int, list[np.ndarray]]]  # each request's [start, end) positions and block ids per group
    group_spans: list[list[block_tables.Span]]  # per KV cache group, each request's span over its blocks
    num_decodes: int  # the first spans
    sample_rows: list[int]  # the rows whose logits are sampled
    sample_req_ids: list[str]  # their requests
    sample_spans: list[tuple[int, int]]  # per sampled request: its first row in sample_rows, and its rows (1 + drafts)
    prompt_rows: list[tuple[str, int, int, int]]  # (request, first row, start, end) of requests wanting prompt logprobs
    adapter_spans: list[tuple[int, int, int]]  # (adapter id, first row, end row) per request, with LoRA on
    rope_rows: list[tuple[int, int, int, int]]  # (start, end, prompt length, length) per request, where RoPE needs them
    # Async scheduling: (row, index in the last step's sampled tokens) of the rows whose token is
    # still on the device (a request's last token, sampled in the step before).
    unknown_inputs: list[tuple[int, int]]
    # A vision-language model's rows inside images' spans: (first row, the image, its first
    # embedding row they take, how many); their token ids here are 0.
    image_rows: list[tuple[int, ImageInput, int, int]]
    # M-RoPE (mrope.py), where a request in the step has images: every row's three positions
    # [3, T]; None: the RoPE takes `positions`.
    rope_positions: np.ndarray | None = None
    # A model whose images attend to themselves both ways (Gemma 3): per request (by its index in
    # `spans`), its images' position spans its chunk computes; the step then attends on the
    # reference, whose masks open them (PrefillSeq.open_spans).
    open_spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)


@dataclass(slots=True)
class DeviceBatch:
    """A StepBatch's tensors for an eager forward."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    metas: list[AttentionMetadata]  # one per KV cache group
    sample_rows: torch.Tensor
    rope_lengths: torch.Tensor | None  # each token's sequence length (on the host), where RoPE depends on it
    rope_positions: torch.Tensor | None = None  # M-RoPE's [3, T] (StepBatch.rope_positions)


class BatchBuilder:
    def __init__(self, model, kv_groups: KVGroups, block_size: int, device: torch.device, attention_backend: str,
                 cache_dtype: torch.dtype, lora: bool):
        """`model`: the target (its args and RoPE); `attention_backend`: "cpu", "triton" or "torch"
        (tests switch it); `lora`: adapters are on (rows grouped by adapter)."""
        self.model, self.kv_groups, self.block_size, self.device = model, kv_groups, block_size, device
        self.attention_backend, self.cache_dtype, self.lora = attention_backend, cache_dtype, lora
        self.staging = block_tables.Staging(device)  # the step's metadata on its way to the device
        self.decode_padding_elems = DECODE_PADDING_ELEMS  # per decode group (the reference's); tests shrink it

    def rows(self, sched: SchedulerOutput, states: dict) -> StepBatch:
        """The step's batch on the host, from the runner's request states (token ids, block ids)."""
        starts = {c.req_id: c.num_computed_tokens for c in sched.scheduled_cached_reqs}
        starts.update((n.req_id, n.num_computed_tokens) for n in sched.scheduled_new_reqs)
        # One-token decodes first, longest context first (the reference's length groups are
        # then row ranges), then prefill chunks; with LoRA, by adapter within each (its rows then
        # run together), except on the reference, whose groups need the length order.
        by_lora = self.lora
        by_adapter = by_lora and self.attention_backend != "torch"
        order = sorted(sched.num_scheduled_tokens.items(), key=lambda kv: (
            kv[1] != 1, states[kv[0]].lora_id if by_adapter else 0, -starts[kv[0]]))
        input_ids, positions, sample_rows, sample_req_ids, rows, prompt_rows = [], [], [], [], [], []
        unknown_inputs, image_rows = [], []
        sample_spans = []  # per sampled request: its first row in sample_rows, and its rows (1 + drafts)
        drafts_of = sched.scheduled_spec_tokens
        rope_rows = []  # (start, end, prompt length, length) per request: what the RoPE of its rows takes
        by_length = self.model.rope_by_length
        adapter_spans = []  # (adapter id, first row, end row) per request, with LoRA on
        for req_id, n in order:
            state, start = states[req_id], starts[req_id]
            end = start + n
            drafts = drafts_of.get(req_id, ())
            if state.prompt_logprobs is not None:
                prompt_rows.append((req_id, len(input_ids), start, end))
            if by_lora:
                adapter_spans.append((state.lora_id, len(input_ids), len(input_ids) + n))
            known = state.token_ids[start:end - len(drafts)]
            input_ids.extend(known)
            if len(known) < end - len(drafts) - start:  # its last token: sampled in the step still running
                unknown_inputs.append((len(input_ids), state.pending_index))
                input_ids.append(0)
            input_ids.extend(drafts)
            if state.images:
                self._image_rows(image_rows, input_ids, state.images, len(input_ids) - n, start, end)
            positions.extend(range(start, end))
            rows.append((start, end, state.block_ids))
            if by_length:
                rope_rows.append((start, end, state.num_prompt_tokens, len(state.token_ids)))
            # Caught up (tokens on their way counted): the last rows' logits give the next tokens.
            if end - len(drafts) == len(state.token_ids) + state.num_pending:
                sample_spans.append((len(sample_rows), 1 + len(drafts)))
                sample_rows.extend(range(len(input_ids) - 1 - len(drafts), len(input_ids)))
                sample_req_ids.append(req_id)
        # Each group's blocks: its own tables and slots.
        group_spans = [[(start, end, blocks[group]) for start, end, blocks in rows]
                       for group in range(len(self.kv_groups.layers))]
        open_spans = self._open_spans(order, starts, states) if image_rows else {}
        return StepBatch(input_ids, positions, order, rows, group_spans, sum(1 for _, n in order if n == 1),
                         sample_rows, sample_req_ids, sample_spans, prompt_rows, adapter_spans, rope_rows,
                         unknown_inputs, image_rows, self._mrope_positions(order, starts, states), open_spans)

    def _open_spans(self, order: list[tuple[str, int]], starts: dict[str, int], states: dict
                    ) -> dict[int, list[tuple[int, int]]]:
        """StepBatch.open_spans: where images attend to themselves both ways, each request's images
        its chunk computes (the scheduler computes each whole: encoder_cache.py)."""
        if not self.model.args.vision.bidirectional:
            return {}
        out = {}
        for i, (req_id, n) in enumerate(order):
            start = starts[req_id]
            mine = [(image.offset, image.offset + image.length) for image in states[req_id].images
                    if image.offset < start + n and image.offset + image.length > start]
            if mine:
                out[i] = mine
        return out

    def _mrope_positions(self, order: list[tuple[str, int]], starts: dict[str, int], states: dict
                         ) -> np.ndarray | None:
        """M-RoPE's positions of the step's rows, where a request in it has images (its positions
        are not its token indices from its first image on)."""
        if not self.model.args.mrope_section or all(states[req_id].mrope is None for req_id, _ in order):
            return None
        return np.concatenate([np.broadcast_to(np.arange(starts[req_id], starts[req_id] + n), (3, n))
                               if states[req_id].mrope is None else
                               mrope.rows(*states[req_id].mrope, starts[req_id], starts[req_id] + n)
                               for req_id, n in order], axis=1)

    @staticmethod
    def _image_rows(image_rows: list, input_ids: list[int], images: list[ImageInput], row0: int, start: int,
                    end: int) -> None:
        """The rows [start, end) of a request (from row0) that fall in its images' spans: noted, and
        their token ids (placeholders, not tokens) made 0."""
        for image in images:
            lo, hi = max(start, image.offset), min(end, image.offset + image.length)
            if lo < hi:
                first = row0 + lo - start
                input_ids[first:first + hi - lo] = [0] * (hi - lo)
                image_rows.append((first, image, lo - image.offset, hi - lo))

    def tensors(self, batch: StepBatch) -> DeviceBatch:
        """The host batch's token ids, positions, sampled rows and attention metadata on the device."""
        dev, group_spans, num_decodes = self.device, batch.group_spans, batch.num_decodes
        positions_t = torch.tensor(batch.positions, device=dev)
        rope_lengths = None
        if self.model.rope_by_length:  # dynamic NTK, LongRoPE: each token's sequence length (on the host)
            rope_lengths = torch.from_numpy(np.concatenate([self.model.rope_lengths(*lens)
                                                            for lens in batch.rope_rows]))
        # Images that attend to themselves both ways: the reference's masks open them.
        backend = "torch" if batch.open_spans else self.attention_backend
        if backend == "cpu":
            metas = [self._kernel_batch(spans, positions_t) for spans in group_spans]
        elif backend == "triton":
            metas = self._triton_batches(group_spans, num_decodes)
        else:
            metas = [self._reference_batch(spans, num_decodes, window, batch.open_spans)
                     for spans, window in zip(group_spans, self.kv_groups.windows)]
        for meta, spans in zip(metas, group_spans):
            self._count_decodes(meta, spans, num_decodes, self.model.args.attention == "mla")
        rope_positions = None if batch.rope_positions is None else torch.from_numpy(batch.rope_positions).to(dev)
        return DeviceBatch(torch.tensor(batch.input_ids, device=dev), positions_t, metas,
                           torch.tensor(batch.sample_rows, device=dev), rope_lengths, rope_positions)

    def metadata(self, spans: list[block_tables.Span], positions: torch.Tensor, num_decodes: int, backend: str,
                 latent: bool) -> AttentionMetadata:
        """One cache's metadata for `backend` (a draft model's or head's, whose backend may differ
        from the target's): the first num_decodes spans one-token decodes; `latent`: MLA's cache."""
        if backend == "cpu":
            meta = self._kernel_batch(spans, positions)
        elif backend == "triton":
            meta = self._triton_batches([spans], num_decodes)[0]
        else:
            meta = self._reference_batch(spans, num_decodes)
        self._count_decodes(meta, spans, num_decodes, latent)
        return meta

    def _count_decodes(self, meta: AttentionMetadata, spans: list[block_tables.Span], num_decodes: int,
                       latent: bool) -> None:
        """The first num_decodes spans are decodes; for MLA (`latent`), whose prefill attends in a
        form of its own (mla.py) whatever the backend, the rest as prefill sequences too."""
        meta.num_decodes = num_decodes
        if latent and num_decodes < len(spans) and not meta.prefills:
            meta.prefills = self._prefill_seqs(spans, num_decodes, [0] * len(spans))
            if meta.slot_mapping is None:
                meta.slot_mapping = (meta.triton.slot_mapping if meta.triton is not None else
                                     torch.from_numpy(block_tables.slots(spans, self.block_size)).to(self.device))

    def _kernel_batch(self, spans: list[block_tables.Span], positions: torch.Tensor) -> AttentionMetadata:
        bs, tables, counts = self.block_size, [], []
        for start, end, blocks in spans:
            needed = -(-end // bs)
            if len(blocks) < needed:  # the kernel would read (and write) the next request's blocks
                raise RuntimeError(f"a request has {len(blocks)} KV blocks for {end} tokens")
            tables.append(blocks[:needed])
            counts.append(end - start)
        starts = np.cumsum([0] + [len(t) for t in tables[:-1]])
        return AttentionMetadata(kernel=KernelBatch(torch.from_numpy(np.concatenate(tables).astype(np.int64)),
                                                    torch.from_numpy(np.repeat(starts, counts)), positions))

    def _triton_batches(self, group_spans: list[list[block_tables.Span]], num_decodes: int
                        ) -> list[AttentionMetadata]:
        """Each KV cache group's metadata for the Triton kernels: its slots and tables, the
        lengths shared."""
        bs, spans = self.block_size, group_spans[0]
        decodes, prefills = spans[:num_decodes], spans[num_decodes:]
        q_lens = [end - start for start, end, _ in prefills]
        tables = [(block_tables.padded_table(g[:num_decodes], bs), block_tables.padded_table(g[num_decodes:], bs))
                  for g in group_spans]
        # One copy to the device for all of it (a copy costs more than its bytes; and the staging
        # buffer is reused by the next call), then views.
        dec_lens, q_starts, q_lens_t, ctx_lens, *per_group = self.staging.to_device([
            np.array([end for _, end, _ in decodes], np.int32),
            np.array(list(accumulate(q_lens, initial=num_decodes))[:-1], np.int32), np.array(q_lens, np.int32),
            np.array([end for _, end, _ in prefills], np.int32),
            *(part for g, (dec_tab, pre_tab) in zip(group_spans, tables)
              for part in (block_tables.slots(g, bs), dec_tab, pre_tab))])
        return [AttentionMetadata(triton=TritonBatch(
            slot_mapping=slots, decode_tables=dec_tab_t.view(dec_tab.shape), decode_lens=dec_lens,
            prefill_tables=pre_tab_t.view(pre_tab.shape), q_starts=q_starts, q_lens=q_lens_t, ctx_lens=ctx_lens,
            max_q_len=max(q_lens, default=0)))
            for (slots, dec_tab_t, pre_tab_t), (dec_tab, pre_tab) in zip(zip(*[iter(per_group)] * 3), tables)]

    def _reference_batch(self, spans: list[block_tables.Span], num_decodes: int,
                         window: int | None = None, open_spans: dict | None = None) -> AttentionMetadata:
        """With a sliding `window`, each row's table starts at the first block its queries read
        and its context counts from there (the masks are relative, so they hold): a long
        request's decode gathers its window, not its whole context. `open_spans`: StepBatch's."""
        bs, dev = self.block_size, self.device
        meta = AttentionMetadata(slot_mapping=torch.from_numpy(block_tables.slots(spans, bs)).to(dev))
        skips = [first_needed_block(end - 1 if i < num_decodes else start, window, bs)
                 for i, (start, end, _) in enumerate(spans)]
        meta.decodes = self._decode_groups(
            [blocks[skip:-(-end // bs)] for (_, end, blocks), skip in zip(spans[:num_decodes], skips)],
            [end - skip * bs for (_, end, _), skip in zip(spans[:num_decodes], skips)])
        meta.prefills = self._prefill_seqs(spans, num_decodes, skips)
        for i, opened in (open_spans or {}).items():
            shift = skips[i] * bs  # (positions counted from the table's first block)
            meta.prefills[i - num_decodes].open_spans = [(lo - shift, hi - shift) for lo, hi in opened]
        return meta

    def _prefill_seqs(self, spans: list[block_tables.Span], num_decodes: int, skips: list[int]) -> list[PrefillSeq]:
        """The prefill chunks (the spans after the decodes), each with its table from its
        `skips` block on (a sliding group's window) and its context counted from there."""
        bs, row, seqs = self.block_size, num_decodes, []
        for (start, end, blocks), skip in zip(spans[num_decodes:], skips[num_decodes:]):
            seqs.append(PrefillSeq(row, end - start, end - skip * bs,
                                   torch.from_numpy(blocks[skip:-(-end // bs)].astype(np.int64)).to(self.device)))
            row += end - start
        return seqs

    def _decode_groups(self, tables: list[np.ndarray], lens: list[int]) -> list[DecodeGroup]:
        groups, start, bs, dev = [], 0, self.block_size, self.device
        args = self.model.args
        for size in group_decodes(lens, 2 * args.num_kv_heads * args.head_dim, self.decode_padding_elems):
            rows = slice(start, start + size)
            width = max(len(t) for t in tables[rows])  # (a sliding group's tables start at their windows)
            table = torch.from_numpy(block_tables.padded_table(
                [(0, len(t) * bs, t) for t in tables[rows]], bs).astype(np.int64)).to(dev)
            past_end = torch.arange(width * bs, device=dev)[None, :] >= torch.tensor(lens[rows], device=dev)[:, None]
            # An additive mask: SDPA's CPU kernel runs ~1.5x faster with it than with a boolean one.
            mask = (torch.zeros(past_end.shape, dtype=self.cache_dtype, device=dev)
                    .masked_fill_(past_end, float("-inf")))
            groups.append(DecodeGroup(start, table, mask[:, None, None, :]))
            start += size
        return groups
