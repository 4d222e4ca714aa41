"""A DeepSeek-V3 checkpoint with a multi-token-prediction layer, made from a random one (what
the MTP tests and the GPU check draft with): transformers' DeepseekV3ForCausalLM writes no MTP
weights, so a checkpoint of one layer more gives its last as the MTP layer's decoder layer."""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file


def write_mtp(path: str, whole: str, drop: tuple[str, ...] = (), seed: int = 3) -> str:
    """`whole` (a one-file DeepSeek-V3 checkpoint): its layers but the last as the target, its last
    as the MTP layer's decoder layer, with seeded enorm, hnorm, eh_proj, shared_head (an LM head
    of its own) and a copy of the target's embeddings, in a shard of its own behind
    model.safetensors.index.json; `drop`: tensors left out."""
    with open(os.path.join(whole, "config.json")) as f:
        cfg = json.load(f)
    layers = cfg["num_hidden_layers"] - 1
    prefix = f"model.layers.{layers}."
    tensors = load_file(os.path.join(whole, "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    h, vocab = cfg["hidden_size"], tensors["lm_head.weight"].shape[0]
    mtp = {name: t for name, t in tensors.items() if name.startswith(prefix)}
    mtp.update({prefix + "enorm.weight": 0.5 + torch.rand(h, generator=gen),
                prefix + "hnorm.weight": 0.5 + torch.rand(h, generator=gen),
                prefix + "eh_proj.weight": torch.randn(h, 2 * h, generator=gen) * 0.2,
                prefix + "shared_head.norm.weight": 0.5 + torch.rand(h, generator=gen),
                prefix + "shared_head.head.weight": torch.randn(vocab, h, generator=gen) * 0.2,
                prefix + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})  # as DeepSeek ships it
    for name in drop:
        del mtp[name]
    shards = {"model-00001-of-00002.safetensors": {n: t for n, t in tensors.items() if not n.startswith(prefix)},
              "model-00002-of-00002.safetensors": mtp}
    os.makedirs(path, exist_ok=True)
    for file, part in shards.items():
        save_file(part, os.path.join(path, file), metadata={"format": "pt"})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: file for file, part in shards.items() for n in part}}, f)
    for name in os.listdir(whole):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(whole, name), path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "num_hidden_layers": layers, "num_nextn_predict_layers": 1}, f)
    return path
