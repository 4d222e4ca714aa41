"""Blocks from a peer whose KV cache holds another dtype, or FP8 under other scales, converted as
they land: a bfloat16 or float32 prefill can feed an FP8 decode (and the other way round).

Such a peer's blocks are never READ into the cache directly (their bytes mean something else):
they are staged whole in the peer's dtype (nixl_staging.py, as a peer of another tensor-parallel
split's are) and written into the cache by `KVConversion.copy`, which widens FP8 with the peer's
scales and quantizes with this engine's through the engine's own converter (base.KVConverter:
the function every attention backend writes with), so a landed block holds exactly what this
engine would have written for the same K and V."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from baton.kv_transfer.base import KVConverter, KVFormat, KVFormatMismatch

if TYPE_CHECKING:
    import torch


def needs_conversion(mine: KVFormat, theirs: KVFormat) -> bool:
    return mine.dtype != theirs.dtype or mine.kv_scales != theirs.kv_scales


def _scales_by_group(fmt: KVFormat) -> torch.Tensor | None:
    """An FP8 format's scales as [groups, layers per block, parts, kv heads] (None: it holds values)."""
    import torch

    if not fmt.kv_scales:
        return None
    by_layer = torch.tensor(fmt.kv_scales, dtype=torch.float32).view(fmt.num_layers, -1, fmt.num_kv_heads)
    return torch.stack([by_layer[list(layers)] for layers in fmt.kv_groups])


@dataclass(frozen=True, slots=True)
class KVConversion:
    """How a peer's staged blocks become this cache's."""
    dtype: torch.dtype  # this cache's
    theirs: torch.Tensor | None  # the peer's FP8 scales by group (_scales_by_group); None: it holds values
    mine: torch.Tensor | None
    convert: KVConverter

    @classmethod
    def between(cls, mine: KVFormat, theirs: KVFormat, cache_dtype: torch.dtype,
                convert: KVConverter | None) -> KVConversion | None:
        """None where the peer's blocks are this cache's byte for byte. Raises KVFormatMismatch
        naming kv_cache_dtype where they are not and the engine gave no converter."""
        if not needs_conversion(mine, theirs):
            return None
        if convert is None:
            raise KVFormatMismatch("kv_cache_dtype", f"the peer's KV cache holds {theirs.dtype} (scales "
                                                     f"{'its own' if theirs.kv_scales else 'none'}), this engine's "
                                                     f"{mine.dtype}, and this engine converts no KV")
        return cls(cache_dtype, _scales_by_group(theirs), _scales_by_group(mine), convert)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, group: int, first: int, last: int) -> None:
        """dst [blocks, layers per block, parts, block_size, heads, D] of `group` from the peer's
        staged src of the same shape, holding the model's KV heads [first, last)."""
        def scales(t):  # broadcast over [..., parts, block_size, heads] (the converter adds D's axis)
            return None if t is None else t[group][:, :, None, first:last].to(src.device)

        dst.copy_(self.convert(src, scales(self.theirs), self.dtype, scales(self.mine)))
