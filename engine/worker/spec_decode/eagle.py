"""Drafts from an EAGLE head ("eagle", "eagle3"; vLLM's names and checkpoint formats): a decoder
layer or a few that read, at position p, token p + 1 and the target's hidden state at p, and put
out a hidden state whose logits guess token p + 2; fed its own output and guess, it drafts on.
- EAGLE-1 (Llama heads such as yuhuili/EAGLE-LLaMA3-Instruct-8B): `fc` [H, 2H] over
  concat(token embedding, hidden state) at every step (with `fc.bias` where the checkpoint has
  one, as EAGLE's own code; vLLM drops it), the layers (`layers.*`; the first has no
  input_layernorm), no final norm; the hidden state the target's final one, after its norm; the
  target's embeddings and LM head.
- EAGLE-3 (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): `fc` [H, 3H] fuses the target's residual
  stream entering three layers (eagle_aux_hidden_state_layer_ids, by default 2, L // 2 and L - 3,
  as vLLM picks; concatenated in layer order), once per target position; the first layer
  (`midlayer.*`) attends over concat(input_layernorm(embedding), hidden_norm(hidden)), 2H wide;
  `norm`, then its own LM head over a draft vocabulary whose ids `d2t` maps to the target's
  (target id = draft id + d2t[draft id]); the next step is fed the output before `norm`.
Not read: HASS's extra norms, the `speculators` config layout, heads of another hidden size.

The head's KV cache is its own, laid out like the target's and addressed by the target's block
ids (a full-attention group's), as draft_model.py's: slot p holds the head's KV of (token p + 1,
hidden state p). Its drafts write the k - 1 slots from the last token's on (Scheduler.lookahead).

EagleProposer drives any head that reads so (DeepSeek's MTP layer too, mtp.py): one with `args`
(its layers and KV shape: K and V, or MLA's latent), `embed_tokens`, `aux_layers`, `fuse`, a
forward over (ids, positions, hidden states) and `greedy` over its outputs.

The runner hands the proposer, after each step, the hidden states of the positions whose tokens
stand (`keep`: a request's rejected drafts' are dropped), fused to H (EAGLE-3's fc) and kept per
request until the head is fed them: when the request drafts, or at once when the requests of a
step hold max_num_batched_tokens of them (memory stays bounded while drafting waits: a prompt in
chunks, disable_by_batch_size). Drafting first feeds each request's kept slots (its catch-up,
one forward for all), then the head's own guesses k - 1 times; those slots are the head's alone,
overwritten by the next catch-up. The state is the request's runner state's (proposer_state):
it goes with a request that ends, and one resumed after a preemption starts afresh.

Across P/D the head's KV goes with the prompt's: the prefill feeds its head the whole prompt,
the last slot with the first token it sampled, in the step that ends the request (`catch_up`,
before its blocks are handed out; the handle says where its head started: past a prefix hit
there), and the decode's load brings the head's blocks with the target's (the connector's draft
region; the KV format names the head, so a prefill of another head, or none, is refused at the
handshake). The decode's head then goes on from the prompt's end (`loaded`), attending from
where the prefill's started (or past the decode's own prefix hit), as a colocated one would.

Where a request's positions were computed without handing hidden states over (KV from the host
tier or the prefix cache, or a prefill's handle naming blocks it moved to its host tier), the
head cannot see them: it starts over at the first position it is handed, attending from the
start of that position's block (its slots there before it hold what they held: at most
block_size - 1 of them, in a block the request owns unless it was a cached one): lower
acceptance, the output is the target's either way.

Drafts are greedy: the proposal is one-hot, and verify.py's rejection sampling stays exact.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from baton.engine.common.errors import InvalidArgument, check
from baton.engine.worker.loader import parameter_for, weight_files
from baton.engine.worker.models import CausalLM
from baton.engine.worker.models.args import ModelArgs, decoder_args
from baton.engine.worker.models.basic import Embedding, Linear, norm
from baton.engine.worker.models.layers import DecoderLayer
from baton.engine.worker.models.rope import RotaryTable
from baton.engine.worker.spec_decode import Proposer
from baton.kernels.attention import AttentionMetadata

FIELD = "speculative_config.model"


class EagleHead(nn.Module):
    """The head's modules, named as its checkpoint's (EAGLE-3's midlayer as layers.0)."""

    def __init__(self, args: ModelArgs, eagle3: bool, fc_in: int, fc_bias: bool, draft_vocab: int,
                 aux_layers: tuple[int, ...], norm_before_residual: bool = False):
        super().__init__()
        h = args.hidden_size
        self.args, self.eagle3, self.aux_layers = args, eagle3, aux_layers
        self.norm_before_residual = norm_before_residual
        self.fc = Linear(fc_in, h, bias=fc_bias) if fc_in else None
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        first = self.layers[0]
        if eagle3:
            attn = first.self_attn
            attn.qkv_proj = Linear(2 * h, attn.q_size + 2 * attn.kv_size, bias=args.qkv_bias)
            first.hidden_norm = norm(args)
            self.norm = norm(args)
            self.lm_head = Linear(h, draft_vocab, bias=False)
        else:
            first.input_layernorm = nn.Identity()
        self.embed_tokens = None  # the target's (or, EAGLE-3's checkpoint having them, its own), by load_head
        # EAGLE-3: each draft id's target id (None: the same); a buffer, so that it moves with the head.
        self.register_buffer("draft_to_target", None, persistent=False)
        self.rope: RotaryTable | None = None  # by EagleProposer

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """What the head reads of a target position: EAGLE-3's fc over its aux states; EAGLE-1's
        final hidden state as it is (its fc mixes in the token at every step)."""
        return self.fc(target_hidden) if self.eagle3 and self.fc is not None else target_hidden

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Each row's output before any final norm (what the next step is fed)."""
        embeds = self.embed_tokens(ids)
        cos, sin = self.rope.lookup(positions)
        first = self.layers[0]
        if self.eagle3:
            normed = first.hidden_norm(hidden)
            x = normed if self.norm_before_residual else hidden
            x = x + first.self_attn(torch.cat((first.input_layernorm(embeds), normed), dim=-1), cos, sin,
                                    *caches[0], meta)
            x = x + first.mlp(first.post_attention_layernorm(x))
        else:
            x = first(self.fc(torch.cat((embeds, hidden), dim=-1)), cos, sin, *caches[0], meta)
        for layer, cache in zip(self.layers[1:], caches[1:]):
            x = layer(x, cos, sin, *cache, meta)
        return x

    def greedy(self, out: torch.Tensor) -> torch.Tensor:
        """The target token each output row guesses."""
        if not self.eagle3:
            return self.lm_head(out).argmax(dim=-1)
        ids = self.lm_head(self.norm(out)).argmax(dim=-1)
        return ids if self.draft_to_target is None else self.draft_to_target[ids]


def load_head(method: str, path: str, target: CausalLM, dtype: torch.dtype, device: str) -> EagleHead:
    """An EAGLE head's checkpoint (config.json and safetensors, or pytorch_model.bin as EAGLE's
    own are published), once it fits the target; refused naming speculative_config.model."""
    cfg = _config(path)
    eagle3, t = method == "eagle3", target.args
    try:
        args = decoder_args(cfg)
    except KeyError as e:
        raise InvalidArgument(FIELD, f"its config.json lacks {e.args[0]}") from None
    except InvalidArgument as e:
        raise InvalidArgument(FIELD, f"{e.field}: {e.reason}") from None
    for key in ("hidden_size", "target_hidden_size"):  # (vLLM's EAGLE-3 may read a target of another width)
        check(cfg.get(key, t.hidden_size) == t.hidden_size, FIELD,
              f"its {key} {cfg.get(key)} is not the target's hidden size {t.hidden_size}")
    check(args.vocab_size == t.vocab_size, FIELD,
          f"its vocabulary has {args.vocab_size} tokens, the target's {t.vocab_size}")
    eagle_config = cfg.get("eagle_config") or {}
    aux = _aux_layers(cfg, eagle_config, t.num_layers) if eagle3 and eagle_config.get(
        "use_aux_hidden_state", True) else ()
    tensors = _tensors(path)
    draft_vocab = cfg.get("draft_vocab_size") or args.vocab_size
    head = EagleHead(args, eagle3, len(aux) * t.hidden_size if eagle3 else 2 * t.hidden_size, "fc.bias" in tensors,
                     draft_vocab, aux, cfg.get("norm_before_residual", False))
    own_embed = eagle3 and "embed_tokens.weight" in tensors
    if own_embed:
        head.embed_tokens = Embedding(t.vocab_size, t.hidden_size)
    # Not the head's: EAGLE-1 checkpoints carry the target's embeddings (shared instead, as vLLM
    # does) and a first input_layernorm the head drops; d2t is read below, t2d is its inverse; an
    # EAGLE-3 head without aux hidden states has no use for an fc.
    skipped = {"t2d", "d2t"}
    if not eagle3:
        skipped |= {"embed_tokens.weight", "lm_head.weight", "layers.0.input_layernorm.weight"}
    elif not aux:
        skipped |= {"fc.weight", "fc.bias"}
    params = dict(head.named_parameters())
    filled: Counter = Counter()
    for name, tensor in tensors.items():
        key = name.removeprefix("model.").replace("midlayer.", "layers.0.")
        if key in skipped or "rotary_emb" in key:
            continue
        param, rows = parameter_for(head, params, key)
        check(param is not None, FIELD, f"unexpected weight {name!r} for an {method} head")
        dest = params[param] if rows is None else params[param][rows]
        check(dest.shape == tensor.shape, FIELD,
              f"weight {name} is {tuple(tensor.shape)}, the {method} head takes {tuple(dest.shape)} here "
              f"(the target's hidden size {t.hidden_size}{', aux layers ' + str(list(aux)) if eagle3 else ''})")
        with torch.no_grad():
            dest.copy_(tensor)
        filled[param] += tensor.shape[0]
    for name, p in params.items():
        check(filled[name] == p.shape[0], FIELD, f"checkpoint lacks weight {name}")
    if "d2t" in tensors:
        head.draft_to_target = _draft_to_target(tensors["d2t"], draft_vocab, t.vocab_size)
    else:
        check(draft_vocab == t.vocab_size, FIELD,
              f"its draft vocabulary of {draft_vocab} tokens has no d2t to map it to the target's {t.vocab_size}")
    head.to(device=device, dtype=dtype)  # (draft_to_target's ids stay integers)
    if not own_embed:
        head.embed_tokens = target.embed_tokens
    if not eagle3:
        head.lm_head = target.lm_head
    return head.eval()


def _config(path: str) -> dict:
    config = os.path.join(path, "config.json")
    check(os.path.isfile(config), FIELD, f"{path!r} has no config.json")
    with open(config) as f:
        return json.load(f)


def _tensors(path: str) -> dict[str, torch.Tensor]:
    files = weight_files(path)
    check(bool(files), FIELD, f"{path!r} has no *.safetensors or pytorch_model.bin")
    if files[0].endswith(".safetensors"):
        from safetensors.torch import load_file
        return {name: t for f in files for name, t in load_file(f).items()}
    return {name: t for f in files for name, t in torch.load(f, map_location="cpu", weights_only=True).items()}


def _aux_layers(cfg: dict, eagle_config: dict, num_layers: int) -> tuple[int, ...]:
    """The target layers whose input EAGLE-3's fc fuses, in layer order (vLLM's: the config's
    eagle_aux_hidden_state_layer_ids, at its top or in eagle_config; else 2, L // 2, L - 3)."""
    ids = (cfg.get("eagle_aux_hidden_state_layer_ids") or eagle_config.get("eagle_aux_hidden_state_layer_ids")
           or (2, num_layers // 2, num_layers - 3))
    check(all(isinstance(i, int) and 0 <= i < num_layers for i in ids), FIELD,
          f"eagle_aux_hidden_state_layer_ids {list(ids)}: the target has layers 0 to {num_layers - 1}")
    return tuple(sorted(set(ids)))


def _draft_to_target(d2t: torch.Tensor, draft_vocab: int, vocab: int) -> torch.Tensor:
    check(tuple(d2t.shape) == (draft_vocab,), FIELD,
          f"d2t is {tuple(d2t.shape)}, one offset per draft token ({draft_vocab}) expected")
    ids = torch.arange(draft_vocab) + d2t.long()
    outside = ((ids < 0) | (ids >= vocab)).nonzero().flatten().tolist()
    if outside:
        raise InvalidArgument(FIELD, f"d2t maps draft token {outside[0]} to {int(ids[outside[0]])}, outside the "
                                     f"target's vocabulary of {vocab}")
    return ids


class _Slots:
    """A request's place in the head: it attends from slot `base` (the start of the block of the
    first position it was handed) and has fed itself slots up to `fed`; `pending` holds the fused
    hidden states of the slots after (the target's, not fed yet), `last` its output at fed - 1."""
    __slots__ = ("base", "fed", "pending", "num_pending", "last")

    def __init__(self, start: int, block_size: int):
        self.base, self.fed = start - start % block_size, start
        self.pending: list[torch.Tensor] = []
        self.num_pending = 0
        self.last: torch.Tensor | None = None


class EagleProposer(Proposer):
    wants_hidden = True  # the head reads the target's hidden states

    def __init__(self, head: EagleHead, target: CausalLM, num_blocks: int, block_size: int, max_model_len: int,
                 group: int, flush_rows: int, metadata: Callable[[list, torch.Tensor, int], AttentionMetadata],
                 device: torch.device, kv_dtype: torch.dtype | None = None):
        """`group`: the target's full-attention KV cache group whose block ids the head's cache
        takes; `flush_rows`: the pending hidden states a step's requests may hold before the head
        is fed them; `metadata(spans, positions, num_decodes)`: as DraftModelProposer's; `kv_dtype`:
        its cache's, the target's (default: the head's dtype)."""
        a = head.args
        check(target.rope_recompute_at is None, "speculative_config.method",
              "a target whose KV is computed again past its original context (LongRoPE) does not draft")
        head.rope = RotaryTable(a.rotary_dim or a.head_dim, a.rope_theta, a.rope_scaling, max_model_len + 1,
                                head.embed_tokens.weight.dtype, device)
        check(not head.rope.by_length, FIELD, "a head whose RoPE depends on the sequence's length is not supported")
        target.aux_layers = frozenset(head.aux_layers)
        self.head, self.target, self.group, self.metadata, self.device = head, target, group, metadata, device
        self.block_size, self.max_model_len, self.flush_rows = block_size, max_model_len, flush_rows
        self.cache = torch.zeros(num_blocks, a.num_layers, a.kv_parts, block_size, a.num_kv_heads, a.head_dim,
                                 dtype=kv_dtype or head.embed_tokens.weight.dtype, device=device)
        self.layer_caches = [(self.cache[:, i, 0], self.cache[:, i, a.kv_parts - 1]) for i in range(a.num_layers)]

    def keep(self, rows: list[tuple], hidden: torch.Tensor) -> None:
        """The target's hidden states of a step's positions that stand: per request (its state,
        its first row in the batch, that row's position, how many rows); `hidden`: the step's
        final hidden states (EAGLE-3 reads the target's aux_hidden instead)."""
        rows = [r for r in rows if r[3] > 0]
        if not rows:
            return
        index = torch.from_numpy(np.concatenate([np.arange(r, r + n) for _, r, _, n in rows])).to(self.device)
        source = self.target.aux_hidden if self.head.aux_layers else [hidden]
        fused = self.head.fuse(torch.cat([h[index] for h in source], dim=-1))
        self.target.aux_hidden = []  # (the step's whole aux states: not held until the next)
        offset = 0
        for state, _, start, n in rows:
            slots = state.proposer_state
            if slots is None or start != slots.fed + slots.num_pending:  # positions it was not handed: start over
                slots = state.proposer_state = _Slots(start, self.block_size)
            slots.pending.append(fused[offset:offset + n])
            slots.num_pending += n
            offset += n
        states = [state for state, *_ in rows]
        if sum(s.proposer_state.num_pending for s in states) >= self.flush_rows:
            self.catch_up(states)

    def propose(self, states: list, k: int) -> list[list[int]]:
        """Up to k drafts for each request state, fewer where the model's length ends first."""
        drafts = [[] for _ in states]
        k = min(k, self.max_model_len - max(len(s.token_ids) for s in states))
        if k <= 0:
            return drafts
        self.catch_up(states)
        ready = [i for i, s in enumerate(states) if s.proposer_state is not None
                 and s.proposer_state.fed == len(s.token_ids) - 1 and s.proposer_state.last is not None]
        if not ready:
            return drafts
        out = torch.stack([states[i].proposer_state.last for i in ready])
        guesses = [self.head.greedy(out)]
        for j in range(1, k):  # one row each: the last guess, at the slot after the last token's
            spans = []
            for i in ready:
                s = states[i]
                slot = len(s.token_ids) - 2 + j
                spans.append((s.proposer_state.base, slot, slot + 1, s.block_ids[self.group]))
            out = self._forward(guesses[-1], out, spans)
            guesses.append(self.head.greedy(out))
        for i, row in zip(ready, torch.stack(guesses, dim=1).tolist()):
            drafts[i] = row
        return drafts

    def loaded(self, state, num_tokens: int, start: int) -> None:
        """The head's KV of a request's slots [start, num_tokens) came with its prompt's (a prefill
        peer's, whose head started at `start`, a block's first slot): it goes on from there."""
        if num_tokens > start:
            slots = state.proposer_state = _Slots(start, self.block_size)
            slots.fed = num_tokens

    @staticmethod
    def start(state) -> int:
        """Where a request's head KV starts (a prefill's, for its handle): the slot it attends from."""
        return state.proposer_state.base if state.proposer_state is not None else -1

    def catch_up(self, states: list) -> None:
        """Feed the head each state's pending slots (token p + 1 and hidden state p), in one forward."""
        states = sorted((s for s in states if s.proposer_state is not None and s.proposer_state.num_pending),
                        key=lambda s: s.proposer_state.num_pending > 1)  # one-row spans first: the metadata's order
        if not states:
            return
        ids, spans = [], []
        for s in states:
            slots = s.proposer_state
            end = slots.fed + slots.num_pending
            ids += s.token_ids[slots.fed + 1:end + 1]
            spans.append((slots.base, slots.fed, end, s.block_ids[self.group]))
        out = self._forward(torch.tensor(ids, device=self.device),
                            torch.cat([h for s in states for h in s.proposer_state.pending]), spans)
        ends = np.cumsum([end - start for _, start, end, _ in spans]) - 1
        for s, last in zip(states, out[torch.from_numpy(ends).to(self.device)]):  # (a copy: `out` goes)
            slots = s.proposer_state
            slots.fed, slots.last, slots.pending, slots.num_pending = slots.fed + slots.num_pending, last, [], 0

    def _forward(self, ids: torch.Tensor, hidden: torch.Tensor, spans: list) -> torch.Tensor:
        """The head over (base, start, end, block ids) spans: RoPE at the true positions, the cache
        addressed from each base's block (so nothing before it is attended)."""
        bs = self.block_size
        positions = np.concatenate([np.arange(start, end) for _, start, end, _ in spans])
        shifted = positions - np.repeat([base for base, *_ in spans], [end - start for _, start, end, _ in spans])
        meta = self.metadata([(start - base, end - base, blocks[base // bs:]) for base, start, end, blocks in spans],
                             torch.from_numpy(shifted).to(self.device),
                             sum(1 for _, start, end, _ in spans if end - start == 1))
        return self.head(ids, torch.from_numpy(positions).to(self.device), hidden, self.layer_caches, meta)
