"""Shared fixtures: real checkpoints written to disk, and transformers as the reference."""
from __future__ import annotations

import os

import pytest
import torch

from baton.engine.checkpoints import SMOLLM2_DIR_NAME, prepare_smollm2, write_tiny_checkpoint

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    # Sharded on purpose: the loader must follow model.safetensors.index.json.
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-llama")), "llama", max_shard_size="200KB")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-qwen2")), "qwen2")


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request, tiny_llama, tiny_qwen2) -> str:
    return {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param]


@pytest.fixture(scope="session")
def smollm2() -> str:
    models_dir = os.environ.get("BATON_MODELS_DIR", os.path.join(os.path.dirname(__file__), "..", "models"))
    return prepare_smollm2(os.path.join(models_dir, SMOLLM2_DIR_NAME))


class HFReference:
    """Greedy continuations from transformers `generate`, one prompt at a time (no padding)."""

    def __init__(self):
        self._models = {}
        self._cache = {}

    def model(self, model_dir: str):
        if model_dir not in self._models:
            from transformers import AutoModelForCausalLM
            self._models[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        return self._models[model_dir]

    def greedy(self, model_dir: str, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = False) -> list[int]:
        key = (model_dir, tuple(prompt_ids), max_new_tokens, stop_at_eos)
        if key not in self._cache:
            model = self.model(model_dir)
            ids = torch.tensor([prompt_ids])
            extra = {} if stop_at_eos else {"eos_token_id": None, "min_new_tokens": max_new_tokens}
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     do_sample=False, pad_token_id=0, **extra)
            self._cache[key] = out[0, len(prompt_ids):].tolist()
        return self._cache[key]


@pytest.fixture(scope="session")
def hf() -> HFReference:
    return HFReference()
