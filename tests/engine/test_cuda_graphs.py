"""Decode steps through the CUDA-graph bookkeeping (engine/worker/cuda_graphs.py). Without a GPU
nothing is captured: the padded batch runs eagerly through the same persistent buffers (Triton
under its interpreter), so what CI checks is the padding (token 0, slot -1, a one-key context),
the tables as wide as max_model_len read by one decode grid whatever the contexts, and several
KV cache groups; on a GPU the same tests replay captured graphs (bench/gpu_check.py also
compares graphs with eager there)."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from helpers import random_prompts
from test_families import FAMILIES

from baton import LLM, SamplingParams
from baton.engine.common.errors import InvalidArgument
from baton.engine.worker.cuda_graphs import capture_sizes
from baton.testing.checkpoints import write_random_checkpoint

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [1, 2, 4, 8]


def graphed(llm: LLM, sizes=SIZES) -> list[tuple[int, int, int]]:
    """The engine's decode steps through DecodeGraphs of `sizes` (captured on a GPU); returns
    the (rows, padded size, requests) of every step that took them, as they come (more rows than
    requests: drafts verified)."""
    runner = llm.engine.runner
    graphs = runner.make_graphs(sizes, capture=runner.device.type == "cuda")
    graphs.capture_all()
    runner.graphs, taken, run = graphs, [], graphs.run

    def counted(input_ids, positions, group_spans, *rest):
        taken.append((len(input_ids), graphs.padded_size(len(input_ids)), len(group_spans[0])))
        return run(input_ids, positions, group_spans, *rest)
    graphs.run = counted
    return taken


def engine(model_dir: str, **extra) -> LLM:
    return LLM(model_dir, dtype="float32", device=DEVICE, attention_backend="triton", max_num_seqs=8,
               max_num_batched_tokens=48, max_model_len=192, **extra)


# Dense GQA; alternating windows with soft-caps (two KV cache groups); MLA's latent (its own
# decode kernel) and experts; sinks.
@pytest.mark.parametrize("name", ["llama", "gemma2", "deepseek-v2", "gpt-oss"])
def test_padded_decode_batches_equal_transformers(tmp_path, hf, name):
    """Six requests of different lengths and output counts: their decode steps run six requests
    (padded to 8), then fewer as they end, at every size; each output equals transformers'."""
    if name == "llama":
        model_dir = write_random_checkpoint(str(tmp_path / name), "LlamaConfig", seed=5, hidden_size=64,
                                            intermediate_size=112, num_attention_heads=4, num_key_value_heads=2,
                                            num_hidden_layers=2)
    else:
        config_class, shape = FAMILIES[name]
        model_dir = write_random_checkpoint(str(tmp_path / name), config_class, seed=7, spread_norms=True, **shape)
    prompts = random_prompts([3, 17, 40, 75, 9, 30], seed=13)
    counts = [12, 5, 9, 3, 7, 10]
    llm = engine(model_dir)
    taken = graphed(llm)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in counts]
    outs = llm.generate(prompts, params)
    for prompt, n, out in zip(prompts, counts, outs, strict=True):
        assert out.token_ids == hf.greedy(model_dir, prompt, n), f"prompt of {len(prompt)} tokens"
    assert (6, 8, 6) in taken and {size for _, size, _ in taken} == set(SIZES), taken  # padded, and every size
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_drafts_verify_through_the_graphs(tmp_path, hf, name):
    """Steps verifying drafts (some right, some wrong: the oracle of test_spec_decode) replay the
    graphs, each request's k + 1 rows as one-token decodes at consecutive positions over the same
    blocks, a sliding window's group too; the outputs equal transformers'."""
    from test_spec_decode import NGRAM, OracleProposer

    config_class, shape = FAMILIES[name] if name != "llama" else ("LlamaConfig", dict(
        hidden_size=64, intermediate_size=112, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2))
    model_dir = write_random_checkpoint(str(tmp_path / name), config_class, seed=9, spread_norms=True, **shape)
    prompts = random_prompts([6, 19, 41, 12], seed=23)
    want = [hf.greedy(model_dir, p, 14) for p in prompts]
    llm = engine(model_dir, speculative_config=NGRAM)
    llm.engine.runner.drafting.proposer = OracleProposer([p + w for p, w in zip(prompts, want)])
    taken = graphed(llm, [1, 2, 4, 8, 16, 24])
    outs = llm.generate(prompts, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    assert any(rows > requests for rows, _, requests in taken), taken  # drafts verified in a graph
    stats = llm.engine.core.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_an_eagle3_head_drafts_from_the_graphs_hidden_states(tiny_llama, tmp_path):
    """EAGLE-3 reads the target's aux hidden states, which a graph's replay returns: the drafts and
    outputs equal an engine's whose steps all run eagerly."""
    from baton.testing.eagle_heads import write_head

    head = write_head(str(tmp_path / "eagle3"), tiny_llama, "eagle3", seed=1)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    prompts = random_prompts([7, 30, 15], seed=4)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eager = engine(tiny_llama, speculative_config=spec)
    want = [o.token_ids for o in eager.generate(prompts, greedy)]
    want_stats = eager.engine.core.scheduler.spec_stats
    llm = engine(tiny_llama, speculative_config=spec)
    taken = graphed(llm, [1, 2, 4, 8, 16])
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == want
    stats = llm.engine.core.scheduler.spec_stats
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (want_stats.num_draft_tokens,
                                                                   want_stats.num_accepted_tokens)
    assert any(rows > requests for rows, _, requests in taken), taken
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_lora_rows_take_their_slots_in_the_graphs(tiny_llama, adapters, peft_ref):
    """Three adapters of ranks 4, 8 and 16 and the base model in the same decode steps, two device
    slots (so an adapter takes the slot another left): the graphs read each row's slot from a
    persistent buffer and the stacked weights (lora/layers.py), the prefill steps views of them;
    every output equals transformers + PEFT's."""
    from test_lora import GREEDY, assert_matches_peft, mixed

    llm = engine(tiny_llama, lora_modules=adapters, max_loras=2)
    taken = graphed(llm)
    runner = llm.engine.runner
    slots_seen, graph_rows = [], runner.lora.graph_rows

    def recorded(spans, rows):
        slots = graph_rows(spans, rows)
        slots_seen.append(slots)
        return slots
    runner.lora.graph_rows = recorded
    prompts, names = mixed(2, seed=3)
    outputs = llm.generate(prompts, GREEDY, lora_request=names)
    assert_matches_peft(peft_ref, adapters, prompts, names, outputs)
    assert taken and any(len(set(s) - {-1}) == 2 and -1 in s for s in slots_seen), slots_seen  # 2 adapters + base
    assert runner.lora.num_loads >= 3  # three adapters, two slots: one took a slot another left
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


def test_steps_the_graphs_cannot_take_run_eagerly(tiny_llama, hf):
    """More decodes than the largest size, prefill chunks in the step, prompt logprobs: eager,
    with the same outputs."""
    prompts = random_prompts([5, 6, 7, 8, 9, 10], seed=3)
    llm = engine(tiny_llama)
    taken = graphed(llm, [1, 2, 4])
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, [greedy] * 5 + [dataclasses.replace(greedy, prompt_logprobs=1)])
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf.greedy(tiny_llama, prompt, 6)
    assert all(n <= 4 for n, _, _ in taken)  # never six decodes at once through a graph of four
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks


_READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")


def count_reads(monkeypatch) -> list[str]:
    """Every way a tensor becomes a Python value (a device read on a GPU), recorded by name as it happens."""
    reads: list[str] = []
    for name in _READS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _name=name, _original=original):
            reads.append(_name)
            return _original(self, *args)
        monkeypatch.setattr(torch.Tensor, name, counting)
    return reads


def test_a_graphed_decode_step_reads_the_device_once(tiny_llama, monkeypatch):
    """The only read of a device tensor on the host in a decode step is the sampled tokens'
    (counted on CPU by patching every way a tensor becomes a Python value)."""
    llm = engine(tiny_llama)
    taken = graphed(llm)
    runner = llm.engine.runner
    reads = count_reads(monkeypatch)
    per_step, execute = [], runner.execute_model

    def step(sched):
        reads.clear()
        before = len(taken)
        out = execute(sched)
        if len(taken) > before:
            per_step.append(list(reads))
        return out
    monkeypatch.setattr(runner, "execute_model", step)
    llm.generate(random_prompts([4, 20, 33], seed=9), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(per_step) >= 5
    assert all(step_reads == ["tolist"] for step_reads in per_step), per_step


def test_capture_sizes_and_their_validation(tiny_llama):
    assert capture_sizes([1, 2, 4, 8, 16], 6) == [1, 2, 4, 8]  # a full batch of 6 pads to 8
    assert capture_sizes([1, 2, 4, 8], 8) == [1, 2, 4, 8]
    assert capture_sizes([16, 32], 4) == [16]
    with_drafts = LLM(tiny_llama, device="cpu", max_num_seqs=20, speculative_config={"method": "ngram",
                                                                                    "num_speculative_tokens": 3})
    assert with_drafts.engine.config.cudagraph_capture_sizes[-2:] == [72, 80]  # 20 requests of 4 rows
    with_drafts.close()
    llm = LLM(tiny_llama, device="cpu", max_num_seqs=20)
    assert llm.engine.config.cudagraph_capture_sizes == [1, 2, 4, 8, 16, 20]
    assert llm.engine.runner.graphs is None  # a CPU engine runs every step eagerly
    llm.close()
    for bad in ([], [0, 4], ["8"], 8):
        with pytest.raises(InvalidArgument, match="cudagraph_capture_sizes"):
            LLM(tiny_llama, device="cpu", cudagraph_capture_sizes=bad)
    with pytest.raises(InvalidArgument, match="enforce_eager"):
        LLM(tiny_llama, device="cpu", enforce_eager="yes")


def test_the_graph_flags_reach_the_engine_and_the_stacks_engines(tiny_llama):
    from baton.services.cli.engine_args import engine_argv, engine_config
    from baton.services.cli.main import build_parser

    args = build_parser().parse_args(["up", "--model", tiny_llama, "--enforce-eager",
                                      "--cudagraph-capture-sizes", "4", "1", "16"])
    config = engine_config(args)
    assert config.enforce_eager and config.cudagraph_capture_sizes == [1, 4, 16]
    again = build_parser().parse_args(["serve", "--model", tiny_llama, *engine_argv(args)])
    assert engine_config(again).enforce_eager and engine_config(again).cudagraph_capture_sizes == [1, 4, 16]
    plain = build_parser().parse_args(["serve", "--model", tiny_llama])
    assert not engine_config(plain).enforce_eager and "--enforce-eager" not in engine_argv(plain)


def test_async_scheduling_through_the_graphs(tiny_llama, hf, monkeypatch):
    """Steps queued ahead (async scheduling) replay the graphs with each request's last token read
    on the device: outputs equal transformers', and queuing a step reads nothing of the device
    (its tokens come back in QueuedStep.result, from pinned host memory)."""
    prompts = random_prompts([4, 20, 33, 9], seed=17)
    llm = engine(tiny_llama, async_scheduling=True)
    taken = graphed(llm)
    runner = llm.engine.runner
    reads, submit, per_submit = count_reads(monkeypatch), runner.submit, []

    def queued(sched):
        reads.clear()
        step = submit(sched)
        per_submit.append(list(reads))
        return step
    monkeypatch.setattr(runner, "submit", queued)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf.greedy(tiny_llama, prompt, 10)
    assert len(taken) >= 5 and not any(per_submit), per_submit
    assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
