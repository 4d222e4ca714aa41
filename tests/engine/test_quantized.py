"""Quantized checkpoints, as their tools publish them (baton/testing/quantized_checkpoints.py
writes each format; compressed-tensors' own decompression checks that writer), kept quantized in
memory and greedy-equal to transformers running the same checkpoint dequantized in float32:
block FP8 (DeepSeek-V3's MLA and experts included), compressed-tensors FP8 per tensor, channel
and with static activation scales, INT8 W8A8 and packed W4A16 (symmetric and with zero points),
GPTQ 4 and 8 bits (act-order too), AWQ, gpt-oss's MXFP4 experts; batched, chunked, preempted
and prefix-cached in one run, over NIXL between a prefill and a decode, through the router, with
a LoRA adapter on the quantized base. A prefill and a decode of two quantizations of one model
pair only when told (accept_kv_from). Bad checkpoints are refused naming the field or tensor."""
from __future__ import annotations

import json
import os

import pytest
from conftest import require_cpu_kernel
from helpers import assert_matches_hf, greedy_through, random_prompts, wait_serving
from nixl_engines import assert_pools_full, connect, disaggregated, nixl_engine
from servers import pd_stack
from test_families import FAMILIES, POOLS, write_family

from baton import LLM, SamplingParams
from baton.engine.common.errors import InvalidArgument
from baton.engine.worker.loader import checkpoint_bytes
from baton.engine.worker.quant.linear import ExpertStack, QuantizedLinear
from baton.testing.quantized_checkpoints import quantize_checkpoint

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# family, scheme, writer options: every format at least once, on the families that need it most.
CASES = [
    ("qwen3", "fp8-block", dict(block=(32, 16))),  # partial blocks: 80 and 144 are not multiples of 32
    ("deepseek-v3", "fp8-block", dict(block=(16, 16))),  # MLA's kv_b_proj (dequantized once) and FP8 experts
    ("phi3", "ct-fp8-tensor", {}),  # fused q/k/v and gate/up, one part each
    ("mistral", "ct-fp8-channel", {}),
    ("gemma3", "ct-fp8-static", {}),
    ("qwen3", "ct-w8a8-int", {}),
    ("qwen3", "ct-w4a16", dict(group_size=16)),
    ("mixtral", "ct-w4a16-asym", dict(group_size=8)),  # experts with zero points
    ("mistral", "gptq-4", dict(group_size=8)),
    ("qwen3-moe", "gptq-8", dict(group_size=8)),
    ("mistral", "gptq-4-actorder", dict(group_size=8)),
    ("qwen3-moe", "gptq-4-actorder", dict(group_size=8)),  # each expert with its own g_idx
    ("qwen3-moe", "awq", dict(group_size=8)),
    ("gpt-oss", "mxfp4", {}),
]


def prompts() -> list[list[int]]:
    out = random_prompts([3, 17, 40, 75, 130], seed=43)
    return out + [out[3][:48] + out[0]]  # shares three blocks with the fourth


# MXFP4's blocks are 32 inputs wide: gpt-oss's experts get an intermediate size that takes them.
SHAPE_CHANGES = {"mxfp4": dict(intermediate_size=32)}


def quantized(tmp_path_factory, family: str, scheme: str, opts: dict) -> tuple[str, str]:
    """(the quantized checkpoint, its dequantized float32 reference) of a tiny random `family`."""
    root = tmp_path_factory.mktemp(f"{family}-{scheme}")
    config_class, shape = FAMILIES[family]
    float_dir = write_family(str(root / "float"), config_class, **{**shape, **SHAPE_CHANGES.get(scheme, {})})
    return quantize_checkpoint(float_dir, str(root / "quantized"), str(root / "reference"), scheme, **opts)


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{s}" for f, s, _ in CASES])
def case(request, tmp_path_factory) -> tuple[str, str, str]:
    """(family, quantized checkpoint, dequantized reference)."""
    return request.param[0], *quantized(tmp_path_factory, *request.param)


