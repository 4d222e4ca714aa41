"""The typed messages between an engine's front (which tokenizes, detokenizes and serves) and
its engine core (which schedules, runs the model and owns the KV cache), as vLLM v1's
EngineCoreRequest and EngineCoreOutputs. In a server they cross a process boundary, encoded
with msgspec (array-like structs: no field names on the wire); the offline engine passes the
same objects within one process.

A front gives each request a `key`, unique among its requests (request ids may be reused once
a request ended): outputs and events carry the key, never the id, so that a late output of an
ended request cannot reach a new one under the same id.
"""
from __future__ import annotations

import enum
from typing import ClassVar

import msgspec

from baton.engine.common.errors import ImagesNotSent, InUse, InvalidArgument, NotFound, StartupError
from baton.engine.common.kv_cache_events import KVEvent
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.common.stats import EngineSnapshot, StepEvents
from baton.kv_transfer.base import KVFormatMismatch, KVHandle, KVLayout, KVUnreachable


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """One position's logprobs: the token's (and its rank, 1 = likeliest) and the top ones'."""
    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


class AdapterInfo(msgspec.Struct, array_like=True):
    """A LoRA adapter an engine serves, as fronts and routers see it."""
    name: str
    path: str
    rank: int
    adapter_id: int  # the core's number for it, never reused
    hash_root: int  # its block-hash chains start here (engine/worker/lora/adapter.py: adapter_fingerprint)


class CoreOptions(msgspec.Struct):
    """How a front starts its core: what the core process reads first, on its stdin."""
    engine_id: str  # the NIXL agent's name
    hold_timeout_s: float
    record_events: bool  # the front turns them into spans and metrics
    input_address: str  # the core's PULL binds here once it has loaded; the front's PUSH connects
    output_address: str  # the front's PULL binds here; the core's PUSH connects
    kv_events: bool = False  # send the KV cache's events with each step (the front publishes them)


class ImageInput(msgspec.Struct, array_like=True, gc=False):
    """One image of a prompt, processed by the front (engine/front/images.py): its pixels for the
    model's image encoder, and the span of placeholder tokens its embeddings take. Those tokens
    are image_placeholder(digest) in the prompt, so block hashes (the prefix cache's, the
    router's, a P/D peer's) name the image with the text: the same image hits, another misses."""
    digest: int  # a 60-bit digest of the pixels
    offset: int  # the span's first position in the prompt
    length: int  # its tokens (the model's tokens_per_image, or by its size)
    # float32, C order, of `shape`; empty: not sent (a decode's, from its prefill's KV handle:
    # errors.ImagesNotSent)
    pixels: bytes
    shape: list[int]  # [3, H, W] (LLaVA); [tiles, 3, H, W] (LLaVA-NeXT); [grid_t, grid_h, grid_w, values] (Qwen2.5-VL)
    size: list[int] = []  # the image's own [height, width], where its tokens depend on it (LLaVA-NeXT)
    # `pixels` holds the image's embeddings instead, float32 [length, hidden] (Qwen3-VL's
    # [length, (1 + levels) x hidden]: then each DeepStack level's features), computed by an
    # encoder tier: the runner holds them as they are (the encoder budget is not spent)
    encoded: bool = False


def image_placeholder(digest: int) -> int:
    """The token id an image's placeholder positions hold: negative, so never a vocabulary's, and
    the image's own (the runner reads embeddings there, never the token)."""
    return -1 - digest % 0x7FFFFFFF


