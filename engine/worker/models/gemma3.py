"""Gemma 3 text (Gemma3ForCausalLM): Gemma 2's layers with QK-norm (per head, (1 + weight)) in
place of attention soft-capping, and sliding layers with a RoPE base of their own (the config
keeps rope parameters per layer type)."""
from __future__ import annotations

from baton.engine.worker.models.args import ModelArgs, decoder_args
from baton.engine.worker.models.rope import rope_settings


def args(cfg: dict) -> ModelArgs:
    rope = cfg.get("rope_parameters") or {}
    per_type = "full_attention" in rope
    full = rope["full_attention"] if per_type else None
    local_theta = (rope_settings({**cfg, "rope_parameters": rope["sliding_attention"]})[0] if per_type
                   else cfg.get("rope_local_base_freq"))
    return decoder_args(
        cfg, rope=full, qk_norm="head", norm_placement="sandwich", sliding_window=cfg.get("sliding_window"),
        layer_types=cfg.get("layer_types") or [], local_rope_theta=local_theta, norm_offset=1.0,
        embed_scale=cfg["hidden_size"] ** 0.5, attn_scale=cfg.get("query_pre_attn_scalar", 256) ** -0.5,
        attn_softcap=cfg.get("attn_logit_softcapping"), final_softcap=cfg.get("final_logit_softcapping"))
