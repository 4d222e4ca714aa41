"""The same engine on a CUDA device (skipped where there is none, as in CI)."""
from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams

from helpers import random_prompts
from test_parity import GREEDY, assert_matches_hf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("budget", [2048, 24])
def test_cuda_float32_matches_transformers(tiny_model, hf, budget):
    prompts = random_prompts([3, 17, 40, 130], seed=11)
    llm = LLM(tiny_model, dtype="float32", device="cuda", max_num_batched_tokens=budget, num_kv_blocks=14,
              max_model_len=192)
    outs = llm.generate(prompts + [prompts[2]], GREEDY)  # tight pool: preemption; repeated prompt: prefix hits
    assert_matches_hf(hf, tiny_model, prompts + [prompts[2]], outs)
    assert llm.engine.runner.kv_cache.is_cuda
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_cuda_bfloat16_defaults(tiny_llama):
    llm = LLM(tiny_llama)  # device and dtype "auto": cuda, bfloat16
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16 and llm.engine.runner.kv_cache.is_cuda
    outs = llm.generate(random_prompts([20, 90], seed=12), SamplingParams(max_tokens=16, temperature=0.7, seed=1))
    assert all(1 <= len(o.token_ids) <= 16 for o in outs)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