class CoreRequest(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """A request as a front hands it to its core: validated and tokenized."""
    key: int
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float  # time.monotonic(), the same clock in every process of a host
    priority: int = 0
    # Outputs generated elsewhere already (a prefill's first token, a failed instance's stream):
    # recomputed with the prompt, so the rest goes on as one uninterrupted run would.
    output_token_ids: list[int] = []
    hold_for_remote: bool = False  # a prefill's: hold its blocks for a decode peer (and give out a KVHandle)
    remote_kv: KVHandle | None = None  # a decode's: the prompt's KV is at this peer
    lora_name: str = ""  # its LoRA adapter ("": the base model)
    images: list[ImageInput] = []  # a vision-language model's, in prompt order
    # On the way to the core only: the images whose pixels follow the request as ZMQ frames of
    # their own (pixel_frames.py), taken without a copy
    pixel_frames: list[int] = []


class CoreAbort(msgspec.Struct, tag=True, array_like=True):
    """End these requests wherever they are, and let go of blocks held for a decode peer."""
    request_ids: list[str]


class CoreCall(msgspec.Struct, tag=True, array_like=True):
    """A Call for the core to run between two steps; answered by a CallResult with its call_id.
    The call travels encoded, so the core answers one it cannot decode (a front of another
    version) with an error instead of failing its whole input."""
    call_id: int
    call: msgspec.Raw  # one of Call's types, msgpack-encoded


class CoreShutdown(msgspec.Struct, tag=True, array_like=True):
    pass


CoreInput = CoreRequest | CoreAbort | CoreCall | CoreShutdown


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's progress in one step."""
    key: int
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error" once it ended
    stop_token_id: int | None = None  # the stop token id that ended it (stop strings are the front's)
    num_cached_tokens: int = 0  # prompt tokens the local prefix cache held
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked for
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the first token, when asked for
    kv_handle: KVHandle | None = None  # a prefill's finished request: where its blocks wait
    ready_time: float | None = None  # with its first sampled token: when it could run (KV landed, or scheduled)


class ErrorKind(enum.Enum):
    """What went wrong in the core, so the front raises the same exception type."""
    NOT_FOUND = "not_found"
    IN_USE = "in_use"
    INVALID_ARGUMENT = "invalid_argument"
    KV_FORMAT_MISMATCH = "kv_format_mismatch"
    IMAGES_NOT_SENT = "images_not_sent"  # errors.ImagesNotSent
    STARTUP = "startup"  # the engine cannot start (or its KV cache cannot be read by peers)
    INTERNAL = "internal"  # anything else: a defect, said in one sentence


class CallError(msgspec.Struct, array_like=True):
    kind: ErrorKind
    message: str
    field: str | None = None


class CoreFailure(msgspec.Struct, array_like=True):
    """A request the core could not take (a grammar that does not compile, an adapter unloaded
    since the front checked it)."""
    key: int
    error: CallError


class CoreStep(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """What one pass of the core's loop tells its front: one message however many requests."""
    outputs: list[CoreOutput]
    time: float  # when this step's tokens were sampled
    num_waiting: int  # the scheduler's waiting queue after the step
    num_received: int  # requests received since the core started (the front's sent - received: not yet queued)
    failures: list[CoreFailure] = []
    events: StepEvents | None = None  # when the front asked for them (telemetry)
    kv_events: list[KVEvent] = []  # the KV cache's, since the last CoreStep, when the front asked for them
    # Most of a decode step as two columns, cheaper to encode, decode and fan out than an output
    # each: requests that gained one token and have nothing else to say (is_plain). A request's
    # outputs are all in `outputs` or all here, so that each reaches its caller in order.
    token_keys: list[int] = []
    token_ids: list[int] = []  # token_keys[i]'s new token

    def to_columns(self) -> CoreStep:
        """Itself with its plain outputs moved into the columns (done by the core's sender thread
        as it encodes the message, off the step loop)."""
        rich = {out.key for out in self.outputs if not is_plain(out)}  # (these requests' outputs all stay outputs)
        plain = [out for out in self.outputs if out.key not in rich] if rich else self.outputs
        self.outputs = [out for out in self.outputs if out.key in rich] if rich else []
        self.token_keys = [out.key for out in plain]
        self.token_ids = [out.new_token_ids[0] for out in plain]
        return self


def is_plain(out: CoreOutput) -> bool:
    """One new token and nothing else a caller must see: not its first (ready_time), not its
    last, no logprobs. (The prompt's cached tokens a caller sees in the last output.)"""
    return (len(out.new_token_ids) == 1 and out.finish_reason is None and out.ready_time is None
            and out.logprobs is None and out.prompt_logprobs is None and out.kv_handle is None)


class CallResult(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    result: msgspec.Raw = msgspec.Raw(b"\xc0")
    error: CallError | None = None


class EngineFacts(msgspec.Struct):
    """What a front needs to know of its core, once it has loaded."""
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    num_kv_blocks: int
    dtype: str  # the weights' and activations' ("float32", "bfloat16", ...)
    device: str  # resolved: cpu or cuda:N
    pid: int  # the core's process (the front's own when in-process)
    kv_layout: KVLayout | None = None  # where peers read its blocks (services trade it in the KV handshake)
    enable_lora: bool = False
    adapters: list[AdapterInfo] = []  # loaded at start (lora_modules)
    kv_group_windows: list[int] = []  # each KV cache group's sliding window (0: full attention); [] as [0]
    kv_cache_dtype: str = ""  # the KV cache's elements ("float8_e4m3fn" for fp8); "": dtype's
    kv_scales: str = ""  # an FP8 cache's scales: "checkpoint" (k_scale/v_scale), "calculated" or "default" (1.0)
    image_token_id: int = -1  # a vision-language model's placeholder for one image in a prompt (-1: text only)
    tokens_per_image: int = 0  # the positions one image's embeddings take (0: each image's own, by its size)
    max_image_tokens: int = 0  # the most one image may take (the encoder cache's budget and room)
    image_wrap: list[int] = []  # the tokens around each image token in a prompt (Qwen2.5-VL's vision start, end)
    image_padding: list[str] = []  # the text before and after those in a chat turn, as the model's processor writes it


class CoreReady(msgspec.Struct, tag=True, array_like=True):
    facts: EngineFacts


class CoreFailed(msgspec.Struct, tag=True, array_like=True):
    """The core cannot start, or its loop died: why, in one sentence."""
    error: CallError


CoreMessage = CoreStep | CallResult | CoreReady | CoreFailed


class CoreStats(msgspec.Struct):
    """The engine's load and totals with its KV connector's counters (the internal Admin.Stats)."""
    snapshot: EngineSnapshot
    engine_id: str
    num_expired_holds: int
    num_blocks_pulled: int
    num_requests: int  # taken in since start
    num_bytes_pulled: int = 0


# ---- the calls a front makes between steps: one type each, its result type beside it ----------
class GetSnapshot(msgspec.Struct, tag=True, array_like=True):
    """The engine's load and running totals."""
    result: ClassVar = EngineSnapshot


class GetStats(msgspec.Struct, tag=True, array_like=True):
    """The snapshot with the KV connector's counters (the internal Admin.Stats)."""
    result: ClassVar = CoreStats


class ReleaseHold(msgspec.Struct, tag=True, array_like=True):
    """Let go of blocks held for a decode that will not come; True when some were held."""
    request_id: str
    result: ClassVar = bool


class AddPeer(msgspec.Struct, tag=True, array_like=True):
    """A KV peer's layout (the KV handshake); a KVFormatMismatch names what differs."""
    layout: KVLayout
    result: ClassVar = None


class GetKVBlockHashes(msgspec.Struct, tag=True, array_like=True):
    """The hashes of every block the prefix cache holds (tests compare them with KV events)."""
    result: ClassVar = list[int]


class LoadAdapter(msgspec.Struct, tag=True, array_like=True):
    name: str
    path: str
    result: ClassVar = AdapterInfo


class UnloadAdapter(msgspec.Struct, tag=True, array_like=True):
    name: str
    result: ClassVar = AdapterInfo


class ListAdapters(msgspec.Struct, tag=True, array_like=True):
    result: ClassVar = list[AdapterInfo]


Call = GetSnapshot | GetStats | ReleaseHold | AddPeer | GetKVBlockHashes | LoadAdapter | UnloadAdapter | ListAdapters


# Core-side exceptions that cross to the front typed (subclasses before their bases).
_ERROR_KINDS = {ErrorKind.NOT_FOUND: NotFound, ErrorKind.IN_USE: InUse, ErrorKind.INVALID_ARGUMENT: InvalidArgument,
                ErrorKind.KV_FORMAT_MISMATCH: KVFormatMismatch}


class CoreCallFailed(RuntimeError):
    pass


def error_of(e: Exception) -> CallError:
    """A core-side exception as a typed error the front can raise again (error_from)."""
    for kind, cls in _ERROR_KINDS.items():
        if isinstance(e, cls):
            return CallError(kind, e.reason, e.field)
    if isinstance(e, (StartupError, KVUnreachable)):
        return CallError(ErrorKind.STARTUP, str(e))
    return CallError(ErrorKind.INTERNAL, f"{type(e).__name__}: {e}")


def error_from(err: CallError) -> Exception:
    """The exception a core-side error stands for."""
    if err.kind in _ERROR_KINDS:
        return _ERROR_KINDS[err.kind](err.field, err.message)
    if err.kind is ErrorKind.STARTUP:
        return StartupError(err.message)
    if err.kind is ErrorKind.IMAGES_NOT_SENT:
        return ImagesNotSent(err.message)
    return CoreCallFailed(err.message)
