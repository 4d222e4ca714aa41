"""Speculative decoding: drafts verified in one forward keep the output what it is without them.

Greedy output with drafts equals output without (batched, chunked, preempted, prefix-cached,
with logprobs and stop tokens); sampled output follows the target's distribution (rejection
sampling, checked on a tiny vocabulary) and repeats under a seed; bad configurations are
refused naming the field. A random-weight checkpoint's greedy text rarely repeats itself, so the
verification paths are driven by an oracle proposer (drafts from a run without speculation, some
of them wrong on purpose); the n-gram proposer is checked on its own and end to end.
"""
from __future__ import annotations

import weakref

import pytest
import torch
from helpers import greedy_through, random_prompts

from baton import LLM, SamplingParams
from baton.engine.common.errors import InvalidArgument
from baton.engine.common.sampling_params import SamplingParams as Params
from baton.engine.worker.spec_decode import Proposer
from baton.engine.worker.spec_decode.draft_model import DraftModelProposer
from baton.engine.worker.spec_decode.ngram import NgramProposer
from baton.engine.worker.spec_decode.verify import greedy_accept, sampled_accept

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


class OracleProposer(Proposer):
    """Drafts of the continuation a run without drafts produced, every `wrong`-th one off by one:
    accepted drafts, rejections at every position, and whole accepted runs."""

    def __init__(self, sequences: list[list[int]], wrong: int = 3):
        self.sequences, self.wrong = sequences, wrong

    def propose(self, states: list, k: int) -> list[list[int]]:
        return [self.match(s.token_ids, k) for s in states]

    def match(self, token_ids: list[int], k: int) -> list[int]:
        n = len(token_ids)
        for seq in self.sequences:
            if seq[:n] == token_ids:
                return [t + 1 if (n + i) % self.wrong == 0 else t for i, t in enumerate(seq[n:n + k])]
        return []


def prompts() -> list[list[int]]:
    out = random_prompts([5, 23, 40, 61, 90], seed=17)
    return out + [out[3][:48] + out[0]]  # shares three blocks with the fourth


