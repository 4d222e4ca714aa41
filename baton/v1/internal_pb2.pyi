from baton.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_KIND_UNSPECIFIED: _ClassVar[KVEventKind]
    KV_EVENT_KIND_STORED: _ClassVar[KVEventKind]
    KV_EVENT_KIND_REMOVED: _ClassVar[KVEventKind]
    KV_EVENT_KIND_TIER_MOVED: _ClassVar[KVEventKind]
    KV_EVENT_KIND_ALL_CLEARED: _ClassVar[KVEventKind]

class FramesService(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FRAMES_SERVICE_UNSPECIFIED: _ClassVar[FramesService]
    FRAMES_SERVICE_GENERATE: _ClassVar[FramesService]
    FRAMES_SERVICE_PREFILL: _ClassVar[FramesService]
KV_EVENT_KIND_UNSPECIFIED: KVEventKind
KV_EVENT_KIND_STORED: KVEventKind
KV_EVENT_KIND_REMOVED: KVEventKind
KV_EVENT_KIND_TIER_MOVED: KVEventKind
KV_EVENT_KIND_ALL_CLEARED: KVEventKind
FRAMES_SERVICE_UNSPECIFIED: FramesService
FRAMES_SERVICE_GENERATE: FramesService
FRAMES_SERVICE_PREFILL: FramesService

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("handle", "first")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    handle: _generate_pb2.KVHandle
    first: _generate_pb2.GenerateResponse
    def __init__(self, handle: _Optional[_Union[_generate_pb2.KVHandle, _Mapping]] = ..., first: _Optional[_Union[_generate_pb2.GenerateResponse, _Mapping]] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("engine_id", "agent_metadata", "base_addr", "block_bytes", "num_blocks", "mem_type", "dev_id", "format", "host_base_addr", "host_num_blocks", "ranks", "draft_base_addr", "draft_block_bytes")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEV_ID_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    HOST_BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    HOST_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    agent_metadata: bytes
    base_addr: int
    block_bytes: int
    num_blocks: int
    mem_type: str
    dev_id: int
    format: KVFormat
    host_base_addr: int
    host_num_blocks: int
    ranks: _containers.RepeatedCompositeFieldContainer[KVLayout]
    draft_base_addr: int
    draft_block_bytes: int
    def __init__(self, engine_id: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., base_addr: _Optional[int] = ..., block_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., mem_type: _Optional[str] = ..., dev_id: _Optional[int] = ..., format: _Optional[_Union[KVFormat, _Mapping]] = ..., host_base_addr: _Optional[int] = ..., host_num_blocks: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[KVLayout, _Mapping]]] = ..., draft_base_addr: _Optional[int] = ..., draft_block_bytes: _Optional[int] = ...) -> None: ...

class KVFormat(_message.Message):
    __slots__ = ("model", "dtype", "num_layers", "num_kv_heads", "head_size", "block_size", "attention_backend", "kv_groups", "attention", "tensor_parallel_size", "draft_method", "draft_model", "draft_kv", "accepts_models")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_METHOD_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KV_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_MODELS_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    attention_backend: str
    kv_groups: _containers.RepeatedCompositeFieldContainer[KVCacheGroup]
    attention: str
    tensor_parallel_size: int
    draft_method: str
    draft_model: str
    draft_kv: _containers.RepeatedScalarFieldContainer[int]
    accepts_models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., block_size: _Optional[int] = ..., attention_backend: _Optional[str] = ..., kv_groups: _Optional[_Iterable[_Union[KVCacheGroup, _Mapping]]] = ..., attention: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., draft_method: _Optional[str] = ..., draft_model: _Optional[str] = ..., draft_kv: _Optional[_Iterable[int]] = ..., accepts_models: _Optional[_Iterable[str]] = ...) -> None: ...

class KVCacheGroup(_message.Message):
    __slots__ = ("layers", "window")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    window: int
    def __init__(self, layers: _Optional[_Iterable[int]] = ..., window: _Optional[int] = ...) -> None: ...

class SubscribeKVEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("instance_id", "epoch", "seq", "snapshot", "block_size", "events")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    epoch: int
    seq: int
    snapshot: bool
    block_size: int
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, instance_id: _Optional[str] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., block_size: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("kind", "block_hashes", "parent_hash", "tier")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    kind: KVEventKind
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_hash: int
    tier: _generate_pb2.KVTier
    def __init__(self, kind: _Optional[_Union[KVEventKind, str]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., parent_hash: _Optional[int] = ..., tier: _Optional[_Union[_generate_pb2.KVTier, str]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("engine_id", "role", "num_kv_blocks", "num_free_kv_blocks", "num_running", "num_waiting", "num_held", "num_in_flight_streams", "num_prefix_hit_tokens", "num_expired_holds", "num_failed_loads", "num_blocks_pulled", "num_requests", "engine_core_pid", "num_host_kv_blocks", "num_free_host_kv_blocks", "num_host_hand_offs", "num_bytes_pulled")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_STREAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPIRED_HOLDS_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_LOADS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_CORE_PID_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_HOST_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_HAND_OFFS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_PULLED_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    role: str
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_running: int
    num_waiting: int
    num_held: int
    num_in_flight_streams: int
    num_prefix_hit_tokens: int
    num_expired_holds: int
    num_failed_loads: int
    num_blocks_pulled: int
    num_requests: int
    engine_core_pid: int
    num_host_kv_blocks: int
    num_free_host_kv_blocks: int
    num_host_hand_offs: int
    num_bytes_pulled: int
    def __init__(self, engine_id: _Optional[str] = ..., role: _Optional[str] = ..., num_kv_blocks: _Optional[int] = ..., num_free_kv_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_held: _Optional[int] = ..., num_in_flight_streams: _Optional[int] = ..., num_prefix_hit_tokens: _Optional[int] = ..., num_expired_holds: _Optional[int] = ..., num_failed_loads: _Optional[int] = ..., num_blocks_pulled: _Optional[int] = ..., num_requests: _Optional[int] = ..., engine_core_pid: _Optional[int] = ..., num_host_kv_blocks: _Optional[int] = ..., num_free_host_kv_blocks: _Optional[int] = ..., num_host_hand_offs: _Optional[int] = ..., num_bytes_pulled: _Optional[int] = ...) -> None: ...

class FramesHello(_message.Message):
    __slots__ = ("service", "metadata", "refused")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    service: FramesService
    metadata: _containers.RepeatedCompositeFieldContainer[_generate_pb2.StreamMetadatum]
    refused: _generate_pb2.StreamStatus
    def __init__(self, service: _Optional[_Union[FramesService, str]] = ..., metadata: _Optional[_Iterable[_Union[_generate_pb2.StreamMetadatum, _Mapping]]] = ..., refused: _Optional[_Union[_generate_pb2.StreamStatus, _Mapping]] = ...) -> None: ...
