"""Gemma 2 (Gemma2ForCausalLM): GeGLU, norms around both blocks that scale by (1 + weight),
embeddings scaled by sqrt(hidden_size), scores scaled by query_pre_attn_scalar ** -0.5 and
soft-capped (attention's on the PyTorch reference), logits soft-capped, sliding layers
alternating with global ones."""
from __future__ import annotations

from baton.engine.worker.models.args import ModelArgs, decoder_args


def args(cfg: dict) -> ModelArgs:
    return decoder_args(
        cfg, norm_placement="sandwich", sliding_window=cfg.get("sliding_window"),
        layer_types=cfg.get("layer_types") or [], norm_offset=1.0, embed_scale=cfg["hidden_size"] ** 0.5,
        attn_scale=cfg.get("query_pre_attn_scalar", cfg.get("head_dim", 256)) ** -0.5,
        attn_softcap=cfg.get("attn_logit_softcapping"), final_softcap=cfg.get("final_logit_softcapping"))
