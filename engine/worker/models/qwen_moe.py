"""Qwen2-MoE and Qwen3-MoE (Qwen2MoeForCausalLM, Qwen3MoeForCausalLM): Qwen2's and Qwen3's
attention, sparse MoE layers where transformers puts them (every decoder_sparse_step-th layer,
none of mlp_only_layers; the rest dense MLPs of intermediate_size), softmax top-k routing,
renormalized where norm_topk_prob says; Qwen2-MoE adds a shared expert behind a sigmoid gate."""
from __future__ import annotations

from baton.engine.worker.models.args import ModelArgs, decoder_args
from baton.engine.worker.models.qwen2 import sliding_layers


def moe_args(cfg: dict) -> dict:
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0  # (transformers 5 writes the latter)
    return {"num_experts": num_experts, "num_experts_per_tok": cfg["num_experts_per_tok"],
            "moe_intermediate_size": cfg["moe_intermediate_size"], "norm_topk_prob": cfg.get("norm_topk_prob", False),
            "sparse_layers": [i not in dense and num_experts > 0 and (i + 1) % step == 0
                              for i in range(cfg["num_hidden_layers"])]}


def qwen2_moe(cfg: dict) -> ModelArgs:
    return decoder_args(cfg, qkv_bias=True, o_bias=False, **sliding_layers(cfg), **moe_args(cfg),
                        shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0)


def qwen3_moe(cfg: dict) -> ModelArgs:
    return decoder_args(cfg, qk_norm="head", **sliding_layers(cfg), **moe_args(cfg))
