"""PEFT adapters for tests, made with PEFT itself (random, non-zero), and transformers + PEFT as
the reference for their greedy output."""
from __future__ import annotations

import os

import torch

# name -> (rank, alpha, rsLoRA, target modules): ranks and targets differ on purpose.
ADAPTERS = {"sql": (4, 8, False, ["q_proj", "v_proj"]),
            "chat": (8, 16, True, ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
            "code": (16, 32, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}


def write_adapter(base_dir: str, out_dir: str, rank: int, alpha: float, rslora: bool, targets: list[str],
                  seed: int) -> str:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
                        init_lora_weights=False)  # random A and B: the adapter changes the output
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # PEFT's random B is small; make each adapter matter to greedy output
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    peft_model.save_pretrained(out_dir)
    return out_dir


def write_adapters(base_dir: str, root: str) -> dict[str, str]:
    return {name: write_adapter(base_dir, os.path.join(root, name), *spec, seed=i + 1)
            for i, (name, spec) in enumerate(ADAPTERS.items())}


class PeftReference:
    """Greedy continuations of transformers + PEFT, one prompt at a time, float32."""

    def __init__(self, base_dir: str):
        self.base_dir = base_dir
        self._models = {}

    def greedy(self, adapter_dir: str | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        if adapter_dir not in self._models:
            model = AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32)
            self._models[adapter_dir] = (PeftModel.from_pretrained(model, adapter_dir) if adapter_dir else model).eval()
        model = self._models[adapter_dir]
        ids = torch.tensor([prompt_ids])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0, eos_token_id=None, min_new_tokens=max_new_tokens)
        return out[0, len(prompt_ids):].tolist()
