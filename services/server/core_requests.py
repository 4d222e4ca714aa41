"""A GenerateRequest made into the engine core's request (validated, errors naming the API's
field): for Generate, colocated or at a decode with the prefill's KV handle, and for a
prefill's Prefill, which runs only the first token and holds the blocks for a decode."""
from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

from baton.engine.common.core_messages import CoreRequest
from baton.engine.common.errors import InvalidArgument, check
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.common.structured_output import StructuredOutput
from baton.engine.front.core_client import CoreClient
from baton.kv_transfer.base import handle_block_counts
from baton.services.rpc.chat import chat_messages, chat_tools
from baton.services.rpc.kv_wire import handle_from_proto
from baton.services.server.responses import api_field
from baton.v1 import generate_pb2 as pb

MAX_REQUEST_ID_CHARS = 256
_OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "min_tokens",
                             "include_stop_str_in_output", "repetition_penalty", "presence_penalty",
                             "frequency_penalty", "min_p", "logprobs", "prompt_logprobs", "skip_special_tokens", "n")


def sampling_params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    kwargs = {name: getattr(p, name) for name in _OPTIONAL_SAMPLING_FIELDS if p.HasField(name)}
    for name in ("stop_token_ids", "stop"):
        if getattr(p, name):
            kwargs[name] = list(getattr(p, name))
    if p.logit_bias:
        kwargs["logit_bias"] = dict(p.logit_bias)
    try:
        kind = p.WhichOneof("structured_output")
        if kind is not None:
            spec = {"json_object": "", "choice": tuple(p.choice.options)}.get(kind, getattr(p, kind))
            kwargs["structured_output"] = StructuredOutput(kind, spec)
        return SamplingParams(**kwargs)
    except InvalidArgument as e:
        raise InvalidArgument(api_field(e.field), e.reason) from None


@dataclass(slots=True)
class MadeRequest:
    """A GenerateRequest as the engine core takes it, and how to answer."""
    request: CoreRequest
    output: int  # pb.Output
    min_tokens: int | None = None  # a prefill's: the request's own (the core runs one token)


def core_request_from_proto(msg: pb.GenerateRequest, core: CoreClient, role: str,
                            for_prefill: bool = False, images: list = ()) -> MadeRequest:
    """The engine request for a GenerateRequest to the loaded `core` of a server of `role`;
    raises InvalidArgument naming the API field. `for_prefill`: only the first token, with
    the blocks held for a decode peer. `images`: its chat's, read (media.py)."""
    inputs = core.inputs
    check(msg.output in pb.Output.values(), "output", f"unknown value {msg.output}")
    check(len(msg.request_id) <= MAX_REQUEST_ID_CHARS, "request_id",
          f"is {len(msg.request_id)} characters, more than {MAX_REQUEST_ID_CHARS}")
    params = sampling_params_from_proto(msg.sampling)
    min_tokens, hold, remote_kv = None, False, None
    if for_prefill:
        # The first token is sampled as colocated (EOS cannot end it before min_tokens); a stop
        # string in it must not end the request before the request's own min_tokens either.
        min_tokens = params.min_tokens
        hold = params.max_tokens > 1  # one token wanted in all: nothing to hand over
        params = dataclasses.replace(params, max_tokens=1, min_tokens=min(min_tokens, 1))
    elif msg.HasField("kv_handle"):
        check(role != "prefill", "kv_handle", "this server runs the prefill role only")
        check(params.max_tokens >= 2, "sampling.max_tokens",
              "must be >= 2 with a kv_handle: the first token came from the prefill")
        remote_kv = handle_from_proto(msg.kv_handle)
    if (not for_prefill and (remote_kv is not None or msg.resume.ids)  # the prompt's logprobs went out already
            and params.prompt_logprobs is not None):  # (a copy checked again: only where it changes)
        params = dataclasses.replace(params, prompt_logprobs=None)
    try:
        request = inputs.core_request(msg.request_id or uuid.uuid4().hex, _prompt(msg, core, bool(images)), params,
                                      msg.priority, hold_for_remote=hold, remote_kv=remote_kv,
                                      resumed_output=list(msg.resume.ids), adapter=msg.adapter, images=list(images))
    except InvalidArgument as e:  # (the images' count: the chat's text held image tokens of its own)
        field = "chat.messages" if e.field.startswith("multi_modal_data") else api_field(e.field)
        raise type(e)(field, e.reason) from None
    num_prompt = len(request.prompt_token_ids)
    if remote_kv is not None:
        facts = core.facts
        check(remote_kv.num_tokens == num_prompt, "kv_handle.num_tokens",
              f"is {remote_kv.num_tokens}, the prompt has {num_prompt} tokens")
        windows = tuple(w or None for w in facts.kv_group_windows) or (None,)
        expected = sum(handle_block_counts(remote_kv.num_tokens, windows, facts.block_size))
        check(len(remote_kv.block_ids) == expected, "kv_handle.block_ids",
              f"has {len(remote_kv.block_ids)} ids for {remote_kv.num_tokens} tokens; this engine's KV cache "
              f"groups (windows {list(facts.kv_group_windows) or [0]}, blocks of {facts.block_size}) take "
              f"{expected}")
    limit = inputs.max_model_len
    check(num_prompt + params.max_tokens <= limit, "sampling.max_tokens",
          f"{params.max_tokens} new tokens after a prompt of {num_prompt} exceed max_model_len {limit}")
    return MadeRequest(request, msg.output or pb.OUTPUT_TEXT_AND_TOKEN_IDS, min_tokens)


def _prompt(msg: pb.GenerateRequest, core: CoreClient, images: bool) -> str | list[int]:
    kind = msg.WhichOneof("prompt")
    check(kind is not None, "prompt", "set one of text, token_ids or chat")
    if kind == "chat":
        check(len(msg.chat.messages) > 0, "chat.messages", "must not be empty")
        image_text = core.inputs.images.image_text if images else ""
        return core.inputs.apply_chat_template(chat_messages(msg.chat, image_text), chat_tools(msg.chat))
    return msg.text if kind == "text" else list(msg.token_ids.ids)
