"""Quantized checkpoints written by the real tool, llm-compressor's `oneshot`, from a float
checkpoint: what tests/engine/test_quantized_real_tools.py loads into Baton (and what a person
can look at to see what llm-compressor really writes). Runs in the tools' own venv
(bench/quant_tools.sh makes it: llm-compressor pins a transformers and compressed-tensors of its
own), never in Baton's.

    bench/quant_tools.sh SRC OUT [--schemes fp8_dynamic,w4a16] [--group-size 64] [--samples 8]

writes OUT/<scheme>/ for each scheme and prints one JSON line per scheme: the seconds `oneshot`
took (calibration, quantization and saving), the checkpoint's bytes, and each tensor's name,
dtype and shape for the first layer.

- fp8_dynamic: FP8 weights with a scale per output channel, activations quantized per token at
  run time (no calibration data).
- w4a16: GPTQ to 4-bit integers, symmetric, one scale per `--group-size` input columns (-1: per
  channel), calibrated on `--samples` sequences of random token ids (a Hessian needs no meaning).
- w4a16_asym: the same, asymmetric (zero points packed too), rounded to nearest (no calibration).
- w8a8: INT8 weights per channel by GPTQ, activations per token at run time.
- fp8_block: FP8 weights in 128x128 blocks (DeepSeek-V3's), no calibration.

lm_head stays float in each (llm-compressor's examples ignore it too).
"""
from __future__ import annotations

import argparse
import json
import os
import time


def _weights(num_bits: int, type_: str, strategy: str, symmetric: bool = True, **more) -> dict:
    return {"num_bits": num_bits, "type": type_, "strategy": strategy, "symmetric": symmetric, "dynamic": False,
            **more}


def recipe(scheme: str, group_size: int):
    """The llm-compressor modifier that writes `scheme`, and whether it calibrates."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    ignore = ["lm_head"]
    group = (dict(strategy="group", group_size=group_size) if group_size > 0 else dict(strategy="channel"))
    if scheme == "fp8_dynamic":
        return QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=ignore), False
    if scheme == "fp8_block":
        return QuantizationModifier(targets="Linear", scheme="FP8_BLOCK", ignore=ignore), False
    if scheme == "w4a16":
        groups = {"group_0": {"targets": ["Linear"], "weights": _weights(4, "int", **group)}}
        return GPTQModifier(config_groups=groups, ignore=ignore), True
    if scheme == "w4a16_asym":
        groups = {"group_0": {"targets": ["Linear"], "weights": _weights(4, "int", symmetric=False, **group)}}
        return QuantizationModifier(config_groups=groups, ignore=ignore), False
    if scheme == "w8a8":
        return GPTQModifier(targets="Linear", scheme="W8A8", ignore=ignore), True
    raise SystemExit(f"--schemes: unknown scheme {scheme!r}")


def calibration(vocab: int, samples: int, length: int, seed: int = 0):
    """Random token ids: GPTQ's Hessian of each layer's inputs needs inputs, not meaning."""
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (samples, length), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * length] * samples})


def tensors_of(out_dir: str, layer: str = "model.layers.0.") -> dict[str, list]:
    """Each tensor of `layer` in the written checkpoint: name -> [dtype, shape]."""
    from safetensors import safe_open

    found = {}
    for name in sorted(os.listdir(out_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(out_dir, name), "pt") as f:
                for key in f.keys():
                    if key.startswith(layer):
                        sl = f.get_slice(key)
                        found[key] = [sl.get_dtype(), list(sl.get_shape())]
    return found


def write(src: str, out: str, scheme: str, group_size: int, samples: int, length: int, dtype: str) -> dict:
    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)  # scales in the model's dtype, as shipped
    modifier, calibrates = recipe(scheme, group_size)
    data = dict(dataset=calibration(model.config.vocab_size, samples, length), num_calibration_samples=samples,
                max_seq_length=length) if calibrates else {}
    t0 = time.monotonic()
    with torch.no_grad():
        oneshot(model=model, recipe=modifier, **data)
    seconds = time.monotonic() - t0
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    size = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out) if n.endswith(".safetensors"))
    return {"scheme": scheme, "dir": out, "seconds": round(seconds, 1), "bytes": size,
            "dtype": str(model.dtype).removeprefix("torch."), "tensors": tensors_of(out)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="a float checkpoint's directory")
    p.add_argument("out", help="where each scheme's checkpoint goes (OUT/<scheme>)")
    p.add_argument("--schemes", default="fp8_dynamic,w4a16")
    p.add_argument("--group-size", type=int, default=64, help="w4a16's group of input columns (-1: per channel)")
    p.add_argument("--samples", type=int, default=8, help="calibration sequences (GPTQ)")
    p.add_argument("--length", type=int, default=64, help="tokens in each calibration sequence")
    p.add_argument("--dtype", default="auto", help="the model's dtype while quantized (auto: the checkpoint's); "
                                                   "the scales and the unquantized tensors are written in it")
    args = p.parse_args()
    for scheme in args.schemes.split(","):
        report = write(args.src, os.path.join(args.out, scheme), scheme, args.group_size, args.samples, args.length,
                       args.dtype)
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
