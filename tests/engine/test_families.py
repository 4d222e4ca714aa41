"""The model families beyond Llama and Qwen2, each greedy-equal to transformers in float32 on a
tiny random checkpoint made here from transformers' own config and model classes, with odd
shapes on purpose: Qwen3 (QK-norm per head, a head size of its own, one KV head, tied head),
Mistral (untied, GQA 3:1, a 24-token sliding window), Phi-3 (fused q/k/v and gate/up weights,
RoPE over half of each head, a 40-token window),
OLMo 2 (norms after each block, QK-norm over the whole projection), Gemma 2 (soft-capped scores
and logits, GeGLU, (1 + w) norms around both blocks, 20-token windows on alternate layers), Gemma 3
(QK-norm, sliding layers with a RoPE base of their own and 28-token windows, linear scaling on
the global ones), Qwen3 with use_sliding_window (layers from max_window_layers on slide), Qwen2
with YaRN past its original context, Phi-3 with LongRoPE (prompts past its original context,
and one that grows past it while it decodes: computed again, long, as transformers' Phi-3 does),
Llama with dynamic NTK (a base per sequence length). Prompts run past every window. One run per family batches,
chunks, preempts and hits the prefix cache; the same prompts through a prefill and a decode
over NIXL equal it. What Baton does not run is refused at load, naming the field."""
from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import require_cpu_kernel
from helpers import assert_matches_hf, greedy_through, pools_full, random_prompts, stats, wait_serving
from nixl_engines import assert_pools_full, connect, disaggregated, nixl_engine
from servers import pd_stack

from baton import LLM, SamplingParams
from baton.engine.common.errors import InvalidArgument
from baton.testing.checkpoints import write_random_checkpoint

