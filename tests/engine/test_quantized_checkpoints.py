"""The test writer of quantized checkpoints (baton/testing/quantized_checkpoints.py) writes what
the formats' own tools read: transformers, with compressed-tensors' decompression and its own
block-FP8 and MXFP4 dequantization, loads each checkpoint to exactly the reference's weights.
GPTQ's and AWQ's packings, which transformers reads only through GPU kernels, are checked on a
small example worked by hand."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from baton.testing.checkpoints import write_random_checkpoint
from baton.testing.quantized_checkpoints import _awq_pack, _pack_int32, quantize_checkpoint

LLAMA = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             tie_word_embeddings=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("float")), "LlamaConfig", **LLAMA)


def _config(scheme: str):
    from transformers import FineGrainedFP8Config, Mxfp4Config
    from transformers.utils.quantization_config import CompressedTensorsConfig

    if scheme.startswith("ct-"):
        return CompressedTensorsConfig(run_compressed=False)  # compressed-tensors decompresses at load
    if scheme == "mxfp4":
        return Mxfp4Config(dequantize=True)
    return FineGrainedFP8Config(dequantize=True, weight_block_size=(32, 16))


@pytest.mark.parametrize("scheme", ["ct-fp8-channel", "ct-fp8-tensor", "ct-fp8-static", "ct-w8a8-int", "ct-w4a16",
                                    "ct-w4a16-asym", "fp8-block", "mxfp4"])
def test_transformers_loads_each_checkpoint_to_the_references_weights(tmp_path, llama, scheme):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    source = llama
    if scheme == "mxfp4":
        source = write_random_checkpoint(str(tmp_path / "gpt-oss"), "GptOssConfig", hidden_size=64,
                                         intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)
    quantized, reference = quantize_checkpoint(source, str(tmp_path / "q"), str(tmp_path / "r"), scheme,
                                               group_size=16, block=(32, 16))
    loaded = AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32,
                                                  quantization_config=_config(scheme)).state_dict()
    want = load_file(f"{reference}/model.safetensors")
    changed = [name for name, w in want.items() if not torch.equal(w, load_file(f"{source}/model.safetensors")[name])]
    assert len(changed) >= 7 * LLAMA["num_hidden_layers"] or scheme == "mxfp4" and len(changed) == 4
    for name, w in want.items():
        assert torch.equal(loaded[name].float(), w), name


def test_int32_packing_is_the_low_bits_first_and_awqs_order_interleaves():
    values = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]])
    # GPTQ / compressed-tensors: value i in bits 4i..4i+3.
    assert _pack_int32(values, 4, dim=1).item() == int("f7654321", 16) - 2**32
    assert _pack_int32(values.T, 4, dim=0).item() == int("f7654321", 16) - 2**32
    # AWQ: nibble i holds column (0, 2, 4, 6, 1, 3, 5, 7)[i].
    assert _awq_pack(values).item() == int("f6427531", 16) - 2**32
    assert _pack_int32(torch.tensor([[200, 7, 255, 1]]), 8, dim=1).item() == int("01ff07c8", 16)


def test_gptq_stores_zero_points_minus_one_and_act_order_groups_by_a_permutation(tmp_path, llama):
    quantized, _ = quantize_checkpoint(llama, str(tmp_path / "q"), str(tmp_path / "r"), "gptq-4-actorder",
                                       group_size=16)
    tensors = load_file(f"{quantized}/model.safetensors")
    zeros = tensors["model.layers.0.self_attn.q_proj.qzeros"]
    assert (zeros == int("77777777", 16)).all()  # symmetric: every zero point 8, stored as 7
    g_idx = tensors["model.layers.0.self_attn.q_proj.g_idx"]
    assert sorted(g_idx.tolist()) == sorted((torch.arange(64) // 16).tolist())  # four groups of 16 columns
    assert not torch.equal(g_idx, torch.arange(64, dtype=torch.int32) // 16)  # ... not in column order


def test_bad_writer_arguments_are_named(tmp_path, llama):
    with pytest.raises(ValueError, match="scheme"):
        quantize_checkpoint(llama, str(tmp_path / "q"), str(tmp_path / "r"), "nf4")
    with pytest.raises(ValueError, match="group_size"):
        quantize_checkpoint(llama, str(tmp_path / "q"), str(tmp_path / "r"), "gptq-4", group_size=24)
