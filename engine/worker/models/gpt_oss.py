"""gpt-oss (GptOssForCausalLM): Llama's decoder with biases on q/k/v/o, a learned attention sink per
head, sliding windows (128) on alternate layers, YaRN, and a mixture of experts in every layer:
the router's top-k logits (it has a bias) softmaxed, experts with biases and a clamped SwiGLU
(swiglu_alpha, swiglu_limit). Checkpoints stack the experts ([experts, hidden, 2 · intermediate],
gate and up interleaved), in MXFP4 for the published weights; the loader reads both."""
from __future__ import annotations

from baton.engine.worker.models.args import ModelArgs, decoder_args
from baton.engine.worker.models.gemma2 import layer_types
from baton.engine.worker.models.moe import GLU


def args(cfg: dict) -> ModelArgs:
    layers = cfg["num_hidden_layers"]
    return decoder_args(cfg, qkv_bias=cfg.get("attention_bias", True), o_bias=cfg.get("attention_bias", True),
                        sliding_window=cfg.get("sliding_window", 128), layer_types=layer_types(cfg, every=2),
                        num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                        moe_intermediate_size=cfg["intermediate_size"], routing="topk_softmax", moe_bias=True,
                        expert_glu=GLU("swiglu_oai", cfg.get("swiglu_alpha", 1.702), cfg.get("swiglu_limit", 7.0)),
                        sparse_layers=[True] * layers, attn_sinks=True)
