"""OLMo 2 (Olmo2ForCausalLM): each block's output normed before its residual add (no input
norm), and RMSNorm over the whole q and k projections before RoPE."""
from __future__ import annotations

from baton.engine.worker.models.args import ModelArgs, decoder_args


def args(cfg: dict) -> ModelArgs:
    return decoder_args(cfg, qk_norm="whole", norm_placement="post")
