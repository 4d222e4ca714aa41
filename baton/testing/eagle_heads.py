"""Random-weight EAGLE heads in the published formats (EAGLE-1: a Llama config and
pytorch_model.bin with fc, layers.0 without its input_layernorm, the target's embeddings;
EAGLE-3: safetensors with fc over three target layers, midlayer, norm, a draft vocabulary's
lm_head, d2t and t2d), for a target checkpoint: what the EAGLE tests and the GPU check draft with."""
from __future__ import annotations

import json
import os

import torch

DRAFT_VOCAB = 300  # EAGLE-3's draft vocabulary: a part of the target's
AUX_LAYERS = [1, 2, 3]  # tiny_llama has 4 layers: vLLM's default (2, 2, 1) gives two states, not three
HEADS, KV_HEADS = 2, 1


def write_head(path: str, target: str, method: str, *, seed: int = 0, hidden: int | None = None,
               drop: tuple[str, ...] = (), d2t_past_vocab: bool = False, aux_layers: list | None = AUX_LAYERS,
               nested_aux: bool = False, target_shape: bool = False) -> str:
    """A random EAGLE head for the `target` checkpoint, in the format `method`'s published heads
    have; `target_shape`: its layer shaped as the target's (heads, KV heads, intermediate), as a
    real head is, else small."""
    with open(os.path.join(target, "config.json")) as f:
        t = json.load(f)
    h, vocab = hidden or t["hidden_size"], t["vocab_size"]
    heads, kv_heads, inter = ((t["num_attention_heads"], t["num_key_value_heads"], t["intermediate_size"])
                              if target_shape else (HEADS, KV_HEADS, 96))  # (its cache is its own either way)
    dim = h // heads
    eagle3 = method == "eagle3"
    cfg = {"architectures": ["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM"], "model_type": "llama",
           "hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "vocab_size": vocab, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "max_position_embeddings": 2048, "hidden_act": "silu", "torch_dtype": "float32",
           "tie_word_embeddings": False}
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.15):
        return torch.randn(*shape, generator=gen) * std

    width = 2 * h if eagle3 else h  # what q/k/v read
    layer = "midlayer" if eagle3 else "layers.0"
    w = {f"{layer}.self_attn.q_proj.weight": rand(heads * dim, width),
         f"{layer}.self_attn.k_proj.weight": rand(kv_heads * dim, width),
         f"{layer}.self_attn.v_proj.weight": rand(kv_heads * dim, width),
         f"{layer}.self_attn.o_proj.weight": rand(h, heads * dim),
         f"{layer}.mlp.gate_proj.weight": rand(inter, h), f"{layer}.mlp.up_proj.weight": rand(inter, h),
         f"{layer}.mlp.down_proj.weight": rand(h, inter),
         f"{layer}.post_attention_layernorm.weight": 1 + rand(h, std=0.1)}
    if eagle3:
        cfg["draft_vocab_size"] = DRAFT_VOCAB
        if aux_layers is not None:
            cfg.update({"eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layers}} if nested_aux
                       else {"eagle_aux_hidden_state_layer_ids": aux_layers})
        targets = torch.randperm(vocab, generator=gen)[:DRAFT_VOCAB].sort().values
        if d2t_past_vocab:
            targets[-1] = vocab + 5
        w.update({"fc.weight": rand(h, 3 * h), f"{layer}.input_layernorm.weight": 1 + rand(h, std=0.1),
                  f"{layer}.hidden_norm.weight": 1 + rand(h, std=0.1), "norm.weight": 1 + rand(h, std=0.1),
                  "lm_head.weight": rand(DRAFT_VOCAB, h, std=0.5), "d2t": targets - torch.arange(DRAFT_VOCAB),
                  "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, targets.clamp(max=vocab - 1), True)})
    else:
        w.update({"fc.weight": rand(h, 2 * h), "embed_tokens.weight": rand(vocab, h)})  # (the target's: unused)
    for name in drop:
        del w[name]
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    if eagle3:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(path, "model.safetensors"))
    else:
        torch.save(w, os.path.join(path, "pytorch_model.bin"))
    return path
