"""Engines with the real NIXL connector, in one process, and the steps of a handoff between
them, for the disaggregation tests (test_nixl_connector.py, test_nixl_faults.py, test_gpu.py)."""
from __future__ import annotations

import itertools
import time

from baton.engine.common.config import EngineConfig
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.offline.llm_engine import LLMEngine
from baton.kv_transfer.nixl_connector import make_nixl_connector

agent_ids = itertools.count()  # NIXL agent names must be unique among peers, across modules


def nixl_engine(model_dir: str, role: str, hold_timeout_s: float = 60.0, agent=None, name=None,
                load_timeout_s: float = 30.0, **kwargs) -> LLMEngine:
    config = EngineConfig(model=model_dir, **{"dtype": "float32", "device": "cpu", **kwargs})
    name = name or f"{role}-{next(agent_ids)}"  # NIXL agent names must be unique among peers
    return LLMEngine(config, kv_connector=make_nixl_connector(name, config.block_size, hold_timeout_s, agent,
                                                              load_timeout_s))


def connect(prefill: LLMEngine, decode: LLMEngine) -> None:
    """The metadata exchange the services do over gRPC, done directly (every rank of each)."""
    decode.core.add_peer(prefill.core.connector.layout)
    prefill.core.add_peer(decode.core.connector.layout)


def run_prefill(prefill: LLMEngine, prompts, params: list[SamplingParams]) -> list[dict]:
    reqs = [prefill.add_request(f"p{next(agent_ids)}", prompt, SamplingParams(**{**_fields(p), "max_tokens": 1}),
                                hold_for_remote=True)
            for prompt, p in zip(prompts, params)]
    while prefill.has_unfinished_requests():
        prefill.step()
    return [r.kv_handle for r in reqs]


def _fields(p: SamplingParams) -> dict:
    return {name: getattr(p, name) for name in SamplingParams.__slots__}


def run_until_done(*engines, on_step=None, timeout_s=60.0) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout_s  # by time, not steps: an idle step takes microseconds
    while time.monotonic() < deadline:
        busy = False
        for eng in engines:
            if eng.has_unfinished_requests() or eng.num_held_requests:
                busy = True
                for out in eng.step():
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if on_step:
            on_step()
        if not busy:
            return tokens
    state = [(e.scheduler.waiting, e.scheduler.running, e.scheduler.arrivals.held, e.runner.connector._loading,
              e.runner.connector._holds.deadlines) for e in engines]
    raise AssertionError(f"engines did not finish: {state}")  # bounded: never hangs


def assert_pools_full(*engines):
    for eng in engines:
        assert eng.num_held_requests == 0
        assert eng.kv.num_free_blocks == eng.num_kv_blocks


def disaggregated(prefill, decode, prompts, params, on_step=None) -> list[list[int]]:
    handles = run_prefill(prefill, prompts, params)
    ids = []
    for prompt, p, handle in zip(prompts, params, handles):
        req = decode.add_request(f"d{next(agent_ids)}", prompt, p, remote_kv=handle)
        ids.append(req.request_id)
    tokens = run_until_done(prefill, decode, on_step=on_step)
    return [[h.first_token] + tokens.get(r, []) for h, r in zip(handles, ids)]