def resident_bytes(llm: LLM) -> int:
    model = llm.engine.runner.model
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}  # (tied weights once)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_batched_chunked_preempted_prefix_cached_equal_transformers_on_the_dequantized_weights(case, hf):
    family, model_dir, reference = case
    require_cpu_kernel()
    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=32, max_model_len=192,
              num_kv_blocks=POOLS.get(family, 16))
    model = llm.engine.runner.model
    quantized_layers = [m for m in model.modules() if isinstance(m, (QuantizedLinear, ExpertStack))]
    assert quantized_layers, "nothing was kept quantized"
    # Weights as stored: what the model holds is the checkpoint's tensors (plus at most a tenth).
    assert resident_bytes(llm) <= 1.1 * sum(checkpoint_bytes(model_dir).values())
    ps = prompts()
    outs = llm.generate(ps, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.prefix_hits > 0
    assert_matches_hf(hf, reference, ps, outs, GREEDY.max_tokens)
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


@pytest.mark.parametrize("family, scheme, opts", [CASES[0], CASES[6], CASES[8]], ids=["fp8", "w4a16", "gptq"])
def test_quantized_prefill_and_decode_over_nixl_equal_colocated(tmp_path_factory, family, scheme, opts):
    model_dir, _ = quantized(tmp_path_factory, family, scheme, opts)
    ps = prompts()
    with LLM(model_dir, dtype="float32", device="cpu") as llm:
        want = [o.token_ids for o in llm.generate(ps, GREEDY)]
    prefill, decode = nixl_engine(model_dir, "prefill"), nixl_engine(model_dir, "decode")
    connect(prefill, decode)
    assert disaggregated(prefill, decode, ps, [GREEDY] * len(ps)) == want
    assert_pools_full(prefill, decode)


def test_through_the_router_a_quantized_stack_equals_offline(tmp_path_factory):
    model_dir, _ = quantized(tmp_path_factory, *CASES[1])  # DeepSeek-V3 in block FP8: MLA's latent blocks
    ps = prompts()[:4]
    with LLM(model_dir, dtype="float32", device="cpu") as llm:
        want = [o.token_ids for o in llm.generate(ps, GREEDY)]
    with pd_stack(model_dir, prefill=("--max-num-batched-tokens", "32")) as (_, _, router):
        wait_serving(router.address)
        got = greedy_through(router.address, ps, GREEDY.max_tokens)
    assert got == want


def test_two_quantizations_of_one_model_pair_only_when_the_decode_names_the_prefills(tmp_path_factory):
    """A float prefill before an FP8 decode: refused at the handshake naming the model until
    the decode's accept_kv_from names the prefill's checkpoint; then the decode continues from
    the float prefill's KV (not token-equal to either engine alone: its quality is measured in
    bench/quantized.py) and every pool is full again."""
    from baton.kv_transfer.base import KVFormatMismatch

    model_dir, reference = quantized(tmp_path_factory, *CASES[0])
    ps = prompts()[:3]
    prefill, decode = nixl_engine(reference, "prefill"), nixl_engine(model_dir, "decode")
    with pytest.raises(KVFormatMismatch) as err:
        decode.core.add_peer(prefill.core.connector.layout)
    assert err.value.field == "model"
    told = nixl_engine(model_dir, "decode", accept_kv_from=[reference])
    connect(prefill, told)  # (each side checks the other: the decode's list pairs them both ways)
    outs = disaggregated(prefill, told, ps, [GREEDY] * len(ps))
    assert [len(o) for o in outs] == [GREEDY.max_tokens] * len(ps)
    assert_pools_full(prefill, told)


def test_a_lora_adapter_on_a_quantized_base_equals_peft_on_the_dequantized_one(tmp_path_factory):
    from lora_adapters import PeftReference, write_adapter

    model_dir, reference = quantized(tmp_path_factory, "mistral", "gptq-4", dict(group_size=8))
    adapter = write_adapter(reference, str(tmp_path_factory.mktemp("adapter")), rank=8, alpha=16.0, rslora=False,
                            targets=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"], seed=1)
    ps = prompts()[:3]
    llm = LLM(model_dir, dtype="float32", device="cpu", lora_modules={"a": adapter}, max_lora_rank=8)
    outs = llm.generate(ps, GREEDY, lora_request=["a"] * len(ps))
    peft = PeftReference(reference)
    for p, o in zip(ps, outs):
        assert o.token_ids == peft.greedy(adapter, p, GREEDY.max_tokens)
    # The adapter changes the output (else this test could not fail).
    assert any(o.token_ids != peft.greedy(None, p, GREEDY.max_tokens) for p, o in zip(ps, outs))


def _edit_config(model_dir: str, edit) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    edit(config["quantization_config"])
    with open(path, "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("scheme, edit, field", [
    ("gptq-4", lambda q: q.update(quant_method="bitsandbytes"), "quantization_config.quant_method"),
    ("gptq-4", lambda q: q.update(bits=3), "quantization_config.bits"),
    ("gptq-4", lambda q: q.update(group_size=7), "quantization_config.group_size"),
    ("awq", lambda q: q.update(version="gemv"), "quantization_config.version"),
    ("fp8-block", lambda q: q.update(weight_block_size=[128]), "quantization_config.weight_block_size"),
    ("ct-w4a16", lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=3),
     "quantization_config.config_groups.group_0.weights.num_bits"),
    ("ct-w4a16", lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="tensor_group"),
     "quantization_config.config_groups.group_0.weights.strategy"),
    ("ct-fp8-channel", lambda q: q.update(format="marlin-24"), "quantization_config.config_groups.group_0.format"),
])
def test_an_unsupported_quantization_config_is_refused_naming_the_field(tmp_path_factory, scheme, edit, field):
    model_dir, _ = quantized(tmp_path_factory, "mistral", scheme, dict(group_size=8, block=(32, 16)))
    _edit_config(model_dir, edit)
    with pytest.raises(InvalidArgument) as err:
        LLM(model_dir, dtype="float32", device="cpu")
    assert err.value.field == field


