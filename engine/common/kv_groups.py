"""How the paged KV cache is split among layers: KV cache groups, as vLLM's hybrid KV cache
manager has them.

Layers that attend alike (full attention, or the same sliding window) form a kind. Every block
of the pool holds the same number of layers (`layers_per_block`: the greatest common divisor of
the kinds' layer counts), so a kind is cut into groups of that many layers; each group has its
own block table per request and takes its blocks from the one shared pool. A sliding-window
group lets go of blocks that fell out of its window while the request runs; a full-attention
group keeps them all. Gemma 3's 5 sliding layers to 1 global, at a context eight times its
window, then need about a third of the blocks that keeping every layer's would.

Without sliding layers (or with the hybrid manager off) there is one group of every layer,
which is the cache as it always was.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVGroups:
    layers: tuple[tuple[int, ...], ...]  # each group's layers, in layer order within it
    windows: tuple[int | None, ...]  # each group's sliding window (None: full attention)

    @property
    def layers_per_block(self) -> int:
        return len(self.layers[0])

    @property
    def hybrid(self) -> bool:
        """Whether some group lets go of blocks (a block list may then have holes)."""
        return any(w is not None for w in self.windows)

    def slot_of(self) -> list[tuple[int, int]]:
        """(group, slot within a block) of every layer, by layer index."""
        where = {}
        for g, layers in enumerate(self.layers):
            for slot, layer in enumerate(layers):
                where[layer] = (g, slot)
        return [where[i] for i in range(len(where))]


def group_layers(windows: list[int | None], hybrid: bool = True) -> KVGroups:
    """KV cache groups for layers whose sliding windows (None: full attention) are `windows`.
    `hybrid=False` (vLLM's disable_hybrid_kv_cache_manager): one group keeping every block."""
    if not hybrid or not any(w is not None for w in windows):
        return KVGroups((tuple(range(len(windows))),), (None,))
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    size = math.gcd(*(len(layers) for layers in kinds.values()))
    groups = [(window, tuple(layers[i:i + size])) for window, layers in kinds.items()
              for i in range(0, len(layers), size)]
    groups.sort(key=lambda g: g[1][0])
    return KVGroups(tuple(layers for _, layers in groups), tuple(window for window, _ in groups))