def assert_images_across_pd_as_colocated(model_dir: str, image: list[int]) -> None:
    """Two prompts with images (one image; two, at the start and the end; `image`: the tokens that
    stand for one in a prompt) through a prefill (32-token chunks) and a decode over NIXL equal a
    colocated engine's. The decode takes the images as a prefill's handle names them, their spans
    without pixels; its encoder must never run, its blocks come over the wire, and both pools end
    full."""
    import msgspec
    import pytest
    from helpers import random_images, random_prompts

    from baton import LLM

    pictures = random_images(9, [(44, 52), (30, 61)])
    texts = random_prompts([11, 23], seed=14)
    prompts = [texts[0][:3] + image + texts[0][3:], image + texts[1] + image]
    images = [[pictures[0]], [pictures[1], pictures[0]]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(model_dir, dtype="float32", device="cpu").generate(
        [{"prompt_token_ids": p, "multi_modal_data": {"image": d}} for p, d in zip(prompts, images)], params)]

    prefill, decode = nixl_engine(model_dir, "prefill", max_num_batched_tokens=32), nixl_engine(model_dir, "decode")
    connect(prefill, decode)
    decode.runner.model.vision.forward = lambda pixels, sizes: pytest.fail("the decode encoded")
    handles = [prefill.add_request(f"p{next(agent_ids)}", p, SamplingParams(max_tokens=1, temperature=0.0),
                                   hold_for_remote=True, images=d) for p, d in zip(prompts, images)]
    while prefill.has_unfinished_requests():
        prefill.step()
    ids = [decode.add_request(f"d{next(agent_ids)}", p, params, remote_kv=r.kv_handle,
                              images=[msgspec.structs.replace(i, pixels=b"") for i in r.images]).request_id
           for p, r in zip(prompts, handles)]
    tokens = run_until_done(prefill, decode)
    assert [[r.kv_handle.first_token] + tokens[i] for r, i in zip(handles, ids)] == want
    assert decode.runner.connector.num_blocks_pulled > 0 and not decode.failed
    assert_pools_full(prefill, decode)


def events_by_request(*engines) -> dict[str, list]:
    out: dict[str, list] = {}
    for eng in engines:
        for ev in eng.take_events().events:
            out.setdefault(ev.request_id, []).append(ev)
    return out


def record_drafts(runner) -> dict[tuple[int, ...], list[int]]:
    """Every draft a runner's proposer makes from now on, by the tokens it follows."""
    proposer = runner.drafting.proposer
    propose, seen = proposer.propose, {}

    def recording(states, k):
        drafts = propose(states, k)
        seen.update((tuple(s.token_ids), d) for s, d in zip(states, drafts) if d)
        return drafts

    proposer.propose = recording
    return seen


def assert_drafts_as_colocated(prompts, want, colocated: dict, drafted: dict) -> set:
    """Every draft the decode made after the same tokens as the colocated engine is the same, each
    request's first decode draft (after its prompt and two tokens) among them; the shared keys."""
    shared = drafted.keys() & colocated.keys()
    assert all(tuple(p + w[:2]) in shared for p, w in zip(prompts, want))
    assert all(drafted[key] == colocated[key] for key in shared)
    return shared


def head_across_pd(model_dir: str, spec: dict, prompts, params: SamplingParams, prefill_tp: int = 1,
                   decode_tp: int = 1, **engine):
    """`prompts` run colocated with a head and by a P/D pair both running it (the head's KV
    shipped with the prompt's; each side over its own ranks): (colocated tokens, P/D tokens,
    colocated drafts, decode drafts (record_drafts), the decode rank 0's KV layout and bytes
    pulled). Pools full after; the engines closed."""
    from baton import LLM

    with LLM(model_dir, dtype="float32", device="cpu", speculative_config=spec, **engine) as llm:
        colocated_drafts = record_drafts(llm.engine.runner)
        want = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.kv.num_free_blocks == llm.engine.num_kv_blocks
    prefill = nixl_engine(model_dir, "prefill", speculative_config=spec, tensor_parallel_size=prefill_tp, **engine)
    decode = nixl_engine(model_dir, "decode", speculative_config=spec, tensor_parallel_size=decode_tp, **engine)
    try:
        connect(prefill, decode)
        decode_drafts = record_drafts(decode.runner)
        got = disaggregated(prefill, decode, prompts, [params] * len(prompts))
        assert_pools_full(prefill, decode)
        reader = decode.core.connector
        layout, pulled = reader.layout, reader.num_bytes_pulled
    finally:
        for eng in (prefill, decode):
            eng.close()
    return want, got, colocated_drafts, decode_drafts, layout, pulled