FAMILIES = {
    "qwen3": ("Qwen3Config", dict(hidden_size=80, intermediate_size=144, num_attention_heads=4, num_key_value_heads=1,
                                  head_dim=24, num_hidden_layers=3, tie_word_embeddings=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "mistral": ("MistralConfig", dict(hidden_size=72, intermediate_size=120, num_attention_heads=6,
                                      num_key_value_heads=2, num_hidden_layers=2, tie_word_embeddings=False,
                                      sliding_window=24)),
    "phi3": ("Phi3Config", dict(hidden_size=96, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                                num_hidden_layers=2, tie_word_embeddings=False, sliding_window=40,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.5})),
    "olmo2": ("Olmo2Config", dict(hidden_size=64, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2,
                                  num_hidden_layers=2, tie_word_embeddings=False)),
    "gemma2": ("Gemma2Config", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=24, num_hidden_layers=3, query_pre_attn_scalar=32,
                                    attn_logit_softcapping=4.0, final_logit_softcapping=5.0, sliding_window=20,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "gemma3": ("Gemma3TextConfig", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                        num_key_value_heads=1, head_dim=32, num_hidden_layers=3,
                                        query_pre_attn_scalar=24, sliding_window=28,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                        rope_parameters={
                                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                               "factor": 8.0}})),
    "qwen3-window": ("Qwen3Config", dict(hidden_size=64, intermediate_size=112, num_attention_heads=4,
                                         num_key_value_heads=2, num_hidden_layers=3, use_sliding_window=True,
                                         sliding_window=24, max_window_layers=1)),
    "qwen2-yarn": ("Qwen2Config", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                       num_key_value_heads=2, num_hidden_layers=2, tie_word_embeddings=True,
                                       use_sliding_window=False, rope_parameters={
                                           "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                           "original_max_position_embeddings": 48})),
    # LongRoPE: short factors within the first 64 positions, long ones past them (a prompt of 75
    # turns every token long; one of 40 crosses over while it decodes), attention factor from 256 / 64.
    "phi3-longrope": ("Phi3Config", dict(hidden_size=96, intermediate_size=160, num_attention_heads=4,
                                         num_key_value_heads=2, num_hidden_layers=2, tie_word_embeddings=False,
                                         max_position_embeddings=256, original_max_position_embeddings=64,
                                         rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.5,
                                                          "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                                          "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]})),
    # Dynamic NTK past 64 positions: a base of each sequence length's own (up to 64 x 4).
    "llama-dynamic": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                          num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=64,
                                          rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                           "factor": 4.0})),
    # Mixture of experts: 6 experts, 2 per token (3 for Qwen3-MoE), renormalized (Mixtral) or not;
    # Qwen3-MoE's first layer dense (mlp_only_layers), Qwen2-MoE's shared expert behind its gate.
    "mixtral": ("MixtralConfig", dict(hidden_size=64, intermediate_size=72, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, num_local_experts=6,
                                      num_experts_per_tok=2, tie_word_embeddings=False)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=40,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                         num_hidden_layers=3, num_experts=6, num_experts_per_tok=3,
                                         norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[0])),
    "qwen2-moe": ("Qwen2MoeConfig", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=40,
                                         shared_expert_intermediate_size=56, num_attention_heads=4,
                                         num_key_value_heads=2, num_hidden_layers=2, num_experts=6,
                                         num_experts_per_tok=2, norm_topk_prob=True, use_sliding_window=False)),
    # DeepSeek-V2-Lite's shape, small: MLA without a query LoRA (a latent of 32, RoPE parts of 8,
    # heads of 16 + 8 for keys, 12 for values), the first layer dense, then 6 routed experts (2 per
    # token, scaled by 1.5) and 2 shared; "-q" with a query LoRA and group-limited routing.
    "deepseek-v2": ("DeepseekV2Config", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                             num_attention_heads=4, num_hidden_layers=3, kv_lora_rank=32,
                                             q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                             v_head_dim=12, n_routed_experts=6, num_experts_per_tok=2,
                                             n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy",
                                             routed_scaling_factor=1.5, tie_word_embeddings=False)),
    "deepseek-v2-q": ("DeepseekV2Config", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                               num_attention_heads=4, num_hidden_layers=2, kv_lora_rank=24,
                                               q_lora_rank=40, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                               v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                                               n_shared_experts=1, first_k_dense_replace=0, n_group=4, topk_group=2,
                                               topk_method="group_limited_greedy", tie_word_embeddings=False)),
    # DeepSeek-V3's routing: sigmoid scores, a correction bias, the best 2 of 4 groups, renormalized, x 2.5.
    "deepseek-v3": ("DeepseekV3Config", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                             num_attention_heads=4, num_hidden_layers=3, kv_lora_rank=32,
                                             q_lora_rank=40, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                             v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                                             n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                                             norm_topk_prob=True, routed_scaling_factor=2.5,
                                             tie_word_embeddings=False)),
    # gpt-oss: attention sinks (drawn wide), 20-token windows on alternate layers, YaRN, biased router
    # and experts, its SwiGLU clamped at 1.0 so that the clamp bites.
    "gpt-oss": ("GptOssConfig", dict(hidden_size=64, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
                                     head_dim=24, num_hidden_layers=3, num_local_experts=6, num_experts_per_tok=2,
                                     sliding_window=20, swiglu_limit=1.0, max_position_embeddings=256,
                                     layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                      "original_max_position_embeddings": 64})),
}
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
# KV blocks for the batched run, a few past what one request of max_model_len holds, so that
# the six prompts preempt: sliding-only families have one group keeping its window's blocks,
# mixed ones a block per layer (three groups of one layer; the global one's keep every block).
POOLS = {"mistral": 7, "phi3": 8, "gemma2": 24, "gemma3": 24, "qwen3-window": 24, "gpt-oss": 24}


def write_family(out_dir: str, config_class: str, **shape) -> str:
    return write_random_checkpoint(out_dir, config_class, seed=7, spread_norms=True, **shape)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> str:
    config_class, shape = FAMILIES[request.param]
    return write_family(str(tmp_path_factory.mktemp(request.param) / request.param), config_class, **shape)


