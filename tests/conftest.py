"""Shared fixtures: real checkpoints written to disk, and transformers as the reference."""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time

import pytest
import torch

from baton.engine.common.messages import GetSnapshot
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


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    # Sharded on purpose: the loader must follow model.safetensors.index.json.
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-llama")), "llama", max_shard_size="200KB")


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
    """Greedy continuations from transformers `generate`, one prompt at a time (no padding)."""

    def __init__(self):
        self._models = {}
        self._cache = {}

    def model(self, model_dir: str, dtype=torch.float32, device: str = "cpu"):
        if (model_dir, dtype, device) not in self._models:
            from transformers import AutoModelForCausalLM
            self._models[model_dir, dtype, device] = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=dtype).to(device).eval()
        return self._models[model_dir, dtype, device]

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


class ServerThread:
    """A real Baton server on 127.0.0.1 (a free port), its event loop on a thread of its own,
    so that tests can be plain functions calling it with sync or asyncio clients."""

    def __init__(self, model_dir: str, options: dict | None = None, **engine_args):
        from baton.engine.common.config import EngineConfig
        from baton.services.server.server import Server, ServerOptions

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self.thread.start()
        config = EngineConfig.from_kwargs(model_dir, dtype="float32", device="cpu", **engine_args)
        self.server = self.call(self._make(Server, config, ServerOptions(**{"port": 0, **(options or {})})))
        self.address = self.server.address

    @staticmethod
    async def _make(server_cls, config, options):
        return server_cls(config, options)  # the grpc.aio server binds to the running loop

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> ServerThread:
        self.call(self.server.start())
        return self

    def snapshot(self):
        """The engine core's load and totals (EngineSnapshot), asked over its IPC."""
        return self.call(self.server.core.call(GetSnapshot()))

    def wait_pool_full(self, timeout: float = 10) -> bool:
        """Aborts land at the next step: wait (bounded) until every KV block is free again, no
        request left in the core, none held, none streaming."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.snapshot()
            if (s.num_free_kv_blocks == s.num_kv_blocks and s.num_running == s.num_waiting == s.num_held_requests == 0
                    and self.server.core.num_in_flight == 0):
                return True
            time.sleep(0.02)
        return False

    @contextlib.contextmanager
    def core_stopped(self):
        """The engine core process stopped (SIGSTOP) for the block, as a stuck GPU or a long
        step would hold it: its front must go on answering."""
        pid = self.server.core.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def close(self, grace_s: float = 0) -> None:
        if not self.thread.is_alive():  # closed already
            return
        try:
            self.call(self.server.stop(grace_s))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


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


class ServerProcess:
    """`baton serve` in a process of its own, on 127.0.0.1 and a free port. Starting returns at
    once (so that several load side by side); `address` waits until it serves."""

    def __init__(self, model_dir: str, *flags: str):
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-m", "baton.services.cli", "serve", "--model", model_dir,
                                      "--port", "0", "--dtype", "float32", "--device", "cpu", *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._address: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read_output, daemon=True).start()  # never blocks on a full pipe

    def _read_output(self) -> None:
        for line in self.proc.stdout:  # ends at EOF when the process exits
            self.lines.append(line)
            if self._address is None and line.startswith("serving on "):
                self._address = line.split()[2].rstrip(";")
                self._ready.set()
        self._ready.set()

    @property
    def address(self) -> str:
        if not self._ready.wait(120) or self._address is None:
            self.kill()
            raise RuntimeError("baton serve did not start:\n" + "".join(self.lines))
        return self._address

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode


@contextlib.contextmanager
def pd_stack(model_dir: str, num_prefill: int = 1, num_decode: int = 1, prefill: tuple = (), decode: tuple = (),
             router: tuple = (), common: tuple = ()):
    """Prefill and decode processes (each with the stack's token) and a router in front of
    them: yields (prefills, decodes, router); every process is stopped on exit, also when
    one fails to start. `prefill`, `decode`, `router`: flags of that tier; `common`: of all."""
    from helpers import TOKEN

    common = ("--internal-token", TOKEN, *common)
    with contextlib.ExitStack() as stack:
        def start(*flags: str) -> ServerProcess:
            proc = ServerProcess(model_dir, *flags)
            stack.callback(proc.stop)
            return proc
        prefills = [start("--role", "prefill", *common, *prefill) for _ in range(num_prefill)]
        decodes = [start("--role", "decode", *common, *decode) for _ in range(num_decode)]
        backends = [("--prefill", prefills), ("--decode", decodes)]
        yield prefills, decodes, start("--role", "router", *common, *router, *(
            arg for flag, procs in backends if procs for arg in (flag, ",".join(p.address for p in procs))))


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
    metrics (the telemetry tests')."""
    from helpers import TOKEN, wait_serving

    receiver = trace_receiver
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # the children inherit it: spans arrive within ms
    common = ("--internal-token", TOKEN, "--otlp-traces-endpoint", receiver.endpoint, "--metrics-port", "0",
              "--served-model-name", "tiny-llama")
    prefill = ServerProcess(tiny_llama, "--role", "prefill", "--max-num-batched-tokens", "32", *common)
    decode = ServerProcess(tiny_llama, "--role", "decode", *common)
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
