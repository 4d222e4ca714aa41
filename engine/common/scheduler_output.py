"""What one scheduler step hands the model runner and what the runner hands back: plain data,
no tensors. The core's scheduler makes them and the worker half consumes them (today in the
core's own process)."""
from __future__ import annotations

from dataclasses import dataclass, field

from baton.engine.common.core_messages import ImageInput
from baton.engine.common.sampling_params import SamplingParams
from baton.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput


@dataclass(slots=True)
class HostKVOps:
    """One step's copies between the device pool and the host tier, as (source, destination)
    block ids. The runner reports the job done once its offloads and loads landed."""
    job_id: int = 0
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # device -> host, before this step's forward
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # host -> device, next (the request runs in this step)
    offload: list[tuple[int, int]] = field(default_factory=list)  # device -> host, in the background
    load: list[tuple[int, int]] = field(default_factory=list)  # host -> device, in the background

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.offload or self.load)


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption)."""
    req_id: str
    token_ids: list[int]
    block_ids: list[list[int]]  # per KV cache group; -1 where a sliding group holds none
    num_computed_tokens: int
    sampling_params: SamplingParams
    num_prompt_tokens: int  # the rest of token_ids are outputs (after preemption, or from a prefill peer)
    lora_id: int = 0  # its LoRA adapter (0: the base model)
    hold_for_remote: bool = False  # a prefill's: its blocks go to a decode peer once it ends
    # A decode's: a peer's load brought the draft's (or head's) KV of its first num_computed_tokens,
    # from this position on (-1: it did not).
    draft_start: int = -1
    images: list[ImageInput] = field(default_factory=list)  # a vision-language model's (the runner encodes them)


@dataclass(slots=True)
class CachedRequestData:
    req_id: str
    new_block_ids: list[list[int]]  # per KV cache group, as NewRequestData's
    num_computed_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    # A vision-language model's encoder cache (engine/core/encoder_cache.py): the images to encode
    # this step (request -> indices among its images), and those to let go first (digests).
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    freed_images: list[int] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)  # the runner drops their state
    # Preempted: they come back as new, and the runner keeps their sampling state (generator,
    # grammar, logprob buffers) for then.
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: KVConnectorMetadata | None = None  # the connector's scheduler half to its worker half
    host_kv_ops: HostKVOps | None = None  # copies between the device pool and the host KV tier
    # Speculative decoding: the drafts verified this step, per request (they follow its last
    # token; num_scheduled_tokens counts them), and whether to draft for the next step.
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    propose_drafts: bool = False


@dataclass(slots=True)
class ModelRunnerOutput:
    # Only requests that reached the end of their known tokens: one token, or with drafts
    # verified the accepted ones and the one sampled after them.
    sampled_token_ids: dict[str, list[int]]
    kv_connector_output: KVConnectorOutput | None = None
    logprobs: dict[str, list] = field(default_factory=dict)  # request id -> its sampled tokens' TokenLogprobs
    prompt_logprobs: dict[str, list] = field(default_factory=dict)  # request id -> one per prompt token, when complete
    grammar_ended: set[str] = field(default_factory=set)  # requests whose grammar took its end token
    host_kv_finished: list[int] = field(default_factory=list)  # host KV tier jobs whose copies landed
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts for the next step, per request
    # A prefill's requests that ended: the first prompt position whose draft (or head) KV their blocks hold.
    draft_start: dict[str, int] = field(default_factory=dict)
