"""The KV connector seam, end to end in one process.

A prefill engine computes the prompt, samples the first token and holds its blocks; a decode
engine parks the request in WAITING_FOR_REMOTE_KVS while its connector copies those blocks,
then decodes. The transport here is a plain tensor copy between the two engines' real KV
caches, a connector written from kv_transfer/base.py alone (the servers plug NIXL's); the
output must equal transformers'.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from helpers import random_prompts

from baton.engine.common.config import EngineConfig
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.core.request import RequestStatus
from baton.engine.offline.llm_engine import LLMEngine
from baton.kv_transfer.base import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVHandle,
)


@dataclass(slots=True)
class CopyMeta(KVConnectorMetadata):
    """A step's copies: (request id, local block ids, remote connector, remote block ids, remote id)."""
    copies: list[tuple] = field(default_factory=list)


class CopyConnector(KVConnectorScheduler, KVConnectorWorker):
    """Both halves in one object: enough for two engines in one process (a handle's engine id
    names the connector whose cache holds the blocks)."""
    by_id: dict[str, CopyConnector] = {}

    def __init__(self, block_size: int):
        self.engine_id = f"copy-{len(self.by_id)}"
        self.by_id[self.engine_id] = self
        self.block_size = block_size
        self.kv_cache = None
        self.pending = CopyMeta()  # copies for the next step
        self.in_flight: set[str] = set()  # copied, reported one step later like a real transfer
        self.done = KVConnectorOutput()

    # scheduler half
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        handle = request.remote_kv
        if handle is None:
            return 0, False
        return handle.num_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if num_external_tokens:
            handle = request.remote_kv
            first = (handle.num_tokens - num_external_tokens) // self.block_size
            last = -(-handle.num_tokens // self.block_size)
            self.pending.copies.append((request.request_id, block_ids[0][first:last], self.by_id[handle.engine_id],
                                        handle.block_ids[first:last], handle.request_id))

    def build_connector_meta(self, scheduler_output):
        meta, self.pending = self.pending, CopyMeta()
        return meta

    def request_finished(self, request, block_ids):
        if not request.hold_for_remote:
            return False, None
        return True, KVHandle(self.engine_id, request.request_id, block_ids[0], request.num_prompt_tokens,
                              request.output_token_ids[0])

    # worker half
    def register_kv_caches(self, kv_cache, kv_format, host_cache=None, draft_cache=None, convert=None):
        self.kv_cache = kv_cache

    def start_load_kv(self, metadata):
        for req_id, local, source, remote, remote_req_id in metadata.copies if metadata is not None else ():
            self.kv_cache[local] = source.kv_cache[remote]
            self.in_flight.add(req_id)
            source.done.finished_sending.add(remote_req_id)

    def get_finished(self):
        done, self.done = self.done, KVConnectorOutput(finished_recving=self.in_flight)
        self.in_flight = set()
        return done

    def release(self, request_id):
        self.done.finished_sending.add(request_id)

    def add_peer(self, layout):  # one process: every engine is known through by_id
        pass

    def close(self):
        self.by_id.pop(self.engine_id, None)


def engine(model_dir, **kwargs):
    config = EngineConfig(model=model_dir, dtype="float32", device="cpu", **kwargs)
    connector = CopyConnector(config.block_size)
    return LLMEngine(config, kv_connector=(connector, connector))


def run(eng, on_step=None):
    tokens = {}
    while eng.has_unfinished_requests() or eng.num_held_requests:
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if on_step:
            on_step()
    return tokens


def test_disaggregated_through_the_seam_equals_transformers(tiny_model, hf):
    prompts = random_prompts([5, 40, 77, 16], seed=21)
    prompts.append(prompts[2])  # the decode side hits its own prefix cache for part of it
    prefill = engine(tiny_model, max_num_batched_tokens=32)
    decode = engine(tiny_model)
    handles = []
    for i, prompt in enumerate(prompts):
        req = prefill.add_request(f"p{i}", prompt, SamplingParams(max_tokens=1, temperature=0),
                                  hold_for_remote=True)
        handles.append(req)
    while prefill.has_unfinished_requests():
        prefill.step()
    assert prefill.num_held_requests == len(prompts)  # blocks pinned for the decode side
    seen_waiting = set()

    def watch():
        seen_waiting.update(r.request_id for r in decode.scheduler.waiting
                            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS)

    outputs = {}
    for i, (prompt, req) in enumerate(zip(prompts, handles)):
        handle = req.kv_handle
        # The first token came from the prefill engine: an output already, so 19 more follow.
        decoding = decode.add_request(f"d{i}", prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                                      remote_kv=handle)
        assert decoding.output_token_ids == [handle.first_token]
        watch()
        outputs.update(run(decode, watch))  # one at a time, so the repeat can hit the cache
    assert decoding.num_cached_tokens == 64  # the repeat: 4 blocks local, the 5th pulled from prefill
    for i, (prompt, req) in enumerate(zip(prompts, handles)):
        first = req.kv_handle.first_token
        assert [first] + outputs[f"d{i}"] == hf.greedy(tiny_model, prompt, 20), f"prompt {i}"
    assert seen_waiting == {f"d{i}" for i in range(len(prompts))}
    run(prefill)  # reports the finished sends: held blocks are freed
    assert prefill.num_held_requests == 0
    assert prefill.kv.num_free_blocks == prefill.num_kv_blocks
    assert decode.kv.num_free_blocks == decode.num_kv_blocks


def test_two_checkpoints_pair_only_where_one_side_names_the_other_and_the_wire_carries_it():
    """Another quantization of the same model (accept_kv_from): either side naming the other's
    fingerprint pairs them; nobody naming it is refused naming `model`. The list crosses the
    handshake's wire as it is."""
    from baton.kv_transfer.base import KVFormat, KVFormatMismatch, KVLayout
    from baton.services.rpc.kv_wire import layout_from_proto, layout_to_proto

    def fmt(model: str, accepts: tuple[str, ...] = ()) -> KVFormat:
        return KVFormat(model, "float32", 2, 2, 16, 16, "cpu", accepts_models=accepts)

    with pytest.raises(KVFormatMismatch) as err:
        fmt("a").check_peer(fmt("b"))
    assert err.value.field == "model" and "accept_kv_from" in str(err.value)
    fmt("a", ("b",)).check_peer(fmt("b"))
    fmt("a").check_peer(fmt("b", ("a",)))
    with pytest.raises(KVFormatMismatch):
        fmt("a", ("c",)).check_peer(fmt("b", ("d",)))
    layout = KVLayout("e1", b"meta", 4096, 64, 8, "DRAM", 0, fmt("a", ("b", "c")))
    assert layout_from_proto(layout_to_proto(layout)).format == layout.format
