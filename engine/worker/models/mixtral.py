"""Mixtral (MixtralForCausalLM): Mistral's decoder with a sparse MoE in every layer: softmax top-k
routing over num_local_experts, the k weights renormalized (checkpoints name the block
block_sparse_moe and the experts' projections w1, w3, w2)."""
from __future__ import annotations

from baton.engine.worker.models.args import ModelArgs, decoder_args


def args(cfg: dict) -> ModelArgs:
    return decoder_args(cfg, sliding_window=cfg.get("sliding_window"), num_experts=cfg["num_local_experts"],
                        num_experts_per_tok=cfg["num_experts_per_tok"], moe_intermediate_size=cfg["intermediate_size"],
                        norm_topk_prob=True, sparse_layers=[True] * cfg["num_hidden_layers"])