def test_the_ngram_proposer_takes_the_latest_longest_match():
    proposer = NgramProposer(min_n=2, max_n=3)
    #                0  1  2  3  4  5  6  7  8  9 10 11
    assert proposer.match([4, 2, 3, 9, 7, 2, 3, 8, 5, 1, 2, 3], 3) == [8, 5, 1]  # "2 3" last seen at 5
    assert proposer.match([4, 1, 2, 3, 6, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # "1 2 3" (3 tokens) at 5
    assert proposer.match([1, 2, 3, 4, 5], 4) == []  # nothing repeats
    assert proposer.match([5, 6, 5, 6], 4) == [5, 6]  # only what follows the match


def test_greedy_accept_keeps_drafts_up_to_the_first_miss():
    assert greedy_accept([7, 8, 9, 1], [7, 8, 9]) == [7, 8, 9, 1]
    assert greedy_accept([7, 8, 9, 1], [7, 5, 9]) == [7, 8]
    assert greedy_accept([7, 8], [3]) == [7]


def run(model_dir, ps, params, proposer=None, **engine):
    llm = LLM(model_dir, dtype="float32", device="cpu", **engine)
    if proposer is not None:
        llm.engine.runner.drafting.proposer = proposer
    outs = llm.generate(ps, params)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks  # no block leaked, drafts or not
    return llm, outs


def test_greedy_with_drafts_equals_without(tiny_llama):
    """Batched, chunked, preempted (a small pool), prefix-cached; one request stops on a token
    its drafts run past; logprobs of the kept drafts equal those computed one by one."""
    ps = prompts()
    _, plain = run(tiny_llama, ps, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    stop_at = plain[2].token_ids[10]  # inside a run of drafts
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2,
                             stop_token_ids=[stop_at] if i == 2 else []) for i in range(len(ps))]
    _, want = run(tiny_llama, ps, params)
    sequences = [p + o.token_ids for p, o in zip(ps, plain)]
    llm, got = run(tiny_llama, ps, params, OracleProposer(sequences), speculative_config=NGRAM,
                   max_num_batched_tokens=32, num_kv_blocks=14, max_model_len=192)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[2].token_ids[-1] == stop_at and got[2].finish_reason == "stop"
    for g, w in zip(got, want):
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert a.token_id == b.token_id and a.top_token_ids == b.top_token_ids
            assert abs(a.logprob - b.logprob) < 1e-4
    scheduler = llm.engine.core.scheduler
    stats = scheduler.spec_stats
    assert scheduler.num_preemptions > 0 and llm.engine.kv.prefix_hits > 0
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert len(stats.accepted_per_pos) >= 2  # whole runs of drafts kept, not only the first


def test_the_ngram_proposer_end_to_end_equals_without(tiny_qwen2):
    ps = [p + p for p in random_prompts([9, 30], seed=3)] + random_prompts([12], seed=4)  # copies to find
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    _, want = run(tiny_qwen2, ps, params)
    llm, got = run(tiny_qwen2, ps, params, speculative_config=NGRAM)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_rejection_sampling_keeps_the_target_distribution():
    """A vocabulary of 5: for drafts that p likes, dislikes, and cannot produce (top-k cut), the
    first token's frequencies over 20,000 draws match p within 4 standard errors; so does the
    second token's, given the first draft was kept."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 1.5, -0.5, 1.0, 0.2], [1.0, 1.0, 1.0, 1.0, 1.0]])
    params = Params(temperature=0.8, top_k=4)
    probs = torch.softmax(logits / 0.8, dim=-1)
    probs[0, 3] = 0.0  # top-k 4 drops each row's least likely
    probs[1, 2] = 0.0
    probs = probs / probs.sum(-1, keepdim=True)
    gen = torch.Generator().manual_seed(0)
    trials = 20_000
    for drafts in ([0, 1], [4, 3], [3, 1]):
        first, second = torch.zeros(5), torch.zeros(5)
        for _ in range(trials):
            out = sampled_accept(logits.clone(), drafts, params, gen)
            first[out[0]] += 1
            if out[0] == drafts[0] and len(out) > 1:
                second[out[1]] += 1
        for counts, p in ((first, probs[0]), (second, probs[1])):
            n = counts.sum()
            if n < 2000:
                continue  # a first draft rarely kept says too little about the second position
            error = 4 * torch.sqrt(p * (1 - p) / n) + 1e-3
            assert torch.all((counts / n - p).abs() <= error), (drafts, counts / n, p)
        assert first[3] == 0  # never a token the target cannot sample


def test_seeded_sampling_with_drafts_repeats(tiny_llama):
    ps = prompts()[:3]
    sequences = [p + o.token_ids for p, o in zip(ps, run(tiny_llama, ps, SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True))[1])]
    params = SamplingParams(max_tokens=20, temperature=0.7, seed=11, ignore_eos=True)
    outs = [[o.token_ids for o in run(tiny_llama, ps, params, OracleProposer(sequences, wrong=4),
                                      speculative_config=NGRAM)[1]] for _ in range(2)]
    assert outs[0] == outs[1]


def test_speculation_stops_above_disable_by_batch_size(tiny_llama):
    ps = prompts()
    _, plain = run(tiny_llama, ps, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    sequences = [p + o.token_ids for p, o in zip(ps, plain)]
    spec = {**NGRAM, "disable_by_batch_size": 3}
    llm, got = run(tiny_llama, ps, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                   OracleProposer(sequences), speculative_config=spec, max_num_seqs=8)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert llm.engine.core.scheduler.spec_stats.num_drafts == 0  # six running: never under three


@pytest.mark.parametrize("config,field", [
    ({"method": "medusa"}, "speculative_config.method"),
    ({"method": "mtp"}, "speculative_config.method"),
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 99}, "speculative_config.num_speculative_tokens"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_max"),
    ({"lookahead": 3}, "speculative_config.lookahead"),
    ("ngram", "speculative_config"),
])
def test_a_bad_speculative_config_is_refused_naming_the_field(tiny_llama, config, field):
    with pytest.raises(InvalidArgument) as err:
        LLM(tiny_llama, dtype="float32", device="cpu", speculative_config=config)
    assert err.value.field == field


def test_penalties_min_tokens_and_logit_bias_shape_every_draft_row(tiny_llama):
    """Each draft row is processed as the single row after the drafts before it would be:
    penalties over those tokens, stop tokens held back until min_tokens (EOS not ignored)."""
    ps = prompts()[:4]
    params = [SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.4, presence_penalty=0.5,
                             frequency_penalty=0.3, logit_bias={7: 2.0}, min_tokens=8),
              SamplingParams(max_tokens=20, temperature=0.0, min_tokens=12, logprobs=1)] * 2
    _, want = run(tiny_llama, ps, params)
    sequences = [p + o.token_ids for p, o in zip(ps, want)]
    llm, got = run(tiny_llama, ps, params, OracleProposer(sequences), speculative_config=NGRAM)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert llm.engine.core.scheduler.spec_stats.num_accepted_tokens > 0


def test_structured_output_checks_drafts_against_the_grammar(tiny_llama):
    """Drafts the grammar refuses are rejected (never advance the matcher); output equals the
    run without drafts."""
    from baton.engine.common.structured_output import StructuredOutput

    ps = prompts()[:3]
    params = SamplingParams(max_tokens=16, temperature=0.0,
                            structured_output=StructuredOutput("regex", "[a-e]{2,6}-[0-9]{3,9}"))
    _, want = run(tiny_llama, ps, params)
    sequences = [p + o.token_ids for p, o in zip(ps, want)]
    llm, got = run(tiny_llama, ps, params, OracleProposer(sequences, wrong=2), speculative_config=NGRAM)
    assert [(o.token_ids, o.text) for o in got] == [(o.token_ids, o.text) for o in want]
    stats = llm.engine.core.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_grammar_forced_tokens_are_free_drafts(tiny_llama):
    """Where the grammar allows one continuation only (a JSON schema's keys and punctuation),
    its tokens are drafted with no proposer's help; output equals the run without drafts."""
    import json

    from baton.engine.common.structured_output import StructuredOutput

    schema = {"type": "object", "properties": {"temperature_celsius": {"type": "integer", "minimum": -50,
                                                                       "maximum": 60},
                                               "condition_summary": {"enum": ["sunny", "overcast"]}},
              "required": ["temperature_celsius", "condition_summary"], "additionalProperties": False}
    params = SamplingParams(max_tokens=64, temperature=0.0,
                            structured_output=StructuredOutput("json_schema", json.dumps(schema)))
    ps = prompts()[:2]
    _, want = run(tiny_llama, ps, params)
    llm, got = run(tiny_llama, ps, params, OracleProposer([]), speculative_config=NGRAM)  # the oracle knows nothing
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(json.loads(o.text).keys() == schema["properties"].keys() for o in got)
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0  # the keys came as drafts


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_the_decode_tier_speculates_through_the_router(tiny_llama, tmp_path, method):
    """Router -> prefill -> decode with drafts on the decode (n-gram, configured on the decode
    alone; the target as its own draft model, or a random EAGLE-3 head, configured on both: the
    prefill ships its KV of the prompt with the target's): output equals the offline engine's
    without them, pools full at the end."""
    import json

    from helpers import pools_full, wait_serving
    from servers import pd_stack

    from baton.testing.eagle_heads import write_head

    ps = [p + p for p in random_prompts([12, 30], seed=21)] + random_prompts([45], seed=22)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    _, want = run(tiny_llama, ps, params)
    spec = {"method": method, "num_speculative_tokens": 3, **{
        "ngram": {"prompt_lookup_min": 1}, "draft_model": {"model": tiny_llama},
        "eagle3": {"model": write_head(str(tmp_path / "head"), tiny_llama, "eagle3")}}[method]}
    flags = ("--speculative-config", json.dumps(spec))
    with pd_stack(tiny_llama, decode=flags, prefill=flags if method != "ngram" else ()) as (
            (prefill,), (decode,), router):
        wait_serving(router.address)
        assert greedy_through(router.address, ps, 24) == [o.token_ids for o in want]
        assert pools_full(prefill.address) and pools_full(decode.address)


def test_a_pd_pair_ships_the_draft_models_kv(tiny_llama, tiny_draft):
    """The prefill catches its draft up on the prompt as the request ends, in pieces of
    max_num_batched_tokens (16 here) as the target's chunks, and the decode reads the draft's
    blocks with the target's: the decode never runs its draft over a prompt (no catch-up longer
    than a verification's k + 1 tokens), drafts as a colocated engine does, and its output is the
    colocated run's."""
    from nixl_engines import assert_drafts_as_colocated, head_across_pd, nixl_engine

    from baton.kv_transfer.base import KVFormatMismatch

    ps = random_prompts([12, 30, 45], seed=22)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    spec = {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 3}
    rows, forward = [], DraftModelProposer._forward

    def counted(self, ids, spans, num_decodes):
        rows.append((self, max(b - a for a, b, _ in spans)))
        return forward(self, ids, spans, num_decodes)

    DraftModelProposer._forward = counted
    try:
        want, got, colocated, drafted, layout, pulled = head_across_pd(tiny_llama, spec, ps, params,
                                                                       max_num_batched_tokens=16)
    finally:
        DraftModelProposer._forward = forward
    assert got == want
    assert_drafts_as_colocated(ps, want, colocated, drafted)
    decode_proposer = rows[-1][0]  # (the decode's was the last to draft)
    assert max(n for who, n in rows if who is decode_proposer) <= 4
    # The colocated engine's and the prefill's catch-ups over prompts, in pieces of 16.
    assert len({id(who) for who, n in rows if n == 16}) == 2 and max(n for _, n in rows) == 16
    assert pulled == sum(-(-len(p) // 16) for p in ps) * (layout.block_bytes + layout.draft_block_bytes)
    # A prefill without the draft (or with another) cannot give the decode the draft's KV.
    decode = nixl_engine(tiny_llama, "decode", speculative_config=spec)
    for prefill_spec, field in ((None, "draft_method"), ({**spec, "model": tiny_llama}, "draft_model")):
        with pytest.raises(KVFormatMismatch, match="same speculative_config") as err:
            decode.core.add_peer(nixl_engine(tiny_llama, "prefill", speculative_config=prefill_spec).core.connector
                                 .layout)
        assert err.value.field == field


def test_a_draft_model_that_is_the_target_is_always_right(tiny_llama):
    """The target as its own draft: every draft kept (its KV, caught up lazily, in the target's
    blocks and the lookahead slots, is right), through chunks, preemptions and prefix hits, and
    the output equals the run without drafts."""
    ps = prompts()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    _, want = run(tiny_llama, ps, params)
    spec = {"method": "draft_model", "model": tiny_llama, "num_speculative_tokens": 3}
    llm, got = run(tiny_llama, ps, params, speculative_config=spec, max_num_batched_tokens=32, num_kv_blocks=16,
                   max_model_len=192)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats, scheduler = llm.engine.core.scheduler.spec_stats, llm.engine.core.scheduler
    assert scheduler.num_preemptions > 0 and llm.engine.kv.prefix_hits > 0
    assert stats.num_draft_tokens > 50 and stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens


def test_a_small_draft_model_keeps_the_targets_output(tiny_llama, tiny_draft):
    ps = prompts()
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)] * 3
    _, want = run(tiny_llama, ps, params)
    spec = {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 4}
    _, got = run(tiny_llama, ps, params, speculative_config=spec)
    assert [o.token_ids for o in got][::2] == [o.token_ids for o in want][::2]  # greedy: equal
    _, again = run(tiny_llama, ps, params, speculative_config=spec)
    assert [o.token_ids for o in again] == [o.token_ids for o in got]  # seeded: repeatable


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_llama, tmp_path):
    from baton.testing.checkpoints import write_random_checkpoint

    other = write_random_checkpoint(str(tmp_path / "other"), "LlamaConfig", hidden_size=32, intermediate_size=64,
                                    num_attention_heads=2, num_hidden_layers=1, vocab_size=600)
    for spec, message in (({"method": "draft_model", "model": other}, "vocabulary"),
                          ({"method": "draft_model"}, "draft checkpoint"),
                          ({"method": "ngram", "model": other}, "is for draft_model")):
        with pytest.raises(InvalidArgument, match=message) as err:
            LLM(tiny_llama, dtype="float32", device="cpu", speculative_config=spec)
        assert err.value.field == "speculative_config.model"


def test_lora_n_and_stop_strings_with_drafts(tiny_llama, adapters):
    """Drafts verified under a request's LoRA adapter; n completions each speculate; a stop
    string inside a run of kept drafts ends the text there. All as without drafts."""
    ps = prompts()[:3]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, n=2),
              SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)]

    def go(proposer=None, spec=None):
        llm = LLM(tiny_llama, dtype="float32", device="cpu", enable_lora=True, max_loras=2,
                  **({"speculative_config": spec} if spec else {}))
        llm.load_adapter("chat", adapters["chat"])
        if proposer is not None:
            llm.engine.runner.drafting.proposer = proposer
        outs = llm.generate(ps, params, lora_request=["chat", None, "chat"])
        assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
        return llm, outs

    _, want = go()
    sequences = [p + c.token_ids for p, o in zip(ps, want) for c in o.outputs]
    llm, got = go(OracleProposer(sequences), NGRAM)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert llm.engine.core.scheduler.spec_stats.num_accepted_tokens > 0
    stop = want[1].text[len(want[1].text) // 2:][:3]  # a piece of text from the middle of a completion
    with_stop = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop])] * 3
    plain = LLM(tiny_llama, dtype="float32", device="cpu").generate(ps, with_stop)
    spec_llm = LLM(tiny_llama, dtype="float32", device="cpu", speculative_config=NGRAM)
    spec_llm.engine.runner.drafting.proposer = OracleProposer([p + o.token_ids for p, o in zip(ps, LLM(
        tiny_llama, dtype="float32", device="cpu").generate(ps, SamplingParams(max_tokens=20, temperature=0.0,
                                                                                ignore_eos=True)))])
    drafted = spec_llm.generate(ps, with_stop)
    assert [(o.token_ids, o.text, o.finish_reason) for o in drafted] == [(o.token_ids, o.text, o.finish_reason)
                                                                         for o in plain]
    assert plain[1].finish_reason == "stop"


