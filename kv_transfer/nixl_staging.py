"""KV head slices a tensor-parallel rank reads from a peer rank of another split. A block holds
every layer's K and V with the heads innermost but one ([layers, parts, block_size, heads,
head_dim]), so a peer rank's blocks hold other heads than this rank's at every (layer, part,
token): rather than a descriptor per such run, the peer rank's whole blocks are READ into a
buffer of their shape (one descriptor per run of blocks), and the heads this rank holds copied
into its own blocks once they landed (strided copies, a run of blocks at a time)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from baton.kv_transfer.base import HeadSlice

if TYPE_CHECKING:
    import torch


def merge_runs(local: list[int], remote: list[int]) -> list[tuple[int, int, int]]:
    """(local start, remote start, length) for runs consecutive on both sides."""
    runs: list[list[int]] = []
    for here, there in zip(local, remote, strict=True):
        if runs and here == runs[-1][0] + runs[-1][2] and there == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([here, there, 1])
    return [tuple(run) for run in runs]


@dataclass(slots=True)
class Staged:
    """A slice of heads read whole from a peer rank into a buffer of its own block shape."""
    buffer: torch.Tensor  # [blocks, *the peer rank's block shape]
    registration: object  # the buffer's NIXL registration (let go with the load)
    head_slice: HeadSlice
    peer_first: int  # the peer rank's first KV head


def staging_buffer(cache: torch.Tensor, num_blocks: int, heads: int) -> torch.Tensor:
    """Room for num_blocks of a peer rank's blocks: the cache's block shape with `heads` heads."""
    import torch

    return torch.empty((num_blocks, *cache.shape[1:-2], heads, cache.shape[-1]), dtype=cache.dtype,
                       device=cache.device)


def land(cache: torch.Tensor, staged: list[Staged], block_ids: list[int], first: int) -> None:
    """Copy each staged slice's heads into `cache`'s blocks (`first`: this rank's first KV head)."""
    if not staged:
        return
    runs = merge_runs(block_ids, list(range(len(block_ids))))
    for s in staged:
        h, at = s.head_slice, s.peer_first
        for block, row, n in runs:
            cache[block:block + n, ..., h.first - first:h.last - first, :].copy_(
                s.buffer[row:row + n, ..., h.first - at:h.last - at, :])
