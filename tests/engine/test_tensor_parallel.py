"""Tensor parallelism on CPU over gloo. The split model: 2 and 4 ranks (one process each) compute
the logits the whole model does, prefill and decode, every rank alike: heads and KV heads split
(replicated past the KV heads), the MLP's intermediate split, vocabulary-parallel embeddings and
LM head (a vocabulary that does not divide, q/k/v biases, tied embeddings). The engine
(`tensor_parallel_size=2`: rank 0 in the engine's process, rank 1 its own, steps over shared
memory): greedy-equal to transformers batched, chunked, preempted and prefix-cached, with
speculative drafts and a grammar; its pool full after. A rank killed under a server's load ends
its streams UNAVAILABLE and the server non-zero, leaving no process or shared memory behind; one
killed under an offline engine fails its generate naming the rank, and one dead before the
ranks meet fails the start at once naming it.
Mixtures of experts (each expert's intermediate split, or with expert parallelism whole experts
spread; shared experts, gpt-oss's biases), latent attention (DeepSeek's heads split, the latent
whole on each rank) and OLMo 2's QK-norm over every head: the same logits over 2 ranks, and the
engine greedy-equal to transformers; sizes that do not divide refused naming the field."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.multiprocessing as mp
from helpers import assert_matches_hf, greedy_through, random_prompts, stats
from tp_workers import prompt_logits, run_rank

from baton import LLM, SamplingParams
from baton.engine.common.errors import InvalidArgument


def logits_over(model_dir: str, world: int, prompt: list[int], out, expert_parallel: bool = False
                ) -> list[torch.Tensor]:
    import datetime

    import torch.distributed as dist

    os.makedirs(out, exist_ok=True)
    # The store is bound here, on a port the kernel picks (a port probed free and bound later by a
    # rank can be taken in between); every rank connects to it.
    store = dist.TCPStore("127.0.0.1", 0, world + 1, True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    mp.spawn(run_rank, args=(world, store.port, model_dir, prompt, str(out), expert_parallel), nprocs=world,
             join=True)
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]


@pytest.mark.parametrize("name", ["llama", "qwen2-odd-vocab"])
def test_two_ranks_compute_the_whole_models_logits(tiny_llama, tmp_path, name):
    from baton.engine.worker.loader import load_model
    from baton.testing.checkpoints import TINY, write_random_checkpoint

    model_dir = tiny_llama if name == "llama" else write_random_checkpoint(  # 517: shares of 259 and 258
        str(tmp_path / "qwen2"), TINY["qwen2"][0], seed=3, **{**TINY["qwen2"][1], "vocab_size": 517})
    prompt = random_prompts([37], seed=5)[0]
    model = load_model(model_dir, torch.float32, "cpu")
    model.prepare(256)
    with torch.inference_mode():
        want = prompt_logits(model, prompt)
    got = logits_over(model_dir, 2, prompt, tmp_path / name)
    for rank_logits in got:
        torch.testing.assert_close(rank_logits, want, atol=2e-5, rtol=2e-5)
    assert torch.equal(want[:-1].argmax(-1), got[1][:-1].argmax(-1))


def test_four_ranks_replicate_two_kv_heads(tiny_llama, tmp_path):
    """More ranks than KV heads (4 over Llama's 4 query and 2 KV heads): each KV head on the two
    ranks whose query head reads it; the logits still the whole model's."""
    from baton.engine.worker.loader import load_model

    prompt = random_prompts([21], seed=6)[0]
    model = load_model(tiny_llama, torch.float32, "cpu")
    model.prepare(256)
    with torch.inference_mode():
        want = prompt_logits(model, prompt)
    for rank_logits in logits_over(tiny_llama, 4, prompt, tmp_path / "tp4"):
        torch.testing.assert_close(rank_logits, want, atol=2e-5, rtol=2e-5)


def test_a_split_the_heads_do_not_allow_is_refused(tiny_llama):
    from baton.engine.worker.loader import load_model
    from baton.engine.worker.parallel.tensor_parallel import TPGroup, shard_model

    model = load_model(tiny_llama, torch.float32, "cpu")
    with pytest.raises(InvalidArgument, match="do not split 4 query and 2 KV heads") as err:
        shard_model(model, TPGroup(0, 3, None))
    assert err.value.field == "tensor_parallel_size"


def qwen2_odd(tmp_path) -> str:
    from baton.testing.checkpoints import TINY, write_random_checkpoint

    return write_random_checkpoint(str(tmp_path / "qwen2"), TINY["qwen2"][0], seed=3,
                                   **{**TINY["qwen2"][1], "vocab_size": 517})


@pytest.mark.parametrize("name", ["llama", "qwen2-odd-vocab"])
def test_an_engine_over_two_ranks_equals_transformers(tiny_llama, tmp_path, hf, name):
    model_dir = tiny_llama if name == "llama" else qwen2_odd(tmp_path)
    prompts = random_prompts([3, 17, 40, 75, 130], seed=41)
    prompts.append(prompts[3][:48] + prompts[0])  # shares three blocks with the fourth
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(model_dir, dtype="float32", device="cpu", tensor_parallel_size=2, max_num_batched_tokens=32,
             num_kv_blocks=16, max_model_len=192) as llm:
        outs = llm.generate(prompts, greedy)
        engine = llm.engine
        assert engine.scheduler.num_preemptions > 0 and engine.kv.prefix_hits > 0
        assert engine.kv.num_free_blocks == engine.num_kv_blocks
        # Rank 0 holds half of the KV heads: its blocks are half as large.
        assert engine.runner.kv_cache.shape[-2] == engine.runner.model.args.num_kv_heads == 1
        procs = engine.core.workers.procs
    assert_matches_hf(hf, model_dir, prompts, outs, greedy.max_tokens)
    assert all(p.poll() == 0 for p in procs)  # told to stop, they did


def test_drafts_and_a_grammar_over_two_ranks_equal_one(tiny_llama):
    """Only rank 0 samples, verifies drafts and follows the grammar; the other rank mirrors its
    kept tokens and computes the same rows."""
    copy = random_prompts([30], seed=8)[0]
    prompts = [copy + copy[:20], random_prompts([12], seed=9)[0]]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    from baton.engine.common.structured_output import StructuredOutput

    choice = SamplingParams(max_tokens=8, temperature=0.0, structured_output=StructuredOutput(
        "json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    runs = []
    for size in (1, 2):
        with LLM(tiny_llama, dtype="float32", device="cpu", tensor_parallel_size=size, speculative_config=spec) as llm:
            outs = llm.generate(prompts + [prompts[1]], [greedy, greedy, choice])
            runs.append(([o.token_ids for o in outs], llm.engine.scheduler.spec_stats.num_accepted_tokens))
            assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
    assert runs[0] == runs[1] and runs[1][1] > 0


def test_swaps_and_host_tier_hits_over_two_ranks_equal_one(tiny_llama):
    """Each rank copies its heads of the blocks to and from its host pool; a job is done once
    every rank's copies landed."""
    from helpers import gib

    shared = random_prompts([48] * 3, seed=21)  # prefixes evicted from the device between uses
    prompts = [shared[i % 3] + p for i, p in enumerate(random_prompts([10, 60, 30, 90, 20, 70], seed=22))]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = []
    for size in (1, 2):
        with LLM(tiny_llama, dtype="float32", device="cpu", tensor_parallel_size=size, num_kv_blocks=14,
                 max_model_len=192, max_num_batched_tokens=64, kv_offloading_size=gib(60),
                 preemption_mode="swap") as llm:
            outs = [o.token_ids for o in llm.generate(prompts, greedy)]
            core = llm.engine.core
            runs.append(outs)
            assert core.host.num_swapped_out > 0 and core.host.num_hits > 0
            assert core.kv.num_free_blocks == core.num_kv_blocks and not core.host.swapped
            assert core.host.num_free_blocks == core.host.num_blocks
    assert runs[0] == runs[1]


def test_lora_adapters_over_two_ranks_equal_peft(tiny_llama, adapters, peft_ref):
    """Each rank keeps its part of an adapter as of the projection it wraps (B's output columns
    of a split projection, A's input rows of a row-parallel one, whose deltas join the partial
    sum before the ranks add it up); adapters loaded and unloaded at run time reach every rank
    under the same id."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    names = [None, "sql", "chat", "code"] * 2
    prompts = random_prompts([5 + 13 * i for i in range(len(names))], seed=3)
    with LLM(tiny_llama, dtype="float32", device="cpu", tensor_parallel_size=2, max_loras=3, max_num_batched_tokens=24,
             lora_modules={"sql": adapters["sql"], "chat": adapters["chat"]}) as llm:
        llm.load_adapter("code", adapters["code"])
        outs = llm.generate(prompts, greedy, lora_request=names)
        for prompt, name, out in zip(prompts, names, outs, strict=True):
            assert out.token_ids == peft_ref.greedy(adapters[name] if name else None, prompt, 12), name
        llm.unload_adapter("code")
        llm.load_adapter("code", adapters["sql"])  # a new adapter under the old name: a new id everywhere
        again = llm.generate(prompts[:2], greedy, lora_request=["code", "code"])
        assert [o.token_ids for o in again] == [peft_ref.greedy(adapters["sql"], p, 12) for p in prompts[:2]]
        assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
        procs = llm.engine.core.workers.procs
    assert all(p.poll() == 0 for p in procs)


def test_decode_graphs_over_two_ranks(tiny_llama, adapters, peft_ref, hf, monkeypatch):
    """Every rank takes the same decode steps through the CUDA-graph bookkeeping (here without
    capturing: the padded batches run eagerly, their all-reduces of the padded shape on both
    ranks, which a rank that went its own way would break), LoRA's stacked slots split as the
    projections are, an adapter unloaded and another taking its slot: greedy equal to
    transformers and PEFT."""
    from baton.engine.worker.model_runner import CPU_GRAPHS_FOR_TESTS

    monkeypatch.setenv(CPU_GRAPHS_FOR_TESTS, "1")
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    names = [None, "sql", "chat", None, "sql", "chat"]
    prompts = random_prompts([3, 17, 40, 9, 30, 22], seed=12)
    with LLM(tiny_llama, dtype="float32", device="cpu", tensor_parallel_size=2, attention_backend="triton",
             max_num_seqs=8, cudagraph_capture_sizes=[1, 2, 4, 8], max_num_batched_tokens=48, max_model_len=192,
             max_loras=2, lora_modules={"sql": adapters["sql"], "chat": adapters["chat"]}) as llm:
        graphs, rows = llm.engine.runner.graphs, []
        assert graphs is not None and not graphs.capture
        run = graphs.run

        def counted(input_ids, *rest):
            rows.append(len(input_ids))
            return run(input_ids, *rest)
        graphs.run = counted
        outs = llm.generate(prompts, greedy, lora_request=names)
        for prompt, name, out in zip(prompts, names, outs, strict=True):
            assert out.token_ids == peft_ref.greedy(adapters[name] if name else None, prompt, 10), name
        llm.unload_adapter("sql")
        llm.load_adapter("code", adapters["code"])
        again = llm.generate(prompts[:3], greedy, lora_request=["code", "chat", None])
        assert [o.token_ids for o in again] == [peft_ref.greedy(adapters[n] if n else None, p, 10)
                                                for n, p in zip(["code", "chat", None], prompts[:3])]
        assert len(rows) >= 10 and any(n not in (1, 2, 4, 8) for n in rows), rows  # padded steps among them
        assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
        procs = llm.engine.core.workers.procs
    assert all(p.poll() == 0 for p in procs)


def test_async_scheduling_over_two_ranks_equals_one_step_at_a_time(tiny_llama, hf):
    """Steps queued ahead on both ranks (each reads the tokens in flight on its own device, rank
    0's broadcast as it samples), mixed with steps run one at a time while a request asks for
    logprobs (the tokens then reach rank 1 through the ring), a small pool preempting: greedy
    and seeded outputs equal a synchronous engine's over two ranks, greedy equal to
    transformers."""
    prompts = random_prompts([3, 17, 40, 75, 9, 30], seed=21)
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=9, temperature=0.8, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)]
    outs, ahead = {}, []
    for mode in (False, True):
        with LLM(tiny_llama, dtype="float32", device="cpu", tensor_parallel_size=2, async_scheduling=mode,
                 num_kv_blocks=10, max_model_len=128, max_num_batched_tokens=48) as llm:
            core = llm.engine.core
            assert core.loop.ahead == mode
            submit = core.workers.submit

            def counted(runner, sched, core=core, submit=submit):
                ahead.append(core.step_in_flight and sched.total_num_scheduled_tokens > 0)
                return submit(runner, sched)
            core.workers.submit = counted
            outs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
            preempted = core.scheduler.num_preemptions
            assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks and not core.step_in_flight
            procs = core.workers.procs
        assert all(p.poll() == 0 for p in procs)
    assert outs[True] == outs[False]
    for i in (0, 2, 3, 5):
        assert outs[True][i] == hf.greedy(tiny_llama, prompts[i], params[i].max_tokens), i
    assert sum(ahead) >= 5 and preempted > 0, (ahead, preempted)


def test_what_the_ranks_do_not_split_is_refused_naming_the_field(tiny_llama):
    with pytest.raises(InvalidArgument, match="do not split 4 query and 2 KV heads") as err:
        LLM(tiny_llama, device="cpu", tensor_parallel_size=3)
    assert err.value.field == "tensor_parallel_size"
    for size in (0, 65, "2"):
        with pytest.raises(InvalidArgument) as err:
            LLM(tiny_llama, device="cpu", tensor_parallel_size=size)
        assert err.value.field == "tensor_parallel_size"


def test_the_handshake_takes_tensor_parallel_peers_whose_sizes_divide():
    from baton.kv_transfer.base import KVFormat, KVFormatMismatch

    def fmt(tp: int) -> KVFormat:
        return KVFormat("m", "float32", 2, 2, 16, 16, "cpu", tensor_parallel_size=tp)

    for mine, theirs in ((1, 2), (2, 1), (2, 2), (4, 2)):
        fmt(mine).check_peer(fmt(theirs))
    for mine, theirs in ((2, 3), (4, 6)):
        with pytest.raises(KVFormatMismatch) as err:
            fmt(mine).check_peer(fmt(theirs))
        assert err.value.field == "tensor_parallel_size"


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2), (2, 2)])
def test_prefill_and_decode_of_other_tensor_parallel_sizes_equal_colocated(tiny_llama, prefill_tp, decode_tp):
    """Each decode rank reads its KV heads from the prefill ranks holding them: straight into
    its cache where a prefill rank holds exactly its heads, else through a buffer of that rank's
    block shape (one READ, one descriptor per run of blocks, per prefill rank read from)."""
    from nixl_engines import assert_pools_full, connect, disaggregated, nixl_engine

    prompts = random_prompts([5, 40, 70], seed=12)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(tiny_llama, dtype="float32", device="cpu") as llm:
        want = [o.token_ids for o in llm.generate(prompts, greedy)]
    prefill = nixl_engine(tiny_llama, "prefill", tensor_parallel_size=prefill_tp)
    decode = nixl_engine(tiny_llama, "decode", tensor_parallel_size=decode_tp)
    try:
        connect(prefill, decode)
        assert len(decode.core.connector.layout.ranks) == decode_tp - 1
        assert disaggregated(prefill, decode, prompts, [greedy] * len(prompts)) == want
        blocks = sum(-(-len(p) // 16) for p in prompts)
        reader = decode.core.connector  # rank 0's
        assert reader.num_blocks_pulled == blocks
        # Its bytes: its own heads (from both prefill ranks, or the one holding them), or the whole
        # block of a prefill of fewer ranks (staged, its heads kept).
        block_bytes = (prefill.core.connector.layout if prefill_tp < decode_tp else reader.layout).block_bytes
        assert reader.num_bytes_pulled == blocks * block_bytes
        assert reader.num_descriptors == {(2, 1): 2, (1, 2): 1, (2, 2): 1}[prefill_tp, decode_tp] * len(prompts)
        assert_pools_full(prefill, decode)
    finally:
        for engine in (prefill, decode):
            engine.close()


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_a_rank_killed_under_load_ends_the_streams_unavailable_and_leaves_nothing(spawn, tiny_llama):
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from test_core_process import alive

    from baton.services.client import Client

    shm = set(os.listdir("/dev/shm"))
    server = spawn(tiny_llama, "--tensor-parallel-size", "2")
    core = stats(server.address).engine_core_pid
    (rank1,) = children(core)

    def stream(i: int):
        with Client(server.address) as client:
            it = client.generate([5, 6, 7 + i], max_tokens=1000, temperature=0, ignore_eos=True)
            next(it)
            started.append(i)
            try:
                for _ in it:
                    pass
            except grpc.RpcError as e:
                return e.code(), e.details()
            return None

    started: list[int] = []
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream, i) for i in range(4)]
        deadline = time.monotonic() + 30
        while len(started) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(rank1, signal.SIGKILL)
        t0 = time.monotonic()
        ends = [f.result(timeout=30) for f in futures]
        waited = time.monotonic() - t0
    assert all(e is not None and e[0] == grpc.StatusCode.UNAVAILABLE for e in ends), ends
    assert waited < 5 and "tensor-parallel rank 1 exited with status -9" in ends[0][1], (waited, ends[0])
    assert server.proc.wait(10) == 1
    assert not alive(core) and not alive(rank1)
    assert set(os.listdir("/dev/shm")) <= shm


def my_children() -> set[int]:
    """This process's children (any thread's; a zombie too, until it is reaped)."""
    pids = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            pids |= {int(c) for c in f.read().split()}
    return pids


def test_a_rank_dead_before_the_rendezvous_fails_the_start_at_once_naming_it(tiny_llama, monkeypatch):
    """Rank 1 exits after saying it loaded, before the group meets: rank 0's rendezvous gives
    up within moments (not after the store's 600 s), naming the rank; nothing is left behind."""
    from baton.engine.common.errors import StartupError
    from baton.engine.worker.parallel.rank import EXIT_BEFORE_JOIN
    from baton.engine.worker.parallel.tensor_parallel import TPGroup

    monkeypatch.setenv(EXIT_BEFORE_JOIN, "1")
    entered: list[float] = []
    join = TPGroup.join

    def timed_join(*args, **kwargs):
        entered.append(time.monotonic())
        return join(*args, **kwargs)

    monkeypatch.setattr(TPGroup, "join", timed_join)
    shm, before = set(os.listdir("/dev/shm")), my_children()
    with pytest.raises(StartupError, match="tensor-parallel rank 1 exited with status 3 while joining the group"):
        LLM(tiny_llama, dtype="float32", device="cpu", tensor_parallel_size=2)
    waited = time.monotonic() - entered[0]
    assert len(entered) == 1 and waited < 10, waited
    assert my_children() <= before
    assert set(os.listdir("/dev/shm")) <= shm


def test_an_offline_engine_whose_rank_is_killed_fails_naming_it_and_leaves_nothing(tiny_llama):
    """Rank 1 killed mid-generation: generate raises RankDied naming it within moments (gloo's
    own error on the closed socket, or a step waiting on the ring, is not what it says), every
    later generate too, and closing the engine leaves no process or shared memory behind."""
    import threading

    from baton.engine.worker.parallel.workers import RankDied

    shm, before = set(os.listdir("/dev/shm")), my_children()
    prompts = [[5, 6, 7 + i] for i in range(4)]
    long = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
    with LLM(tiny_llama, dtype="float32", device="cpu", tensor_parallel_size=2) as llm:
        (rank1,) = llm.engine.core.workers.procs
        killed: list[float] = []

        def kill_mid_generation():
            deadline = time.monotonic() + 60
            while llm.engine.times.steps < 10 and time.monotonic() < deadline:
                time.sleep(0.01)
            killed.append(time.monotonic())
            os.kill(rank1.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_mid_generation)
        killer.start()
        with pytest.raises(RankDied, match="tensor-parallel rank 1 exited with status -9"):
            llm.generate(prompts, long)
        waited = time.monotonic() - killed[0]
        killer.join()
        assert waited < 10, waited
        with pytest.raises(RankDied, match="tensor-parallel rank 1 exited with status -9"):
            llm.generate(prompts[:1], long)
    assert rank1.poll() == -9
    assert my_children() <= before
    assert set(os.listdir("/dev/shm")) <= shm


# DeepSeek-V2-Lite's attention: 16 heads over a 512 + 64 latent, no query compression.
SHAPES = {"deepseek-v2-lite-width": ("DeepseekV2Config", dict(
    hidden_size=256, intermediate_size=384, moe_intermediate_size=64, num_attention_heads=16, num_hidden_layers=2,
    kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1))}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family(name) -> its tiny checkpoint (test_families' shapes), written once per module."""
    from test_families import FAMILIES

    from baton.testing.checkpoints import write_random_checkpoint

    written: dict[str, str] = {}

    def family(name: str) -> str:
        if name not in written:
            config_class, shape = {**FAMILIES, **SHAPES}[name]
            written[name] = write_random_checkpoint(str(tmp_path_factory.mktemp(name) / name), config_class, seed=7,
                                                    spread_norms=True, **shape)
        return written[name]
    return family


# Qwen2-MoE: a gated shared expert; DeepSeek-V2: MLA (the query whole, then with its LoRA: "-q"),
# a dense first layer, shared experts, group-limited routing; gpt-oss: biased experts and router,
# sinks; OLMo 2: QK-norm over every head.
@pytest.mark.parametrize("name, expert_parallel", [("qwen2-moe", False), ("qwen2-moe", True), ("deepseek-v2", False),
                                                   ("deepseek-v2-lite-width", False),
                                                   ("deepseek-v2-q", True), ("gpt-oss", False), ("gpt-oss", True),
                                                   ("olmo2", False)])
def test_experts_latent_attention_and_whole_qk_norm_over_two_ranks_compute_the_whole_models_logits(
        families, tmp_path, name, expert_parallel):
    from baton.engine.worker.loader import load_model

    model_dir = families(name)
    prompt = random_prompts([37], seed=5)[0]
    model = load_model(model_dir, torch.float32, "cpu")
    model.prepare(256)
    with torch.inference_mode():
        want = prompt_logits(model, prompt)
    tol = 1e-4 if name == "deepseek-v2-lite-width" else 2e-5  # (wider sums, added in another order)
    for rank_logits in logits_over(model_dir, 2, prompt, tmp_path / name, expert_parallel):
        torch.testing.assert_close(rank_logits, want, atol=tol, rtol=tol)
        assert torch.equal(rank_logits.argmax(-1), want.argmax(-1))


def test_what_each_rank_keeps_of_experts_and_latent_attention(families):
    """Rank 1 of 2 (no collective runs while sharding): split, each expert's half of the
    intermediate and no down bias (rank 0 adds it); spread, experts 3..5 whole with theirs; MLA's
    args its 2 query heads and the one latent head whole."""
    from baton.engine.worker.loader import load_model
    from baton.engine.worker.parallel.tensor_parallel import LocalExperts, PartialSum, TPGroup, shard_model

    gpt_oss = load_model(families("gpt-oss"), torch.float32, "cpu")
    whole = gpt_oss.layers[0].mlp.experts
    gate_up, down_bias = whole.gate_up.detach().clone(), whole.down_bias.detach().clone()
    shard_model(gpt_oss, TPGroup(1, 2, None))
    experts = gpt_oss.layers[0].mlp.block.experts
    assert experts.gate_up.shape == (6, 40, 64) and experts.down.shape == (6, 64, 20) and experts.down_bias is None
    assert torch.equal(experts.gate_up[:, :20], gate_up[:, 20:40]) and experts.gate_up_bias.shape == (6, 40)
    gpt_oss = load_model(families("gpt-oss"), torch.float32, "cpu")
    shard_model(gpt_oss, TPGroup(1, 2, None), expert_parallel=True)
    moe = gpt_oss.layers[0].mlp
    assert isinstance(moe, PartialSum) and isinstance(moe.block.experts, LocalExperts)
    local = moe.block.experts
    assert local.start == 3 and torch.equal(local.experts.gate_up, gate_up[3:])
    assert torch.equal(local.experts.down_bias, down_bias[3:])
    deepseek = load_model(families("deepseek-v2-q"), torch.float32, "cpu")
    shard_model(deepseek, TPGroup(1, 2, None))
    a = deepseek.args
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.kv_parts) == (2, 1, 24 + 8, 1)  # latent + RoPE part
    attn = deepseek.layers[0].self_attn
    assert attn.q_b_proj.weight.shape == (2 * 24, 40) and attn.kv_b_proj.weight.shape == (2 * 32, 24)
    assert attn.kv_a_proj_with_mqa.weight.shape == (24 + 8, 64)  # the latent, whole


@pytest.mark.parametrize("name, expert_parallel", [("qwen3-moe", False), ("qwen3-moe", True), ("deepseek-v2", False)])
def test_an_engine_over_two_ranks_equals_transformers_with_experts_and_latent_attention(
        families, hf, name, expert_parallel):
    model_dir = families(name)
    prompts = random_prompts([3, 17, 40, 75, 130], seed=41)
    prompts.append(prompts[3][:48] + prompts[0])  # shares three blocks with the fourth
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(model_dir, dtype="float32", device="cpu", tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
             max_num_batched_tokens=32, num_kv_blocks=16, max_model_len=192) as llm:
        outs = llm.generate(prompts, greedy)
        engine = llm.engine
        assert engine.scheduler.num_preemptions > 0 and engine.kv.prefix_hits > 0
        assert engine.kv.num_free_blocks == engine.num_kv_blocks
        args = engine.runner.model.args
        assert args.num_heads == 2 and engine.runner.kv_cache.shape[-2:] == (args.num_kv_heads, args.head_dim)
        assert args.num_kv_heads == 1  # half of Qwen3-MoE's 2 KV heads; MLA's latent, whole
        if expert_parallel:  # rank 0: experts 0..2 of Qwen3-MoE's 6, whole (its first layer dense)
            assert engine.runner.model.layers[1].mlp.block.experts.experts.gate_up.shape == (3, 2 * 40, 64)
        procs = engine.core.workers.procs
    assert_matches_hf(hf, model_dir, prompts, outs, greedy.max_tokens)
    assert all(p.poll() == 0 for p in procs)


def test_experts_the_ranks_do_not_split_are_refused_naming_the_field(families):
    import dataclasses

    from baton.engine.common.config import read_config
    from baton.engine.worker.models import model_args
    from baton.engine.worker.parallel.tensor_parallel import check_split

    model_dir = families("qwen2-moe")  # 6 experts of 40, a shared one of 56
    with pytest.raises(InvalidArgument, match="do not take 6 experts whole") as err:
        LLM(model_dir, device="cpu", tensor_parallel_size=4, enable_expert_parallel=True)
    assert err.value.field == "enable_expert_parallel"
    with pytest.raises(InvalidArgument) as err:
        LLM(model_dir, device="cpu", tensor_parallel_size=2, enable_expert_parallel="yes")
    assert err.value.field == "enable_expert_parallel"
    args = model_args(read_config(model_dir))
    check_split(args, 4)
    check_split(args, 2, expert_parallel=True)
    for changes, ep, says in (({"moe_intermediate_size": 42}, False, "experts' intermediate size 42"),
                              ({"num_experts": 8, "shared_expert_intermediate_size": 54}, True,  # (split even so)
                               "shared experts' intermediate size 54")):
        with pytest.raises(InvalidArgument, match=says) as err:
            check_split(dataclasses.replace(args, **changes), 4, ep)
        assert err.value.field == "tensor_parallel_size"
    # Spread whole, the experts' intermediate need not divide.
    check_split(dataclasses.replace(args, moe_intermediate_size=42, num_experts=8), 4, expert_parallel=True)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_through_the_router_to_a_decode_of_another_tensor_parallel_size(tiny_llama, prefill_tp, decode_tp):
    """Servers: the handshake trades every rank's layout over gRPC; output equals offline."""
    from helpers import pools_full, wait_serving
    from servers import pd_stack

    prompts = random_prompts([5, 40, 70], seed=13)
    with LLM(tiny_llama, dtype="float32", device="cpu") as llm:
        want = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0,
                                                                           ignore_eos=True))]
    with pd_stack(tiny_llama, prefill=("--tensor-parallel-size", str(prefill_tp)),
                  decode=("--tensor-parallel-size", str(decode_tp))) as ((prefill,), (decode,), router):
        wait_serving(router.address)
        assert greedy_through(router.address, prompts, 8) == want
        assert stats(decode.address).num_blocks_pulled == sum(-(-len(p) // 16) for p in prompts)
        assert pools_full(prefill.address) and pools_full(decode.address)


def test_the_expert_parallel_flag_reaches_the_engine_and_the_stacks_engines(tiny_llama):
    from baton.services.cli.engine_args import engine_argv, engine_config
    from baton.services.cli.main import build_parser

    args = build_parser().parse_args(["serve", "--model", tiny_llama, "--tensor-parallel-size", "2",
                                      "--enable-expert-parallel"])
    assert engine_config(args).enable_expert_parallel and "--enable-expert-parallel" in engine_argv(args)
    plain = build_parser().parse_args(["serve", "--model", tiny_llama])
    assert not engine_config(plain).enable_expert_parallel and "--enable-expert-parallel" not in engine_argv(plain)