@pytest.mark.parametrize("spec", [{**NGRAM, "prompt_lookup_min": 1},
                                  {"method": "draft_model", "num_speculative_tokens": 3}])
def test_a_migrated_request_resumes_speculating(tiny_llama, spec):
    """A request another decode began (its outputs so far resumed here, as the router's failover
    sends it) goes on speculating from where it is: the draft model catches up over the prompt
    and the resumed outputs, n-gram looks them up; the rest equals the uninterrupted run."""
    copy = random_prompts([40], seed=31)[0]
    prompt = copy + copy[:10]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    spec = {**spec, "model": tiny_llama} if spec["method"] == "draft_model" else spec
    _, (whole,) = run(tiny_llama, [prompt], params)
    llm = LLM(tiny_llama, dtype="float32", device="cpu", speculative_config=spec)
    moved = llm.engine.inputs.core_request("moved", prompt, params, resumed_output=whole.token_ids[:12])
    request = llm.engine.add(moved)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert request.output_token_ids == whole.token_ids
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_drafts > 0
    if spec["method"] == "draft_model":  # the target as its own draft: right wherever it caught up
        assert stats.num_draft_tokens >= 9 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_an_engine_with_a_draft_model_is_freed_when_dropped(tiny_llama, tiny_draft):
    """Nothing of the draft's proposer refers back to the runner: an engine dropped is freed at
    once, its caches with it, not at the garbage collector's next full pass (rare in a large process)."""
    spec = {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 2}
    llm = LLM(tiny_llama, dtype="float32", device="cpu", speculative_config=spec)
    llm.generate(prompts()[:2], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    runner, cache = weakref.ref(llm.engine.runner), weakref.ref(llm.engine.runner.kv_cache)
    del llm
    assert runner() is None and cache() is None
