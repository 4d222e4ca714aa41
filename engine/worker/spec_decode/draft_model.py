"""Drafts from a smaller model with the target's tokenizer ("draft_model"): its greedy tokens,
k of them, one forward of the draft each.

Its KV cache is its own tensor, laid out block for block like the target's and addressed by the
target's block ids (those of a full-attention KV cache group), so the scheduler allocates for
both at once (Scheduler.lookahead: the k slots past a request's tokens that drafting writes) and
nothing else keeps books for it. The draft's KV is computed lazily, when a request drafts: each
round first catches the draft up on the request's tokens it has not seen (the whole prompt the
first time, then the tokens the last verification kept and the one after them), then feeds its
own drafts back k - 1 times. A request whose prompt's KV came from the host tier or a prefix hit
costs the draft one forward over that prompt.

Across P/D the draft's KV goes with the prompt's, as an EAGLE head's does (eagle.py): the prefill
catches its draft up on the prompt in the step that ends the request (`catch_up`) and the
decode's load brings the draft's blocks too (`loaded`). Chosen by measurement
(bench/draft_handoff.py, SmolLM2, 2,048 tokens, 2 CPU cores): the decode's catch-up over the
prompt took 50 ms with a two-layer draft and 4.0 s with a SmolLM2-sized one, a stall of every
running request's next token, against 0.2 ms and 17 ms to READ the draft's 2 and 90 MiB.

Drafts are greedy, so the proposal distribution is one-hot and verify.py's rejection sampling
stays exact.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from baton.engine.common.errors import check
from baton.engine.worker.models import CausalLM
from baton.engine.worker.spec_decode import Proposer
from baton.kernels.attention import AttentionMetadata


class DraftModelProposer(Proposer):
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, max_model_len: int, group: int,
                 metadata: Callable[[list, torch.Tensor, int], AttentionMetadata], device: torch.device,
                 max_rows: int = 8192, kv_dtype: torch.dtype | None = None):
        """`group`: the target's full-attention KV cache group whose block ids the draft's cache
        takes; `metadata(spans, positions, num_decodes)`: the attention metadata of a batch of
        (start, end, block ids) spans on the draft's backend, decodes (one row) first;
        `max_rows`: the most tokens of one request a catch-up feeds in one forward; `kv_dtype`: its
        cache's, the target's (FP8 with the draft's own scales; default: the draft's dtype)."""
        args = model.args
        model.prepare(max_model_len)
        check(not model.rope_by_length, "speculative_config.model",
              "a draft whose RoPE depends on the sequence's length (dynamic NTK, LongRoPE) is not supported")
        self.model, self.group, self.metadata, self.device = model, group, metadata, device
        self.cache = torch.zeros(num_blocks, args.num_layers, args.kv_parts, block_size, args.num_kv_heads,
                                 args.head_dim, dtype=kv_dtype or model.embed_tokens.weight.dtype, device=device)
        self.layer_caches = [(self.cache[:, i, 0], self.cache[:, i, args.kv_parts - 1]) for i in range(args.num_layers)]
        self.max_model_len = max_model_len
        self.max_rows = max_rows

    @staticmethod
    def block_bytes(model: CausalLM, block_size: int, kv_dtype: torch.dtype) -> int:
        a = model.args
        return a.num_layers * a.kv_parts * block_size * a.num_kv_heads * a.head_dim * kv_dtype.itemsize

    def propose(self, states: list, k: int) -> list[list[int]]:
        """Up to k drafts for each request state (token_ids, block_ids, draft_computed), fewer
        where the model's length ends first; each state's draft_computed advanced."""
        k = min(k, self.max_model_len - max(len(s.token_ids) for s in states))
        if k <= 0:
            return [[] for _ in states]
        drafts = [[token] for token in self.catch_up(states)]
        for j in range(1, k):  # one row each: the last draft, at the position after the tokens and drafts before
            spans = [(len(s.token_ids) + j - 1, len(s.token_ids) + j, s.block_ids[self.group]) for s in states]
            for row, token in zip(drafts, self._forward([row[-1] for row in drafts], spans, len(spans))):
                row.append(token)
        for s in states:
            s.draft_computed = len(s.token_ids) + k - 1
        return drafts

    def catch_up(self, states: list) -> list[int]:
        """Feed the draft each state's tokens it has not seen, in one forward (one-row requests
        first: the metadata's order); the token it guesses after each state's last. A request far
        behind (a prefill's whole prompt) is first fed alone in pieces of max_rows, as the target
        computed it in chunks."""
        for s in states:
            while len(s.token_ids) - s.draft_computed > self.max_rows:
                end = s.draft_computed + self.max_rows
                self._forward(s.token_ids[s.draft_computed:end], [(s.draft_computed, end, s.block_ids[self.group])], 0)
                s.draft_computed = end
        order = sorted(range(len(states)), key=lambda i: len(states[i].token_ids) - states[i].draft_computed > 1)
        spans, ids = [], []
        for i in order:
            s = states[i]
            start = min(s.draft_computed, len(s.token_ids) - 1)
            spans.append((start, len(s.token_ids), s.block_ids[self.group]))
            ids += s.token_ids[start:]
        guesses = [0] * len(states)
        for i, token in zip(order, self._forward(ids, spans, sum(1 for a, b, _ in spans if b - a == 1))):
            guesses[i] = token
        for s in states:
            s.draft_computed = len(s.token_ids)
        return guesses

    def loaded(self, state, num_tokens: int, start: int) -> None:
        """The draft's KV of a request's tokens [start, num_tokens) came with its prompt's (a prefill
        peer's): where that is all of them, the draft goes on from there."""
        if start == 0:
            state.draft_computed = num_tokens

    @staticmethod
    def start(state) -> int:
        """Where a request's draft KV starts: its first token (catch_up goes from there)."""
        return 0

    def _forward(self, ids: list[int], spans: list, num_decodes: int) -> list[int]:
        """The draft over a batch of spans; the argmax after each span's last row."""
        positions = torch.from_numpy(np.concatenate([np.arange(a, b) for a, b, _ in spans])).to(self.device)
        meta = self.metadata(spans, positions, num_decodes)
        hidden = self.model(torch.tensor(ids, device=self.device), positions, self.layer_caches,
                            [meta] * len(self.layer_caches))
        ends = np.cumsum([b - a for a, b, _ in spans]) - 1
        return self.model.compute_logits(hidden[torch.from_numpy(ends).to(self.device)]).argmax(dim=-1).tolist()
