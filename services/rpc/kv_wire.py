"""The KV seam's types on the wire, each conversion with its inverse beside it: tiers, handles
(a prefill gives one out in its PrefillResponse; a decode takes it in its GenerateRequest) and
layouts (traded at the KV handshake)."""
from __future__ import annotations

from baton.engine.common.core_messages import ImageInput
from baton.kv_transfer.base import KVFormat, KVHandle, KVLayout, KVTier
from baton.v1 import generate_pb2 as pb
from baton.v1 import internal_pb2

TIER_TO_WIRE = {KVTier.DEVICE: pb.KV_TIER_DEVICE, KVTier.HOST: pb.KV_TIER_HOST}
TIER_FROM_WIRE = {wire: tier for tier, wire in TIER_TO_WIRE.items()}


def handle_to_proto(handle: KVHandle, address: str, trace_context: dict[str, str], images: list[ImageInput] = ()
                    ) -> pb.KVHandle:
    """`address`: the prefill server's, where a router releases the hold; `trace_context`: the
    hold's span, which the decode's transfer span follows; `images`: the prompt's (their spans go,
    never their pixels)."""
    return pb.KVHandle(engine_id=handle.engine_id, address=address, request_id=handle.request_id,
                       block_ids=handle.block_ids, num_tokens=handle.num_tokens, first_token=handle.first_token,
                       hold_seconds=handle.hold_s, tier=TIER_TO_WIRE[handle.tier], trace_context=trace_context,
                       draft_start=handle.draft_start if handle.draft_start >= 0 else None,
                       images=[pb.ImageSpan(digest=i.digest, offset=i.offset, length=i.length, shape=i.shape)
                               for i in images])


def handle_from_proto(h: pb.KVHandle) -> KVHandle:
    return KVHandle(h.engine_id, h.request_id, list(h.block_ids), h.num_tokens, h.first_token, h.hold_seconds,
                    TIER_FROM_WIRE.get(h.tier, KVTier.DEVICE), h.draft_start if h.HasField("draft_start") else -1)


def image_spans_from_proto(h: pb.KVHandle) -> list[ImageInput]:
    """A handle's image spans, as images without pixels (errors.ImagesNotSent)."""
    return [ImageInput(i.digest, i.offset, i.length, b"", list(i.shape)) for i in h.images]


def layout_to_proto(layout: KVLayout) -> internal_pb2.KVLayout:
    f = layout.format
    return internal_pb2.KVLayout(
        engine_id=layout.engine_id, agent_metadata=layout.agent_metadata, base_addr=layout.base_addr,
        block_bytes=layout.block_bytes, num_blocks=layout.num_blocks, mem_type=layout.mem_type, dev_id=layout.dev_id,
        host_base_addr=layout.host_base_addr, host_num_blocks=layout.host_num_blocks,
        format=internal_pb2.KVFormat(model=f.model, dtype=f.dtype, num_layers=f.num_layers, num_kv_heads=f.num_kv_heads,
                                     head_size=f.head_size, block_size=f.block_size,
                                     attention_backend=f.attention_backend, attention=f.attention,
                                     kv_groups=[internal_pb2.KVCacheGroup(layers=layers, window=window)
                                                for layers, window in zip(f.kv_groups, f.kv_windows, strict=True)],
                                     tensor_parallel_size=f.tensor_parallel_size, draft_method=f.draft_method,
                                     draft_model=f.draft_model, draft_kv=f.draft_kv,
                                     accepts_models=f.accepts_models),
        ranks=[layout_to_proto(rank) for rank in layout.ranks], draft_base_addr=layout.draft_base_addr,
        draft_block_bytes=layout.draft_block_bytes)


def layout_from_proto(msg: internal_pb2.KVLayout) -> KVLayout:
    f = msg.format
    return KVLayout(msg.engine_id, msg.agent_metadata, msg.base_addr, msg.block_bytes, msg.num_blocks,
                    msg.mem_type, msg.dev_id, KVFormat(f.model, f.dtype, f.num_layers, f.num_kv_heads, f.head_size,
                                                       f.block_size, f.attention_backend,
                                                       tuple(tuple(g.layers) for g in f.kv_groups),
                                                       tuple(g.window for g in f.kv_groups), f.attention,
                                                       f.tensor_parallel_size or 1, f.draft_method, f.draft_model,
                                                       tuple(f.draft_kv), tuple(f.accepts_models)),
                    msg.host_base_addr, msg.host_num_blocks, msg.draft_base_addr, msg.draft_block_bytes,
                    [layout_from_proto(rank) for rank in msg.ranks])
