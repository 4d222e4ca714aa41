"""EAGLE heads as proposers (engine/worker/spec_decode/eagle.py).

Random-weight heads in each published format (baton/testing/eagle_heads.py: EAGLE-1, a Llama
config and pytorch_model.bin with fc, layers.0 without its input_layernorm, the target's
embeddings; EAGLE-3, safetensors with fc over three target layers, midlayer, norm, a draft
vocabulary's lm_head, d2t and t2d), sized for tiny_llama. Their drafts equal a dense reference's (the
target's hidden states from transformers, the head computed over the whole sequence at once)
through batches and chunks; the target's greedy output is the same with them as without
(chunked, preempted, prefix-cached), pools full after; a P/D pair ships the head's KV with the
prompt's, so its decode drafts as a colocated engine does, and a pair of other heads is refused
at the handshake; over two ranks (rank 0 drafting alone) a head drafts as over one; heads that
do not fit the target are refused naming the field.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from helpers import drafted_and_plain, random_prompts, run_llm

from baton import LLM, SamplingParams
from baton.engine.common.errors import InvalidArgument
from baton.testing.eagle_heads import AUX_LAYERS, HEADS, KV_HEADS, write_head


@pytest.fixture(scope="module")
def heads(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("eagle")
    return {m: write_head(str(root / m), tiny_llama, m, seed=i) for i, m in enumerate(("eagle", "eagle3"))}


def spec(method: str, head: str, k: int = 3) -> dict:
    return {"method": method, "model": head, "num_speculative_tokens": k}


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


# ---- the dense reference ---------------------------------------------------------------------
def _rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def _rope(x, positions):  # x [T, heads, D]: Llama's rotate-half RoPE, theta 10000
    d = x.shape[-1]
    angles = positions[:, None].double() / 10000.0 ** (torch.arange(0, d, 2).double() / d)
    cos, sin = (torch.cat((a, a), -1)[:, None].float() for a in (angles.cos(), angles.sin()))
    return x * cos + torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1) * sin


def dense_head(w: dict, layer: str, eagle3: bool, embeds, hidden, positions):
    """The head over a whole sequence of slots at once (causal attention), its outputs before any final norm."""
    if eagle3:
        normed = _rms(hidden, w[f"{layer}.hidden_norm.weight"])
        x, attn_in = hidden, torch.cat((_rms(embeds, w[f"{layer}.input_layernorm.weight"]), normed), -1)
    else:
        x = attn_in = torch.cat((embeds, hidden), -1) @ w["fc.weight"].T
    p = f"{layer}.self_attn."
    q = _rope((attn_in @ w[p + "q_proj.weight"].T).view(len(x), HEADS, -1), positions)
    k = _rope((attn_in @ w[p + "k_proj.weight"].T).view(len(x), KV_HEADS, -1), positions)
    v = (attn_in @ w[p + "v_proj.weight"].T).view(len(x), KV_HEADS, -1)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, dim=1), v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    x = x + out.transpose(0, 1).flatten(1) @ w[p + "o_proj.weight"].T
    m = f"{layer}.mlp."
    y = _rms(x, w[f"{layer}.post_attention_layernorm.weight"])
    return x + (F.silu(y @ w[m + "gate_proj.weight"].T) * (y @ w[m + "up_proj.weight"].T)) @ w[m + "down_proj.weight"].T


def reference_drafts(target, w: dict, eagle3: bool, token_ids: list[int], k: int) -> list[int]:
    """Head slot p reads token p + 1 and the target's hidden state at p: slots 0..n-2 from the
    target, then the head's own guesses, each step computed again from scratch."""
    with torch.no_grad():
        states = target(torch.tensor([token_ids[:-1]]), output_hidden_states=True).hidden_states
        hidden = (torch.cat([states[i][0] for i in AUX_LAYERS], -1) @ w["fc.weight"].T if eagle3 else states[-1][0])
        embed = target.get_input_embeddings().weight
        tokens, drafts = list(token_ids[1:]), []
        layer = "midlayer" if eagle3 else "layers.0"
        for _ in range(k):
            out = dense_head(w, layer, eagle3, embed[tokens], hidden, torch.arange(len(tokens)))[-1]
            if eagle3:
                draft = int(w["d2t"][i := int((_rms(out, w["norm.weight"]) @ w["lm_head.weight"].T).argmax())]) + i
            else:
                draft = int(target.lm_head(out).argmax())
            drafts.append(draft)
            tokens.append(draft)
            hidden = torch.cat((hidden, out[None]))
        return drafts


