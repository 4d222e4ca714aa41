"""Suffix decoding ("suffix", Snowflake's Arctic Inference; vLLM's names for its settings): drafts
from suffix trees over what the request has seen and what earlier requests produced.

Two trees of token paths, each node counting how often its path occurred, at most
`max_depth` tokens deep: one per request over its prompt and its outputs so far (grown as the
request grows, dropped with it), and one shared over the outputs of the last
`max_cached_requests` finished requests (agents, templated answers and retries repeat
themselves across requests, which prompt lookup cannot see). To draft, the request's longest
suffix found in a tree is followed by the likeliest continuation, child by child (a child's
count over its parent's), while the product of those likelihoods stays above
`min_token_prob`, for at most `max_spec_factor` times the match's length tokens; the tree whose
continuation promises more kept tokens (the sum of those products) drafts. Unlike n-gram
lookup it drafts the continuation seen most often rather than the latest one, and it can say
when none is likely.
"""
from __future__ import annotations

from collections import deque

from baton.engine.worker.spec_decode import Proposer


class Node:
    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0
        self.children: dict[int, Node] = {}


class SuffixTree:
    """Every path of at most `depth` tokens of the sequences added, with how often it occurred."""

    def __init__(self, depth: int):
        self.depth, self.root = depth, Node()
        self._tails: list[Node] = []  # where the paths ending at the last token added end (extend())

    def extend(self, tokens: list[int]) -> None:
        """Continue the current sequence by `tokens`: every path ending at each new token counted."""
        for token in tokens:
            tails = [self.root, *self._tails[:self.depth - 1]]
            self._tails = []
            for node in tails:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = Node()
                child.count += 1
                self._tails.append(child)

    def add(self, tokens: list[int], sign: int = 1) -> None:
        """Count (or, sign -1, uncount) a whole sequence's paths, apart from the current one."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + self.depth]:
                child = node.children.get(token)
                if child is None:
                    if sign < 0:
                        break
                    child = node.children[token] = Node()
                child.count += sign
                if child.count <= 0:
                    del node.children[token]
                    break
                node = child

    def match(self, tokens: list[int]) -> tuple[Node | None, int]:
        """The node of the longest suffix of `tokens` (shorter than the depth) with a continuation."""
        for length in range(min(self.depth - 1, len(tokens)), 0, -1):
            node = self.root
            for token in tokens[len(tokens) - length:]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is not None and node.children:
                return node, length
        return None, 0


def continuation(node: Node, length: int, k: int, min_prob: float, spec_factor: float) -> tuple[list[int], float]:
    """The likeliest path below a matched node: up to min(k, spec_factor x the match's length)
    tokens while their joint likelihood stays >= min_prob; and the sum of those likelihoods."""
    drafts, prob, score = [], 1.0, 0.0
    limit = min(k, max(1, int(spec_factor * length)))
    while node.children and len(drafts) < limit:
        token, child = max(node.children.items(), key=lambda item: item[1].count)
        total = sum(c.count for c in node.children.values())
        prob *= child.count / total
        if prob < min_prob:
            break
        drafts.append(token)
        score += prob
        node = child
    return drafts, score


class SuffixProposer(Proposer):
    def __init__(self, max_depth: int, max_cached_requests: int, min_token_prob: float, max_spec_factor: float):
        self.depth, self.min_prob, self.factor = max_depth, min_token_prob, max_spec_factor
        self.shared = SuffixTree(max_depth)
        self.cached: deque[list[int]] = deque()
        self.max_cached = max_cached_requests

    def propose(self, states: list, k: int) -> list[list[int]]:
        return [self._propose(s, k) for s in states]

    def _propose(self, state, k: int) -> list[int]:
        tree = state.proposer_state
        if tree is None:
            tree = state.proposer_state = [SuffixTree(self.depth), 0]  # the request's tree, tokens added
        own, seen = tree
        own.extend(state.token_ids[seen:])
        tree[1] = len(state.token_ids)
        best, best_score = [], 0.0
        for candidate in (own, self.shared):
            node, length = candidate.match(state.token_ids)
            if node is not None:
                drafts, score = continuation(node, length, k, self.min_prob, self.factor)
                if score > best_score:
                    best, best_score = drafts, score
        return best

    def finished(self, state) -> None:
        """A request ended: its outputs join the shared tree (the oldest leave past the cap)."""
        outputs = state.token_ids[state.num_prompt_tokens:]
        if not outputs or not self.max_cached:
            return
        self.shared.add(outputs)
        self.cached.append(outputs)
        if len(self.cached) > self.max_cached:
            self.shared.add(self.cached.popleft(), sign=-1)
