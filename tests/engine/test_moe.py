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


@pytest.mark.parametrize("name", ["qwen3-moe", "gpt-oss"])
def test_lora_on_a_mixture_of_experts_attention_equals_peft_and_experts_are_refused(tmp_path, name):
    """Qwen3-MoE (its first layer dense), gpt-oss (biased q/k/v/o, sinks): a PEFT adapter on
    attention equals PEFT; one on Qwen3-MoE's MLPs (PEFT puts it on the experts' stacked weights)
    is refused at load, naming the field."""
    from helpers import random_prompts
    from lora_adapters import PeftReference, write_adapter
    from test_families import FAMILIES

    from baton import LLM, SamplingParams
    from baton.engine.common.errors import InvalidArgument
    from baton.testing.checkpoints import write_random_checkpoint

    config_class, shape = FAMILIES[name]
    base = write_random_checkpoint(str(tmp_path / "base"), config_class, seed=7, spread_norms=True, **shape)
    adapter = write_adapter(base, str(tmp_path / "attn"), 8, 16, False, ["q_proj", "v_proj", "o_proj"], seed=5)
    llm = LLM(base, dtype="float32", device="cpu", enable_lora=True)
    llm.load_adapter("attn", adapter)
    ps, greedy = random_prompts([9, 40], seed=8), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(ps, greedy, lora_request=["attn", None])
    ref = PeftReference(base)
    assert [o.token_ids for o in outs] == [ref.greedy(adapter, ps[0], 12), ref.greedy(None, ps[1], 12)]
    assert outs[0].token_ids != ref.greedy(None, ps[0], 12)  # the adapter changes the output
    if name != "qwen3-moe":
        return
    experts = write_adapter(base, str(tmp_path / "experts"), 8, 16, False, ["down_proj"], seed=6)
    with pytest.raises(InvalidArgument, match="mixture of experts") as err:
        llm.load_adapter("experts", experts)
    assert err.value.field.endswith("target_modules")


@pytest.mark.parametrize("name", ["deepseek-v2", "deepseek-v2-q", "deepseek-v3", "mixtral", "gpt-oss"])
def test_logprobs_equal_transformers_log_softmax(tmp_path, hf, name):
    """Closer than greedy tokens: every sampled token's logprob equals transformers' (MLA's absorbed
    form and the grouped experts against its up-projected K/V and per-expert loop). DeepSeek-V3's
    correction biases are drawn (zero at init), and its checkpoint carries a multi-token-prediction
    layer past num_hidden_layers, which is not loaded."""
    from helpers import random_prompts
    from test_families import FAMILIES

    from baton import LLM, SamplingParams
    from baton.testing.checkpoints import write_random_checkpoint

    config_class, shape = FAMILIES[name]
    model_dir = write_random_checkpoint(str(tmp_path / name), config_class, seed=7, spread_norms=True, **shape)
    if name == "deepseek-v3":
        with_mtp_layer_and_biases(model_dir)
    prompt = random_prompts([70], seed=9)[0]
    out = LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=32).generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1))[0]
    with torch.inference_mode():
        ref = hf.model(model_dir)(torch.tensor([prompt + out.token_ids])).logits[0].float().log_softmax(-1)
    for i, lp in enumerate(out.outputs[0].logprobs):
        assert abs(lp.logprob - ref[len(prompt) - 1 + i, lp.token_id].item()) < 1e-4


def test_mla_caches_one_latent_per_token_and_refuses_lora(tmp_path):
    """DeepSeek-V2's cache: one "head" of kv_lora_rank + qk_rope_head_dim per token and layer, no
    separate values: (32 + 8) x 4 bytes, against 2 x 4 heads x 24 x 4 bytes for its attention
    computed as plain multi-head attention. LoRA on MLA is refused at start, naming the field."""
    from test_families import FAMILIES

    from baton import LLM
    from baton.engine.common.errors import InvalidArgument
    from baton.engine.worker.model_runner import kv_attention
    from baton.testing.checkpoints import write_random_checkpoint

    config_class, shape = FAMILIES["deepseek-v2"]
    model_dir = write_random_checkpoint(str(tmp_path / "ds"), config_class, seed=7, **shape)
    llm = LLM(model_dir, dtype="float32", device="cpu")
    cache = llm.engine.runner.kv_cache
    assert cache.shape[1:] == (3, 1, 16, 1, 40)  # [blocks, layers, K only, block size, one head, 32 + 8]
    assert kv_attention(llm.engine.runner.model.args) == "mla(kv_lora_rank=32, qk_rope_head_dim=8)"  # in KVFormat
    with pytest.raises(InvalidArgument, match="multi-head latent attention") as err:
        LLM(model_dir, dtype="float32", device="cpu", enable_lora=True)
    assert err.value.field == "enable_lora"


def test_a_routing_baton_lacks_is_refused_naming_it(tmp_path):
    """A routing method Baton lacks, or a scoring that does not go with the method: refused at load."""
    from test_families import FAMILIES, edited

    from baton import LLM
    from baton.engine.common.errors import InvalidArgument
    from baton.testing.checkpoints import write_random_checkpoint

    config_class, shape = FAMILIES["deepseek-v2"]
    model_dir = write_random_checkpoint(str(tmp_path / "ds"), config_class, seed=7, **shape)
    for changes, field in ((dict(topk_method="seq_aux_greedy"), "topk_method"),
                           (dict(scoring_func="sigmoid"), "scoring_func")):  # (with V2's greedy routing)
        with pytest.raises(InvalidArgument) as err:
            LLM(edited(model_dir, tmp_path / field, **changes), dtype="float32", device="cpu")
        assert err.value.field == field


def with_mtp_layer_and_biases(model_dir: str) -> None:
    import json
    import os

    from safetensors.torch import load_file, save_file

    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(4)
    for name, t in tensors.items():
        if name.endswith("e_score_correction_bias"):
            tensors[name] = torch.rand(t.shape, generator=gen) * 0.5
    layers = json.load(open(os.path.join(model_dir, "config.json")))["num_hidden_layers"]
    tensors[f"model.layers.{layers}.eh_proj.weight"] = torch.zeros(4, 4)  # an MTP layer's
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("name", ["deepseek-v2", "mixtral", "gpt-oss"])
def test_swap_to_the_host_tier_and_a_grammar(tmp_path, hf, name):
    """MLA's latent blocks and an MoE model's go to the host tier and back when preempted (swap),
    equal to transformers; a regex constrains their output."""
    import re

    from helpers import assert_matches_hf
    from test_families import FAMILIES, GREEDY, prompts

    from baton import LLM, SamplingParams
    from baton.engine.common.structured_output import StructuredOutput
    from baton.testing.checkpoints import write_random_checkpoint

    config_class, shape = FAMILIES[name]
    model_dir = write_random_checkpoint(str(tmp_path / name), config_class, seed=7, spread_norms=True, **shape)
    ps = prompts()
    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=32, num_kv_blocks=16,
              max_model_len=192, kv_offloading_size=0.01, preemption_mode="swap")
    outs = llm.generate(ps, GREEDY)
    assert llm.engine.core.host.num_swapped_out > 0
    assert_matches_hf(hf, model_dir, ps, outs, GREEDY.max_tokens)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
    params = SamplingParams(max_tokens=12, temperature=0.0,
                            structured_output=StructuredOutput("regex", "[a-c]{3}-[0-9]{2,4}"))
    for out in llm.generate(ps[3:], params):
        assert re.fullmatch("[a-c]{3}-[0-9]{2,4}", out.text), out.text