@pytest.mark.parametrize("method,backend", [("eagle", "auto"), ("eagle3", "auto"), ("eagle3", "torch")])
def test_drafts_equal_a_dense_reference(tiny_llama, heads, hf, method, backend):
    """Batched, in chunks of 32 tokens (so the hidden states kept of a prompt are fed as they
    pile up, and the rest when the request drafts), on the C++ kernel and the reference
    attention: every draft equals the reference's. A random head's drafts are all rejected, so
    the scheduler verifies an oracle's instead (the head still drafts each step): runs of them
    kept, the head then catches up over several positions at once."""
    from test_spec_decode import OracleProposer

    ps = random_prompts([7, 40, 75], seed=5)
    want = [hf.greedy(tiny_llama, p, 16) for p in ps]
    oracle = OracleProposer([p + w for p, w in zip(ps, want)])
    calls = []
    llm = LLM(tiny_llama, dtype="float32", device="cpu", speculative_config=spec(method, heads[method]),
              max_num_batched_tokens=32, attention_backend=backend)
    proposer = llm.engine.runner.drafting.proposer
    propose = proposer.propose

    def recording(states, k):
        calls.extend((list(s.token_ids), d) for s, d in zip(states, propose(states, k)))
        return oracle.propose(states, k)

    proposer.propose = recording
    got = llm.generate(ps, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in got] == want
    assert len(llm.engine.core.scheduler.spec_stats.accepted_per_pos) >= 2  # runs of drafts kept
    if method == "eagle3":
        from safetensors.torch import load_file
        w = load_file(os.path.join(heads[method], "model.safetensors"))
    else:
        w = torch.load(os.path.join(heads[method], "pytorch_model.bin"))
    assert len(calls) >= 10 and all(len(d) == 3 for _, d in calls)
    for token_ids, drafts in calls:
        assert drafts == reference_drafts(hf.model(tiny_llama), w, method == "eagle3", token_ids, 3), len(token_ids)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_with_a_head_equals_without(tiny_llama, heads, method):
    """Batched, chunked, preempted (a small pool), prefix-cached: the greedy output is the
    target's, seeded sampling repeats, drafts were proposed and verified, every block came back."""
    _, want, got = drafted_and_plain(tiny_llama, spec(method, heads[method]))
    assert got[::2] == want[::2]


def test_a_migrated_request_drafts_with_a_head(tiny_llama, heads):
    """A request whose first outputs were made elsewhere (resumed here, as the router's failover
    sends it): its prompt and those outputs computed here, the head catches up over all of them."""
    prompt = random_prompts([40], seed=31)[0]
    _, (whole,) = run_llm(tiny_llama, [prompt], GREEDY)
    llm = LLM(tiny_llama, dtype="float32", device="cpu", speculative_config=spec("eagle3", heads["eagle3"]))
    moved = llm.engine.inputs.core_request("moved", prompt, GREEDY, resumed_output=whole.token_ids[:12])
    request = llm.engine.add(moved)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert request.output_token_ids == whole.token_ids
    assert llm.engine.core.scheduler.spec_stats.num_drafts > 0
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


@pytest.mark.parametrize("method,prefill_tp,decode_tp", [("eagle", 1, 1), ("eagle3", 1, 1), ("eagle3", 2, 1),
                                                          ("eagle", 1, 2)])
