"""Shared fixtures: real checkpoints written to disk, and transformers as the reference."""
from __future__ import annotations

import contextlib
import os
import shutil

import pytest
import torch
from leftovers import Garbage, Snapshot
from servers import ServerProcess, ServerThread

from baton.services.cli.demo_models import SMOLLM2_DIR_NAME, prepare_smollm2
from baton.testing.checkpoints import write_tiny_checkpoint

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
if not torch.cuda.is_available():  # the Triton kernels run on CPU tensors, interpreted (read at triton's import)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def require_cpu_kernel() -> None:
    """The CPU attention kernel must build wherever a C++ compiler exists; skip only without one."""
    from baton.kernels import cpu_kernels
    if os.environ.get("BATON_CPU_KERNELS") == "0":
        pytest.skip("BATON_CPU_KERNELS=0")
    if cpu_kernels.load() is None:
        if os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++"):
            pytest.fail("a C++ compiler is present but the CPU kernel did not build (see the log)")
        pytest.skip("no C++ compiler: the CPU kernel falls back to the PyTorch reference")


_garbage = Garbage()


@pytest.fixture(autouse=True, scope="module")
def _nothing_left_by_the_module(request):
    """A module's tests and fixtures stop the processes and non-daemon threads they started
    (leftovers.py); checked once its fixtures are torn down, this one being set up before them
    and torn down after."""
    before = Snapshot(f"module {request.module.__name__}")
    yield
    if (message := before.left_behind(with_threads=True)) is not None:
        pytest.fail(message, pytrace=False)


@pytest.fixture(autouse=True)
def _nothing_left_by_the_test(request):
    """A test and its function fixtures stop the processes they started (engine cores, servers,
    tensor-parallel ranks): whatever ran at setup (a module's servers included) is not the test's.
    Its threads are checked at the module's end. Then the garbage, where the process grew
    (leftovers.Garbage)."""
    before = Snapshot(request.node.nodeid)
    yield
    _garbage.maybe_collect()
    message = before.left_behind(with_threads=False)
    before.note_threads()
    if message is not None:
        pytest.fail(message, pytrace=False)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    # Sharded on purpose: the loader must follow model.safetensors.index.json.
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-llama")), "llama", max_shard_size="200KB")


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory) -> str:
    """A one-layer Llama with the tiny checkpoints' tokenizer: a draft of its own weights."""
    from baton.testing.checkpoints import write_random_checkpoint

    return write_random_checkpoint(str(tmp_path_factory.mktemp("draft")), "LlamaConfig", seed=3, hidden_size=32,
                                   intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                                   num_hidden_layers=1, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-qwen2")), "qwen2")


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request, tiny_llama, tiny_qwen2) -> str:
    return {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param]


@pytest.fixture(scope="session")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    """Three PEFT adapters of tiny_llama (lora_adapters.ADAPTERS: ranks 4, 8 and 16)."""
    from lora_adapters import write_adapters
    return write_adapters(tiny_llama, str(tmp_path_factory.mktemp("adapters")))


@pytest.fixture(scope="session")
def peft_ref(tiny_llama):
    """transformers + PEFT greedy continuations of tiny_llama with an adapter (or without)."""
    from lora_adapters import PeftReference
    return PeftReference(tiny_llama)


@pytest.fixture(scope="session")
def smollm2() -> str:
    models_dir = os.environ.get("BATON_MODELS_DIR", os.path.join(os.path.dirname(__file__), "..", "models"))
    return prepare_smollm2(os.path.join(models_dir, SMOLLM2_DIR_NAME))


class HFReference:
    """Greedy continuations from transformers `generate`, one prompt at a time (no padding).
    Every result is kept for the session; the models only up to `keep_bytes` of weights, the
    least recently used let go first (the tiny checkpoints stay; SmolLM2's half GiB does not
    outlive the tests that use it)."""

    def __init__(self, keep_bytes: int = 128 << 20):
        self._models = {}
        self._cache = {}
        self.keep_bytes = keep_bytes

    def model(self, model_dir: str, dtype=torch.float32, device: str = "cpu"):
        key = (model_dir, dtype, device)
        model, size = self._models.pop(key, (None, 0))
        if model is None:
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
            size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        self._models[key] = model, size  # (model, its weights' bytes), the last used last
        while len(self._models) > 1 and sum(size for _, size in self._models.values()) > self.keep_bytes:
            del self._models[next(iter(self._models))]
        return model

    def greedy(self, model_dir: str, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = False,
               dtype=torch.float32, device: str = "cpu") -> list[int]:
        key = (model_dir, tuple(prompt_ids), max_new_tokens, stop_at_eos, dtype, device)
        if key not in self._cache:
            model = self.model(model_dir, dtype, device)
            ids = torch.tensor([prompt_ids], device=device)
            extra = {} if stop_at_eos else {"eos_token_id": None, "min_new_tokens": max_new_tokens}
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     do_sample=False, pad_token_id=0, **extra)
            self._cache[key] = out[0, len(prompt_ids):].tolist()
        return self._cache[key]


@pytest.fixture(scope="session")
def hf() -> HFReference:
    return HFReference()


@pytest.fixture
def serve():
    """serve(model_dir, options=None, **engine_args) -> a started ServerThread; all are
    stopped at teardown, also when the test fails."""
    servers = []

    def start(model_dir: str, options: dict | None = None, **engine_args) -> ServerThread:
        server = ServerThread(model_dir, options, **engine_args)
        servers.append(server)
        return server.start()

    yield start
    with contextlib.ExitStack() as stack:  # every one is closed, even when one of them fails to
        for server in servers:
            stack.callback(server.close)


@pytest.fixture
def spawn():
    """spawn(model_dir, *flags) -> a ServerProcess; all are stopped at teardown."""
    procs = []

    def start(model_dir: str, *flags: str) -> ServerProcess:
        proc = ServerProcess(model_dir, *flags)
        procs.append(proc)
        return proc

    yield start
    with contextlib.ExitStack() as stack:
        for proc in procs:
            stack.callback(proc.stop)


@pytest.fixture(scope="module")
def trace_receiver():
    """An OTLP receiver in the test process (trace_view.TraceReceiver), for a module's tests."""
    from baton.services.telemetry.trace_view import TraceReceiver

    r = TraceReceiver()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def traced_stack(tiny_llama, trace_receiver):
    """Router, prefill and decode processes, every one tracing to the receiver and serving
    metrics (the telemetry tests'); the decode speculates (n-gram drafts)."""
    from helpers import TOKEN, wait_serving

    receiver = trace_receiver
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # the children inherit it: spans arrive within ms
    common = ("--internal-token", TOKEN, "--otlp-traces-endpoint", receiver.endpoint, "--metrics-port", "0",
              "--served-model-name", "tiny-llama")
    prefill = ServerProcess(tiny_llama, "--role", "prefill", "--max-num-batched-tokens", "32", *common)
    decode = ServerProcess(tiny_llama, "--role", "decode", "--speculative-config",
                           '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}', *common)
    procs = [prefill, decode]
    try:
        router = ServerProcess(tiny_llama, "--role", "router", "--prefill", prefill.address, "--decode",
                               decode.address, *common)
        procs.insert(0, router)
        wait_serving(router.address)
        yield router, prefill, decode
    finally:
        os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
        for p in procs:
            p.stop()