def pool(family: str) -> int:
    return POOLS.get(os.path.basename(family), 16)


def prompts() -> list[list[int]]:
    out = random_prompts([3, 17, 40, 75, 130], seed=41)
    return out + [out[3][:48] + out[0]]  # shares three blocks with the fourth


def test_batched_chunked_preempted_and_prefix_cached_equal_transformers(family, hf):
    llm = LLM(family, dtype="float32", device="cpu", max_num_batched_tokens=32, num_kv_blocks=pool(family),
              max_model_len=192)
    require_cpu_kernel()
    assert llm.engine.runner.attention_backend == "cpu"  # windows and soft-caps included
    ps = prompts()
    outs = llm.generate(ps, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.prefix_hits > 0
    assert_matches_hf(hf, family, ps, outs, GREEDY.max_tokens)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_prefill_and_decode_over_nixl_equal_colocated(family):
    ps = prompts()
    want = [o.token_ids for o in LLM(family, dtype="float32", device="cpu").generate(ps, GREEDY)]
    prefill, decode = nixl_engine(family, "prefill"), nixl_engine(family, "decode")
    connect(prefill, decode)
    assert disaggregated(prefill, decode, ps, [GREEDY] * len(ps)) == want
    assert decode.runner.connector.num_blocks_pulled > 0
    assert_pools_full(prefill, decode)


# Soft-caps and alternating windows; every layer sliding; MLA (one latent head of 40, groups of 4); sinks.
@pytest.mark.parametrize("name", ["gemma2", "mistral", "deepseek-v2", "gpt-oss"])
@pytest.mark.parametrize("backend", ["torch", "triton"])  # (the batched run above: the C++ kernel, auto's pick)
def test_windows_and_soft_caps_on_every_attention_backend(tmp_path, hf, name, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    config_class, shape = FAMILIES[name]
    model_dir = write_family(str(tmp_path / name), config_class, **shape)
    ps = prompts()[3:]  # past every window; the last hits the prefix cache
    llm = LLM(model_dir, dtype="float32", device="cpu", attention_backend=backend, max_num_batched_tokens=32,
              max_model_len=192)
    assert llm.engine.runner.attention_backend == backend
    assert_matches_hf(hf, model_dir, ps, llm.generate(ps, GREEDY), GREEDY.max_tokens)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


# gemma3: hybrid KV cache groups, handles of window blocks; deepseek-v2: MLA's latent blocks, experts.
@pytest.mark.parametrize("name", ["qwen3", "gemma3", "deepseek-v2"])
def test_through_the_router_prefill_and_decode_equals_offline(tmp_path, name):
    config_class, shape = FAMILIES[name]
    model_dir = write_family(str(tmp_path / name), config_class, **shape)
    ps = prompts()
    want = [o.token_ids for o in LLM(model_dir, dtype="float32", device="cpu").generate(ps, GREEDY)]
    with pd_stack(model_dir, prefill=("--max-num-batched-tokens", "32")) as ((prefill,), (decode,), router):
        wait_serving(router.address)
        assert greedy_through(router.address, ps, GREEDY.max_tokens) == want
        assert stats(decode.address).num_blocks_pulled > 0
        assert pools_full(prefill.address) and pools_full(decode.address)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_mla_prefill_up_projects_and_decode_absorbs(tmp_path, hf, monkeypatch, backend):
    """DeepSeek's prefill chunks attend up-projected (per-head K and V from the cached latents),
    its decodes absorbed (over the latents), in the same steps, equal to transformers."""
    from baton.engine.worker.models.mla import MLAttention

    if backend == "cpu":
        require_cpu_kernel()
    rows = {"_up_projected": 0, "_absorbed": 0}
    for name in rows:
        original = getattr(MLAttention, name)

        def counted(self, q, *rest, _name=name, _original=original):
            rows[_name] += q.shape[0]
            return _original(self, q, *rest)
        monkeypatch.setattr(MLAttention, name, counted)
    config_class, shape = FAMILIES["deepseek-v2"]
    model_dir = write_family(str(tmp_path / "deepseek"), config_class, **shape)
    ps = prompts()
    llm = LLM(model_dir, dtype="float32", device="cpu", attention_backend=backend, max_num_batched_tokens=32)
    assert_matches_hf(hf, model_dir, ps, llm.generate(ps, GREEDY), GREEDY.max_tokens)
    layers = shape["num_hidden_layers"]
    assert rows["_up_projected"] >= layers * (sum(map(len, ps)) - llm.engine.kv.prefix_hits)  # (hits: tokens)
    assert rows["_absorbed"] >= layers * len(ps) * (GREEDY.max_tokens - 1)


def test_gpt_oss_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path, hf):
    """The published gpt-oss weights keep the experts in MXFP4 (_blocks and _scales): Baton reads
    them into float32 and equals transformers on the same values dequantized by its own
    convert_moe_packed_tensors."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config_class, shape = FAMILIES["gpt-oss"]
    dense = write_family(str(tmp_path / "dense"), config_class, **{**shape, "intermediate_size": 32})
    quantized = edited(dense, tmp_path / "mxfp4", quantization_config={"quant_method": "mxfp4"})
    os.unlink(os.path.join(quantized, "model.safetensors"))
    tensors = load_file(os.path.join(dense, "model.safetensors"))
    packed = dict(tensors)
    gen = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows_in, rows_out = tensors[name].shape  # [experts, in, out]
        blocks = torch.randint(0, 256, (experts, rows_out, rows_in // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(122, 127, (experts, rows_out, rows_in // 32), generator=gen, dtype=torch.uint8)
        tensors[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
        del packed[name]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
    save_file(tensors, os.path.join(dense, "model.safetensors"), metadata={"format": "pt"})
    save_file(packed, os.path.join(quantized, "model.safetensors"), metadata={"format": "pt"})
    ps = prompts()[2:4]
    outs = LLM(quantized, dtype="float32", device="cpu").generate(ps, GREEDY)
    assert_matches_hf(hf, dense, ps, outs, GREEDY.max_tokens)
    del packed[next(n for n in packed if n.endswith("_scales"))]
    save_file(packed, os.path.join(quantized, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InvalidArgument, match="without its other MXFP4 half"):
        LLM(quantized, dtype="float32", device="cpu")


def edited(src: str, dst, **changes) -> str:
    """A copy of a checkpoint with its config.json changed."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


def test_what_baton_does_not_run_is_refused_naming_the_field(tiny_llama, tmp_path):
    cases = [(dict(architectures=["GPT2LMHeadModel"]), "model", "architecture 'GPT2LMHeadModel' is not supported"),
             (dict(rope_parameters={"rope_type": "mrope", "rope_theta": 10000.0, "mrope_section": [2, 2]}),
              "rope_scaling", "rope_type 'mrope' is not supported")]
    for i, (changes, field, message) in enumerate(cases):
        with pytest.raises(InvalidArgument, match=message) as err:
            LLM(edited(tiny_llama, tmp_path / str(i), **changes), dtype="float32", device="cpu")
        assert err.value.field == field
    windowed = edited(tiny_llama, tmp_path / "window", architectures=["MistralForCausalLM"], sliding_window=64)
    # A window as long as the context is every token: equal to no window.
    prompt = random_prompts([40], seed=42)
    llm = LLM(windowed, dtype="float32", device="cpu", max_model_len=64)
    assert llm.engine.runner.model.layers[0].self_attn.window is None
    got = llm.generate(prompt, GREEDY)[0].token_ids
    assert got == LLM(tiny_llama, dtype="float32", device="cpu", max_model_len=64).generate(prompt, GREEDY)[0].token_ids


def test_a_checkpoint_missing_a_weight_is_refused_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    config_class, shape = FAMILIES["qwen3"]
    model_dir = write_family(str(tmp_path / "qwen3"), config_class, **shape)
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(InvalidArgument, match=r"lacks weight layers\.1\.self_attn\.k_norm\.weight") as err:
        LLM(model_dir, dtype="float32", device="cpu")
    assert err.value.field == "model"


def test_gemma2_logprobs_follow_its_capped_logits(tmp_path, hf):
    """The final soft-cap never changes a greedy token (tanh keeps the order): logprobs show it."""
    config_class, shape = FAMILIES["gemma2"]
    model_dir = write_family(str(tmp_path / "gemma2"), config_class, **shape)
    prompt = random_prompts([30], seed=43)[0]
    out = LLM(model_dir, dtype="float32", device="cpu").generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1))[0]
    with torch.inference_mode():
        ref = hf.model(model_dir)(torch.tensor([prompt + out.token_ids])).logits[0].float().log_softmax(-1)
    for i, lp in enumerate(out.outputs[0].logprobs):
        assert abs(lp.logprob - ref[len(prompt) - 1 + i, lp.token_id].item()) < 1e-4


