"""The sampling features users expect, checked against transformers and against references
written here from their definitions: repetition/presence/frequency penalties, logit bias,
min-p, logprobs and prompt logprobs, stop strings (whole and cut mid-token, streamed and not),
and n completions of one prompt."""
from __future__ import annotations

import math

import pytest
import torch
from helpers import random_prompts

from baton import LLM, SamplingParams
from baton.engine.common.errors import InvalidArgument
from baton.engine.worker.sampler import sample

LOGPROB_TOL = 1e-4  # float32 on both sides; the engine's attention kernel sums in another order


def hf_logits(hf, model_dir: str, ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(ids), V] (float32) for a whole sequence."""
    with torch.inference_mode():
        return hf.model(model_dir)(torch.tensor([ids])).logits[0].float()


def reference_greedy(hf, model_dir, prompt, n, process) -> list[int]:
    """Greedy decoding from transformers' logits with `process(logits, prompt, outputs)` applied."""
    out = []
    for _ in range(n):
        logits = hf_logits(hf, model_dir, prompt + out)[-1].clone()
        out.append(int(process(logits, prompt, out).argmax()))
    return out


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_equals_transformers(tiny_model, hf, penalty):
    prompts = random_prompts([8, 30, 3], seed=201, vocab=60)  # a small vocabulary: tokens repeat
    llm = LLM(tiny_model, dtype="float32", device="cpu")
    got = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                               repetition_penalty=penalty))
    for prompt, out in zip(prompts, got):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            want = hf.model(tiny_model).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                                 do_sample=False, repetition_penalty=penalty, eos_token_id=None,
                                                 min_new_tokens=24, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == want


def test_presence_frequency_penalties_and_logit_bias_follow_their_definitions(tiny_llama, hf):
    prompt = random_prompts([20], seed=202)[0]
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    presence, frequency, bias = 0.7, 0.4, {17: 3.5, 42: -100.0}

    def openai(logits, prompt, out):  # OpenAI's: logit - frequency × count - presence × [count > 0]
        for token in set(out):
            logits[token] -= frequency * out.count(token) + presence
        return logits

    def biased(logits, prompt, out):
        for token, b in bias.items():
            logits[token] += b
        return logits

    for params, process in ((dict(presence_penalty=presence, frequency_penalty=frequency), openai),
                            (dict(logit_bias=bias), biased)):
        got = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, **params))[0]
        assert got.token_ids == reference_greedy(hf, tiny_llama, prompt, 20, process), params
    forced = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                   logit_bias={99: 100.0}))[0]
    assert forced.token_ids == [99] * 5


def test_min_p_samples_only_tokens_within_min_p_of_the_likeliest():
    probs = torch.tensor([[0.40, 0.30, 0.15, 0.10, 0.05]])
    params = SamplingParams(temperature=1.0, min_p=0.3)  # keeps p >= 0.12: the first three
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[sample(probs.log(), [params], [g])[0]] += 1
    assert counts[3:].sum() == 0
    assert torch.allclose(counts[:3] / 4000, probs[0, :3] / probs[0, :3].sum(), atol=0.03)


def test_logprobs_are_transformers_log_softmax(tiny_model, hf):
    prompts = random_prompts([12, 45], seed=203)
    llm = LLM(tiny_model, dtype="float32", device="cpu", max_num_batched_tokens=16)  # the prompt in chunks
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=5, ignore_eos=True, logprobs=4, prompt_logprobs=3,
                            repetition_penalty=1.2)  # processing never changes the logprobs (vLLM's default)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        ids = prompt + out.token_ids
        ref = hf_logits(hf, tiny_model, ids).log_softmax(-1)
        assert len(out.outputs[0].logprobs) == 10 and out.prompt_logprobs[0] is None
        positions = [(len(prompt) - 1 + i, lp) for i, lp in enumerate(out.outputs[0].logprobs)]
        positions += [(j - 1, lp) for j, lp in enumerate(out.prompt_logprobs) if j > 0]
        assert len(positions) == 10 + len(prompt) - 1
        for pos, lp in positions:
            row = ref[pos]
            assert lp.token_id == ids[pos + 1]
            assert abs(lp.logprob - row[lp.token_id].item()) < LOGPROB_TOL
            x = row[lp.token_id]  # ranks and top lists up to ties within the tolerance
            assert int((row > x + LOGPROB_TOL).sum()) + 1 <= lp.rank <= int((row > x - LOGPROB_TOL).sum()) + 1
            want = row.topk(len(lp.top_token_ids))
            assert torch.allclose(torch.tensor(lp.top_logprobs), want.values, atol=LOGPROB_TOL)
            assert torch.allclose(row[lp.top_token_ids], want.values, atol=LOGPROB_TOL)
        assert len(out.outputs[0].logprobs[0].top_token_ids) == 4 and len(out.prompt_logprobs[1].top_token_ids) == 3
    # A prompt seen before still gets its logprobs (such requests compute the whole prompt). Within
    # the tolerance, not exactly: alone its chunks differ from the first run's (batched with the
    # other prompt), and a CPU may sum such batches in another order (last-bit differences).
    again = llm.generate(prompts[1:], params)[0]
    assert [lp.token_id for lp in again.prompt_logprobs[1:]] == prompts[1][1:]
    assert all(abs(a.logprob - b.logprob) < LOGPROB_TOL
               for a, b in zip(again.prompt_logprobs[1:], out.prompt_logprobs[1:]))
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def stop_case(llm: LLM, prompt: list[int], n: int = 24):
    """A greedy continuation, and a stop string that starts inside one token and ends inside the next."""
    full = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
    text = full.text
    pieces = [llm.tokenizer.decode(full.token_ids[:i]) for i in range(n + 1)]
    for i in range(n - 2):  # token i is text[a:b], token i + 1 is text[b:c]
        a, b, c = len(pieces[i]), len(pieces[i + 1]), len(pieces[i + 2])
        stable = all(text.startswith(pieces[k]) for k in (i, i + 1, i + 2)) and "\ufffd" not in text[a:c]
        if stable and b - a >= 3 and c - b >= 2 and text.find(text[a + 1:b + 1]) == a + 1:
            return full, text[a + 1:b + 1], a + 1, i + 2
    raise AssertionError("no pair of tokens long enough to cut")


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_spanning_tokens_and_starting_mid_token(tiny_llama, include):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    prompt = random_prompts([16], seed=204)[0]
    full, stop, at, last = stop_case(llm, prompt)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=["never appears", stop],
                            include_stop_str_in_output=include)
    out = llm.generate([prompt], params)[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.token_ids == full.token_ids[:last]  # ends with the token that completed the stop string
    assert out.text == full.text[:at + (len(stop) if include else 0)]
    # Not found: the text held back in case it began one comes out at the end, whole.
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                stop=[full.text[-3:] + "zzz"]))[0]
    assert out.text == full.text and out.finish_reason == "length"
    # Before min_tokens no stop string counts.
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop],
                                                min_tokens=last + 2))[0]
    assert out.finish_reason == "length"
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_n_completions_share_the_prompt_and_seeds_are_reproducible(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    prompt = random_prompts([70], seed=205)[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True, n=4)
    hits = llm.engine.kv.prefix_hits
    out = llm.generate([prompt], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4  # different streams
    assert llm.engine.kv.prefix_hits - hits >= 3 * 64  # the later three found the prompt's four full blocks
    assert [c.token_ids for c in llm.generate([prompt], params)[0].outputs] == [c.token_ids for c in out.outputs]
    alone = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, seed=13, ignore_eos=True))[0]
    assert alone.token_ids == out.outputs[2].token_ids  # completion i is seed + i
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


