"""The hybrid KV cache manager without a model: KV cache groups (engine/common/kv_groups.py), and
the scheduler driving full-attention and sliding-window groups for thousands of random steps
against a token-level model of the pool (every position a query reads, in its window, holds
its own request's token; reference counts match owners; nothing leaks), with chunking,
preemption, aborts and prefix hits."""
from __future__ import annotations

import random

import pytest

from baton.engine.common.config import EngineConfig
from baton.engine.common.kv_groups import group_layers
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.common.scheduler_output import ModelRunnerOutput
from baton.engine.core.kv_cache_manager import KVCacheManager
from baton.engine.core.request import Request
from baton.engine.core.scheduler import Scheduler


def test_layers_group_by_window_in_equal_blocks():
    g = group_layers([16, 16, 16, 16, 16, None] * 2)  # Gemma 3's 5:1
    assert g.layers_per_block == 2 and g.hybrid
    assert g.windows.count(None) == 1 and g.windows.count(16) == 5
    assert sorted(layer for layers in g.layers for layer in layers) == list(range(12))
    assert g.slot_of()[5] == (g.layers.index((5, 11)), 0)
    assert group_layers([8, None, 8]).layers == ((0,), (1,), (2,))  # gcd 1: a block per layer
    assert group_layers([8, 8]).windows == (8,) and group_layers([8, 8]).layers == ((0, 1),)  # Mistral: one group
    assert group_layers([None, None]) == group_layers([8, None], hybrid=False)  # every layer keeps every block
    assert not group_layers([None, None]).hybrid


class TokenPool:
    """The pool's contents, token by token: writes each scheduled token into its slot in every
    group, and checks that each position a scheduled query reads (its group's window back) holds
    the request's own token."""

    def __init__(self, sched: Scheduler, num_blocks: int):
        self.sched, self.bs = sched, sched.kv.block_size
        self.pool = [[None] * self.bs for _ in range(num_blocks)]

    def run(self, out, rng) -> ModelRunnerOutput:
        sampled = {}
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.sched.requests[req_id]
            start = req.num_computed_tokens - n
            for blocks, window in zip(self.sched.kv.block_ids(req_id), self.sched.kv.windows, strict=True):
                assert len(blocks) * self.bs >= start + n
                for pos in range(start, start + n):
                    assert blocks[pos // self.bs] >= 0, (req_id, pos, "written where no block is")
                    self.pool[blocks[pos // self.bs]][pos % self.bs] = req.all_token_ids[pos]
                oldest = 0 if window is None else max(0, start - window + 1)  # the first query's window
                for pos in range(oldest, start):
                    block = blocks[pos // self.bs]
                    assert block >= 0 and self.pool[block][pos % self.bs] == req.all_token_ids[pos], (req_id, pos)
            if req.num_computed_tokens == req.num_tokens:
                sampled[req_id] = [rng.randrange(3)]
        return ModelRunnerOutput(sampled)


def check_refcounts(kv: KVCacheManager) -> int:
    """Checks the pool's references and caches; returns how many blocks sliding groups let go."""
    owners: dict[int, int] = {}
    holes = 0
    for groups in kv.req_blocks.values():
        assert len({len(blocks) for blocks in groups}) == 1  # every group covers the same positions
        for blocks in groups:
            held = [b for b in blocks if b is not None]
            assert blocks[:len(blocks) - len(held)] == [None] * (len(blocks) - len(held))  # holes lead
            holes += len(blocks) - len(held)
            for b in held:
                owners[b.block_id] = owners.get(b.block_id, 0) + 1
    for block in kv.blocks:
        assert block.ref_cnt == owners.get(block.block_id, 0)
        assert (block.ref_cnt == 0) == (block.block_id in kv.free_queue)
    assert all(cache[h].block_hash == h and cache[h].group == g for g, cache in enumerate(kv.caches) for h in cache)
    return holes


@pytest.mark.parametrize("seed", range(24))
def test_randomized_bookkeeping_of_sliding_and_full_groups(tmp_path, seed):
    rng = random.Random(seed)
    block_size, max_model_len = rng.choice([2, 4, 8]), rng.choice([32, 64])
    windows = rng.choice([(None, 5), (7, 7, None), (3,), (None, 9, 9), (12, None, 4)])
    config = EngineConfig(model=str(tmp_path), block_size=block_size, max_num_seqs=rng.randint(1, 6),
                          max_num_batched_tokens=rng.choice([8, 16, 64]), max_model_len=max_model_len,
                          long_prefill_token_threshold=rng.choice([0, 0, 5]),
                          scheduling_policy=rng.choice(["fcfs", "priority"]))
    num_blocks = len(windows) * (max_model_len // block_size) + rng.randrange(0, 24)
    kv = KVCacheManager(num_blocks, block_size, rng.random() < 0.9, windows)
    sched = Scheduler(config, kv)
    pool = TokenPool(sched, num_blocks)
    prefixes = [[rng.randrange(3) for _ in range(rng.randint(0, max_model_len // 2))] for _ in range(3)]
    pending, prompts = [], []
    for i in range(rng.randint(8, 24)):
        prompt = ((rng.choice(prefixes) + [rng.randrange(3) for _ in range(max_model_len)])
                  [:rng.randint(1, max_model_len - 1)])
        if prompts and rng.random() < 0.4:  # a prompt again
            prompt = rng.choice(prompts)
        prompts.append(prompt)
        pending.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 12)),
                               priority=rng.randint(0, 3)))
    holes = 0
    for _ in range(4000):
        if pending and rng.random() < 0.3:
            sched.add_request(pending.pop())
        if sched.requests and rng.random() < 0.04:
            sched.finish_requests([rng.choice(list(sched.requests))])
        if rng.random() < 0.005:
            kv.reset_prefix_cache()
        out = sched.schedule()
        holes += check_refcounts(kv)
        sched.update_from_output(out, pool.run(out, rng))
        if not pending and not sched.requests:
            break
    assert not sched.requests and not pending
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_blocks
    check_refcounts(kv)
    assert holes > 0  # windows moved on while requests ran
