"""DeepSeek's multi-token-prediction layer as a proposer (engine/worker/spec_decode/mtp.py).

A tiny DeepSeek-V3 (test_families' shape: MLA with a compressed query, noaux_tc routing, layer 0
dense) is written with four layers by transformers, and its fourth becomes the MTP layer's
decoder layer (baton/testing/mtp_checkpoint.py): `model.layers.3.*` of a three-layer checkpoint
with num_nextn_predict_layers 1, with seeded enorm, hnorm, eh_proj, shared_head (its own LM
head, unlike the target's) and a copy of the target's embeddings, in a shard of its own behind
model.safetensors.index.json. The
head's drafts equal a dense reference (the target's hidden states from transformers, the MTP
layer's decoder layer run by transformers over the whole sequence); the greedy output is the
target's with it as without (batched, chunked, preempted, prefix-cached); a P/D pair ships its KV
and its decode drafts as a colocated engine does;
pools full after; a checkpoint without the layer is refused naming the field.
"""
from __future__ import annotations

import os

import pytest
import torch
from helpers import drafted_and_plain, random_prompts
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_families import FAMILIES

from baton import LLM, SamplingParams
from baton.engine.common.errors import InvalidArgument
from baton.testing.checkpoints import write_random_checkpoint
from baton.testing.mtp_checkpoint import write_mtp

CONFIG_CLASS, SHAPE = FAMILIES["deepseek-v3"]
LAYERS = SHAPE["num_hidden_layers"]  # the MTP layer: model.layers.3
MTP = f"model.layers.{LAYERS}."
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> str:
    """Four layers; DeepSeek-V3's correction biases drawn (zero at init)."""
    path = write_random_checkpoint(str(tmp_path_factory.mktemp("whole")), CONFIG_CLASS, seed=7, spread_norms=True,
                                   **{**SHAPE, "num_hidden_layers": LAYERS + 1})
    file = os.path.join(path, "model.safetensors")
    tensors, gen = load_file(file), torch.Generator().manual_seed(4)
    for name, t in tensors.items():
        if name.endswith("e_score_correction_bias"):
            tensors[name] = torch.rand(t.shape, generator=gen) * 0.5
    save_file(tensors, file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def deepseek(whole, tmp_path_factory) -> str:
    return write_mtp(str(tmp_path_factory.mktemp("mtp")), whole)


def spec(k: int = 3, **more) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, **more}


