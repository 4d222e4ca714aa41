"""Qwen2 and Qwen2.5 (Qwen2ForCausalLM): a bias on q, k and v (none on o); sliding-window
attention only where use_sliding_window asks for it, on the layers from max_window_layers on."""
from __future__ import annotations

from baton.engine.worker.models.args import ModelArgs, decoder_args


def args(cfg: dict) -> ModelArgs:
    return decoder_args(cfg, qkv_bias=True, o_bias=False, **sliding_layers(cfg))


def sliding_layers(cfg: dict) -> dict:
    """Qwen's window switches: the window, and which layers slide (layer_types where the config
    lists them, else every layer from max_window_layers on, as transformers derives them)."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if window is None:
        return {}
    first = cfg.get("max_window_layers", 0)
    types = cfg.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                       for i in range(cfg["num_hidden_layers"])]
    return {"sliding_window": window, "layer_types": types}
