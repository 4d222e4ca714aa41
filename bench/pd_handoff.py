"""A prefill and a decode engine in this process, wired over NIXL as the services wire them, and
timed handoffs of one prompt between them: the handoff benchmarks' shared part
(bench/tensor_parallel.py, bench/fp8_kv.py)."""
from __future__ import annotations

import torch

from baton.engine.common.config import EngineConfig
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.offline.llm_engine import LLMEngine


def pd_pair(model: str, name: str, prefill: dict, decode: dict,
            threads: dict[str, int] | None = None) -> tuple[LLMEngine, LLMEngine]:
    """Engines of `model` (float32 on CPU, no prefix caching: every handoff moves every block), each
    with its role's EngineConfig fields and torch threads while it is built (a tensor-parallel one
    sets its own), peers of each other."""
    from baton.kv_transfer.nixl_connector import make_nixl_connector

    sides = []
    for role, fields in (("prefill", prefill), ("decode", decode)):
        if threads:
            torch.set_num_threads(threads[role])
        config = EngineConfig(model=model, dtype="float32", device="cpu", max_model_len=4096,
                              enable_prefix_caching=False, **fields)
        sides.append(LLMEngine(config, kv_connector=make_nixl_connector(f"bench-{name}-{role}", 16)))
    first, second = sides
    second.core.add_peer(first.core.connector.layout)
    first.core.add_peer(second.core.connector.layout)
    return first, second


def timed_handoffs(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], count: int) -> list[float]:
    """`count` handoffs of `prompt` (the first registers the staging buffers it needs; the next
    find them registered): each load's milliseconds as the decode recorded them, started ->
    every rank's part landed."""
    from baton.engine.common.stats import EventType

    times = []
    for i in range(count):
        req = prefill.add_request(f"p{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_for_remote=True)
        while prefill.has_unfinished_requests():
            prefill.step()
        decode.record_events()
        decode.add_request(f"d{i}", prompt, SamplingParams(max_tokens=2, temperature=0.0), remote_kv=req.kv_handle)
        while decode.has_unfinished_requests() or prefill.num_held_requests:
            decode.step()
            prefill.step()
        load = next(e.transfer for e in decode.take_events().events if e.type == EventType.KV_LOAD_END)
        times.append(1e3 * (load.end_time - load.start_time))
    return times


def close(*engines: LLMEngine) -> None:
    for engine in engines:
        engine.core.close()
        engine.core.connector.close()
