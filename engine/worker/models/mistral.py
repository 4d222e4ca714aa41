"""Mistral (MistralForCausalLM): the Llama decoder, its layers attending within sliding_window
tokens when the config sets one."""
from __future__ import annotations

from baton.engine.worker.models.args import ModelArgs, decoder_args


def args(cfg: dict) -> ModelArgs:
    return decoder_args(cfg, sliding_window=cfg.get("sliding_window"))
