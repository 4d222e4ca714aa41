"""Llama 1-3 (LlamaForCausalLM): the plain decoder; attention_bias and mlp_bias as the config says."""
from __future__ import annotations

from baton.engine.worker.models.args import ModelArgs, decoder_args


def args(cfg: dict) -> ModelArgs:
    return decoder_args(cfg)