# ---- the dense reference ---------------------------------------------------------------------
def _rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Reference:
    """Slot p reads token p + 1 (its embedding zeroed at position 0) and the target's final hidden
    state at p, then the head's own guesses and outputs; each step computed again over the whole
    sequence by transformers' decoder layer holding the MTP layer's weights."""

    def __init__(self, hf, deepseek: str, whole: str):
        from transformers import AutoModelForCausalLM

        self.target = hf.model(deepseek)
        four = AutoModelForCausalLM.from_pretrained(whole, dtype=torch.float32).eval()
        self.block, self.rotary = four.model.layers[LAYERS], four.model.rotary_emb
        self.w = {n.removeprefix(MTP): t for n, t in load_file(
            os.path.join(deepseek, "model-00002-of-00002.safetensors")).items()}

    def drafts(self, token_ids: list[int], k: int) -> list[int]:
        w = self.w
        with torch.no_grad():
            hidden = self.target(torch.tensor([token_ids[:-1]]), output_hidden_states=True).hidden_states[-1][0]
            embed = self.target.get_input_embeddings().weight
            tokens, drafts = list(token_ids[1:]), []
            for _ in range(k):
                n = len(tokens)
                embeds = embed[tokens].clone()
                embeds[0] = 0
                x = torch.cat((_rms(embeds, w["enorm.weight"]), _rms(hidden, w["hnorm.weight"])), -1)
                x = (x @ w["eh_proj.weight"].T)[None]
                positions = torch.arange(n)[None]
                mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
                out = self.block(x, attention_mask=mask, position_ids=positions,
                                 position_embeddings=self.rotary(x, positions))[0]
                draft = int((_rms(out[-1], w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].T).argmax())
                drafts.append(draft)
                tokens.append(draft)
                hidden = torch.cat((hidden, out[-1:]))
            return drafts


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_drafts_equal_a_dense_reference(deepseek, whole, hf, backend):
    """Batched, in chunks of 32 tokens, on the C++ kernel, the reference attention and Triton's
    (interpreted on CPU): every draft equals the reference's. A random layer's drafts are all
    rejected, so the scheduler verifies an oracle's instead (the head still drafts each step):
    runs of them kept, the head then catches up over several positions at once, in one forward
    with others' single positions (MLA's prefill rows up-projected, its one-row spans absorbed)."""
    from test_spec_decode import OracleProposer

    if backend == "triton":
        pytest.importorskip("triton")
    ps = random_prompts([7, 41, 75], seed=5)
    want = [hf.greedy(deepseek, p, 16) for p in ps]
    oracle = OracleProposer([p + w for p, w in zip(ps, want)])
    calls, forwards = [], []
    llm = LLM(deepseek, dtype="float32", device="cpu", speculative_config=spec(), max_num_batched_tokens=32,
              attention_backend=backend)
    proposer = llm.engine.runner.drafting.proposer
    propose, metadata = proposer.propose, proposer.metadata

    def recording(states, k):
        calls.extend((list(s.token_ids), d) for s, d in zip(states, propose(states, k)))
        return oracle.propose(states, k)

    def counted(spans, positions, num_decodes):
        forwards.append((num_decodes, len(spans)))
        return metadata(spans, positions, num_decodes)

    proposer.propose, proposer.metadata = recording, counted
    got = llm.generate(ps, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in got] == want
    assert len(llm.engine.core.scheduler.spec_stats.accepted_per_pos) >= 2  # runs of drafts kept
    assert any(0 < decodes < spans for decodes, spans in forwards)  # a catch-up of one row and of several
    assert len(calls) >= 10 and all(len(d) == 3 for _, d in calls)
    reference = Reference(hf, deepseek, whole)
    for token_ids, drafts in calls:
        assert drafts == reference.drafts(token_ids, 3), len(token_ids)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_mtp_equals_without(deepseek, hf, k):
    """Batched, chunked, preempted (a small pool), prefix-cached: the greedy output is the
    target's (transformers', which, as Baton's target, leaves the MTP layer out), seeded sampling
    repeats, drafts were proposed and verified, every block came back."""
    ps, want, got = drafted_and_plain(deepseek, spec(k))
    if k == 1:
        assert want[::2] == [hf.greedy(deepseek, p, 24) for p in ps[::2]]
    assert got[::2] == want[::2]


def test_the_layer_is_read_from_its_shard_into_an_mla_cache(deepseek, monkeypatch):
    """Only the shard holding model.layers.3.* is opened for it; the copy of the target's
    embeddings is shared, the layer's own LM head kept; its KV cache holds one latent part of
    kv_lora_rank + qk_rope_head_dim per slot, and the blocks are sized for it and the target."""
    from baton.engine.worker import loader

    opened, real = [], loader.safe_open

    def spied(path, **kwargs):
        opened.append(os.path.basename(path))
        return real(path, **kwargs)

    monkeypatch.setattr(loader, "safe_open", spied)
    shard = os.path.join(deepseek, "model-00002-of-00002.safetensors")
    with safe_open(shard, "pt") as f:
        assert {name for name, _ in loader.tensors_under(deepseek, MTP)} == set(f.keys())
    assert opened == [os.path.basename(shard)]
    latent = SHAPE["kv_lora_rank"] + SHAPE["qk_rope_head_dim"]
    llm = LLM(deepseek, dtype="float32", device="cpu", speculative_config=spec(), max_model_len=256,
              kv_cache_memory_bytes=50 * (LAYERS + 1) * 16 * latent * 4)  # 50 blocks of 4 layers' latents
    assert llm.engine.core.num_kv_blocks == 50  # (66 for the target's three layers alone)
    runner = llm.engine.runner
    assert runner.drafting.proposer.cache.shape == (50, 1, 1, 16, 1, latent)  # [blocks, layer, latent, slots, head, D]
    head, target = runner.drafting.proposer.head, runner.model
    assert head.embed_tokens is target.embed_tokens and head.shared_head.head is not target.lm_head
    with safe_open(shard, "pt") as f:
        assert torch.equal(head.shared_head.head.weight, f.get_tensor(MTP + "shared_head.head.weight"))
        assert torch.equal(head.mtp_block.mlp.experts.down[5], f.get_tensor(MTP + "mlp.experts.5.down_proj.weight"))