def test_a_pd_pair_ships_the_heads_kv(tiny_llama, heads, method, prefill_tp, decode_tp):
    """The prefill feeds its head the whole prompt, in 32-token chunks, and the decode reads the
    head's blocks with the target's: the decode's head drafts as the colocated one does, from the
    prompt's context (every draft made after the same tokens is the same; the first of each
    request included, a random head's first colocated draft being rejected), and the output is
    the colocated run's. The last prompt's first two blocks are a prefix hit (the head starts
    past them, on the prefill as colocated: the handle says so). Each block moved once with its
    head's block (rank 0's, which alone drafts, read from the prefill's rank 0, however the
    ranks split the rest)."""
    from nixl_engines import assert_drafts_as_colocated, head_across_pd

    ps = random_prompts([12, 30, 45], seed=22)
    ps.append(ps[2][:32] + random_prompts([20], seed=23)[0])
    want, got, colocated, drafted, layout, pulled = head_across_pd(
        tiny_llama, spec(method, heads[method]), ps, GREEDY, prefill_tp, decode_tp, max_num_batched_tokens=32)
    assert got == want
    assert len(assert_drafts_as_colocated(ps, want, colocated, drafted)) >= len(drafted) // 2
    assert layout.draft_block_bytes > 0
    blocks = sum(-(-len(p) // 16) for p in ps)  # rank 0's heads, or the prefill rank's whole blocks holding them
    assert pulled == blocks * (layout.block_bytes * max(1, decode_tp // prefill_tp) + layout.draft_block_bytes)


def test_a_pd_pair_of_other_heads_is_refused_at_the_handshake(tiny_llama, heads, tmp_path):
    """A head's KV goes from prefill to decode: a prefill with no head, another method or another
    head's weights is refused naming the field, before any block moves."""
    from nixl_engines import nixl_engine

    from baton.kv_transfer.base import KVFormatMismatch

    other = write_head(str(tmp_path / "other"), tiny_llama, "eagle3", seed=9)
    decode = nixl_engine(tiny_llama, "decode", speculative_config=spec("eagle3", heads["eagle3"]))
    for prefill_spec, field in ((None, "draft_method"), (spec("eagle", heads["eagle"]), "draft_method"),
                                (spec("eagle3", other), "draft_model"),
                                ({"method": "ngram", "num_speculative_tokens": 3}, "draft_method")):
        prefill = nixl_engine(tiny_llama, "prefill", speculative_config=prefill_spec)
        with pytest.raises(KVFormatMismatch, match="same speculative_config") as err:
            decode.core.add_peer(prefill.core.connector.layout)
        assert err.value.field == field


@pytest.mark.parametrize("method,options,message", [
    ("eagle", {"hidden": 32}, "hidden_size 32 is not the target.s hidden size 64"),
    ("eagle3", {"d2t_past_vocab": True}, "outside the target's vocabulary"),
    ("eagle3", {"drop": ("midlayer.hidden_norm.weight",)}, "lacks weight layers.0.hidden_norm.weight"),
    ("eagle", {"drop": ("layers.0.self_attn.k_proj.weight",)}, "lacks weight layers.0.self_attn.qkv_proj.weight"),
    ("eagle3", {"aux_layers": None}, r"fc.weight is \(64, 192\).*aux layers \[1, 2\]"),  # vLLM's default: (2, 2, 1)
    ("eagle3", {"aux_layers": [1, 2, 4]}, "the target has layers 0 to 3"),
    ("eagle3", {"drop": ("d2t",)}, "no d2t"),
])
def test_a_head_that_does_not_fit_is_refused(tiny_llama, tmp_path, method, options, message):
    head = write_head(str(tmp_path / "head"), tiny_llama, method, **options)
    with pytest.raises(InvalidArgument, match=message) as err:
        LLM(tiny_llama, dtype="float32", device="cpu", speculative_config=spec(method, head))
    assert err.value.field == "speculative_config.model"


def test_a_head_needs_its_checkpoint(tiny_llama, heads):
    for config, field in (({"method": "eagle3"}, "speculative_config.model"),
                          ({"method": "ngram", "model": heads["eagle"]}, "speculative_config.model"),
                          ({"method": "mtp"}, "speculative_config.method")):
        with pytest.raises(InvalidArgument) as err:
            LLM(tiny_llama, dtype="float32", device="cpu", speculative_config=config)
        assert err.value.field == field


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_head_over_two_ranks_drafts_as_over_one(tiny_llama, heads, method):
    """Rank 0 alone drafts: its head holds the target's whole embeddings and LM head (the ranks
    split theirs) and reads the hidden states every rank has whole. Same drafts, same output."""
    from nixl_engines import record_drafts

    ps = random_prompts([12, 30, 45], seed=22)
    runs = []
    for size in (1, 2):
        with LLM(tiny_llama, dtype="float32", device="cpu", tensor_parallel_size=size,
                 speculative_config=spec(method, heads[method])) as llm:
            drafts = record_drafts(llm.engine.runner)
            runs.append(([o.token_ids for o in llm.generate(ps, GREEDY)], drafts))
            assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] == runs[1][1] and len(runs[1][1]) > 20


def test_the_nested_aux_layer_ids_are_read(tiny_llama, tmp_path):
    head = write_head(str(tmp_path / "head"), tiny_llama, "eagle3", nested_aux=True)
    llm = LLM(tiny_llama, dtype="float32", device="cpu", speculative_config=spec("eagle3", head))
    assert llm.engine.runner.model.aux_layers == frozenset(AUX_LAYERS)
