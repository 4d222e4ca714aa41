"""Checkpoints quantized by the real tools, not by Baton's own writers: llm-compressor's
`oneshot` (compressed-tensors: FP8 per channel and in blocks, INT8 per channel, packed INT4 per
group, symmetric by GPTQ and asymmetric) and GPTQModel (GPTQ v1, with and without act-order),
each in a venv of its own that bench/quant_tools.sh makes (minutes, the first time). What
Baton's reader (engine/worker/quant/formats.py) meets in the wild. Opt-in with
BATON_TEST_QUANT_TOOLS=1; BATON_TEST_QUANT_TOOLS_SMOLLM2=1 adds the demo model (SmolLM2-135M)
quantized by llm-compressor in bfloat16, so scales in bfloat16 (GPTQ over its 30 layers takes
over ten minutes on two cores).

For each checkpoint the tool's own code dequantizes it into float32 (compressed-tensors'
decompressors; GPTQModel's torch layers), the scales widened to float32 first so that nothing
rounds: the reference. transformers loads each compressed-tensors checkpoint itself and
generates as it does on the reference; and Baton, the layers kept quantized, generates greedily
exactly what transformers does on the reference."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import random_prompts

from baton import LLM, SamplingParams
from baton.engine.worker.quant.linear import QuantizedLinear
from baton.engine.worker.quant.weights import IntWeight
from baton.testing.checkpoints import write_random_checkpoint

pytestmark = [pytest.mark.quant_tools,
              pytest.mark.skipif(os.environ.get("BATON_TEST_QUANT_TOOLS") != "1",
                                 reason="quantizes with llm-compressor and GPTQModel in venvs of their own (minutes): "
                                        "BATON_TEST_QUANT_TOOLS=1")]

ROOT = Path(__file__).resolve().parents[2]
# hidden 128, intermediate 256, head 32: every input width (128, 256) a multiple of the groups (64)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False)
LLM_COMPRESSOR = ("fp8_dynamic", "w4a16", "w4a16_asym", "w8a8", "fp8_block")
GPTQMODEL = ("gptq", "gptq_act")
MODELS = ["tiny"] + (["smollm2"] if os.environ.get("BATON_TEST_QUANT_TOOLS_SMOLLM2") == "1" else [])
# What transformers (5.24, with compressed-tensors 0.20) cannot load itself of llm-compressor 0.14's
# checkpoints (compressed-tensors 0.19's): the reference and Baton still read them.
NATIVE_CANNOT = {"w4a16_asym": "compressed-tensors 0.20 lays weight_zero_point out unpacked [out, groups] for "
                               "loading, the checkpoint packs it along the rows ([out / 8, groups] int32)",
                 "gptq": "GPTQ needs GPTQModel or optimum in Baton's venv", "gptq_act": "the same"}
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, request):
    """model -> (its float checkpoint, {scheme: the tool's report: dir, seconds, bytes, tensors
    and, GPTQModel's, its reference}), each model's checkpoints written once."""
    done = {}

    def get(model: str) -> tuple[str, dict]:
        if model not in done:
            out = str(tmp_path_factory.mktemp(f"quantized-{model}"))
            if model == "tiny":
                src = write_random_checkpoint(os.path.join(out, "float"), "LlamaConfig", **TINY)
                reports = {**run_tool([], src, out, LLM_COMPRESSOR), **run_tool(["--gptqmodel"], src, out, GPTQMODEL)}
            else:  # 576 and 1536 input columns: groups of 64 divide both
                src = request.getfixturevalue("smollm2")
                reports = run_tool([], src, out, ("fp8_dynamic", "w4a16"), "--dtype", "bfloat16")
            done[model] = src, reports
        return done[model]
    return get


def run_tool(tool: list[str], src: str, out: str, schemes, *more: str) -> dict:
    t0 = time.monotonic()
    run = subprocess.run([str(ROOT / "bench/quant_tools.sh"), *tool, src, out, "--schemes", ",".join(schemes),
                          "--group-size", "64", *more], capture_output=True, text=True, timeout=3600)
    assert run.returncode == 0, run.stderr[-6000:]
    reports = {r["scheme"]: r for r in (json.loads(line) for line in run.stdout.splitlines()
                                                           if line.startswith("{\"scheme\""))}
    assert set(reports) == set(schemes), run.stdout[-2000:]
    print(f"\n{tool or ['llm-compressor']} on {os.path.basename(src)}: {time.monotonic() - t0:.0f}s in all "
          f"(its venv made where it was not)")
    for r in reports.values():
        print(f"  {r['scheme']}: {r['seconds']}s, {r['bytes'] / 2**20:.2f} MiB of safetensors; layer 0's "
              + ", ".join(f"{k.removeprefix('model.layers.0.')} {d}{s}" for k, (d, s) in r["tensors"].items()
                          if ".q_proj." in k or ".down_proj." in k))
    return reports


def dequantized_reference(qdir: str, dst: str) -> str:
    """The quantized checkpoint in float32 as compressed-tensors' own decompressor (its format's,
    from the registry) computes it, in a checkpoint transformers loads as a plain model."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file, save_file

    config = json.loads(Path(qdir, "config.json").read_text())
    qconfig = QuantizationConfig.model_validate(config.pop("quantization_config"))
    (scheme,) = qconfig.config_groups.values()  # bench/quant_tools.py's schemes have one group
    compressor = BaseCompressor.get_value_from_registry(scheme.format or qconfig.format)
    tensors = {}
    for name in sorted(os.listdir(qdir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(qdir, name)))
    for module in sorted({n.removesuffix(".weight_scale") for n in tensors if n.endswith(".weight_scale")}):
        prefix = module + "."
        local = {n.removeprefix(prefix): tensors.pop(n) for n in list(tensors) if n.startswith(prefix)
                 and "." not in n.removeprefix(prefix) and n.removeprefix(prefix) != "bias"}
        local["weight_scale"] = local["weight_scale"].float()  # (decompress computes in the scale's dtype)
        tensors[prefix + "weight"] = compressor.decompress(local, scheme)["weight"]
    os.makedirs(dst, exist_ok=True)
    save_file({n: t.float().contiguous() for n, t in tensors.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    Path(dst, "config.json").write_text(json.dumps({**config, "torch_dtype": "float32", "dtype": "float32"}))
    for name in os.listdir(qdir):
        if name.startswith(("tokenizer", "chat_template", "generation_config", "special_tokens")):
            shutil.copy(os.path.join(qdir, name), dst)
    return dst


def assert_quantized_from(src: str, reference: str) -> None:
    """The reference's projections are the float model's, quantized: near, not equal."""
    from safetensors import safe_open

    name = "model.layers.0.mlp.down_proj.weight"
    with safe_open(os.path.join(reference, "model.safetensors"), "pt") as f:
        dequantized = f.get_tensor(name)
    for shard in sorted(n for n in os.listdir(src) if n.endswith(".safetensors")):
        with safe_open(os.path.join(src, shard), "pt") as f:
            if name in f.keys():
                original = f.get_tensor(name).float()
    error = (dequantized - original).norm() / original.norm()
    assert 0 < error < 0.2, f"{name}: relative error {error:.3f} of the dequantized weights"


def native_greedy(qdir: str, prompts) -> list[list[int]]:
    """transformers' greedy on the quantized checkpoint as it loads it itself: compressed-tensors'
    layers, the weights as shipped (FP8, packed int32) until the first forward decompresses them.
    Activations unquantized, as Baton runs them: a scheme with quantized inputs (FP8_DYNAMIC,
    W8A8, FP8_BLOCK) has its fake quantization turned off, layer by layer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qdir, dtype=torch.float32).eval()
    layers = [m for m in model.modules() if getattr(m, "quantization_scheme", None) is not None]
    assert layers, "transformers loaded the checkpoint unquantized"
    assert all(hasattr(m, "weight_packed") or m.weight.dtype in (torch.float8_e4m3fn, torch.int8) for m in layers)
    for m in layers:
        m.quantization_enabled = m.quantization_scheme.input_activations is None
    return transformers_greedy(model, prompts)


def transformers_greedy(model, prompts) -> list[list[int]]:
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                                 min_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return outs


@pytest.mark.parametrize("scheme", LLM_COMPRESSOR + GPTQMODEL)
@pytest.mark.parametrize("model", MODELS)
def test_real_tools_checkpoint_runs_quantized_as_transformers_on_its_dequantized_weights(
        model, scheme, quantized, hf, tmp_path):
    src, reports = quantized(model)
    if scheme not in reports:
        pytest.skip(f"{scheme} is written for the tiny model only")
    qdir = reports[scheme]["dir"]
    reference = reports[scheme].get("reference") or dequantized_reference(qdir, str(tmp_path / "reference"))
    assert_quantized_from(src, reference)
    prompts = random_prompts([5, 17, 33, 2], seed=(LLM_COMPRESSOR + GPTQMODEL).index(scheme))
    expected = [hf.greedy(reference, p, GREEDY.max_tokens) for p in prompts]
    if scheme in NATIVE_CANNOT:
        print(f"\n{scheme}: transformers does not load it here: {NATIVE_CANNOT[scheme]}")
    else:
        assert native_greedy(qdir, prompts) == expected

    llm = LLM(qdir, dtype="float32", device="cpu")
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * json.loads(Path(qdir, "config.json").read_text())["num_hidden_layers"]
    if scheme == "gptq_act":  # act-order's groups really reached the layers (not column // group_size)
        assert all(isinstance(p, IntWeight) and p.g_idx is not None for m in layers for p in m.parts)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
