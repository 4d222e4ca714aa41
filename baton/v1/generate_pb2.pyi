from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Output(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_UNSPECIFIED: _ClassVar[Output]
    OUTPUT_TEXT: _ClassVar[Output]
    OUTPUT_TOKEN_IDS: _ClassVar[Output]
    OUTPUT_TEXT_AND_TOKEN_IDS: _ClassVar[Output]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class FailureReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_REASON_UNSPECIFIED: _ClassVar[FailureReason]
    FAILURE_REASON_ENGINE_UNAVAILABLE: _ClassVar[FailureReason]
    FAILURE_REASON_KV_PEER_UNREACHABLE: _ClassVar[FailureReason]
    FAILURE_REASON_KV_PEER_RESTARTED: _ClassVar[FailureReason]
    FAILURE_REASON_KV_FORMAT_MISMATCH: _ClassVar[FailureReason]
    FAILURE_REASON_IMAGES_NOT_SENT: _ClassVar[FailureReason]

class KVTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_UNSPECIFIED: _ClassVar[KVTier]
    KV_TIER_DEVICE: _ClassVar[KVTier]
    KV_TIER_HOST: _ClassVar[KVTier]

class AbortStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ABORT_STATUS_UNSPECIFIED: _ClassVar[AbortStatus]
    ABORT_STATUS_ABORTED: _ClassVar[AbortStatus]
    ABORT_STATUS_ALREADY_FINISHED: _ClassVar[AbortStatus]
    ABORT_STATUS_NOT_FOUND: _ClassVar[AbortStatus]
OUTPUT_UNSPECIFIED: Output
OUTPUT_TEXT: Output
OUTPUT_TOKEN_IDS: Output
OUTPUT_TEXT_AND_TOKEN_IDS: Output
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
FAILURE_REASON_UNSPECIFIED: FailureReason
FAILURE_REASON_ENGINE_UNAVAILABLE: FailureReason
FAILURE_REASON_KV_PEER_UNREACHABLE: FailureReason
FAILURE_REASON_KV_PEER_RESTARTED: FailureReason
FAILURE_REASON_KV_FORMAT_MISMATCH: FailureReason
FAILURE_REASON_IMAGES_NOT_SENT: FailureReason
KV_TIER_UNSPECIFIED: KVTier
KV_TIER_DEVICE: KVTier
KV_TIER_HOST: KVTier
ABORT_STATUS_UNSPECIFIED: AbortStatus
ABORT_STATUS_ABORTED: AbortStatus
ABORT_STATUS_ALREADY_FINISHED: AbortStatus
ABORT_STATUS_NOT_FOUND: AbortStatus

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "priority", "output", "adapter", "kv_handle", "resume", "encoded_images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    ENCODED_IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: Chat
    sampling: SamplingParams
    priority: int
    output: Output
    adapter: str
    kv_handle: KVHandle
    resume: TokenIds
    encoded_images: EncodedImages
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., output: _Optional[_Union[Output, str]] = ..., adapter: _Optional[str] = ..., kv_handle: _Optional[_Union[KVHandle, _Mapping]] = ..., resume: _Optional[_Union[TokenIds, _Mapping]] = ..., encoded_images: _Optional[_Union[EncodedImages, _Mapping]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages", "tools_json")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools_json: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls_json", "tool_call_id", "images")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls_json: str
    tool_call_id: str
    images: _containers.RepeatedCompositeFieldContainer[Image]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls_json: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("data", "url")
    DATA_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    url: str
    def __init__(self, data: _Optional[bytes] = ..., url: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "min_tokens", "stop", "include_stop_str_in_output", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "logit_bias", "logprobs", "prompt_logprobs", "skip_special_tokens", "n", "json_schema", "json_object", "regex", "choice", "grammar")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    include_stop_str_in_output: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: int
    prompt_logprobs: int
    skip_special_tokens: bool
    n: int
    json_schema: str
    json_object: bool
    regex: str
    choice: Choice
    grammar: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., include_stop_str_in_output: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., n: _Optional[int] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choice, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("options",)
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    options: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, options: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "index", "logprobs", "prompt_logprobs", "stop_string", "stop_token_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    stop_string: str
    stop_token_id: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("engine_id", "address", "request_id", "block_ids", "num_tokens", "first_token", "trace_context", "hold_seconds", "tier", "draft_start", "images")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    HOLD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DRAFT_START_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    address: str
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    first_token: int
    trace_context: _containers.ScalarMap[str, str]
    hold_seconds: float
    tier: KVTier
    draft_start: int
    images: _containers.RepeatedCompositeFieldContainer[ImageSpan]
    def __init__(self, engine_id: _Optional[str] = ..., address: _Optional[str] = ..., request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., first_token: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., hold_seconds: _Optional[float] = ..., tier: _Optional[_Union[KVTier, str]] = ..., draft_start: _Optional[int] = ..., images: _Optional[_Iterable[_Union[ImageSpan, _Mapping]]] = ...) -> None: ...

class ImageSpan(_message.Message):
    __slots__ = ("digest", "offset", "length", "shape")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    digest: int
    offset: int
    length: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, digest: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class EncodedImages(_message.Message):
    __slots__ = ("encoder_id", "agent_metadata", "images", "hold_seconds")
    ENCODER_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    HOLD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    encoder_id: str
    agent_metadata: bytes
    images: _containers.RepeatedCompositeFieldContainer[EncodedImage]
    hold_seconds: float
    def __init__(self, encoder_id: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., images: _Optional[_Iterable[_Union[EncodedImage, _Mapping]]] = ..., hold_seconds: _Optional[float] = ...) -> None: ...

class EncodedImage(_message.Message):
    __slots__ = ("span", "address", "nbytes", "dtype", "hidden")
    SPAN_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    span: ImageSpan
    address: int
    nbytes: int
    dtype: str
    hidden: int
    def __init__(self, span: _Optional[_Union[ImageSpan, _Mapping]] = ..., address: _Optional[int] = ..., nbytes: _Optional[int] = ..., dtype: _Optional[str] = ..., hidden: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "model_path", "architecture", "max_model_len", "vocab_size", "block_size", "dtype", "eos_token_ids", "has_chat_template", "baton_version", "role", "kv_cache_dtype", "kv_scales", "frames_port")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    BATON_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_SCALES_FIELD_NUMBER: _ClassVar[int]
    FRAMES_PORT_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_path: str
    architecture: str
    max_model_len: int
    vocab_size: int
    block_size: int
    dtype: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_chat_template: bool
    baton_version: str
    role: str
    kv_cache_dtype: str
    kv_scales: str
    frames_port: int
    def __init__(self, model_name: _Optional[str] = ..., model_path: _Optional[str] = ..., architecture: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., has_chat_template: _Optional[bool] = ..., baton_version: _Optional[str] = ..., role: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., kv_scales: _Optional[str] = ..., frames_port: _Optional[int] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("role", "address", "num_running", "num_waiting", "num_waiting_for_remote_kvs", "kv_cache_usage", "num_held_blocks", "num_in_flight", "backends", "num_host_kv_blocks", "host_kv_cache_usage", "host_kv_cache_hits", "num_swapped")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FOR_REMOTE_KVS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    num_running: int
    num_waiting: int
    num_waiting_for_remote_kvs: int
    kv_cache_usage: float
    num_held_blocks: int
    num_in_flight: int
    backends: _containers.RepeatedCompositeFieldContainer[BackendLoad]
    num_host_kv_blocks: int
    host_kv_cache_usage: float
    host_kv_cache_hits: int
    num_swapped: int
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_waiting_for_remote_kvs: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_held_blocks: _Optional[int] = ..., num_in_flight: _Optional[int] = ..., backends: _Optional[_Iterable[_Union[BackendLoad, _Mapping]]] = ..., num_host_kv_blocks: _Optional[int] = ..., host_kv_cache_usage: _Optional[float] = ..., host_kv_cache_hits: _Optional[int] = ..., num_swapped: _Optional[int] = ...) -> None: ...

class BackendLoad(_message.Message):
    __slots__ = ("address", "tier", "healthy", "outstanding", "load")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    address: str
    tier: str
    healthy: bool
    outstanding: int
    load: Load
    def __init__(self, address: _Optional[str] = ..., tier: _Optional[str] = ..., healthy: _Optional[bool] = ..., outstanding: _Optional[int] = ..., load: _Optional[_Union[Load, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[AbortResult]
    def __init__(self, results: _Optional[_Iterable[_Union[AbortResult, _Mapping]]] = ...) -> None: ...

class AbortResult(_message.Message):
    __slots__ = ("request_id", "status")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: AbortStatus
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[_Union[AbortStatus, str]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "chat")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: Chat
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "max_model_len")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Adapter(_message.Message):
    __slots__ = ("name", "path", "rank", "hash_root", "instances")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    HASH_ROOT_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    hash_root: int
    instances: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., hash_root: _Optional[int] = ..., instances: _Optional[_Iterable[str]] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ...) -> None: ...

class StreamCommand(_message.Message):
    __slots__ = ("stream", "open", "cancel", "more")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    stream: int
    open: StreamOpen
    cancel: StreamCancel
    more: _containers.RepeatedCompositeFieldContainer[StreamCommand]
    def __init__(self, stream: _Optional[int] = ..., open: _Optional[_Union[StreamOpen, _Mapping]] = ..., cancel: _Optional[_Union[StreamCancel, _Mapping]] = ..., more: _Optional[_Iterable[_Union[StreamCommand, _Mapping]]] = ...) -> None: ...

class StreamOpen(_message.Message):
    __slots__ = ("request", "metadata", "timeout_s")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    metadata: _containers.RepeatedCompositeFieldContainer[StreamMetadatum]
    timeout_s: float
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., metadata: _Optional[_Iterable[_Union[StreamMetadatum, _Mapping]]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class StreamCancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamMetadatum(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class StreamEvents(_message.Message):
    __slots__ = ("events", "tokens")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[StreamEvent]
    tokens: StreamTokens
    def __init__(self, events: _Optional[_Iterable[_Union[StreamEvent, _Mapping]]] = ..., tokens: _Optional[_Union[StreamTokens, _Mapping]] = ...) -> None: ...

class StreamTokens(_message.Message):
    __slots__ = ("streams", "counts", "token_ids", "texts")
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    streams: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, streams: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., texts: _Optional[_Iterable[str]] = ...) -> None: ...

class StreamEvent(_message.Message):
    __slots__ = ("stream", "headers", "response", "status")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    stream: int
    headers: StreamHeaders
    response: bytes
    status: StreamStatus
    def __init__(self, stream: _Optional[int] = ..., headers: _Optional[_Union[StreamHeaders, _Mapping]] = ..., response: _Optional[bytes] = ..., status: _Optional[_Union[StreamStatus, _Mapping]] = ...) -> None: ...

class StreamHeaders(_message.Message):
    __slots__ = ("metadata",)
    METADATA_FIELD_NUMBER: _ClassVar[int]
    metadata: _containers.RepeatedCompositeFieldContainer[StreamMetadatum]
    def __init__(self, metadata: _Optional[_Iterable[_Union[StreamMetadatum, _Mapping]]] = ...) -> None: ...

class StreamStatus(_message.Message):
    __slots__ = ("code", "details", "status_details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    status_details: bytes
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., status_details: _Optional[bytes] = ...) -> None: ...
