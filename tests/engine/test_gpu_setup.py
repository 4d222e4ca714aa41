"""What the GPU path decides on the host, checked without a GPU: the KV cache's share of
memory under gpu_memory_utilization, the dummy step that measures the largest step, the
attention backend, and the devices `baton up` gives its engines."""
from __future__ import annotations

import os
import time
import weakref

import pytest
import torch
from helpers import TOKEN
from torch.utils._python_dispatch import TorchDispatchMode

from baton.engine.common.config import EngineConfig
from baton.engine.common.errors import InvalidArgument
from baton.engine.worker.attention_backend import choose_backend
from baton.engine.worker.loader import load_model
from baton.engine.worker.memory import kv_cache_bytes, profile_batch
from baton.engine.worker.model_runner import ModelRunner
from baton.services.cli.launcher import build_stack, free_port
from baton.services.cli.placement import Placement, place_engines
from baton.services.rpc.health import is_serving

GIB = 1 << 30


class LiveBytes(TorchDispatchMode):
    """The most bytes of tensors torch's operators allocated and held at once (what a device's
    allocator would have had to find), counted as they are made and freed. A tensor set onto
    storage that exists already (safetensors maps the file) allocates nothing."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()  # storages counted, by address
        self._mapped: set[int] = set()  # storages made elsewhere (the checkpoint's file)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if func.overloadpacket is torch.ops.aten.set_:
                self._mapped.add(ptr)
            elif ptr not in self._seen and ptr not in self._mapped:
                self._seen.add(ptr)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, ptr, storage.nbytes())
        return out

    def _freed(self, ptr: int, nbytes: int) -> None:
        self._seen.discard(ptr)
        self.live -= nbytes


def test_a_bf16_model_is_built_in_bf16_never_in_float32_first(tiny_llama):
    with LiveBytes() as held:
        model = load_model(tiny_llama, torch.bfloat16, "cpu")
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # Built in float32 and cast, it would peak at 3x (both copies alive during the cast).
    assert held.peak <= 1.05 * size, (held.peak, size)


def test_kv_cache_gets_what_the_share_leaves():
    # 80 GiB device, 0.9 of it: 72 GiB, less 16 of weights, 3 of activations, 1 outside torch.
    assert kv_cache_bytes(80 * GIB, 79 * GIB, 0.9, 16 * GIB, 3 * GIB, 1 * GIB, "cuda:0") == 52 * GIB
    # A negative "outside torch" (another process freed memory meanwhile) counts as none.
    assert kv_cache_bytes(80 * GIB, 79 * GIB, 0.5, 16 * GIB, 3 * GIB, -GIB, "cuda:0") == 21 * GIB


def test_a_share_larger_than_the_free_memory_is_refused_naming_the_field():
    # Another engine holds 40 GiB of the device: 0.9 of it cannot be had.
    with pytest.raises(InvalidArgument, match=r"gpu_memory_utilization: 0.9 of cuda:1 is 72.00 GiB, but only 40.00"):
        kv_cache_bytes(80 * GIB, 40 * GIB, 0.9, GIB, GIB, 0, "cuda:1")


def test_a_share_the_weights_fill_is_refused_naming_the_field():
    with pytest.raises(InvalidArgument, match="gpu_memory_utilization: .*leaves nothing for the KV cache"):
        kv_cache_bytes(80 * GIB, 80 * GIB, 0.2, 15 * GIB, 2 * GIB, 0, "cuda:0")


@pytest.mark.parametrize("value", [0, 1.5, -0.1, "0.5"])
def test_bad_utilization_is_named(tiny_llama, value):
    with pytest.raises(InvalidArgument, match="gpu_memory_utilization: must be in"):
        EngineConfig(tiny_llama, gpu_memory_utilization=value)


def test_unknown_backend_is_named(tiny_llama):
    with pytest.raises(InvalidArgument, match="attention_backend: must be one of auto, cpu, triton, torch"):
        EngineConfig(tiny_llama, attention_backend="flash")


@pytest.mark.parametrize("budget,seqs,max_len", [(2048, 64, 1024), (100, 64, 1024), (5000, 3, 1024), (48, 4, 16)])
def test_the_profile_step_is_the_largest_the_scheduler_may_emit(tiny_llama, budget, seqs, max_len):
    config = EngineConfig(tiny_llama, max_num_batched_tokens=budget, max_num_seqs=seqs, max_model_len=max_len)
    sched, num_blocks = profile_batch(config)
    lengths = [len(r.token_ids) for r in sched.scheduled_new_reqs]
    assert sum(lengths) == sched.total_num_scheduled_tokens == min(budget, seqs * max_len)
    assert len(lengths) == min(seqs, sum(lengths)) and max(lengths) <= max_len and min(lengths) >= 1
    # The first carries prompt logprobs over a full chunk of rows where it can; the rest even.
    assert lengths[0] >= min(257, max_len, sum(lengths) - len(lengths) + 1)
    assert max(lengths[1:], default=1) - min(lengths[1:], default=1) <= 1
    first, *rest = sched.scheduled_new_reqs
    assert first.sampling_params.prompt_logprobs and all(r.sampling_params.prompt_logprobs is None for r in rest)
    assert all(r.sampling_params.logprobs == 20 and r.sampling_params.min_p > 0 for r in sched.scheduled_new_reqs)
    blocks = [b for r in sched.scheduled_new_reqs for (group,) in [r.block_ids] for b in group]  # one KV cache group
    assert sorted(blocks) == list(range(num_blocks))  # each request its own blocks, none shared
    assert all(len(r.block_ids[0]) * config.block_size >= len(r.token_ids) for r in sched.scheduled_new_reqs)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_the_profile_step_runs_on_each_backend(tiny_llama, backend):
    """The dummy step goes through the real runner (here on CPU; on a GPU before the pool is
    sized): every prompt gets its sampled token."""
    if backend == "triton":
        pytest.importorskip("triton")
    config = EngineConfig(tiny_llama, dtype="float32", device="cpu", max_num_batched_tokens=100, max_num_seqs=7,
                          max_model_len=64, attention_backend=backend if backend != "cpu" else "auto")
    sched, num_blocks = profile_batch(config)
    runner = ModelRunner(load_model(tiny_llama, torch.float32, "cpu"), config, num_blocks, frozenset())
    if backend == "cpu" and runner.attention_backend != "cpu":
        pytest.skip("the CPU kernel did not build here")
    out = runner.execute_model(sched)
    assert sorted(out.sampled_token_ids) == sorted(r.req_id for r in sched.scheduled_new_reqs)
    assert list(out.prompt_logprobs) == ["profile-0"]


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InvalidArgument, match=r"attention_backend: triton runs on CUDA, or on CPU under Triton's"):
        choose_backend("triton", torch.float32, torch.device("cpu"), 4, 2, 16)
    assert choose_backend("auto", torch.float32, torch.device("cpu"), 4, 2, 16) in ("cpu", "torch")
    assert choose_backend("torch", torch.float32, torch.device("cpu"), 4, 2, 16) == "torch"


def test_the_cpu_kernel_asked_for_where_it_cannot_run_is_named():
    with pytest.raises(InvalidArgument, match="attention_backend: the CPU kernel cannot run torch.float16"):
        choose_backend("cpu", torch.float16, torch.device("cpu"), 4, 2, 16)


PD = ["prefill", "decode"]


@pytest.mark.parametrize("gpus,device,tiers,want", [
    (2, None, {}, [Placement("cuda:0"), Placement("cuda:1")]),  # one GPU per tier
    (1, None, {}, [Placement("cuda:0", True, 0.45)] * 2),  # one GPU: shared, the share split
    (0, None, {}, [Placement(None)] * 2),  # CPU: the engines' default
    (2, "auto", {}, [Placement("cuda:0"), Placement("cuda:1")]),
    (2, "cuda", {}, [Placement("cuda:0", True, 0.45)] * 2),  # --device for every tier
    (4, None, {"decode": "cuda:2"}, [Placement("cuda:0"), Placement("cuda:2")]),
    (1, "cpu", {"decode": "cuda"}, [Placement("cpu"), Placement("cuda:0")]),
])
def test_each_engine_gets_a_device(gpus, device, tiers, want):
    assert place_engines(PD, device, tiers, gpus) == want


def test_a_tiers_devices_are_taken_in_turn_and_a_shared_one_splits_the_given_share():
    got = place_engines(["prefill", "decode", "decode", "decode"], None, {"decode": "cuda:1, cuda:2"}, 4, 0.8)
    assert got == [Placement("cuda:0"), Placement("cuda:1", True, 0.4), Placement("cuda:2"),
                   Placement("cuda:1", True, 0.4)]
    assert got[1].argv() == ["--device", "cuda:1", "--gpu-memory-utilization", "0.4"]
    assert got[0].argv() == ["--device", "cuda:0"] and Placement(None).argv() == []


@pytest.mark.parametrize("device,tiers,message", [
    ("cuda", {}, "--device cuda: 0 GPUs visible"),
    (None, {"prefill": "cuda:0,cuda:1"}, "--prefill-device cuda:1: 1 GPU visible"),
    (None, {"decode": "tpu:0"}, "--decode-device tpu:0: must be cpu, cuda or cuda:N"),
])
def test_a_device_that_is_not_there_is_named(device, tiers, message):
    gpus = 1 if tiers.get("prefill") else 0
    with pytest.raises(ValueError, match=message):
        place_engines(PD, device, tiers, gpus)


def test_engines_sharing_a_gpu_start_and_restart_one_at_a_time(tiny_llama):
    """Each measures its memory use with no other loading beside it, at the start and when
    both died and come back. (On CPU here: the placement only orders the starts.)"""
    stack = build_stack(tiny_llama, "127.0.0.1", free_port("127.0.0.1"), 0, 2,
                        ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64"], "round_robin")
    router, first, second = stack.services
    first.placement = second.placement = Placement("cuda:0", True, 0.45)

    def loading(s) -> bool:
        return s.proc is not None and s.proc.poll() is None and not is_serving(s.address, 0.2)
    try:
        stack.start(dict(os.environ, BATON_INTERNAL_TOKEN=TOKEN))
        assert router.proc is not None and first.proc is not None and second.proc is None
        stack.wait_serving(120)
        assert second.proc is not None and second.proc.poll() is None
        assert second.started_at - first.started_at > 0.5  # the first loaded the model meanwhile
        for s in (first, second):
            s.proc.kill()
            s.proc.wait()
        deadline, both_loading = time.monotonic() + 120, False
        while time.monotonic() < deadline:
            assert stack.supervise() is None
            both_loading |= loading(first) and loading(second)
            if all(s.restart_at is None and s.proc.poll() is None and is_serving(s.address, 0.2)
                   for s in (first, second)):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the two engines did not both come back")
        assert not both_loading
    finally:
        stack.stop(0)
    assert all(s.proc.poll() is not None for s in stack.services)


def test_the_benchs_random_checkpoints_load_in_baton_and_transformers_alike(tmp_path, hf):
    """bench/random_checkpoint.py writes the Llama-3-shaped random models the GPU throughput
    bench runs; at a tiny shape, Baton's greedy output equals transformers' on it."""
    import sys
    from pathlib import Path

    from baton import LLM, SamplingParams

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    try:
        from random_checkpoint import write_random_checkpoint
    finally:
        sys.path.pop(0)
    model = write_random_checkpoint(str(tmp_path / "random-tiny"), "tiny")
    prompt = [5, 900, 17, 333, 999, 4, 12]  # ids beyond the small tokenizer's vocabulary included
    out = LLM(model, dtype="float32", device="cpu").generate([prompt], SamplingParams(max_tokens=12, temperature=0,
                                                                                      ignore_eos=True))[0]
    assert out.token_ids == hf.greedy(model, prompt, 12)


def test_plain_cuda_and_auto_resolve_to_the_current_device_index(tiny_llama, monkeypatch):
    """torch.cuda.set_device refuses a device without an index: the config gives it one."""
    def resolved(device: str) -> str:
        config = EngineConfig(model=tiny_llama, device=device)
        config.resolve_device()
        return config.device

    assert resolved("auto") == resolved("cpu") == "cpu"  # no GPU here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolved("cuda") == resolved("auto") == "cuda:1"
    assert resolved("cuda:0") == "cuda:0"
    with pytest.raises(InvalidArgument, match=r"^device: cuda:2 was asked for but 2 GPU\(s\) are visible") as err:
        resolved("cuda:2")
    assert err.value.field == "device"


def test_heads_wider_than_the_triton_kernels_take_fall_back_or_are_refused():
    """A 576-wide head overflows the generic Triton kernels' shared memory (seen on an H100): auto
    falls back to the reference on a GPU; asking for triton is refused, naming the field. MLA's
    latent of that width has a kernel of its own (kernels/triton_mla.py): Triton takes it."""
    from baton.engine.worker.attention_backend import choose_backend

    pytest.importorskip("triton")
    assert choose_backend("auto", torch.bfloat16, torch.device("cuda"), 16, 1, 576) == "torch"
    assert choose_backend("auto", torch.bfloat16, torch.device("cuda"), 16, 1, 256) == "triton"
    with pytest.raises(InvalidArgument, match="heads of at most 256") as err:
        choose_backend("triton", torch.float32, torch.device("cpu"), 16, 1, 576)
    assert err.value.field == "attention_backend"
    assert choose_backend("auto", torch.bfloat16, torch.device("cuda"), 16, 1, 576, latent=True) == "triton"
