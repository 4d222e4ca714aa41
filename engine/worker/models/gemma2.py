"""Gemma 2 (Gemma2ForCausalLM): GeGLU, norms around both blocks that scale by (1 + weight),
embeddings scaled by sqrt(hidden_size), scores scaled by query_pre_attn_scalar ** -0.5 and
soft-capped (attention's on the PyTorch reference), logits soft-capped, sliding layers
alternating with global ones. Fields a config leaves out take transformers' defaults."""
from __future__ import annotations

from baton.engine.worker.models.args import ModelArgs, decoder_args


def args(cfg: dict) -> ModelArgs:
    return decoder_args(
        cfg, norm_placement="sandwich", sliding_window=cfg.get("sliding_window", 4096),
        layer_types=layer_types(cfg, every=2), norm_offset=1.0, embed_scale=cfg["hidden_size"] ** 0.5,
        attn_scale=cfg.get("query_pre_attn_scalar", 256) ** -0.5,
        attn_softcap=cfg.get("attn_logit_softcapping", 50.0), final_softcap=cfg.get("final_logit_softcapping", 30.0))


def layer_types(cfg: dict, every: int) -> list[str]:
    """The config's layer_types, or as transformers derives them: every `every`-th layer global."""
    return cfg.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention"
                                      for i in range(cfg["num_hidden_layers"])]
