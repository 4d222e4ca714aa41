"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on GPUs), Megatron's split as vLLM
makes it: each rank holds its share of every layer and the ranks meet twice per layer.

- Attention: each rank takes num_heads / N query heads and the KV heads they read (its KV cache
  holds only those), from the merged q/k/v projection's rows; with more ranks than KV heads,
  each KV head is replicated on the N / num_kv_heads ranks whose query heads read it. o_proj
  takes the matching columns and its outputs are summed over the ranks (all-reduce), its bias
  added once. OLMo 2's QK-norm over the whole projection sums each rank's squares over the ranks
  (two [tokens, 1] all-reduces more per layer).
- Latent attention (MLA, DeepSeek): each rank takes num_heads / N query heads (q_proj's or
  q_b_proj's rows, kv_b_proj's up-projection rows of those heads, o_proj's columns, summed). The
  latent (kv_a_proj and its norm; q_a's compression likewise) is computed whole on every rank and
  every rank's cache holds it whole: MLA's one latent "KV head", replicated.
- MLP: each rank takes a share of the intermediate size, from the gate's and up's rows; down_proj
  the matching columns, summed over the ranks.
- Mixture of experts: the router replicated; each expert's intermediate split as the MLP's (the
  fused kernel just sees a smaller one), or with expert parallelism whole experts spread over the
  ranks (LocalExperts); shared experts split as the MLP. The routed and shared parts are each a
  partial sum per rank: added, then one all-reduce per layer (PartialSum). A bias on what is
  summed (gpt-oss's down bias, a shared MLP's) is kept on rank 0 alone, added once.
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
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from baton.engine.common.errors import check
from baton.engine.worker.models.basic import Linear, RMSNorm
from baton.engine.worker.models.layers import Attention
from baton.engine.worker.models.mla import MLAttention
from baton.engine.worker.models.moe import Experts, SparseMoE
from baton.engine.worker.parallel.watched_store import WatchedStore
from baton.engine.worker.quant.linear import ExpertStack, QuantizedLinear


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This process's place in its engine's tensor-parallel group."""
    rank: int
    size: int
    group: dist.ProcessGroup
    store: dist.Store | None = None  # a Python store the group met at must outlive it (torch calls into it)

    @classmethod
    def join(cls, rank: int, size: int, store: dist.Store, device: torch.device,
             timeout_s: float = 600.0, give_up: Callable[[], None] | None = None) -> TPGroup:
        """The group of `size` ranks meeting at `store`: gloo on CPU, NCCL on GPUs. Gloo meets
        here, waiting on the store for every rank: with `give_up` (which raises to end the wait)
        those waits poll and call it in between (watched_store.py), so that a rank that died is
        an error at once, not after the store's timeout. NCCL meets at the first collective."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return cls(rank, size, dist.ProcessGroupNCCL(store, rank, size, options))
        if give_up is not None:
            store = WatchedStore(store, give_up)
            return cls(rank, size, dist.ProcessGroupGloo(store, rank, size, timeout), store)
        return cls(rank, size, dist.ProcessGroupGloo(store, rank, size, timeout))

    def abort(self) -> None:
        """End the collectives under way, from another thread, where the backend can: NCCL's
        communicators are aborted (a collective waiting on a dead rank would wait for ever). On
        gloo torch does nothing; a collective on a dead rank fails by itself as soon as the
        rank's sockets close, which the kernel does when the process ends."""
        self.group.abort()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.group.allreduce([x]).wait()
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x, on every rank (in place)."""
        self.group.broadcast(x, 0).wait()
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

    def __init__(self, linear: nn.Linear | QuantizedLinear, columns: slice, tp: TPGroup, name: str = "o_proj"):
        super().__init__()
        # A quantized layer keeps its format: its columns' share, scales with them (no bias: added after the sum).
        quantized = isinstance(linear, QuantizedLinear)
        self.quantized = linear.columns_taken(columns, name, bias=False) if quantized else None
        self.weight = None if quantized else nn.Parameter(linear.weight.data[:, columns].clone(), requires_grad=False)
        self.bias = linear.bias
        self.columns = columns  # (a LoRA adapter's A keeps the same rows)
        self.tp = tp

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the sum (what a LoRA delta joins before the ranks add them up)."""
        return F.linear(x, self.weight) if self.quantized is None else self.quantized(x)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(partial)
        return out if self.bias is None else out + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.partial(x))


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
    """The LM head's share of the vocabulary here; forward gathers every rank's logits. A quantized
    head (a GPTQ checkpoint's, quantized with lm_head) keeps its rows quantized; the last rank's
    shorter share is padded with zero logits before the gather."""

    def __init__(self, head: Linear | QuantizedLinear, vocab: int, tp: TPGroup):
        super().__init__()
        self.vocab, self.tp = vocab, tp
        self.each = each = -(-vocab // tp.size)
        self.quantized = head if isinstance(head, QuantizedLinear) else None
        if self.quantized is not None:
            head.keep_rows(slice(tp.rank * each, min((tp.rank + 1) * each, vocab)))
        self.weight = None if self.quantized else nn.Parameter(_padded_rows(head.weight.data, tp.rank * each, each),
                                                                requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quantized is None:
            return self.tp.all_gather(F.linear(hidden, self.weight))[..., :self.vocab]
        local = self.quantized(hidden)
        return self.tp.all_gather(F.pad(local, (0, self.each - local.shape[-1])))[..., :self.vocab]


def _padded_rows(weight: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Rows [start, start + n) of weight, zeros past its end (the last rank's share)."""
    out = torch.zeros(n, weight.shape[1], dtype=weight.dtype, device=weight.device)
    rows = weight[start:start + n]
    out[:rows.shape[0]] = rows
    return out


class PartialSum(nn.Module):
    """A block of which each rank computes a part (a mixture of experts: its experts' shares and
    its shared experts' share): the parts summed over the ranks, one all-reduce."""

    def __init__(self, block: nn.Module, tp: TPGroup):
        super().__init__()
        self.block, self.tp = block, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.block(x))


class LocalExperts(nn.Module):
    """Expert parallelism: this rank's experts [start, start + n), whole, of a layer's E (n = E / N).
    Every rank has every token (attention's all-reduce leaves the activations replicated), so no
    token moves: each rank runs its experts over the (token, expert) pairs routed to them, zeros
    for the rest, and the layer's all-reduce (PartialSum) adds the ranks' parts. An all-to-all
    (tokens sent to their experts' ranks, outputs sent back) pays only where ranks hold different
    tokens: data-parallel attention, which this engine does not have. Against each expert split,
    a rank runs fewer, whole-width matmuls (only its experts' tokens); its load follows the router."""

    def __init__(self, experts: Experts, tp: TPGroup):
        super().__init__()
        self.n = experts.gate_up.shape[0] // tp.size
        self.start = tp.rank * self.n
        mine = slice(self.start, self.start + self.n)
        if isinstance(experts.gate_up, ExpertStack):  # quantized experts: each one's weights and scales
            experts.gate_up, experts.down = experts.gate_up.experts_taken(mine), experts.down.experts_taken(mine)
        else:
            experts.gate_up, experts.down = _param(experts.gate_up.data[mine]), _param(experts.down.data[mine])
        if experts.gate_up_bias is not None:  # (each expert's biases go with it)
            experts.gate_up_bias = _param(experts.gate_up_bias.data[mine])
        if experts.down_bias is not None:
            experts.down_bias = _param(experts.down_bias.data[mine])
        self.experts = experts

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        tokens, k = ((local >= 0) & (local < self.n)).nonzero(as_tuple=True)  # this rank's pairs, one per row
        out = self.experts(x[tokens], weights[tokens, k, None], local[tokens, k, None])
        return torch.zeros_like(x).index_add_(0, tokens, out)


class WholeNormShare(nn.Module):
    """An RMSNorm over a whole projection (OLMo 2's QK-norm: every head's q, or k) on a rank that
    holds some of its heads: the mean square is the ranks' sums of squares summed, over the
    projection's width times the ranks holding each of its elements (KV heads may be replicated)."""

    def __init__(self, whole: RMSNorm, columns: slice, copies: int, tp: TPGroup):
        super().__init__()
        self.weight = _param(whole.weight.data[columns])
        self.eps, self.offset, self.tp = whole.eps, whole.offset, tp
        self.count = whole.weight.shape[0] * copies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()  # in float32, as RMSNorm
        h = h * torch.rsqrt(self.tp.all_reduce(h.pow(2).sum(-1, keepdim=True)) / self.count + self.eps)
        if self.offset:
            return (h * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


def check_split(args, size: int, expert_parallel: bool = False) -> None:
    """Refuse, naming the field, a model that `size` ranks cannot split (`expert_parallel`: its
    routed experts spread whole over the ranks)."""
    field = "tensor_parallel_size"
    kv = args.num_kv_heads
    check(args.num_heads % size == 0 and (kv % size == 0 or size % kv == 0), field,
          f"{size} ranks do not split {args.num_heads} query and {kv} KV heads evenly (nor replicate the KV "
          f"heads on whole groups of ranks)")
    sparse = args.sparse_layers or [False] * args.num_layers
    if not all(sparse):
        check(args.intermediate_size % size == 0, field,
              f"{size} ranks do not split the intermediate size {args.intermediate_size} evenly")
    if not any(sparse):
        return
    if expert_parallel:
        check(args.num_experts % size == 0, "enable_expert_parallel",
              f"{size} ranks (tensor_parallel_size) do not take {args.num_experts} experts whole and evenly")
    else:
        check(args.moe_intermediate_size % size == 0, field,
              f"{size} ranks do not split the experts' intermediate size {args.moe_intermediate_size} evenly")
    shared = args.shared_expert_intermediate_size or args.moe_intermediate_size * args.num_shared_experts
    check(shared % size == 0, field, f"{size} ranks do not split the shared experts' intermediate size {shared} evenly")


def shard_model(model, tp: TPGroup, expert_parallel: bool = False) -> None:
    """In place: a model loaded whole becomes this rank's share (see the module docstring;
    `expert_parallel`: the routed experts spread whole). A layout the ranks cannot split is
    refused naming the field."""
    args = model.args
    check_split(args, tp.size, expert_parallel)
    for layer in model.layers:
        if isinstance(layer.self_attn, MLAttention):
            _shard_latent_attention(layer.self_attn, tp)
        else:
            _shard_attention(layer.self_attn, tp)
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp = _shard_moe(layer.mlp, tp, expert_parallel)
        else:
            _shard_mlp(layer.mlp, tp)
    head = model.lm_head
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, tp)
    model.lm_head = ParallelLMHead(head, args.vocab_size, tp)
    attn = model.layers[0].self_attn
    # MLA keeps its one latent "KV head" (and its width): whole on every rank.
    model.args = replace(args, num_heads=attn.num_heads,
                         num_kv_heads=attn.num_kv_heads if isinstance(attn, Attention) else args.num_kv_heads)


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
    attn.o_proj = RowParallelLinear(attn.o_proj, slice(q.start * d, q.stop * d), tp, "self_attn.o_proj")
    if attn.qk_norm == "whole":
        attn.q_norm = WholeNormShare(attn.q_norm, slice(q.start * d, q.stop * d), 1, tp)
        attn.k_norm = WholeNormShare(attn.k_norm, slice(kv.start * d, kv.stop * d),
                                     max(1, tp.size // attn.num_kv_heads), tp)
    attn.num_heads, attn.num_kv_heads = q.stop - q.start, kv.stop - kv.start
    attn.q_size, attn.kv_size = attn.num_heads * d, attn.num_kv_heads * d
    if attn.sinks is not None:
        attn.sinks = nn.Parameter(attn.sinks.data[q].clone(), requires_grad=False)
    attn.kv_scales = attn.kv_scales[:, kv].clone()  # (a buffer: an FP8 cache's per-head scales)


def _shard_latent_attention(attn: MLAttention, tp: TPGroup) -> None:
    heads = tp.share(attn.num_heads)
    _keep_rows(attn.q_proj if attn.q_proj is not None else attn.q_b_proj, _per_head(heads, attn.nope + attn.rope))
    _keep_rows(attn.kv_b_proj, _per_head(heads, attn.nope + attn.v_dim))  # the heads' W_UK and W_UV
    attn.o_proj = RowParallelLinear(attn.o_proj, _per_head(heads, attn.v_dim), tp, "self_attn.o_proj")
    attn.num_heads = heads.stop - heads.start


def _per_head(heads: slice, width: int) -> slice:
    """The rows (or columns) of `heads` in a projection of `width` per head."""
    return slice(heads.start * width, heads.stop * width)


def _shard_mlp(mlp, tp: TPGroup, reduce: bool = True) -> None:
    """The share of the intermediate; `reduce`: down_proj's outputs summed here, else left a
    partial sum for the caller to reduce (its bias then on rank 0 alone)."""
    size = mlp.gate_up_proj.out_features // 2
    share = tp.share(size)
    _keep_rows(mlp.gate_up_proj, _gate_and_up(share, size))
    if reduce:
        mlp.down_proj = RowParallelLinear(mlp.down_proj, share, tp, "mlp.down_proj")
        return
    down = mlp.down_proj
    if isinstance(down, QuantizedLinear):  # its bias (if any) on rank 0 alone, as below
        mlp.down_proj = down.columns_taken(share, "mlp.down_proj", bias=tp.rank == 0)
        return
    down.weight = _param(down.weight.data[:, share])
    down.in_features = down.weight.shape[1]
    if tp.rank:
        down.bias = None


def _shard_moe(moe: SparseMoE, tp: TPGroup, expert_parallel: bool) -> PartialSum:
    """The router replicated; the routed experts spread whole (`expert_parallel`) or each split;
    shared experts split; every part left a partial sum that the returned block reduces once."""
    if expert_parallel:
        moe.experts = LocalExperts(moe.experts, tp)
    else:
        _split_experts(moe.experts, tp)
    # (Qwen2-MoE's shared_expert_gate stays whole: a per-token scale of a partial sum scales the sum.)
    for shared in (moe.shared_expert, moe.shared_experts):
        if shared is not None:
            _shard_mlp(shared, tp, reduce=False)
    return PartialSum(moe, tp)


def _split_experts(experts: Experts, tp: TPGroup) -> None:
    """Each expert's share of its intermediate, as the MLP's: gate and up rows, down columns."""
    size = experts.intermediate
    share = tp.share(size)
    rows = _gate_and_up(share, size)
    if isinstance(experts.gate_up, ExpertStack):  # quantized: scales and zero points with their rows, columns
        experts.gate_up, experts.down = experts.gate_up.rows_taken(rows), experts.down.columns_taken(share, "experts")
    else:
        experts.gate_up = _param(experts.gate_up.data[:, rows])
        experts.down = _param(experts.down.data[:, :, share])
    if experts.gate_up_bias is not None:
        experts.gate_up_bias = _param(experts.gate_up_bias.data[:, rows])
    if tp.rank:  # added to the sum once
        experts.down_bias = None
    experts.intermediate = share.stop - share.start


def _gate_and_up(share: slice, size: int) -> torch.Tensor:
    """The rows of a share of the intermediate in a merged [gate; up] projection."""
    return torch.cat([torch.arange(share.start, share.stop), size + torch.arange(share.start, share.stop)])


def _keep_rows(linear: Linear | QuantizedLinear, rows: torch.Tensor | slice) -> None:
    if isinstance(linear, QuantizedLinear):
        linear.keep_rows(rows)
        return
    linear.weight = _param(linear.weight.data[rows])
    linear.kept_rows = rows
    if linear.bias is not None:
        linear.bias = _param(linear.bias.data[rows])
    linear.out_features = linear.weight.shape[0]


def _param(t: torch.Tensor) -> nn.Parameter:
    """A copy of its own (a view would keep the whole weight alive), contiguous."""
    return nn.Parameter(t.clone(memory_format=torch.contiguous_format), requires_grad=False)
