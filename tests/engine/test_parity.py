"""The spine: Baton's greedy output is token-for-token transformers' (float32), however the
scheduler slices the work (batching, chunked prefill, preemption, prefix caching, priorities)."""
from __future__ import annotations

import pytest
from conftest import require_cpu_kernel
from helpers import GREEDY, assert_matches_hf, random_prompts

from baton import LLM, SamplingParams


def test_one_text_prompt(tiny_model, hf):
    llm = LLM(tiny_model, dtype="float32", device="cpu")
    out = llm.generate("the capital of France is", SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == hf.greedy(tiny_model, out.prompt_token_ids, 32)
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def use_attention(llm: LLM, path: str) -> None:
    """Runs the engine's attention on the CPU kernel or on the PyTorch reference."""
    if path == "cpu kernel":
        require_cpu_kernel()
        assert llm.engine.runner.attention_backend == "cpu"
    else:
        llm.engine.runner.batches.attention_backend = "torch"


@pytest.mark.parametrize("attention", ["cpu kernel", "reference, one group", "reference, per length"])
def test_batch_of_mixed_lengths(tiny_model, hf, attention):
    prompts = random_prompts([3, 16, 17, 40, 77, 130])
    llm = LLM(tiny_model, dtype="float32", device="cpu", enable_prefix_caching=False)
    use_attention(llm, attention.split(",")[0])
    if attention == "reference, per length":  # no padding allowed: every context length its own group
        llm.engine.runner.batches.decode_padding_elems = 0
    assert_matches_hf(hf, tiny_model, prompts, llm.generate(prompts, GREEDY))
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


@pytest.mark.parametrize("attention", ["cpu kernel", "reference"])
@pytest.mark.parametrize("budget,threshold", [(24, 0), (64, 10)])
def test_chunked_prefill(tiny_model, hf, budget, threshold, attention):
    prompts = random_prompts([130, 9, 57, 33], seed=1)
    llm = LLM(tiny_model, dtype="float32", device="cpu", max_num_batched_tokens=budget,
              long_prefill_token_threshold=threshold, enable_prefix_caching=False)
    use_attention(llm, attention)
    assert_matches_hf(hf, tiny_model, prompts, llm.generate(prompts, GREEDY))
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_by_recompute(tiny_model, hf, policy):
    prompts = random_prompts([100, 60, 90, 30, 75, 45], seed=2)
    # 12 blocks of 16 tokens: each request fits alone, the batch does not.
    llm = LLM(tiny_model, dtype="float32", device="cpu", num_kv_blocks=12, max_model_len=192,
              scheduling_policy=policy)
    outs = llm.generate(prompts, GREEDY, priority=[3, 1, 4, 1, 5, 9])
    assert llm.engine.scheduler.num_preemptions > 0
    assert_matches_hf(hf, tiny_model, prompts, outs)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


@pytest.mark.parametrize("attention", ["cpu kernel", "reference"])
def test_prefix_cache_hits(tiny_model, hf, attention):
    shared = random_prompts([48], seed=3)[0]
    tails = random_prompts([5, 21, 1], seed=4)
    prompts = [shared + t for t in tails]
    llm = LLM(tiny_model, dtype="float32", device="cpu", max_num_batched_tokens=64)
    use_attention(llm, attention)
    first = llm.generate(prompts, GREEDY)
    assert_matches_hf(hf, tiny_model, prompts, first)
    # The same prompt twice in one batch: the second is admitted while the first's KV is
    # still being computed in the same step.
    twice = llm.generate([prompts[1], prompts[1]], GREEDY)
    assert_matches_hf(hf, tiny_model, [prompts[1]] * 2, twice)
    assert all(o.num_cached_tokens >= 48 for o in twice)
    assert first[0].num_cached_tokens == 0 and [o.num_cached_tokens for o in first[1:]] == [48, 48]
    assert llm.engine.kv.prefix_hits > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_bfloat16_runs_and_returns_the_pool(tiny_llama):
    llm = LLM(tiny_llama, dtype="bfloat16", device="cpu")
    outs = llm.generate(random_prompts([20, 50]), GREEDY)
    assert (llm.engine.runner.kv_cache.dtype.is_floating_point
            and str(llm.engine.runner.kv_cache.dtype) == "torch.bfloat16")
    assert [len(o.token_ids) for o in outs] == [20, 20]
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_smollm2_chat_batch(smollm2, hf):
    llm = LLM(smollm2, dtype="float32", device="cpu")
    questions = ["What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
                 "Write one sentence about the sea."]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    outs = llm.chat(conversations, SamplingParams(max_tokens=40, temperature=0))
    for out in outs:
        assert out.token_ids == hf.greedy(smollm2, out.prompt_token_ids, 40, stop_at_eos=True)
    assert "Paris" in outs[0].text
    assert outs[0].finish_reason == "stop"
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


@pytest.mark.parametrize("policy,expected", [("priority", ["1", "2", "0"]), ("fcfs", ["0", "1", "2"])])
def test_policy_sets_the_order(tiny_llama, hf, policy, expected):
    llm = LLM(tiny_llama, dtype="float32", device="cpu", max_num_seqs=1, scheduling_policy=policy)
    prompts = random_prompts([30, 12, 50], seed=5)
    for i, (prompt, priority) in enumerate(zip(prompts, [2, 0, 1])):
        llm.engine.add_request(str(i), prompt, GREEDY, priority=priority)
    finished, tokens = [], {str(i): [] for i in range(3)}
    while llm.engine.has_unfinished_requests():
        for step in llm.engine.step():
            tokens[step.request_id] += step.new_token_ids
            if step.finished:
                finished.append(step.request_id)
    assert finished == expected
    for i, prompt in enumerate(prompts):
        assert tokens[str(i)] == hf.greedy(tiny_llama, prompt, GREEDY.max_tokens)


def test_triton_kernels_in_the_engine(tiny_model, hf):
    """The GPU path's kernels run the engine (on CPU under Triton's interpreter, as CI has no
    GPU): a batch of mixed lengths, chunked, preempted in a tight pool, with prefix-cache hits."""
    pytest.importorskip("triton")
    prompts = random_prompts([3, 17, 40, 130], seed=11)
    prompts.append(prompts[2][:33] + prompts[0])  # shares two blocks with the third
    llm = LLM(tiny_model, dtype="float32", device="cpu", attention_backend="triton", max_num_batched_tokens=48,
              num_kv_blocks=14, max_model_len=192)
    assert llm.engine.runner.attention_backend == "triton"
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.prefix_hits > 0
    assert_matches_hf(hf, tiny_model, prompts, outs)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
