"""Gemma 3 text (Gemma3ForCausalLM): Gemma 2's layers with QK-norm (per head, (1 + weight)) in
place of attention soft-capping, and sliding layers with a RoPE base of their own: the config
keeps rope parameters per layer type (older ones: rope_theta and rope_scaling for global layers,
rope_local_base_freq for sliding ones). Fields a config leaves out take transformers' defaults."""
from __future__ import annotations

from baton.engine.worker.models.args import ModelArgs, decoder_args
from baton.engine.worker.models.gemma2 import layer_types
from baton.engine.worker.models.rope import rope_settings


def args(cfg: dict) -> ModelArgs:
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope:
        full, local_theta = rope["full_attention"], rope_settings({"rope_parameters": rope["sliding_attention"]})[0]
    else:
        full, local_theta = {"rope_theta": cfg.get("rope_theta", 1_000_000.0)}, cfg.get("rope_local_base_freq", 10000.0)
    return decoder_args(
        cfg, rope=full, qk_norm="head", norm_placement="sandwich", sliding_window=cfg.get("sliding_window", 4096),
        layer_types=layer_types(cfg, every=cfg.get("sliding_window_pattern", 6)), local_rope_theta=local_theta,
        norm_offset=1.0, embed_scale=cfg["hidden_size"] ** 0.5,
        attn_scale=cfg.get("query_pre_attn_scalar", 256) ** -0.5,
        attn_softcap=cfg.get("attn_logit_softcapping"), final_softcap=cfg.get("final_logit_softcapping"))
