"""Drafts from DeepSeek's multi-token-prediction layer ("mtp"; vLLM's deepseek_mtp.py): the layer
DeepSeek-V3 trains past its num_hidden_layers L (num_nextn_predict_layers of them, kept in the
target's own checkpoint as model.layers.{L + i}.*) to read, at position p, token p + 1 and the
target's hidden state at p, and guess token p + 2. An EAGLE head in all but its names, it is
driven by eagle.py's EagleProposer (hidden states kept per request, its own KV, catch-up, drafting).
- `enorm` over the token's embedding and `hnorm` over the target's final hidden state (after the
  target's norm: what vLLM hands its proposers), concatenated in that order, through `eh_proj`
  [H, 2H] (no bias). Position 0's embedding (token 1's) is zeroed, as vLLM does; SGLang and
  transformers keep it: a difference in that slot's KV, hence in drafts, never in the output.
- Then a whole DeepSeek decoder layer (the checkpoint's other tensors of the layer; `mtp_block`
  here, as in vLLM): MLA, and the MoE or dense MLP that the config gives layer L (sparse from
  first_k_dense_replace on, as deepseek.py reads it).
- `shared_head.norm` and `shared_head.head` (an LM head) over its output; the next step reads that
  output before the norm as its hidden state.
- The layer's `embed_tokens` and `shared_head.head`, which DeepSeek ships as copies of the
  target's, are the target's where equal (not held twice), its own where not, the target's where
  the checkpoint has none.
- The first MTP layer only: it drafts all k tokens, each step on its own last output, as vLLM does
  (its proposer never steps past layer L); DeepSeek publishes one.
Its KV cache is MLA's latent (one part of kv_lora_rank + qk_rope_head_dim per slot), sized with
the target's blocks as a draft model's is. Only the layer's tensors are read, from the shards that
hold them (loader.tensors_under); the target's own loading skips them (ModelArgs.skipped_layers).
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import torch
from torch import nn

from baton.engine.common.config import read_config
from baton.engine.common.errors import InvalidArgument, check
from baton.engine.worker.loader import default_dtype, parameter_for, tensors_under
from baton.engine.worker.models import CausalLM, ModelArgs, model_args
from baton.engine.worker.models.basic import Embedding, Linear, norm
from baton.engine.worker.models.layers import DecoderLayer
from baton.engine.worker.models.rope import RotaryTable
from baton.engine.worker.quant.formats import CheckpointFormat, checkpoint_format
from baton.engine.worker.quant.placement import QuantizedPlacement
from baton.kernels.attention import AttentionMetadata

_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")  # the layer's own; the rest its decoder layer's
_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # the target's where the same (_own_or_target)


class MTPHead(nn.Module):
    """The layer's modules, named as its tensors past model.layers.{L}. (its decoder layer's
    under mtp_block); the embeddings and LM head are set by load_mtp."""

    def __init__(self, args: ModelArgs, sparse: bool):
        super().__init__()
        self.args, self.aux_layers = args, ()
        self.enorm, self.hnorm = norm(args), norm(args)
        self.eh_proj = Linear(2 * args.hidden_size, args.hidden_size, bias=False)
        self.mtp_block = DecoderLayer(args, sparse=sparse)
        self.shared_head = nn.Module()
        self.shared_head.norm = norm(args)
        self.shared_head.head = None
        self.embed_tokens = None
        self.rope: RotaryTable | None = None  # by EagleProposer

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's final hidden state, as it is."""
        return target_hidden

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Each row's output before shared_head.norm (what the next step is fed)."""
        embeds = self.embed_tokens(ids).masked_fill((positions == 0)[:, None], 0)
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        cos, sin = self.rope.lookup(positions)
        return self.mtp_block(x, cos, sin, *caches[0], meta)

    def greedy(self, out: torch.Tensor) -> torch.Tensor:
        """The token each output row guesses."""
        return self.shared_head.head(self.shared_head.norm(out)).argmax(dim=-1)


