"""Block hashes: each full block of a token sequence named by a hash chained over the blocks
before it, so equal prefixes get equal names. The engine's prefix cache keys its blocks by them,
and the router hashes prompts the same way to find the instance holding a prompt's prefix
(this module imports nothing else of the engine, so a router may use it without the core)."""
from __future__ import annotations

ROOT_HASH = 0x5BA70  # the base model's block-hash chains start here


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    # Python's hash of ints and tuples of ints is not salted per process, so two services
    # (and the router's affinity) compute the same chain for the same tokens.
    return hash((parent_hash, token_ids))


def extend_block_hashes(hashes: list[int], token_ids: list[int], block_size: int,
                        max_blocks: int | None = None, root: int = ROOT_HASH) -> list[int]:
    """Append the chain hashes of token_ids' full blocks after the len(hashes) already there
    (up to max_blocks in all), the chain starting at `root` (a LoRA adapter's own); returns
    hashes. The cache and the router's affinity both use it, so they name equal prefixes alike."""
    end = len(token_ids) // block_size if max_blocks is None else min(max_blocks, len(token_ids) // block_size)
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), end):
        parent = hash_block(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        hashes.append(parent)
    return hashes