@pytest.mark.parametrize("scheme, tensor, change, message", [
    ("fp8-block", "layers.0.self_attn.q_proj.weight_scale_inv", "drop", "lacks model.layers.0.self_attn.q_proj"),
    ("gptq-4", "layers.1.mlp.down_proj.qzeros", "drop", "lacks model.layers.1.mlp.down_proj.qzeros"),
    ("gptq-4", "layers.0.self_attn.o_proj.scales", "halve", "model.layers.0.self_attn.o_proj.scales has shape"),
    ("ct-w4a16", "layers.0.mlp.up_proj.weight_packed", "halve", "model.layers.0.mlp.up_proj.weight_packed has shape"),
])
def test_a_missing_or_misshapen_quantized_tensor_is_refused_naming_it(tmp_path_factory, scheme, tensor, change,
                                                                      message):
    from safetensors.torch import load_file, save_file

    model_dir, _ = quantized(tmp_path_factory, "mistral", scheme, dict(group_size=8, block=(32, 16)))
    for name in os.listdir(model_dir):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(model_dir, name)
        tensors = load_file(path)
        key = f"model.{tensor}"
        if key in tensors:
            if change == "drop":
                del tensors[key]
            else:
                tensors[key] = tensors[key][: tensors[key].shape[0] // 2].contiguous()
            os.unlink(path)  # (a fresh file: the old one may still be mapped)
            save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(InvalidArgument, match=message) as err:
        LLM(model_dir, dtype="float32", device="cpu")
    assert err.value.field == "model"


def test_baton_models_names_the_format_and_the_memory(tmp_path_factory):
    from baton.services.cli.model_info import describe

    model_dir, reference = quantized(tmp_path_factory, *CASES[8])
    lines = "\n".join(describe(model_dir, None))
    assert "quantized (gptq int4 group 8), kept as stored" in lines and "I32" in lines
    assert "unquantized" in "\n".join(describe(reference, None))


# Tensor and expert parallel: rows cut through FP8 blocks (the kept rows keep their block's
# scales), columns through GPTQ's and AWQ's groups (regrouped), act-order, MLA and experts.
PARALLEL = [("qwen3", "fp8-block", dict(block=(32, 8)), False),  # q rows 48 a rank: cut 32-row blocks
            ("mistral", "gptq-4", dict(group_size=8), False),  # o_proj's 36 columns a rank: groups of 8 cut
            ("mistral", "gptq-4-actorder", dict(group_size=8), False),
            ("qwen3-moe", "awq", dict(group_size=8), False),
            ("deepseek-v3", "fp8-block", dict(block=(16, 16)), False),
            ("mistral", "gptq-4", dict(group_size=8, lm_head=True), False),  # the LM head quantized too
            ("gpt-oss", "mxfp4", {}, True)]  # expert parallel: whole MXFP4 experts


@pytest.mark.parametrize("family, scheme, opts, expert_parallel", PARALLEL,
                         ids=[f"{p[0]}-{p[1]}{'-lm-head' if p[2].get('lm_head') else ''}" for p in PARALLEL])
def test_two_ranks_over_a_quantized_checkpoint_equal_transformers(tmp_path_factory, hf, family, scheme, opts,
                                                                  expert_parallel):
    model_dir, reference = quantized(tmp_path_factory, family, scheme, opts)
    ps = prompts()[1:5]
    with LLM(model_dir, dtype="float32", device="cpu", tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
             max_num_batched_tokens=32, max_model_len=192) as llm:
        outs = llm.generate(ps, GREEDY)
        model = llm.engine.runner.model
        assert any(isinstance(m, (QuantizedLinear, ExpertStack)) for m in model.modules())
        assert isinstance(model.lm_head.quantized, QuantizedLinear) == bool(opts.get("lm_head"))
        assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
    assert_matches_hf(hf, reference, ps, outs, GREEDY.max_tokens)


@pytest.mark.parametrize("family, scheme, opts, expert_parallel, cut", [
    ("qwen3", "fp8-block", dict(block=(32, 16)), False, "FP8 scale blocks of 16 columns"),  # down: 72 a rank
    ("gpt-oss", "mxfp4", {}, False, "MXFP4 blocks of 32"),  # experts' 32 intermediate: 16 a rank
])
def test_a_split_that_would_cut_a_scale_block_is_refused_naming_the_size(tmp_path_factory, family, scheme, opts,
                                                                         expert_parallel, cut):
    model_dir, _ = quantized(tmp_path_factory, family, scheme, opts)
    with pytest.raises(InvalidArgument, match=cut) as err:
        LLM(model_dir, dtype="float32", device="cpu", tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    assert err.value.field == "tensor_parallel_size"
