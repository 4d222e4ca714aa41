"""Checkpoints made by the real tool, llm-compressor's `oneshot` (opt-in, BATON_TEST_QUANT_TOOLS=1:
it builds a virtual environment of its own, since llm-compressor pins an older transformers, which
takes minutes the first time; it is kept under build/): FP8_DYNAMIC and GPTQ W4A16 of a random
Llama (SmolLM2 too with BATON_TEST_QUANT_SMOLLM2=1) load in Baton kept quantized and greedy-equal
to transformers loading the same checkpoint (compressed-tensors decompressing it)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import random_prompts

from baton import LLM, SamplingParams
from baton.engine.worker.quant.linear import QuantizedLinear
from baton.testing.checkpoints import write_random_checkpoint

pytestmark = [pytest.mark.quant_tools,
              pytest.mark.skipif(os.environ.get("BATON_TEST_QUANT_TOOLS") != "1",
                                 reason="builds llm-compressor's environment (minutes): BATON_TEST_QUANT_TOOLS=1")]

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / "build" / "quant-tools-venv"
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tool_python() -> str:
    """The tool environment's python: torch pinned as Baton's first (the CPU build), then llm-compressor."""
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        for spec in (["torch==" + torch.__version__.split("+")[0]], ["llmcompressor"]):
            subprocess.run([str(python), "-m", "pip", "install", "-q", *spec], check=True, timeout=1800)
    return str(python)


def oneshot(tool_python: str, src: str, out: str, scheme: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # baton/testing only: the repo's top folder holds `baton`
    subprocess.run([tool_python, "-m", "baton.testing.llm_compressor_oneshot", src, out, scheme], check=True,
                   timeout=1800, env=env, cwd=ROOT)
    return out


def transformers_greedy(model_dir: str, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(run_compressed=False))
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                                        do_sample=False, eos_token_id=None, min_new_tokens=GREEDY.max_tokens,
                                        pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


def sources(tmp_path_factory) -> list[str]:
    llama = write_random_checkpoint(str(tmp_path_factory.mktemp("llama")), "LlamaConfig", hidden_size=128,
                                    intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                                    num_hidden_layers=2, tie_word_embeddings=False)
    smollm2 = ROOT / "models" / "smollm2-135m-instruct"
    return [llama] + ([str(smollm2)] if os.environ.get("BATON_TEST_QUANT_SMOLLM2") == "1" else [])


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "W4A16"])
def test_llm_compressor_checkpoints_load_quantized_and_equal_transformers(tool_python, tmp_path_factory, scheme):
    pytest.importorskip("compressed_tensors")
    for src in sources(tmp_path_factory):
        model_dir = oneshot(tool_python, src, str(tmp_path_factory.mktemp(scheme)), scheme)
        prompts = random_prompts([5, 30, 57], seed=3)
        with LLM(model_dir, dtype="float32", device="cpu") as llm:
            assert any(isinstance(m, QuantizedLinear) for m in llm.engine.runner.model.modules())
            got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        assert got == transformers_greedy(model_dir, prompts), src
