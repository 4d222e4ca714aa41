"""Random-weight Llama checkpoints in real models' shapes, for benchmarks on a GPU (no hub).

The weights are seeded normal draws (std 0.02, norms at 1), written as bf16 safetensors, a
shard per few layers, with the index transformers and Baton follow. The tokenizer is the
tests' small trained one: prompts are token ids, and ids it does not know decode to nothing.

    python bench/random_checkpoint.py llama3-8b models/random-llama3-8b
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

SHAPES = {
    # Llama-3.1-8B: 32 layers, 32 query / 8 KV heads of 128, untied 128k vocabulary, Llama 3 RoPE.
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    # Llama-3.2-1B: 16 layers, heads of 64, tied embeddings.
    "llama3-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    # Small enough that a CPU step takes milliseconds, the regime a GPU puts every engine in:
    # the serving benchmark's middle model (heads of 64, which vLLM's CPU attention accepts).
    "llama-h512": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=4, vocab_size=1000, tie_word_embeddings=False),
    # Wide enough that splitting its matmuls over ranks can pay on a CPU (the tensor-parallel
    # benchmark's), few enough layers that a step stays well under a second.
    "llama-h2048": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
                        num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False),
    # Steps as short as a GPU's on a CPU (a fraction of a millisecond of model per step), with
    # heads of 64 for vLLM's CPU attention: the front, router and client are what limits it.
    "llama-h128": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=1000, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False),  # for the tests
}
_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_LAYERS_PER_SHARD = 4


def write_random_checkpoint(out_dir: str, shape: str, seed: int = 0, max_position_embeddings: int = 131072,
                            device: str = "cpu") -> str:
    """`device`: where the weights are drawn ("cuda": an 8B checkpoint in seconds rather than
    minutes; its generator's stream, so other weights than the CPU's for the same seed)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from baton.testing.checkpoints import train_tokenizer

    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    dims = SHAPES[shape]
    tokenizer = train_tokenizer()
    config = LlamaConfig(**dims, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
                         rope_parameters=dict(_ROPE), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         dtype="bfloat16")
    config.architectures = ["LlamaForCausalLM"]
    os.makedirs(out_dir, exist_ok=True)
    gen = torch.Generator(device).manual_seed(seed)
    h, heads, kv = dims["hidden_size"], dims["num_attention_heads"], dims["num_key_value_heads"]
    head_dim, inter = h // heads, dims["intermediate_size"]

    def normal(*shape):
        return (torch.randn(*shape, generator=gen, device=device) * 0.02).to(torch.bfloat16)

    layers = dims["num_hidden_layers"]
    num_shards = 1 + -(-layers // _LAYERS_PER_SHARD)
    weight_map = {}

    def save(n: int, tensors: dict) -> None:  # each shard written as soon as it is drawn
        name = f"model-{n + 1:05d}-of-{num_shards:05d}.safetensors"
        tensors = {k: v.to("cpu") for k, v in tensors.items()}  # (a device's shard leaves it here)
        save_file(tensors, os.path.join(out_dir, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    first = {"model.embed_tokens.weight": normal(dims["vocab_size"], h),
             "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    if not dims["tie_word_embeddings"]:
        first["lm_head.weight"] = normal(dims["vocab_size"], h)
    save(0, first)
    for n, start in enumerate(range(0, layers, _LAYERS_PER_SHARD), start=1):
        shard = {}
        for i in range(start, min(start + _LAYERS_PER_SHARD, layers)):
            p = f"model.layers.{i}."
            shard.update({
                p + "self_attn.q_proj.weight": normal(heads * head_dim, h),
                p + "self_attn.k_proj.weight": normal(kv * head_dim, h),
                p + "self_attn.v_proj.weight": normal(kv * head_dim, h),
                p + "self_attn.o_proj.weight": normal(h, heads * head_dim),
                p + "mlp.gate_proj.weight": normal(inter, h),
                p + "mlp.up_proj.weight": normal(inter, h), p + "mlp.down_proj.weight": normal(h, inter),
                p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
        save(n, shard)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    tokenizer.save_pretrained(out_dir)
    config.save_pretrained(out_dir)  # last: a directory with config.json is complete
    return out_dir


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(write_random_checkpoint(args.out_dir, args.shape, args.seed), file=sys.stderr)