@pytest.mark.parametrize("field,value", [
    ("stop", [""]), ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", math.nan),
    ("min_p", 1.5), ("logit_bias", {-1: 1.0}), ("logit_bias", {5: 200.0}), ("logprobs", 21), ("prompt_logprobs", -1),
    ("n", 0), ("n", 17)])
def test_bad_sampling_parameters_name_their_field(field, value):
    with pytest.raises(InvalidArgument) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field


def test_a_logit_bias_outside_the_vocabulary_is_refused(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    with pytest.raises(InvalidArgument) as e:
        llm.generate([[5, 6]], SamplingParams(logit_bias={10**6: 1.0}))
    assert e.value.field == "logit_bias" and "vocabulary" in str(e.value)


@pytest.mark.slow
def test_smollm2_repetition_penalty_and_logprobs_equal_transformers(smollm2, hf):
    """The demo model loops on a short poem; a repetition penalty is what users reach for."""
    llm = LLM(smollm2, dtype="float32", device="cpu")
    prompt = llm.engine.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}])
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                repetition_penalty=1.3, logprobs=2))[0]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        want = hf.model(smollm2).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                          repetition_penalty=1.3, eos_token_id=None, min_new_tokens=24,
                                          pad_token_id=0)[0, len(prompt):].tolist()
    assert out.token_ids == want
    ref = hf_logits(hf, smollm2, prompt + out.token_ids).log_softmax(-1)
    for i, lp in enumerate(out.outputs[0].logprobs):
        assert abs(lp.logprob - ref[len(prompt) - 1 + i, lp.token_id].item()) < LOGPROB_TOL


def test_a_resumed_request_continues_as_the_uninterrupted_one(tiny_llama):
    """Outputs streamed by an instance that failed, taken as a new request's first outputs
    (GenerateRequest.resume): what the client gets from it after what it had equals the
    uninterrupted run, tokens, text and finish, stop strings and min_tokens included (a stop
    string seen before min_tokens must not drop the text held back at the cut)."""
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    engine = llm.engine

    def run(prompt, params, resumed=()):
        """Token ids, the text the client had after each token, and the finish reason."""
        engine.add(engine.inputs.core_request("r", prompt, params, resumed_output=list(resumed)))
        ids, texts, finish = [], [""], None
        while engine.has_unfinished_requests():
            for out in engine.step():
                ids += out.new_token_ids
                texts += [texts[-1]] * (len(out.new_token_ids) - 1) + [texts[-1] + out.text]
                finish = out.finish_reason
        return ids, texts, finish

    checked = 0
    for prompt in random_prompts([12] * 6, seed=330):
        whole = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
        for stop in {whole.text[1:3], whole.text[4:6]} - {""}:
            for sampling in (dict(temperature=0), dict(temperature=0.9, seed=4, presence_penalty=0.5)):
                params = SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop], min_tokens=6, **sampling)
                ids, texts, finish = run(prompt, params)
                for k in range(1, len(ids)):
                    rest, rest_texts, rest_finish = run(prompt, params, ids[:k])
                    assert (ids[:k] + rest, rest_finish) == (ids, finish), (prompt, stop, k)
                    assert texts[k] + rest_texts[-1] == texts[-1], (prompt, stop, k)
                    checked += 1
    assert checked > 50
