"""Qwen3 (Qwen3ForCausalLM): RMSNorm over each head of q and k before RoPE, a head size of its
own (not hidden / heads); attention_bias as the config says; sliding windows as Qwen2's."""
from __future__ import annotations

from baton.engine.worker.models.args import ModelArgs, decoder_args
from baton.engine.worker.models.qwen2 import sliding_layers


def args(cfg: dict) -> ModelArgs:
    return decoder_args(cfg, qk_norm="head", **sliding_layers(cfg))
