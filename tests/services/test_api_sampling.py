"""The sampling features over the public API: a colocated server and the router in front of
prefill and decode processes give what the offline engine gives — stop strings (also one
that begins in the prefill's token and ends in the decode's), logprobs, prompt logprobs,
penalties, min-p, logit bias, n completions — and bad values are refused naming the field."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from helpers import pools_full, random_prompts, wait_serving
from servers import ServerProcess, pd_stack

from baton import LLM, SamplingParams
from baton.services.client import AsyncClient

LOGPROB_TOL = 1e-4


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


@pytest.fixture(scope="module")
def tiers(tiny_llama):
    with pd_stack(tiny_llama, prefill=("--max-num-batched-tokens", "32")) as ((prefill,), (decode,), router):
        colocated = ServerProcess(tiny_llama)
        try:
            wait_serving(router.address)
            wait_serving(colocated.address)
            yield router, colocated, prefill, decode
        finally:
            colocated.stop()


async def completions(address: str, prompt, **sampling) -> dict[int, dict]:
    """Each completion's tokens, text, logprobs, prompt logprobs and last chunk, by index."""
    got: dict[int, dict] = {}
    async with AsyncClient(address) as client:
        async for chunk in client.generate(prompt, **sampling):
            c = got.setdefault(chunk.index, {"ids": [], "text": "", "logprobs": [], "prompt_logprobs": None})
            c["ids"] += chunk.token_ids
            c["text"] += chunk.text
            c["logprobs"] += chunk.logprobs or []
            c["prompt_logprobs"] = c["prompt_logprobs"] or chunk.prompt_logprobs
            c["last"] = chunk
    return got


def first_token_stop(llm: LLM, prompts):
    """A prompt whose greedy first token ends inside a stop string that the second completes."""
    for prompt in prompts:
        out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
        first, two = (llm.tokenizer.decode(out.token_ids[:k]) for k in (1, 2))
        if len(first) >= 2 and len(two) >= len(first) + 2 and "\ufffd" not in two and two.startswith(first) \
                and out.text.startswith(two):
            return prompt, two[1:len(first) + 1]  # its second character to the next token's first
    raise AssertionError("no prompt to cut")


CASES = [
    dict(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.4, logprobs=3, prompt_logprobs=2),
    dict(max_tokens=12, temperature=0, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.5,
         logit_bias={7: 2.5, 99: -100.0}),
    dict(max_tokens=12, temperature=0.9, seed=21, min_p=0.05, top_p=0.95, ignore_eos=True, logprobs=0),
    dict(max_tokens=8, temperature=1.0, seed=4, ignore_eos=True, n=3, logprobs=1),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_through_the_router_and_colocated_equal_the_offline_engine(tiers, tiny_llama, case):
    router, colocated, prefill, decode = tiers
    sampling = CASES[case]
    prompt = random_prompts([40], seed=300 + case)[0]
    offline = LLM(tiny_llama, dtype="float32", device="cpu").generate([prompt], SamplingParams(**sampling))[0]
    for address in (colocated.address, router.address):
        got = run(completions(address, prompt, **sampling))
        assert sorted(got) == list(range(sampling.get("n", 1)))
        for index, want in enumerate(offline.outputs):
            c = got[index]
            assert c["ids"] == want.token_ids and c["text"] == want.text, (address, index)
            assert c["last"].finish_reason == want.finish_reason and c["last"].usage.completion_tokens == len(c["ids"])
            if want.logprobs is not None:
                assert [lp.token_id for lp in c["logprobs"]] == want.token_ids
                assert all(abs(a.logprob - b.logprob) < LOGPROB_TOL and a.rank == b.rank and
                           list(a.top_token_ids) == b.top_token_ids for a, b in zip(c["logprobs"], want.logprobs))
        if offline.prompt_logprobs is not None:
            lps = got[0]["prompt_logprobs"]
            assert [lp.token_id for lp in lps] == prompt[1:]
            assert all(abs(a.logprob - b.logprob) < LOGPROB_TOL for a, b in zip(lps, offline.prompt_logprobs[1:]))
    assert pools_full(prefill.address) and pools_full(decode.address)


def test_a_stop_string_across_the_handoff_is_cut_and_never_streamed_past(tiers, tiny_llama):
    """The stop string begins in the prefill's token and ends in the decode's: the prefill holds
    back what could begin it, the decode picks that up and cuts."""
    router, colocated, prefill, decode = tiers
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    prompt, stop = first_token_stop(llm, random_prompts([20] * 40, seed=310))
    for include in (False, True):
        sampling = dict(max_tokens=6, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=include)
        want = llm.generate([prompt], SamplingParams(**sampling))[0]
        assert want.finish_reason == "stop" and len(want.token_ids) == 2
        for address in (router.address, colocated.address):
            got = run(completions(address, prompt, **sampling))[0]
            assert got["text"] == want.text and got["ids"] == want.token_ids  # streamed: nothing past the stop
            assert got["last"].finish_reason == "stop" and got["last"].stop_reason == stop
    assert pools_full(prefill.address) and pools_full(decode.address)


def test_a_stop_string_in_the_first_token_waits_for_min_tokens_across_the_handoff(tiers, tiny_llama):
    """The prefill samples the first token; a stop string in it must not end the request there
    while min_tokens is not reached (the decode goes on, as colocated does)."""
    router, colocated, prefill, decode = tiers
    llm = LLM(tiny_llama, dtype="float32", device="cpu")
    prompt = random_prompts([24], seed=320)[0]
    first = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))[0].text
    stop = next(ch for ch in first if not ch.isspace())
    for min_tokens in (0, 3):
        sampling = dict(max_tokens=6, temperature=0, ignore_eos=True, stop=[stop], min_tokens=min_tokens)
        want = llm.generate([prompt], SamplingParams(**sampling))[0]
        assert len(want.token_ids) == (1 if min_tokens == 0 else 6) or want.finish_reason == "stop"
        for address in (router.address, colocated.address):
            got = run(completions(address, prompt, **sampling))[0]
            assert (got["ids"], got["text"], got["last"].finish_reason) == (want.token_ids, want.text,
                                                                            want.finish_reason), (address, min_tokens)
    assert pools_full(prefill.address) and pools_full(decode.address)


@pytest.mark.parametrize("field,value", [("presence_penalty", 3.0), ("logprobs", 50), ("stop", [""]),
                                         ("logit_bias", {10**6: 1.0}), ("n", 40), ("min_p", 2.0),
                                         ("stop_token_ids", [10**6])])
def test_bad_sampling_values_are_refused_naming_the_field(tiers, field, value):
    router, colocated, _, _ = tiers
    for address in (router.address, colocated.address):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            run(completions(address, [5, 6, 7], max_tokens=4, **{field: value}))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith(f"sampling.{field}"), e.value.details()