def test_a_pd_pair_ships_the_layers_kv(deepseek):
    """The MTP layer's latent KV of the prompt goes from prefill to decode with the target's: the
    decode drafts as a colocated engine does (each request's first decode draft included), the
    output is the colocated run's; pools full after."""
    from nixl_engines import assert_drafts_as_colocated, head_across_pd

    ps = random_prompts([12, 30, 45], seed=22)
    want, got, colocated, drafted, layout, _ = head_across_pd(deepseek, spec(), ps, GREEDY)
    assert got == want
    assert_drafts_as_colocated(ps, want, colocated, drafted)
    assert layout.format.draft_method == "mtp"


def test_the_layer_over_two_ranks_drafts_as_over_one(deepseek):
    """Rank 0 alone drafts, the layer whole (its MLA and experts unsplit) beside the target's
    shares: same drafts, same output."""
    from nixl_engines import record_drafts

    ps = random_prompts([12, 30, 45], seed=22)
    runs = []
    for size in (1, 2):
        with LLM(deepseek, dtype="float32", device="cpu", tensor_parallel_size=size, speculative_config=spec()) as llm:
            drafts = record_drafts(llm.engine.runner)
            runs.append(([o.token_ids for o in llm.generate(ps, GREEDY)], drafts))
            assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] == runs[1][1] and len(runs[1][1]) > 20


def test_a_checkpoint_without_the_layer_is_refused(tiny_llama, whole, deepseek, tmp_path):
    """No num_nextn_predict_layers (Llama), the count without the tensors (`whole`: transformers
    writes num_nextn_predict_layers 1 and no such layer), a tensor missing: refused naming
    .method where the layer is sought in the target's checkpoint, .model where it was named."""
    missing = write_mtp(str(tmp_path / "missing"), whole, drop=(MTP + "hnorm.weight",))
    for target, config, field, message in (
            (tiny_llama, spec(), "speculative_config.method", "num_nextn_predict_layers is None"),
            (deepseek, spec(model=tiny_llama), "speculative_config.model", "num_nextn_predict_layers is None"),
            (whole, spec(), "speculative_config.method", r"no tensors of its MTP layer \(model.layers.4.\*\)"),
            (missing, spec(), "speculative_config.method", "lacks weight model.layers.3.hnorm.weight")):
        with pytest.raises(InvalidArgument, match=message) as err:
            LLM(target, dtype="float32", device="cpu", speculative_config=config)
        assert err.value.field == field


def test_a_block_fp8_checkpoints_layer_stays_fp8_and_drafts_as_the_greedy_target(deepseek, tmp_path):
    """DeepSeek-V3 as published: the target and its MTP layer in block FP8. The layer's
    projections and experts load quantized beside the target's, and the drafted greedy output is
    the target's own."""
    from baton.engine.worker.loader import load_model
    from baton.engine.worker.quant.linear import ExpertStack, QuantizedLinear
    from baton.engine.worker.spec_decode.mtp import load_mtp
    from baton.testing.quantized_checkpoints import quantize_checkpoint

    fp8, _ = quantize_checkpoint(deepseek, str(tmp_path / "fp8"), str(tmp_path / "ref"), "fp8-block", block=(16, 16))
    head = load_mtp(None, fp8, load_model(fp8, torch.float32, "cpu"), torch.float32, "cpu")
    kinds = {type(m) for m in head.modules()}
    assert QuantizedLinear in kinds and ExpertStack in kinds
    ps, want, got = drafted_and_plain(fp8, spec(3))
    assert got[::2] == want[::2]
