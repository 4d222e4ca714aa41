"""The mixture-of-experts layer (engine/worker/models/moe.py) without an engine: the grouped
experts equal the per-token loop for random routings (experts no token picks, a token routed to
one expert twice, one token, many), and the routing equals transformers' routers."""
from __future__ import annotations

import pytest
import torch

from baton.engine.worker.models.moe import grouped_experts, naive_experts, route


@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (7, 2), (64, 3), (300, 4)])
def test_grouped_experts_equal_the_per_token_loop(num_tokens, top_k):
    gen = torch.Generator().manual_seed(num_tokens)
    experts, hidden, inter = 8, 32, 24
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    x = torch.randn(num_tokens, hidden, generator=gen)
    ids = torch.randint(0, experts - 3, (num_tokens, top_k), generator=gen)  # the last three get no token
    ids[0, 1] = ids[0, 0]  # a token routed to the same expert twice adds it twice
    weights = torch.rand(num_tokens, top_k, generator=gen)
    got = grouped_experts(x, weights, ids, gate_up, down)
    torch.testing.assert_close(got, naive_experts(x, weights, ids, gate_up, down))
    assert not torch.isin(torch.arange(experts - 3, experts), ids).any()


@pytest.mark.parametrize("renormalize", [True, False])
def test_routing_equals_transformers(renormalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=3, norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(1))
    x = torch.randn(50, 16, generator=torch.Generator().manual_seed(2))
    logits, want_weights, want_ids = router(x)
    weights, ids = route(logits, 3, renormalize)
    assert torch.equal(ids, want_ids)  # the same top-k of the same softmax: the same choice
    torch.testing.assert_close(weights, want_weights)


def test_lora_on_a_mixture_of_experts_attention_equals_peft_and_experts_are_refused(tmp_path):
    """Qwen3-MoE (its first layer dense): a PEFT adapter on attention equals PEFT; one on the
    MLPs (PEFT puts it on the experts' stacked weights) is refused at load, naming the field."""
    from baton import LLM, SamplingParams
    from baton.engine.common.errors import InvalidArgument
    from baton.testing.checkpoints import write_random_checkpoint
    from helpers import random_prompts
    from lora_adapters import PeftReference, write_adapter
    from test_families import FAMILIES

    config_class, shape = FAMILIES["qwen3-moe"]
    base = write_random_checkpoint(str(tmp_path / "base"), config_class, seed=7, spread_norms=True, **shape)
    adapter = write_adapter(base, str(tmp_path / "attn"), 8, 16, False, ["q_proj", "v_proj", "o_proj"], seed=5)
    llm = LLM(base, dtype="float32", device="cpu", enable_lora=True)
    llm.load_adapter("attn", adapter)
    ps, greedy = random_prompts([9, 40], seed=8), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(ps, greedy, lora_request=["attn", None])
    ref = PeftReference(base)
    assert [o.token_ids for o in outs] == [ref.greedy(adapter, ps[0], 12), ref.greedy(None, ps[1], 12)]
    assert outs[0].token_ids != ref.greedy(None, ps[0], 12)  # the adapter changes the output
    experts = write_adapter(base, str(tmp_path / "experts"), 8, 16, False, ["down_proj"], seed=6)
    with pytest.raises(InvalidArgument, match="mixture of experts") as err:
        llm.load_adapter("experts", experts)
    assert err.value.field.endswith("target_modules")
