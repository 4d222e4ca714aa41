"""KV head slices a tensor-parallel rank reads from a peer rank of another split. A block holds
every layer's K and V with the heads innermost but one ([layers, parts, block_size, heads,
head_dim]), so a peer rank's blocks hold other heads than this rank's at every (layer, part,
token): rather than a descriptor per such run, the peer rank's whole blocks are READ into a
buffer of their shape (one descriptor per run of blocks), and the heads this rank holds copied
into its own blocks once they landed (strided copies, a run of blocks at a time). A peer whose
cache holds another dtype or FP8 scales is staged the same way, every head, and converted as it
lands (kv_conversion.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from baton.kv_transfer.base import HeadSlice

if TYPE_CHECKING:
    import torch

    from baton.kv_transfer.kv_conversion import KVConversion


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


def staging_buffer(cache: torch.Tensor, num_blocks: int, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """Room for num_blocks of a peer rank's blocks: the cache's block shape with `heads` heads,
    in the peer's `dtype`."""
    import torch

    return torch.empty((num_blocks, *cache.shape[1:-2], heads, cache.shape[-1]), dtype=dtype, device=cache.device)


def land(cache: torch.Tensor, staged: list[Staged], block_ids: list[int], first: int,
         conversion: KVConversion | None = None, group_counts: tuple[int, ...] = ()) -> None:
    """Copy each staged slice's heads into `cache`'s blocks (`first`: this rank's first KV head),
    converted where the peer's cache holds another dtype or scales (`conversion`; then
    `group_counts`: how many of block_ids each KV cache group has, in order)."""
    if not staged:
        return
    spans = [(0, len(block_ids), 0)]
    if conversion is not None:
        group_counts = group_counts or (len(block_ids),)  # (a load of one group's blocks)
        ends = [sum(group_counts[:g + 1]) for g in range(len(group_counts))]
        spans = [(end - n, end, g) for g, (n, end) in enumerate(zip(group_counts, ends, strict=True)) if n]
    for start, end, group in spans:
        for block, row, n in merge_runs(block_ids[start:end], list(range(start, end))):
            for s in staged:
                h, at = s.head_slice, s.peer_first
                dst = cache[block:block + n, ..., h.first - first:h.last - first, :]
                src = s.buffer[row:row + n, ..., h.first - at:h.last - at, :]
                if conversion is None:
                    dst.copy_(src)
                else:
                    conversion.copy(dst, src, group, h.first, h.last)


class StagingPool:
    """Registered staging buffers kept for later loads: allocating and registering one with NIXL
    per load cost 3-9 ms of a 2,048-token handoff (bench/tensor_parallel.py). A buffer holds a
    power of two of blocks, at least the load's; one a READ may still write into (a failed or
    timed-out load) is let go instead of kept."""

    def __init__(self, agent, keep: int = 8):
        self.agent, self.keep = agent, keep
        self.free: list[tuple[torch.Tensor, object]] = []

    def take(self, cache: torch.Tensor, num_blocks: int, heads: int, dtype: torch.dtype) -> tuple[torch.Tensor, object]:
        """A registered buffer of at least num_blocks of a peer rank's blocks with `heads` heads,
        in the peer's `dtype`."""
        for i, (buffer, registration) in enumerate(self.free):
            if buffer.shape[0] >= num_blocks and buffer.shape[-2] == heads and buffer.dtype == dtype:
                del self.free[i]
                return buffer, registration
        buffer = staging_buffer(cache, 1 << max(0, num_blocks - 1).bit_length(), heads, dtype)
        return buffer, self.agent.register_memory(buffer)

    def give_back(self, buffer: torch.Tensor, registration, reusable: bool) -> None:
        if reusable and len(self.free) < self.keep:
            self.free.append((buffer, registration))
        else:
            self.agent.deregister_memory(registration)

    def close(self) -> None:
        for _, registration in self.free:
            self.agent.deregister_memory(registration)
        self.free = []
