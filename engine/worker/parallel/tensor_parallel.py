"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on GPUs), Megatron's split as vLLM
makes it: each rank holds its share of every layer and the ranks meet twice per layer.

- Attention: each rank takes num_heads / N query heads and the KV heads they read (its KV cache
  holds only those), from the merged q/k/v projection's rows; with more ranks than KV heads,
  each KV head is replicated on the N / num_kv_heads ranks whose query heads read it. o_proj
  takes the matching columns and its outputs are summed over the ranks (all-reduce), its bias
  added once.
- MLP: each rank takes a share of the intermediate size, from the gate's and up's rows; down_proj
  the matching columns, summed over the ranks.
- Embeddings and the LM head: each rank holds a contiguous share of the vocabulary (the last may
  hold fewer); an embedding lookup outside a rank's share reads zeros and the shares are summed;
  logits are gathered from every rank's share.

Each rank loads the whole checkpoint and keeps its share (`shard_model`); the model's `args` then
describe the rank's share (its heads), which is what its KV cache and kernels are sized by.
The group is a torch.distributed process group made from a TCP store (`TPGroup.join`), not the
process's default group: two engines in one process (a test's prefill and decode) each have
their own.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from baton.engine.common.errors import check
from baton.engine.worker.models.layers import Attention


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This process's place in its engine's tensor-parallel group."""
    rank: int
    size: int
    group: dist.ProcessGroup

    @classmethod
    def join(cls, rank: int, size: int, store: dist.Store, device: torch.device,
             timeout_s: float = 600.0) -> TPGroup:
        """The group of `size` ranks meeting at `store`: gloo on CPU, NCCL on GPUs."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return cls(rank, size, dist.ProcessGroupNCCL(store, rank, size, options))
        return cls(rank, size, dist.ProcessGroupGloo(store, rank, size, timeout))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x (the same shape on each), concatenated along the last dimension."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def share(self, n: int) -> slice:
        """This rank's contiguous share of n things split evenly (n divisible by the size)."""
        each = n // self.size
        return slice(self.rank * each, (self.rank + 1) * each)


class RowParallelLinear(nn.Module):
    """A linear layer whose input is split over the ranks: its columns' share here, the outputs
    summed over the ranks, then the bias."""

    def __init__(self, linear: nn.Linear, columns: slice, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.data[:, columns].clone(), requires_grad=False)
        self.bias = linear.bias
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, embedding: nn.Embedding, tp: TPGroup):
        super().__init__()
        vocab = embedding.weight.shape[0]
        self.each = -(-vocab // tp.size)
        self.start = tp.rank * self.each
        self.weight = nn.Parameter(_padded_rows(embedding.weight.data, self.start, self.each), requires_grad=False)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.each)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """The LM head's share of the vocabulary here; forward gathers every rank's logits."""

    def __init__(self, weight: torch.Tensor, vocab: int, tp: TPGroup):
        super().__init__()
        self.vocab, self.tp = vocab, tp
        each = -(-vocab // tp.size)
        self.weight = nn.Parameter(_padded_rows(weight, tp.rank * each, each), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(F.linear(hidden, self.weight))[..., :self.vocab]


def _padded_rows(weight: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Rows [start, start + n) of weight, zeros past its end (the last rank's share)."""
    out = torch.zeros(n, weight.shape[1], dtype=weight.dtype, device=weight.device)
    rows = weight[start:start + n]
    out[:rows.shape[0]] = rows
    return out


def check_split(args, size: int) -> None:
    """Refuse, naming tensor_parallel_size, a model that `size` ranks cannot split."""
    field = "tensor_parallel_size"
    kv = args.num_kv_heads
    check(args.num_heads % size == 0 and (kv % size == 0 or size % kv == 0), field,
          f"{size} ranks do not split {args.num_heads} query and {kv} KV heads evenly (nor replicate the KV "
          f"heads on whole groups of ranks)")
    check(args.intermediate_size % size == 0, field,
          f"{size} ranks do not split the intermediate size {args.intermediate_size} evenly")
    check(not any(args.sparse_layers) and args.attention == "mha" and args.qk_norm != "whole", field,
          f"{args.architecture}'s layers (experts, latent attention or a norm over every head) are not split yet")


def shard_model(model, tp: TPGroup) -> None:
    """In place: a model loaded whole becomes this rank's share (see the module docstring). A
    layout this slice does not split yet is refused naming tensor_parallel_size."""
    args = model.args
    check_split(args, tp.size)
    for layer in model.layers:
        _shard_attention(layer.self_attn, tp)
        _shard_mlp(layer.mlp, tp)
    head = model.lm_head.weight.data
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, tp)
    model.lm_head = ParallelLMHead(head, args.vocab_size, tp)
    attn = model.layers[0].self_attn
    model.args = replace(args, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads)


def _shard_attention(attn: Attention, tp: TPGroup) -> None:
    d = attn.head_dim
    q = tp.share(attn.num_heads)
    if attn.num_kv_heads >= tp.size:
        kv = tp.share(attn.num_kv_heads)
    else:  # replicated: the KV head this rank's query heads read
        head = tp.rank * attn.num_kv_heads // tp.size
        kv = slice(head, head + 1)
    rows = torch.cat([torch.arange(q.start * d, q.stop * d),
                      attn.q_size + torch.arange(kv.start * d, kv.stop * d),
                      attn.q_size + attn.kv_size + torch.arange(kv.start * d, kv.stop * d)])
    _keep_rows(attn.qkv_proj, rows)
    attn.o_proj = RowParallelLinear(attn.o_proj, slice(q.start * d, q.stop * d), tp)
    attn.num_heads, attn.num_kv_heads = q.stop - q.start, kv.stop - kv.start
    attn.q_size, attn.kv_size = attn.num_heads * d, attn.num_kv_heads * d
    if hasattr(attn, "sinks"):
        attn.sinks = nn.Parameter(attn.sinks.data[q].clone(), requires_grad=False)


def _shard_mlp(mlp, tp: TPGroup) -> None:
    size = mlp.gate_up_proj.out_features // 2
    share = tp.share(size)
    rows = torch.cat([torch.arange(share.start, share.stop), size + torch.arange(share.start, share.stop)])
    _keep_rows(mlp.gate_up_proj, rows)
    mlp.down_proj = RowParallelLinear(mlp.down_proj, share, tp)


def _keep_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight.data[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[rows].clone(), requires_grad=False)
    linear.out_features = len(rows)
