"""How the router picks an instance of a tier: round robin, fewest requests in flight, the
instance whose prefix cache most likely holds the prompt's start (within a load bound), or
(kv_aware.py) the one whose cache, as its KV events tell, holds most of it against its load.

A policy sees backends through `address`, `outstanding` and `num_routed` (kv_aware: and the
router's ledger of their load) only, and says why it chose what it chose (for the route span
and the policy-decision metric)."""
from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import NamedTuple, Protocol

POLICIES = ("round_robin", "least_outstanding", "prefix_affinity", "kv_aware")


class Choice(NamedTuple):
    backend: object
    decision: str  # round_robin, least_loaded, affinity, or load_bound (affinity overruled by load)
    prefix_hit_blocks: int = 0  # how deep the prompt's prefix matched what the instance served
    inputs: dict | None = None  # what the decision weighed, per candidate (kv_aware), for the route span
    charge: tuple[int, int] = (0, 0)  # blocks the request adds to the instance: to compute, in all (kv_aware)


class Policy(Protocol):
    def choose(self, backends: list, hashes: list[int]) -> Choice: ...


class RoundRobin:
    def __init__(self):
        self._counter = itertools.count()

    def choose(self, backends: list, hashes: list[int]) -> Choice:
        ordered = sorted(backends, key=lambda b: b.address)  # stable under health flaps
        return Choice(ordered[next(self._counter) % len(ordered)], "round_robin")


class LeastOutstanding:
    def choose(self, backends: list, hashes: list[int]) -> Choice:
        return Choice(min(backends, key=lambda b: (b.outstanding, b.num_routed)), "least_loaded")


class PrefixAffinity:
    """The instance that last served the longest matching prefix (so its prefix cache hits),
    unless that would load it beyond `load_factor` × the mean and `slack` above the least
    loaded: then the least loaded, which the prefix then follows."""

    def __init__(self, load_factor: float, slack: int, table_size: int):
        self.load_factor = load_factor
        self.slack = slack
        self.table_size = table_size
        self._table: OrderedDict[int, str] = OrderedDict()  # block hash -> address, LRU order
        self._fallback = LeastOutstanding()

    def choose(self, backends: list, hashes: list[int]) -> Choice:
        by_address = {b.address: b for b in backends}
        loads = [b.outstanding for b in backends]
        bound = max(self.load_factor * (sum(loads) + 1) / len(backends), min(loads) + self.slack)
        choice = None
        for depth in range(len(hashes), 0, -1):  # deepest match first
            backend = by_address.get(self._table.get(hashes[depth - 1]))
            if backend is not None:
                choice = (Choice(backend, "affinity", depth) if backend.outstanding + 1 <= bound
                          else Choice(self._fallback.choose(backends, hashes).backend, "load_bound"))
                break
        choice = choice or self._fallback.choose(backends, hashes)
        for h in hashes:
            self._table[h] = choice.backend.address
            self._table.move_to_end(h)
        while len(self._table) > self.table_size:
            self._table.popitem(last=False)
        return choice


def make_policy(name: str, load_factor: float, slack: int, table_size: int, kv_index=None,
                kv_weights: tuple[float, float, float] = (8.0, 0.5, 0.25)) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_outstanding":
        return LeastOutstanding()
    if name == "kv_aware":
        from baton.services.router.kv_aware import KVAware
        return KVAware(kv_index, *kv_weights, load_factor, slack)
    return PrefixAffinity(load_factor, slack, table_size)
