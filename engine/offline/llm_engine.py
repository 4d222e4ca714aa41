"""The engine in one process: input processor -> engine core -> output processor, as vLLM v1's
LLMEngine holds its core in-process. The offline API (llm.py) runs on it; a server runs the
same three pieces with the core in a process of its own (core_client.py)."""
from __future__ import annotations

from baton.engine.common.config import EngineConfig
from baton.engine.common.core_messages import AdapterInfo, CoreRequest, LoadAdapter, error_from
from baton.engine.common.errors import InvalidArgument
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.common.stats import EngineSnapshot, StepEvents
from baton.engine.common.tokenizer import load_tokenizer
from baton.engine.core.engine_core import EngineCore
from baton.engine.core.request import Request, RequestStatus
from baton.engine.front.images import image_processor
from baton.engine.front.input_processor import InputProcessor
from baton.engine.front.output_processor import OutputProcessor, StepOutput
from baton.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker, KVHandle


class LLMEngine:
    def __init__(self, config: EngineConfig,
                 kv_connector: tuple[KVConnectorScheduler, KVConnectorWorker] | None = None):
        """`kv_connector`: the scheduler and worker halves of a KV connector, or None (colocated)."""
        self.core = EngineCore(config, kv_connector)
        self.tokenizer = load_tokenizer(config.model)
        facts = self.core.facts()
        self.inputs = InputProcessor(self.tokenizer, facts, image_processor(config.model, self.tokenizer, facts))
        self.outputs = OutputProcessor(self.tokenizer)
        self.failed: list[Exception] = []  # errors of requests the core ended unfinished (step), for the caller

    # The core's parts, for tests and benchmarks.
    config = property(lambda self: self.core.config)
    scheduler = property(lambda self: self.core.scheduler)
    kv = property(lambda self: self.core.kv)
    runner = property(lambda self: self.core.runner)
    num_kv_blocks = property(lambda self: self.core.num_kv_blocks)
    vocab_size = property(lambda self: self.core.vocab_size)
    eos_token_ids = property(lambda self: self.core.eos_token_ids)
    times = property(lambda self: self.core.times)

    def record_events(self) -> None:
        self.core.record_events()

    def take_events(self) -> StepEvents:
        return self.core.take_events()

    def close(self) -> None:
        """Stop what runs beside the steps (EngineCore.close): the tensor-parallel ranks, the KV
        connector, the compiler and copier threads. Twice is once."""
        self.core.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.inputs.tokenize(prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.inputs.apply_chat_template(messages)

    def add(self, request: CoreRequest, detokenize: bool = True) -> Request:
        """Queue a request made by `inputs.core_request`; returns the core's view of it. A grammar is
        compiled first (offline, waiting is fine), so one that does not compile raises here."""
        so = request.sampling_params.structured_output
        if so is not None:
            self.core.grammars.compile(so).result()
        core_request = self.core.add(request)
        self.outputs.add(request, detokenize)
        return core_request

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, detokenize: bool = True,
                    hold_for_remote: bool = False, remote_kv: KVHandle | None = None, adapter: str = "",
                    images: list | None = None) -> Request:
        return self.add(self.inputs.core_request(request_id, prompt, params, priority, arrival_time, hold_for_remote,
                                                 remote_kv, adapter=adapter, images=images), detokenize)

    # ---- LoRA adapters ------------------------------------------------------------------------
    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        info = self.core.load_adapter(LoadAdapter(name, path))
        self.inputs.adapter_loaded(info)
        return info

    def unload_adapter(self, name: str) -> AdapterInfo:
        info = self.core.unload_adapter(name)
        self.inputs.adapter_unloaded(name)
        return info

    def abort_request(self, request_ids) -> list[StepOutput]:
        """Abort live requests; returns the last output of each (finish reason "abort")."""
        return self.outputs.process(self.core.abort(request_ids), self.core.scheduler.last_step_time)[0]

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    @property
    def num_held_requests(self) -> int:
        return self.core.num_held_requests

    def snapshot(self) -> EngineSnapshot:
        return self.core.snapshot()

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """The step's outputs. A request the core ended unfinished (errors.ImagesNotSent) has none:
        its error goes to `failed`."""
        outputs, stopped = self.outputs.process(self.core.step(), self.core.scheduler.last_step_time)
        if stopped:  # ended by a stop string: at once, before the next step
            self.core.abort(stopped)
        for failure in self.core.take_failures():
            self.outputs.drop(failure.key)
            self.failed.append(error_from(failure.error))
        return outputs


__all__ = ["LLMEngine", "StepOutput", "RequestStatus", "InvalidArgument"]
