"""Sampling: seeded requests reproduce whatever shares their batch; greedy equals top-k 1."""
from __future__ import annotations

import torch
from helpers import random_prompts

from baton import LLM, SamplingParams
from baton.engine.worker.sampler import _apply_top_k_top_p, sample


def test_seeded_sampling_is_independent_of_the_batch(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    prompt = random_prompts([25], seed=7)[0]
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].token_ids
    others = random_prompts([5, 60, 33], seed=8)
    unseeded = SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True)
    crowd = llm.generate(others[:2] + [prompt] + others[2:], [unseeded, unseeded, seeded, unseeded])
    assert crowd[2].token_ids == alone
    # ... and after preemption by recompute, in a tight pool.
    tight = LLM(tiny_llama, dtype="float32", device="cpu", num_kv_blocks=10, max_model_len=160)
    squeezed = tight.generate(others + [prompt], [unseeded] * 3 + [seeded])
    assert tight.engine.scheduler.num_preemptions > 0
    assert squeezed[3].token_ids == alone
    other_seed = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=1.0, seed=99, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_top_k_one_is_greedy_and_top_p_keeps_the_head():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.7, top_p=1e-6),
              SamplingParams(temperature=0.0)]
    assert sample(logits, params, gens) == logits.argmax(-1).tolist()


def test_top_k_top_p_masks():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    masked = _apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([1.0]))
    assert torch.isinf(masked[0, 3:]).all() and not torch.isinf(masked[0, :3]).any()
    # softmax of [4, 3, 2, 1, 0] is about [.64, .24, .09, .03, .01]: top_p .8 keeps two tokens.
    masked = _apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.8]))
    assert (~torch.isinf(masked[0])).sum() == 2


def test_sampled_frequencies_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(logits, [SamplingParams(temperature=1.0)], [g])[0]] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_draws_from_a_shared_generator_come_in_one_launch_and_equal_row_by_row_draws():
    """Every unseeded request draws from the engine's generator: one [rows, V] draw for all of
    them gives each row what drawing row by row would, and a seeded row keeps its own stream."""
    from baton.engine.worker.sampler import _noise, _noises

    def generators():
        shared, seeded = torch.Generator().manual_seed(3), torch.Generator().manual_seed(9)
        return [shared, seeded, shared, shared]

    gens = generators()
    want = torch.stack([_noise(50, "cpu", g) for g in gens])
    # Exact by construction: the same generator's stream in the same order, each draw transformed
    # on its own (no reduction), so batching cannot change a bit; seeded reproducibility needs it.
    assert torch.equal(_noises(50, "cpu", generators()), want)
