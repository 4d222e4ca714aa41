"""Tensor parallelism on CPU over gloo. The split model: 2 and 4 ranks (one process each) compute
the logits the whole model does, prefill and decode, every rank alike: heads and KV heads split
(replicated past the KV heads), the MLP's intermediate split, vocabulary-parallel embeddings and
LM head (a vocabulary that does not divide, q/k/v biases, tied embeddings). The engine
(`tensor_parallel_size=2`: rank 0 in the engine's process, rank 1 its own, steps over shared
memory): greedy-equal to transformers batched, chunked, preempted and prefix-cached, with
speculative drafts and a grammar; its pool full after. A rank killed under a server's load ends
its streams UNAVAILABLE and the server non-zero, leaving no process or shared memory behind."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.multiprocessing as mp

from baton.engine.common.errors import InvalidArgument
from baton.services.cli.launcher import free_port

from baton import LLM, SamplingParams

from helpers import assert_matches_hf, random_prompts, stats
from tp_workers import prompt_logits, run_rank


def logits_over(model_dir: str, world: int, prompt: list[int], out) -> list[torch.Tensor]:
    os.makedirs(out, exist_ok=True)
    mp.spawn(run_rank, args=(world, free_port("127.0.0.1"), model_dir, prompt, str(out)), nprocs=world, join=True)
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


def test_what_the_ranks_do_not_split_is_refused_naming_the_field(tiny_llama):
    with pytest.raises(InvalidArgument, match="do not split 4 query and 2 KV heads") as err:
        LLM(tiny_llama, device="cpu", tensor_parallel_size=3)
    assert err.value.field == "tensor_parallel_size"
    for args, field in (({"enable_lora": True}, "enable_lora"), ({"kv_offloading_size": 0.01}, "kv_offloading_size"),
                        ({"tensor_parallel_size": 0}, "tensor_parallel_size")):
        with pytest.raises(InvalidArgument) as err:
            LLM(tiny_llama, device="cpu", **{"tensor_parallel_size": 2, **args})
        assert err.value.field == field


def test_kv_transfer_with_a_tensor_parallel_peer_is_refused_at_the_handshake():
    from baton.kv_transfer.base import KVFormat, KVFormatMismatch

    one = KVFormat("m", "float32", 2, 2, 16, 16, "cpu")
    two = KVFormat("m", "float32", 2, 1, 16, 16, "cpu", tensor_parallel_size=2)
    for mine, theirs in ((one, two), (two, one), (two, two)):
        with pytest.raises(KVFormatMismatch) as err:
            mine.check_peer(theirs)
        assert err.value.field == "tensor_parallel_size"


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_a_rank_killed_under_load_ends_the_streams_unavailable_and_leaves_nothing(spawn, tiny_llama):
    import grpc
    from concurrent.futures import ThreadPoolExecutor

    from baton.services.client import Client

    from test_core_process import alive

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
