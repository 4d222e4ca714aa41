"""A model with sliding-window layers over prefill and decode (NIXL, one process): the handle
names each sliding group's window blocks only, the decode pulls exactly those and its output
equals colocated output for prompts longer than the window; engines whose KV cache groups
differ are refused at the handshake, naming the field."""
from __future__ import annotations

import pytest
from helpers import random_prompts
from nixl_engines import assert_pools_full, connect, disaggregated, nixl_engine

from baton import LLM, SamplingParams
from baton.kv_transfer.base import KVFormatMismatch, handle_block_counts
from baton.testing.checkpoints import write_random_checkpoint

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
WINDOW = 20


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> str:
    """Gemma 3's 5:1 pattern of sliding to global layers, two of it, with a 20-token window."""
    return write_random_checkpoint(
        str(tmp_path_factory.mktemp("gemma3")), "Gemma3TextConfig", seed=3, spread_norms=True, hidden_size=48,
        intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_hidden_layers=12,
        sliding_window=WINDOW, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2)


def test_the_decode_pulls_only_the_windows_blocks_and_equals_colocated(gemma3):
    ps = random_prompts([150, 97, 64, 21], seed=5)
    want = [o.token_ids for o in LLM(gemma3, dtype="float32", device="cpu").generate(ps, GREEDY)]
    prefill, decode = nixl_engine(gemma3, "prefill"), nixl_engine(gemma3, "decode", enable_prefix_caching=False)
    connect(prefill, decode)
    assert disaggregated(prefill, decode, ps, [GREEDY] * len(ps)) == want
    groups, bs = decode.core.kv_groups, decode.config.block_size
    assert groups.layers_per_block == 2 and groups.windows.count(None) == 1 and groups.windows.count(WINDOW) == 5
    pulled = sum(sum(handle_block_counts(len(p), groups.windows, bs)) for p in ps)
    every_block = sum(len(groups.windows) * -(-len(p) // bs) for p in ps)
    assert decode.runner.connector.num_blocks_pulled == pulled
    assert pulled < every_block / 2  # 150 tokens: 10 blocks for the global group, 2 for each sliding one
    assert_pools_full(prefill, decode)


def test_engines_grouping_the_cache_differently_are_refused_at_the_handshake(gemma3):
    prefill = nixl_engine(gemma3, "prefill")
    for changes in (dict(disable_hybrid_kv_cache_manager=True),  # every layer keeps every block
                    dict(max_model_len=WINDOW)):  # a window that holds the whole context does not slide
        decode = nixl_engine(gemma3, "decode", **changes)
        with pytest.raises(KVFormatMismatch, match="kv_groups") as err:
            decode.runner.connector.add_peer(prefill.runner.connector.layout)
        assert err.value.field == "kv_groups"
