"""N-gram drafts (prompt lookup decoding, vLLM's "ngram"): the request's last n tokens, for n
from prompt_lookup_max down to prompt_lookup_min, are looked for earlier in its prompt and
output; the tokens that followed the latest earlier occurrence are the drafts. Free to compute,
and right where an output copies its input (edits, code, quotes, retrieval answers)."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from baton.engine.worker.spec_decode import Proposer


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, states: list, k: int) -> list[list[int]]:
        return [self.match(s.token_ids, k) for s in states]

    def match(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix."""
        tokens = np.asarray(token_ids)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows ending before the last token: the suffix itself is not a match, and every
            # match has a token after it.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return token_ids[start:start + k]
        return []
