"""GPTQ checkpoints written by GPTQModel itself, and each one's float32 reference dequantized by
GPTQModel's own layers: what tests/engine/test_quantized_real_tools.py loads into Baton.
Runs in GPTQModel's venv (bench/quant_tools.sh --gptqmodel makes it), never in Baton's.

    bench/quant_tools.sh --gptqmodel SRC OUT [--schemes gptq,gptq_act] [--group-size 64]

writes OUT/<scheme>/ (the checkpoint) and OUT/<scheme>-reference/ (float32, no quantization)
for each scheme and prints one JSON line per scheme as bench/quant_tools.py does.

- gptq: 4-bit, symmetric, groups of `--group-size` input columns, checkpoint format v1 (each
  zero point stored minus one), calibrated on `--samples` sequences of random token ids.
- gptq_act: the same with act-order (desc_act): the columns quantized in the order of their
  activations' size, so `g_idx` is no longer column // group_size.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # (its default pool asks more workers than 2 cores give)


def calibration(vocab: int, samples: int, length: int, seed: int = 0) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, vocab, (length,), generator=g).tolist(), "attention_mask": [1] * length}
            for _ in range(samples)]


def write(src: str, out: str, scheme: str, group_size: int, samples: int, length: int) -> dict:
    from gptqmodel import GPTQModel, QuantizeConfig
    from transformers import AutoConfig

    if scheme not in ("gptq", "gptq_act"):
        raise SystemExit(f"--schemes: unknown scheme {scheme!r}")
    config = QuantizeConfig(bits=4, group_size=group_size, desc_act=scheme == "gptq_act", sym=True)
    t0 = time.monotonic()
    model = GPTQModel.load(src, config, device="cpu")
    model.quantize(calibration(AutoConfig.from_pretrained(src).vocab_size, samples, length), batch_size=1)
    model.save(out)
    seconds = time.monotonic() - t0
    size = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out) if n.endswith(".safetensors"))
    return {"scheme": scheme, "dir": out, "seconds": round(seconds, 1), "bytes": size, "tensors": tensors_of(out)}


def tensors_of(out_dir: str, layer: str = "model.layers.0.") -> dict[str, list]:
    from safetensors import safe_open

    found = {}
    for name in sorted(n for n in os.listdir(out_dir) if n.endswith(".safetensors")):
        with safe_open(os.path.join(out_dir, name), "pt") as f:
            for key in f.keys():
                if key.startswith(layer):
                    sl = f.get_slice(key)
                    found[key] = [sl.get_dtype(), list(sl.get_shape())]
    return found


def reference(qdir: str, dst: str) -> str:
    """The checkpoint in float32 as GPTQModel's own torch layers dequantize it (the checkpoint's
    scales widened to float32 first, so nothing rounds), beside its unquantized tensors, as a plain
    checkpoint."""
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from safetensors.torch import load_file, save_file

    model = GPTQModel.load(qdir, device="cpu", backend=BACKEND.TORCH)
    tensors = {}
    for name in sorted(n for n in os.listdir(qdir) if n.endswith(".safetensors")):
        tensors.update(load_file(os.path.join(qdir, name)))
    for name, module in model.model.named_modules():
        if not hasattr(module, "dequantize_weight"):
            continue
        # (the checkpoint's scales, widened: GPTQModel's layer may hold them in the model's dtype)
        module.scales = tensors[f"{name}.scales"].float()
        with torch.no_grad():
            weight = module.dequantize_weight().T  # [in, out] there
        for field in ("qweight", "qzeros", "scales", "g_idx"):
            tensors.pop(f"{name}.{field}", None)
        tensors[f"{name}.weight"] = weight
    os.makedirs(dst, exist_ok=True)
    save_file({n: t.float().contiguous() for n, t in tensors.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(qdir, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config")
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**config, "torch_dtype": "float32", "dtype": "float32"}, f)
    for name in os.listdir(qdir):
        if name.startswith(("tokenizer", "chat_template", "generation_config", "special_tokens")):
            shutil.copy(os.path.join(qdir, name), dst)
    return dst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--schemes", default="gptq,gptq_act")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--length", type=int, default=64)
    args = p.parse_args()
    args.src, args.out = os.path.abspath(args.src), os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    os.chdir(args.out)  # (GPTQModel writes its logs/ where it runs)
    for scheme in args.schemes.split(","):
        out = os.path.join(args.out, scheme)
        report = write(args.src, out, scheme, args.group_size, args.samples, args.length)
        report["reference"] = reference(out, out + "-reference")
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
