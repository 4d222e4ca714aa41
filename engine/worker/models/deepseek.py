"""DeepSeek-V2 and V3 (DeepseekV2ForCausalLM, V2-Lite's shape included; DeepseekV3ForCausalLM):
multi-head latent attention (mla.py; the query compressed too where q_lora_rank is set), RoPE
on the RoPE parts' adjacent pairs (V3: halves where rope_interleave is off), and a mixture of
experts from layer first_k_dense_replace on, its weights times routed_scaling_factor, with
n_shared_experts shared: V2 routes by softmax, greedy or group-limited; V3 by sigmoid scores and a
correction bias over groups (noaux_tc). V3's multi-token-prediction layers (past
num_hidden_layers) are not the target's: speculative decoding's `mtp` loads the first as a draft
head (spec_decode/mtp.py)."""
from __future__ import annotations

import dataclasses

from baton.engine.common.errors import InvalidArgument, check
from baton.engine.worker.models.args import ModelArgs, decoder_args
from baton.engine.worker.models.mla import yarn_softmax_mscale

# (topk_method, scoring_func) -> moe.route's method
_ROUTINGS = {("greedy", "softmax"): "softmax", ("group_limited_greedy", "softmax"): "group_limited_greedy",
             ("noaux_tc", "sigmoid"): "noaux_tc"}


def v2(cfg: dict) -> ModelArgs:
    return _args(cfg, "greedy", "softmax", renormalize=False)


def v3(cfg: dict) -> ModelArgs:
    a = _args(cfg, "noaux_tc", "sigmoid", renormalize=cfg.get("norm_topk_prob", True))
    return dataclasses.replace(a, skipped_layers=cfg.get("num_nextn_predict_layers") or 0)


def _args(cfg: dict, default_method: str, default_scoring: str, renormalize: bool) -> ModelArgs:
    method, scoring = cfg.get("topk_method") or default_method, cfg.get("scoring_func") or default_scoring
    if method not in {m for m, _ in _ROUTINGS}:
        raise InvalidArgument("topk_method", f"{method!r} is not supported ({', '.join(m for m, _ in _ROUTINGS)})")
    check((method, scoring) in _ROUTINGS, "scoring_func", f"{scoring!r} is not supported with topk_method {method!r}")
    layers, dense = cfg["num_hidden_layers"], cfg.get("first_k_dense_replace", 0)
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    rank, nope, rope, v = cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    a = decoder_args(cfg, num_experts=experts, num_experts_per_tok=cfg.get("num_experts_per_tok") or 0,
                     moe_intermediate_size=cfg.get("moe_intermediate_size", 0), norm_topk_prob=renormalize,
                     num_shared_experts=cfg.get("n_shared_experts") or 0, routing=_ROUTINGS[method, scoring],
                     routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
                     num_expert_groups=cfg.get("n_group") or 1, top_expert_groups=cfg.get("topk_group") or 1,
                     sparse_layers=[experts > 0 and i >= dense for i in range(layers)], attention="mla",
                     q_lora_rank=cfg.get("q_lora_rank") or 0, kv_lora_rank=rank, qk_nope_head_dim=nope,
                     qk_rope_head_dim=rope, v_head_dim=v, rope_interleaved=cfg.get("rope_interleave", True))
    # The cache: one latent "head" per token; RoPE over the rope part only.
    return dataclasses.replace(a, num_kv_heads=1, head_dim=rank + rope, rotary_dim=rope,
                               attn_scale=(nope + rope) ** -0.5 * yarn_softmax_mscale(a.rope_scaling))