def test_a_sharded_bf16_checkpoint_loads_into_float32(tmp_path, hf):
    """As users have them: bf16 weights in several shards with an index, served in float32."""
    import transformers

    config_class, shape = FAMILIES["gemma3"]
    source = write_family(str(tmp_path / "source"), config_class, **shape)
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    sharded = str(tmp_path / "sharded")
    model.save_pretrained(sharded, max_shard_size="100KB")
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(sharded)
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    ps = prompts()[:3]
    outs = LLM(sharded, dtype="float32", device="cpu").generate(ps, GREEDY)
    assert_matches_hf(hf, sharded, ps, outs, GREEDY.max_tokens)  # transformers in float32 on the same weights


def test_lora_on_phi3s_fused_projections_equals_peft(tmp_path):
    """A PEFT adapter of Phi-3 targets its fused qkv_proj and gate_up_proj (one A and one B each)."""
    from lora_adapters import PeftReference, write_adapter

    config_class, shape = FAMILIES["phi3"]
    base = write_family(str(tmp_path / "phi3"), config_class, **shape)
    adapter = write_adapter(base, str(tmp_path / "fused"), 8, 16, False,
                            ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], seed=5)
    llm = LLM(base, dtype="float32", device="cpu", enable_lora=True, max_num_batched_tokens=32)
    llm.load_adapter("fused", adapter)
    ps = prompts()[:4]
    outs = llm.generate(ps, GREEDY, lora_request=["fused", None, "fused", None])
    ref = PeftReference(base)
    assert [o.token_ids for o in outs] == [ref.greedy(adapter if i % 2 == 0 else None, p, GREEDY.max_tokens)
                                           for i, p in enumerate(ps)]
    assert outs[0].token_ids != ref.greedy(None, ps[0], GREEDY.max_tokens)  # the adapter changes the output


