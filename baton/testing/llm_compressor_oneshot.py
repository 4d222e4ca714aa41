"""Quantize a checkpoint with llm-compressor itself (the vLLM project's tool), as its users do:
`oneshot` with the FP8_DYNAMIC scheme (no calibration data) or GPTQ W4A16 (groups of 128, or 64
where 128 does not divide the model's widths, as SmolLM2's 576; calibrated on a few built-in
sentences), saved compressed (compressed-tensors format).

llm-compressor pins a transformers older than Baton's, so this runs in a virtual environment of
its own (tests/engine/test_quantized_real_tools.py makes one):

    VENV/bin/python -m baton.testing.llm_compressor_oneshot FLOAT_DIR OUT_DIR FP8_DYNAMIC|W4A16

(with this repository's baton/ folder on PYTHONPATH; it imports nothing else of Baton)."""
from __future__ import annotations

import sys
import time

SENTENCES = ["The capital of France is Paris, a city on the river Seine.",
             "Water boils at one hundred degrees at the level of the sea.",
             "The three primary colors are red, yellow and blue.",
             "A haiku has three lines of five, seven and five syllables."]


def main(src: str, out: str, scheme: str) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(src)
    if scheme == "FP8_DYNAMIC":
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]))
    elif scheme == "W4A16":
        from datasets import Dataset

        texts = [" ".join(SENTENCES[i:] + SENTENCES[:i]) for i in range(len(SENTENCES))] * 4
        data = Dataset.from_dict({"text": texts}).map(lambda e: tokenizer(e["text"], truncation=True, max_length=64),
                                                      remove_columns=["text"])
        widths = (model.config.hidden_size, model.config.intermediate_size)
        group = 128 if all(w % 128 == 0 for w in widths) else 64
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}
        recipe = GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                              ignore=["lm_head"])
        oneshot(model=model, dataset=data, recipe=recipe, max_seq_length=64, num_calibration_samples=len(texts))
    else:
        raise SystemExit(f"scheme: {scheme!r} is not FP8_DYNAMIC or W4A16")
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    print(f"{scheme}: {out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main(*sys.argv[1:4])
