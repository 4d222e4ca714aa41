"""How an engine's outputs and errors become the API's messages and gRPC statuses (shared
by the public Generate and the internal Prefill)."""
from __future__ import annotations

import grpc

from baton.engine.errors import InvalidArgument
from baton.engine.llm_engine import StepOutput
from baton.engine.request import Request
from baton.engine.sampler import TokenLogprobs
from baton.engine.async_engine import DuplicateRequest, EngineDead, QueueFull
from baton.services.rpc.api import DECODE_STEP_KEY, FINISH_REASONS
from baton.v1 import generate_pb2 as pb

ENGINE_ERRORS = (InvalidArgument, DuplicateRequest, QueueFull, EngineDead)  # raised by AsyncEngine.generate


async def abort_for_engine_error(context: grpc.aio.ServicerContext, e: Exception) -> None:
    if isinstance(e, DuplicateRequest):
        await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {e.args[0]!r} is already in flight")
    code = {InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,  # raised by the engine on admission
            QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED, EngineDead: grpc.StatusCode.INTERNAL}[type(e)]
    await context.abort(code, str(e))


def decode_timing(request: Request) -> tuple[tuple[str, str], ...]:
    """Initial metadata of a decode stream: its first step, from the KV landing (or the
    request being scheduled) to its first token, in seconds."""
    ready = request.kv_ready_time or request.scheduled_time
    if ready is None or request.first_token_time is None:
        return ()
    return ((DECODE_STEP_KEY, f"{max(0.0, request.first_token_time - ready):.6f}"),)


def response_from_output(out: StepOutput, output: int, index: int = 0, request_id: str | None = None,
                         ) -> pb.GenerateResponse:
    """The API's message for an engine output, with text, token ids or both (`output`);
    `index`: which of n completions (`request_id` then the parent's, not the child's)."""
    resp = pb.GenerateResponse(request_id=request_id or out.request_id, index=index)
    if output != pb.OUTPUT_TEXT:
        resp.token_ids.extend(out.new_token_ids)
    if output != pb.OUTPUT_TOKEN_IDS:
        resp.text = out.text
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
