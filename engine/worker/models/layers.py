"""The shared layers every family is made of, in plain PyTorch, running on a flat token batch:
attention over the paged KV cache (GQA, QK-norm, partial rotary, soft-capping, sliding
windows, sinks; MLA in mla.py), the decoder layer with its norms where the family puts them and its
MLP or mixture of experts (basic.py, moe.py), and the causal LM around them (per-layer RoPE
bases, logit soft-capping). q/k/v projections are merged into one matmul when weights are
loaded (loader.py)."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from baton.engine.worker.models import mrope
from baton.engine.worker.models.args import ModelArgs, VisionArgs
from baton.engine.worker.models.basic import MLP, Embedding, Linear, norm
from baton.engine.worker.models.gemma3_vl import Gemma3Vision, SiglipArgs
from baton.engine.worker.models.llava import LlavaVision
from baton.engine.worker.models.mla import MLAttention
from baton.engine.worker.models.moe import SparseMoE
from baton.engine.worker.models.qwen2_5_vl import QwenVision, QwenVisionArgs
from baton.engine.worker.models.qwen3_vl import Qwen3Vision, Qwen3VisionArgs
from baton.engine.worker.models.rope import RotaryTable, rotate
from baton.kernels.attention import AttentionMetadata, paged_attention


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, sliding: bool = False):
        super().__init__()
        # Keys fewer than this many positions behind a query (None: all); CausalLM.prepare drops it
        # where the window holds the whole context anyway.
        self.window = args.sliding_window if sliding else None
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_size, self.kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = Linear(self.q_size, args.hidden_size, bias=args.o_bias)
        if args.qk_norm:  # its own weights for q and for k, over each head or over the whole projection
            whole = args.qk_norm == "whole"
            self.q_norm = norm(args, self.q_size if whole else args.head_dim)
            self.k_norm = norm(args, self.kv_size if whole else args.head_dim)
        self.qk_norm = args.qk_norm
        self.rotary_dim = args.rotary_dim or args.head_dim
        self.scale = args.attn_scale or args.head_dim ** -0.5
        self.softcap = args.attn_softcap
        # gpt-oss: one score per query head that takes weight and gives nothing
        self.sinks = nn.Parameter(torch.empty(args.num_heads)) if args.attn_sinks else None
        # An FP8 cache's K and V scale per KV head (kernels/kv_quant.py): the checkpoint's, else 1.
        self.register_buffer("kv_scales", torch.ones(2, args.num_kv_heads, dtype=torch.float32), persistent=False)

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        # q and k side by side in each row: one RoPE over both heads' sets.
        if self.qk_norm == "whole":
            q, k = qkv[:, :self.q_size], qkv[:, self.q_size:self.q_size + self.kv_size]
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1).view(-1, self.num_heads + self.num_kv_heads,
                                                                          self.head_dim)
        else:
            qk = qkv[:, :self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            qk = torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)
        if self.rotary_dim == self.head_dim:
            qk = rotate(qk, cos, sin)
        else:  # partial rotary: the first rotary_dim dims of each head turn, the rest pass
            qk = torch.cat((rotate(qk[..., :self.rotary_dim], cos, sin), qk[..., self.rotary_dim:]), dim=-1)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        sinks = self.sinks.float() if self.sinks is not None else None
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.softcap, self.window, sinks,
                              self.kv_scales)
        return self.o_proj(out.flatten(1))


class DecoderLayer(nn.Module):
    """Where the norms sit, by norm_placement; the names are the checkpoints':
    - "pre" (Llama): input_layernorm before attention, post_attention_layernorm before the MLP;
    - "post" (OLMo 2): post_attention_layernorm and post_feedforward_layernorm on each block's
      output, before its residual add;
    - "sandwich" (Gemma 2, 3): both, input_layernorm / post_attention_layernorm around attention
      and pre_ / post_feedforward_layernorm around the MLP."""

    def __init__(self, args: ModelArgs, sliding: bool = False, sparse: bool = False):
        super().__init__()
        self.placement = placement = args.norm_placement
        self.self_attn = MLAttention(args) if args.attention == "mla" else Attention(args, sliding)
        self.mlp = SparseMoE(args) if sparse else MLP(args)
        self.post_attention_layernorm = norm(args)
        if placement in ("pre", "sandwich"):
            self.input_layernorm = norm(args)
        if placement in ("post", "sandwich"):
            self.post_feedforward_layernorm = norm(args)
        if placement == "sandwich":
            self.pre_feedforward_layernorm = norm(args)

    def forward(self, x, cos, sin, k_cache, v_cache, meta):
        if self.placement == "pre":
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta)
            return x + self.mlp(self.post_attention_layernorm(x))
        if self.placement == "post":
            x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, k_cache, v_cache, meta))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


# A vision-language model's image encoder, by its args' type (llava.py, qwen2_5_vl.py, qwen3_vl.py,
# gemma3_vl.py).
VISION_ENCODERS = {VisionArgs: LlavaVision, QwenVisionArgs: QwenVision, Qwen3VisionArgs: Qwen3Vision,
                   SiglipArgs: Gemma3Vision}


class CausalLM(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        sliding = args.sliding_layers()
        sparse = args.sparse_layers or [False] * args.num_layers
        self.layers = nn.ModuleList(DecoderLayer(args, s, m) for s, m in zip(sliding, sparse, strict=True))
        self.norm = norm(args)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Each layer's RoPE table: sliding layers have their own where local_rope_theta is set.
        self.layer_rope = [1 if s and args.local_rope_theta is not None else 0 for s in sliding]
        self.rope: list[RotaryTable] = []  # by prepare()
        # EAGLE-3 (spec_decode/eagle.py): the layers whose input (the residual stream after the
        # layers before) forward keeps in aux_hidden, for the head; none otherwise.
        self.aux_layers: frozenset[int] = frozenset()
        self.aux_hidden: list[torch.Tensor] = []
        # Where each attention layer's kv_scales (an FP8 cache's) came from: "checkpoint", "calculated"
        # (engine/worker/kv_calibration.py) or "default" (1.0).
        self.kv_scales_source = "default"
        # A vision-language model's image encoder (llava.py, qwen2_5_vl.py, qwen3_vl.py, gemma3_vl.py):
        # images to embeddings the runner merges.
        self.vision = None if args.vision is None else VISION_ENCODERS[type(args.vision)](args.vision, args.hidden_size)

    def prepare(self, max_model_len: int) -> None:
        """RoPE tables for every position of a context of max_model_len (and one past it), and
        each layer's window for such contexts."""
        for layer, window in zip(self.layers, self.args.layer_windows(max_model_len)):
            layer.self_attn.window = window  # one that holds every position: full attention, any kernel
        a, weight = self.args, self.embed_tokens.weight
        bases = [(a.rope_theta, a.rope_scaling)] + ([(a.local_rope_theta, None)] if max(self.layer_rope) else [])
        self.rope = [RotaryTable(a.rotary_dim or a.head_dim, theta, scaling, max_model_len + 1, weight.dtype,
                                 weight.device) for theta, scaling in bases]

    def rope_key(self, prompt_len: int, total_len: int) -> int:
        """What a sequence's KV depends on beyond its tokens (0: nothing; RotaryTable.length_key)."""
        return self.rope[0].length_key(prompt_len, total_len)

    def rope_lengths(self, start: int, end: int, prompt_len: int, total_len: int) -> np.ndarray:
        """The sequence lengths the RoPE of positions [start, end) of a request takes (rope_by_length)."""
        return self.rope[0].lengths(start, end, prompt_len, total_len)

    @property
    def rope_recompute_at(self) -> int | None:
        """A request longer than this has its KV computed again (RotaryTable.recompute_at)."""
        return self.rope[0].recompute_at

    @property
    def rope_by_length(self) -> bool:
        """Whether forward needs each token's sequence length (dynamic NTK, LongRoPE)."""
        return any(table.by_length for table in self.rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                caches: list[tuple[torch.Tensor, torch.Tensor]], metas: list[AttentionMetadata],
                rope_lengths: torch.Tensor | None = None,
                image_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids: [T]; positions: the RoPE's, [T], or [3, T] for M-RoPE's streams (mrope.py);
        per layer, its K and V caches ([num_blocks, block_size, kv_heads, D] views) and the step's
        attention metadata for its blocks (its KV cache group's); `rope_lengths`: each token's
        sequence length where rope_by_length, on the host (RotaryTable.lookup); `image_rows`:
        (rows, embeddings) an image's placeholder rows take instead of their token's embedding
        (with DeepStack, Qwen3-VL's, [rows, (1 + levels) x hidden]: the embeddings, then each
        level's features, added to those rows after the decoder layer of the level's index).
        Returns the final hidden states [T, hidden] (and keeps the aux_layers' inputs in aux_hidden)."""
        x = self.embed_tokens(input_ids)
        if self.args.embed_scale != 1.0:  # a float32 scalar cast to the weights' dtype, as Gemma's
            x = x * torch.tensor(self.args.embed_scale).to(x.dtype)
        deepstack = None
        if image_rows is not None:
            rows, embeds = image_rows[0], image_rows[1].to(x.dtype)
            x = x.index_copy(0, rows, embeds[:, :x.shape[1]])
            if embeds.shape[1] > x.shape[1]:
                deepstack = embeds[:, x.shape[1]:].unflatten(1, (-1, x.shape[1]))  # [rows, levels, hidden]
        if positions.dim() == 2:
            tables = [mrope.lookup(*table.tables[0], positions, self.args.mrope_section, self.args.mrope_interleaved)
                      for table in self.rope]
        else:
            tables = [table.lookup(positions, rope_lengths) for table in self.rope]
        aux = []
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                aux.append(x)
            cos, sin = tables[self.layer_rope[i]]
            x = layer(x, cos, sin, *caches[i], metas[i])
            if deepstack is not None and i < deepstack.shape[1]:
                x = x.index_add(0, rows, deepstack[:, i])
        if aux:
            self.aux_hidden = aux
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.args.final_softcap is not None:
            logits = torch.tanh(logits / self.args.final_softcap) * self.args.final_softcap
        return logits
