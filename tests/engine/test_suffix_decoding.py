"""Suffix decoding's trees: counts of every path, the likeliest continuation of the longest
suffix seen before, the shared tree of finished requests' outputs (bounded), and end to end
the same greedy output as without drafts."""
from __future__ import annotations

from types import SimpleNamespace

from helpers import random_prompts
from test_spec_decode import run

from baton import SamplingParams
from baton.engine.worker.spec_decode.suffix import SuffixProposer, SuffixTree


def state(tokens, prompt_len=0):
    return SimpleNamespace(token_ids=list(tokens), num_prompt_tokens=prompt_len, proposer_state=None)


def test_the_tree_counts_every_path_up_to_its_depth():
    tree = SuffixTree(depth=3)
    tree.extend([1, 2, 1, 2, 3])
    root = tree.root
    assert root.children[1].count == 2 and root.children[2].count == 2 and root.children[3].count == 1
    assert root.children[1].children[2].count == 2
    assert root.children[1].children[2].children[3].count == 1  # depth 3: "1 2 3"
    assert root.children[1].children[2].children[1].count == 1
    assert not root.children[1].children[2].children[1].children  # "1 2 1 2": past the depth
    node, length = tree.match([7, 1, 2])
    assert length == 2 and set(node.children) == {1, 3}  # "1 2" went on with 1, then with 3


def test_the_likeliest_continuation_is_drafted_while_likely_enough():
    proposer = SuffixProposer(max_depth=8, max_cached_requests=4, min_token_prob=0.3, max_spec_factor=4.0)
    # The longest suffix seen before, "0 5 6", went on once with "7 8 0 5" and once with "9":
    # each draft's joint likelihood 1/2.
    s = state([5, 6, 7, 8, 0, 5, 6, 7, 8, 0, 5, 6, 9, 0, 5, 6])
    assert proposer.propose([s], 4) == [[7, 8, 0, 5]]
    unlikely = SuffixProposer(max_depth=8, max_cached_requests=4, min_token_prob=0.7, max_spec_factor=4.0)
    assert unlikely.propose([state(s.token_ids)], 4) == [[]]  # 1/2 < 0.7: nothing worth verifying
    short = SuffixProposer(max_depth=8, max_cached_requests=4, min_token_prob=0.1, max_spec_factor=0.5)
    assert short.propose([state(s.token_ids)], 4) == [[7]]  # a match of 3 tokens drafts at most 1


def test_finished_outputs_draft_for_later_requests_and_the_oldest_leave():
    proposer = SuffixProposer(max_depth=8, max_cached_requests=1, min_token_prob=0.1, max_spec_factor=4.0)
    first = state([1, 2, 3, 40, 41, 42, 43, 44], prompt_len=3)
    proposer.propose([first], 4)
    proposer.finished(first)  # its outputs: 40 ... 44
    assert proposer.propose([state([9, 9, 40, 41], prompt_len=2)], 3) == [[42, 43, 44]]
    proposer.finished(state([7, 50, 51, 52], prompt_len=1))  # the cap is one request: the first leaves
    assert proposer.propose([state([9, 9, 40, 41], prompt_len=2)], 3) == [[]]
    assert 40 not in proposer.shared.root.children and 50 in proposer.shared.root.children


def test_suffix_drafts_keep_the_greedy_output(tiny_qwen2):
    ps = [p + p for p in random_prompts([9, 30], seed=3)] + random_prompts([12, 40], seed=4)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    _, want = run(tiny_qwen2, ps, params)
    spec = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 0.05}
    llm, got = run(tiny_qwen2, ps + ps, [params] * 8, speculative_config=spec, max_num_seqs=4)
    assert [o.token_ids for o in got] == [o.token_ids for o in want + want]
    stats = llm.engine.core.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0  # the repeats find the first round's outputs in the shared tree
