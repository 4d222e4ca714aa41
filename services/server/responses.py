"""How an engine's outputs and errors become the API's messages and gRPC statuses (shared
by the public Generate and the internal Prefill)."""
from __future__ import annotations

import grpc

from baton.engine.common.core_messages import TokenLogprobs
from baton.engine.common.errors import ImagesNotSent, InvalidArgument
from baton.engine.common.sampling_params import SamplingParams
from baton.engine.front.core_client import DuplicateRequest, EngineDead, QueueFull
from baton.engine.front.output_processor import StepOutput
from baton.services.rpc.errors import abort, abort_invalid
from baton.services.rpc.names import DECODE_STEP_KEY, FINISH_REASONS
from baton.v1 import generate_pb2 as pb

# raised by CoreClient.generate
ENGINE_ERRORS = (InvalidArgument, DuplicateRequest, QueueFull, EngineDead, ImagesNotSent)
# Engine field names the public API spells otherwise (sampling parameters: under "sampling.").
_API_FIELD = {"prompt_token_ids": "token_ids", "resumed_output": "resume", "messages": "chat"}


def api_field(field: str) -> str:
    """An engine error's field as the API names it."""
    if field in _API_FIELD:
        return _API_FIELD[field]
    return f"sampling.{field}" if field.split(".")[0] in SamplingParams.__dataclass_fields__ else field


async def abort_for_engine_error(context: grpc.aio.ServicerContext, e: Exception) -> None:
    if isinstance(e, InvalidArgument):  # raised by the core on admission (a grammar that does not compile)
        await abort_invalid(context, type(e)(api_field(e.field), e.reason))
    if isinstance(e, DuplicateRequest):
        await abort(context, grpc.StatusCode.ALREADY_EXISTS, f"request_id: {e.args[0]!r} is already in flight",
                    field="request_id")
    if isinstance(e, QueueFull):
        await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    if isinstance(e, ImagesNotSent):  # the router sends it again, images and all, without the handle
        await abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e), pb.FAILURE_REASON_IMAGES_NOT_SENT)
    # The engine core is gone: another instance can serve the request (the router moves it).
    await abort(context, grpc.StatusCode.UNAVAILABLE, str(e), pb.FAILURE_REASON_ENGINE_UNAVAILABLE)


def decode_timing(out: StepOutput) -> tuple[tuple[str, str], ...]:
    """Initial metadata of a decode stream: its first step, from the KV landing (or the
    request being scheduled) to its first token, in seconds."""
    if out.ready_time is None:
        return ()
    return ((DECODE_STEP_KEY, f"{max(0.0, out.time - out.ready_time):.6f}"),)


def output_parts(out: StepOutput, output: int) -> tuple[list[int], str]:
    """The token ids and the text of an engine output that a response carries, as `output`
    asks (text, token ids or both)."""
    return (out.new_token_ids if output != pb.OUTPUT_TEXT else [], out.text if output != pb.OUTPUT_TOKEN_IDS else "")


def response_from_output(out: StepOutput, output: int, index: int = 0, request_id: str | None = None,
                         ) -> pb.GenerateResponse:
    """The API's message for an engine output, with text, token ids or both (`output`);
    `index`: which of n completions (`request_id` then the parent's, not the child's)."""
    token_ids, text = output_parts(out, output)
    resp = pb.GenerateResponse(request_id=request_id or out.request_id, token_ids=token_ids, text=text, index=index)
    if out.logprobs is not None:
        resp.logprobs.extend(map(logprobs_to_proto, out.logprobs))
    if out.prompt_logprobs is not None:
        resp.prompt_logprobs.extend(map(logprobs_to_proto, out.prompt_logprobs[1:]))
    if out.finished:
        resp.finish_reason = FINISH_REASONS.get(out.finish_reason, pb.FINISH_REASON_ERROR)
        resp.usage.prompt_tokens = out.num_prompt_tokens
        resp.usage.completion_tokens = out.num_output_tokens
        resp.usage.cached_tokens = out.num_cached_tokens
        if isinstance(out.stop_reason, str):
            resp.stop_string = out.stop_reason
        elif out.stop_reason is not None:
            resp.stop_token_id = out.stop_reason
    return resp


def logprobs_to_proto(lp: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank, top_token_ids=lp.top_token_ids,
                            top_logprobs=lp.top_logprobs)
