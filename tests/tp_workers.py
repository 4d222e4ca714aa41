"""What each rank of the tensor-parallel tests runs (imported by the processes they spawn)."""
from __future__ import annotations

import datetime
import math
import os

import torch
import torch.distributed as dist


def prompt_logits(model, prompt: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits of every prompt position but the last (a prefill), then of the last (a decode over
    the cached prefix), through the reference attention on a paged cache of this rank's heads."""
    from baton.kernels.attention import AttentionMetadata, DecodeGroup, PrefillSeq

    a = model.args  # (a split model's: this rank's KV heads; MLA's one latent, whole)
    blocks = math.ceil(len(prompt) / block_size)
    caches = []
    for _ in model.layers:  # K and V, or (MLA) the latent alone, one view for both
        parts = [torch.zeros(blocks, block_size, a.num_kv_heads, a.head_dim) for _ in range(a.kv_parts)]
        caches.append((parts[0], parts[-1]))
    table = torch.arange(blocks)
    n = len(prompt) - 1
    prefill = AttentionMetadata(prefills=[PrefillSeq(0, n, n, table)], slot_mapping=torch.arange(n))
    hidden = model(torch.tensor(prompt[:n]), torch.arange(n), caches, [prefill] * len(caches))
    mask = torch.zeros(1, 1, 1, blocks * block_size).masked_fill_(torch.arange(blocks * block_size) > n, float("-inf"))
    decode = AttentionMetadata(decodes=[DecodeGroup(0, table[None], mask)], slot_mapping=torch.tensor([n]))
    last = model(torch.tensor(prompt[n:]), torch.tensor([n]), caches, [decode] * len(caches))
    return model.compute_logits(torch.cat([hidden, last]))


def run_rank(rank: int, world: int, port: int, model_dir: str, prompt: list[int], out: str,
             expert_parallel: bool = False) -> None:
    from baton.engine.worker.loader import load_model
    from baton.engine.worker.parallel.tensor_parallel import TPGroup, shard_model

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world + 1, False, timeout=datetime.timedelta(seconds=60))  # (the test's)
    model = load_model(model_dir, torch.float32, "cpu")
    model.prepare(256)
    shard_model(model, TPGroup.join(rank, world, store, torch.device("cpu")), expert_parallel)
    with torch.inference_mode():
        logits = prompt_logits(model, prompt)
    torch.save(logits, os.path.join(out, f"rank{rank}.pt"))