def test_gemma_configs_written_by_older_transformers_read_the_same(tmp_path):
    """Hub checkpoints predate layer_types and per-layer-type rope parameters: the layer kinds come
    from sliding_window_pattern (Gemma 3) or alternate (Gemma 2), as transformers derives them."""
    from baton.engine.common.config import read_config
    from baton.engine.worker.models import model_args

    config_class, shape = FAMILIES["gemma3"]
    modern = read_config(write_family(str(tmp_path / "gemma3"), config_class, **shape))
    legacy = {k: v for k, v in modern.items() if k not in ("layer_types", "rope_parameters")}
    legacy.update(sliding_window_pattern=3, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                  rope_scaling={"rope_type": "linear", "factor": 8.0})
    fields = ("layer_types", "rope_theta", "rope_scaling", "local_rope_theta", "sliding_window")
    got, want = model_args(legacy), model_args(modern)
    assert [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields]
    absent = ("layer_types", "attn_logit_softcapping", "final_logit_softcapping")
    gemma2 = model_args({**{k: v for k, v in modern.items() if k not in absent},
                         "architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 4})
    assert gemma2.layer_types == ["sliding_attention", "full_attention"] * 2
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (50.0, 30.0)  # transformers' defaults


def test_a_sliding_family_swaps_to_the_host_tier_and_follows_a_grammar(tmp_path, hf):
    """Gemma 3 with a host KV tier (which keeps every layer's blocks: one KV cache group) preempts
    by swapping, equal to transformers; with the hybrid cache, a regex constrains its output."""
    import re

    from baton.engine.common.structured_output import StructuredOutput

    config_class, shape = FAMILIES["gemma3"]
    model_dir = write_family(str(tmp_path / "gemma3"), config_class, **shape)
    ps = prompts()
    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=32, num_kv_blocks=16,
              max_model_len=192, kv_offloading_size=0.01, preemption_mode="swap")
    assert llm.engine.core.kv_groups.windows == (None,)
    outs = llm.generate(ps, GREEDY)
    assert llm.engine.core.host.num_swapped_out > 0
    assert_matches_hf(hf, model_dir, ps, outs, GREEDY.max_tokens)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
    llm = LLM(model_dir, dtype="float32", device="cpu", max_model_len=192)
    assert llm.engine.core.kv_groups.hybrid
    params = SamplingParams(max_tokens=12, temperature=0.0,
                            structured_output=StructuredOutput("regex", "[a-c]{3}-[0-9]{2,4}"))
    for out in llm.generate(ps[3:], params):
        assert re.fullmatch("[a-c]{3}-[0-9]{2,4}", out.text), out.text
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_baton_models_lists_what_it_serves_and_checks_a_checkpoint(tmp_path, capsys):
    """`baton models`: the architectures; a checkpoint's reading (layers, windows, KV cache groups)
    without loading it; a refusal naming the field, exit 1."""
    from baton.services.cli.main import main

    main(["models"])
    listed = capsys.readouterr().out
    assert all(arch in listed for arch in ("Gemma3ForCausalLM", "Phi3ForCausalLM", "Qwen3ForCausalLM", "longrope"))
    config_class, shape = FAMILIES["gemma3"]
    model_dir = write_family(str(tmp_path / "gemma3"), config_class, **shape)
    main(["models", model_dir])  # no refusal: it returns
    out = capsys.readouterr().out
    assert "Gemma3ForCausalLM" in out and "2 sliding-window layers (window 28), 3 KV cache group(s)" in out
    bad = edited(model_dir, tmp_path / "bad", architectures=["GPT2LMHeadModel"])
    with pytest.raises(SystemExit) as exit_:
        main(["models", model_dir, bad])
    assert exit_.value.code == 1
    assert "refused: model: architecture 'GPT2LMHeadModel' is not supported" in capsys.readouterr().err


def test_a_longrope_prompt_at_the_original_context_moves_to_a_decode_and_runs_long(tmp_path, hf):
    """Phi-3's prompt of exactly original_max_position_embeddings tokens: the prefill computes it
    short, its first token takes the sequence past, so the decode computes it again long (as
    transformers does when it drops its cache), equal to colocated and to transformers."""
    config_class, shape = FAMILIES["phi3-longrope"]
    model_dir = write_family(str(tmp_path / "phi3"), config_class, **shape)
    ps = random_prompts([64, 63], seed=12)  # at the original context; one below, crossing while it decodes
    want = [o.token_ids for o in LLM(model_dir, dtype="float32", device="cpu").generate(ps, GREEDY)]
    assert want == [hf.greedy(model_dir, p, GREEDY.max_tokens) for p in ps]
    prefill, decode = nixl_engine(model_dir, "prefill"), nixl_engine(model_dir, "decode")
    connect(prefill, decode)
    assert disaggregated(prefill, decode, ps, [GREEDY] * len(ps)) == want
    assert decode.scheduler.num_preemptions == 0  # computed again, not preempted
    assert_pools_full(prefill, decode)