def load_mtp(model: str | None, target_dir: str, target: CausalLM, dtype: torch.dtype, device: str) -> MTPHead:
    """The first MTP layer of `model` (by default `target_dir`, the target's checkpoint), once it
    fits the target; refused naming speculative_config.model where one was given, else .method."""
    path = model or target_dir
    field = "speculative_config.model" if model else "speculative_config.method"
    try:
        cfg = read_config(path)
        args = model_args(cfg)
    except InvalidArgument as e:
        raise InvalidArgument(field, f"{e.field}: {e.reason}") from None
    n = cfg.get("num_nextn_predict_layers") or 0
    check(isinstance(n, int) and n >= 1, field,
          f"mtp drafts with DeepSeek's multi-token-prediction layer, and {path!r} has none (its config.json's "
          f"num_nextn_predict_layers is {cfg.get('num_nextn_predict_layers')!r})")
    t = target.args
    for what, ours, theirs in (("hidden size", args.hidden_size, t.hidden_size),
                               ("vocabulary", args.vocab_size, t.vocab_size)):
        check(ours == theirs, field, f"its MTP layer's {what} is {ours}, the target's {theirs}")
    layer = args.num_layers
    head_args = dataclasses.replace(args, num_layers=1, sparse_layers=[], skipped_layers=0)
    with torch.device(device), default_dtype(dtype):  # (allocated once, in place: an MoE layer is big)
        head = MTPHead(head_args, sparse=args.num_experts > 0 and layer >= cfg.get("first_k_dense_replace", 0))
    prefix = f"model.layers.{layer}."
    params = dict(head.named_parameters())
    filled: Counter = Counter()
    shared: dict[str, torch.Tensor] = {}
    fmt = checkpoint_format(cfg)  # (DeepSeek-V3's published layer is block FP8, as the target)
    quantized: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in _tensors(path, prefix, field):  # (one tensor at a time, into place)
        key = name.removeprefix(prefix)
        if "rotary_emb" in key:
            continue
        if key in _SHARED:
            shared[key] = tensor
            continue
        split = None if fmt is None else fmt.split(key, tensor)
        if split is not None:
            quantized.setdefault(split[0], {})[split[1]] = tensor
            continue
        param, rows = parameter_for(head, params, key if key.startswith(_OWN) else "mtp_block." + key)
        check(param is not None, field, f"unexpected weight {name!r} in the MTP layer")
        dest = params[param] if rows is None else params[param][rows]
        check(dest.shape == tensor.shape, field,
              f"weight {name} is {tuple(tensor.shape)}, the MTP layer takes {tuple(dest.shape)} here")
        with torch.no_grad():
            dest.copy_(tensor)
        filled[param] += tensor.numel()
    if quantized:
        _place_quantized(head, params, fmt, quantized, dtype, filled, prefix, field)
        head.to(device)
    check(bool(filled or shared), field, f"{path!r} has no tensors of its MTP layer ({prefix}*), though its "
                                         f"num_nextn_predict_layers is {n}")
    for name, p in params.items():
        check(filled[name] == p.numel(), field, f"checkpoint lacks weight {prefix}{name.removeprefix('mtp_block.')}")
    embed, lm_head = (shared.get(key) for key in _SHARED)
    head.embed_tokens = _own_or_target(embed, prefix + _SHARED[0], target.embed_tokens, Embedding, field)
    head.shared_head.head = _own_or_target(lm_head, prefix + _SHARED[1], target.lm_head,
                                           lambda vocab, h: Linear(h, vocab, bias=False), field)
    return head.eval()


def _place_quantized(head: MTPHead, params: dict, fmt: CheckpointFormat, tensors: dict, dtype: torch.dtype,
                     filled: Counter, prefix: str, field: str) -> None:
    """The layer's quantized projections and experts, kept as the target's are (quant/placement.py)."""
    placed = QuantizedPlacement(head, dtype)
    for module, fields in tensors.items():
        name = f"{module}.weight"
        param, rows = parameter_for(head, params, name if name.startswith(_OWN) else "mtp_block." + name)
        check(param is not None, field, f"unexpected quantized weight {prefix}{module} in the MTP layer")
        weight = fmt.read(prefix + module, fields)
        placed.add(param, rows, weight)
        filled[param] += weight.out_features * weight.in_features
    placed.install()


def _tensors(path: str, prefix: str, field: str):
    try:
        yield from tensors_under(path, prefix)
    except InvalidArgument as e:
        raise InvalidArgument(field, f"{e.field}: {e.reason}") from None


def _own_or_target(tensor: torch.Tensor | None, name: str, target: nn.Module, make, field: str) -> nn.Module:
    """The target's module where the layer has no such tensor or the same one; else the layer's own."""
    weight = target.weight
    if tensor is None or (tensor.shape == weight.shape and torch.equal(tensor.to(weight.dtype), weight.cpu())):
        return target
    check(tensor.shape == weight.shape, field, f"weight {name} is {tuple(tensor.shape)}, the target's "
                                               f"{tuple(weight.shape)}")
    with torch.device(weight.device), default_dtype(weight.dtype):
        module = make(*weight.shape)
    with torch.no_grad():
        module.weight.copy_(tensor)
    return module
