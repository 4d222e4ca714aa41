"""Phi-3 and Phi-4 (Phi3ForCausalLM): checkpoints with q/k/v and gate/up fused already
(qkv_proj, gate_up_proj, as Baton lays them out), RoPE over partial_rotary_factor of each head,
sliding_window where the config sets one."""
from __future__ import annotations

from baton.engine.worker.models.args import ModelArgs, decoder_args


def args(cfg: dict) -> ModelArgs:
    return decoder_args(cfg, sliding_window=cfg.get("sliding_window"))
