from baton.v1 import generate_pb2 as _generate_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillResponse(_message.Message):
    __slots__ = ("handle", "first")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    handle: _generate_pb2.KVHandle
    first: _generate_pb2.GenerateResponse
    def __init__(self, handle: _Optional[_Union[_generate_pb2.KVHandle, _Mapping]] = ..., first: _Optional[_Union[_generate_pb2.GenerateResponse, _Mapping]] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("engine_id", "agent_metadata", "base_addr", "block_bytes", "num_blocks", "mem_type", "dev_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEV_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    agent_metadata: bytes
    base_addr: int
    block_bytes: int
    num_blocks: int
    mem_type: str
    dev_id: int
    def __init__(self, engine_id: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., base_addr: _Optional[int] = ..., block_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., mem_type: _Optional[str] = ..., dev_id: _Optional[int] = ...) -> None: ...
