"""Tensor parallelism's first slice: a model split over 2 ranks (gloo, one process each) computes
the logits the whole model does, prefill and decode, every rank alike: heads and KV heads split,
the MLP's intermediate split, vocabulary-parallel embeddings and LM head (a vocabulary that does
not divide, q/k/v biases, tied embeddings)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from baton.engine.common.errors import InvalidArgument
from baton.services.cli.launcher import free_port

from helpers import random_prompts
from tp_workers import prompt_logits, run_rank


def logits_over(model_dir: str, world: int, prompt: list[int], out) -> list[torch.Tensor]:
    os.makedirs(out, exist_ok=True)
    mp.spawn(run_rank, args=(world, free_port("127.0.0.1"), model_dir, prompt, str(out)), nprocs=world, join=True)
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]


@pytest.mark.parametrize("name", ["llama", "qwen2-odd-vocab"])
def test_two_ranks_compute_the_whole_models_logits(tiny_llama, tmp_path, name):
    from baton.engine.worker.loader import load_model
    from baton.testing.checkpoints import TINY, write_random_checkpoint

    model_dir = tiny_llama if name == "llama" else write_random_checkpoint(  # 517: shares of 259 and 258
        str(tmp_path / "qwen2"), TINY["qwen2"][0], seed=3, **{**TINY["qwen2"][1], "vocab_size": 517})
    prompt = random_prompts([37], seed=5)[0]
    model = load_model(model_dir, torch.float32, "cpu")
    model.prepare(256)
    with torch.inference_mode():
        want = prompt_logits(model, prompt)
    got = logits_over(model_dir, 2, prompt, tmp_path / name)
    for rank_logits in got:
        torch.testing.assert_close(rank_logits, want, atol=2e-5, rtol=2e-5)
    assert torch.equal(want[:-1].argmax(-1), got[1][:-1].argmax(-1))


def test_four_ranks_replicate_two_kv_heads(tiny_llama, tmp_path):
    """More ranks than KV heads (4 over Llama's 4 query and 2 KV heads): each KV head on the two
    ranks whose query head reads it; the logits still the whole model's."""
    from baton.engine.worker.loader import load_model

    prompt = random_prompts([21], seed=6)[0]
    model = load_model(tiny_llama, torch.float32, "cpu")
    model.prepare(256)
    with torch.inference_mode():
        want = prompt_logits(model, prompt)
    for rank_logits in logits_over(tiny_llama, 4, prompt, tmp_path / "tp4"):
        torch.testing.assert_close(rank_logits, want, atol=2e-5, rtol=2e-5)


def test_a_split_the_heads_do_not_allow_is_refused(tiny_llama):
    from baton.engine.worker.loader import load_model
    from baton.engine.worker.parallel.tensor_parallel import TPGroup, shard_model

    model = load_model(tiny_llama, torch.float32, "cpu")
    with pytest.raises(InvalidArgument, match="do not split 4 query and 2 KV heads") as err:
        shard_model(model, TPGroup(0, 3))
    assert err.value.field == "tensor_parallel_size"
