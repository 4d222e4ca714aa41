"""Speculative decoding's worker half. After a step, a proposer drafts each decoding request's
next tokens (one module per proposer, behind Proposer: ngram.py, suffix.py, draft_model.py,
eagle.py, which also drives mtp.py's head); the scheduler sends them back with the request's next
token, the model computes them all in one forward, and verify.py keeps the drafts the target
model would have produced (greedy: equal to its argmax; sampled: rejection sampling, which keeps
the target's distribution) and one token more."""
from __future__ import annotations

from baton.engine.common.speculative import SpeculativeConfig


class Proposer:
    """What every proposer does (propose), and the hooks the runner calls on each, no-ops here."""

    wants_hidden = False  # keep() is handed the target's hidden states after each step (eagle.py's heads)

    def propose(self, states: list, k: int) -> list[list[int]]:
        """Up to k drafts to follow each request's tokens (its runner state: token_ids, block_ids,
        draft_computed, proposer_state: the proposer's own, per request); none where nothing is
        worth verifying."""
        raise NotImplementedError

    def finished(self, state) -> None:
        """A request ended (its runner state): what the proposer keeps of it may go."""

    def keep(self, rows: list[tuple], hidden) -> None:
        """Where wants_hidden: the target's hidden states of the step's positions whose tokens
        stand, per request (its state, first row, first position, rows kept)."""


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """A proposer that needs nothing but the tokens (draft_model's and the heads' are made by the
    runner, with their model; a tensor-parallel rank that does not draft gets this one)."""
    from baton.engine.worker.spec_decode.ngram import NgramProposer
    from baton.engine.worker.spec_decode.suffix import SuffixProposer

    if config.method == "suffix":
        return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_min_token_prob, config.suffix_decoding_max_spec_factor)
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
