"""Typed failures between tiers and to clients: gRPC's rich error model. A status carries, in
its `grpc-status-details-bin` trailer, a google.rpc.Status whose details hold an ErrorInfo
(the FailureReason, domain "baton") and, for a bad field, a BadRequest naming it. The router
and the HTTP front decide on these, never on message text."""
from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2, status_pb2

from baton.engine.common.errors import InUse, InvalidArgument, NotFound
from baton.v1 import generate_pb2 as pb

DETAILS_KEY = "grpc-status-details-bin"
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}  # by number, as a stream carries it
DOMAIN = "baton"
_PREFIX = "FAILURE_REASON_"


@dataclass(frozen=True, slots=True)
class Failure:
    """What a failed call's details say."""
    reason: int = pb.FAILURE_REASON_UNSPECIFIED  # a pb.FailureReason
    field: str | None = None  # the request field at fault (INVALID_ARGUMENT, KV_FORMAT_MISMATCH)


def details(code: grpc.StatusCode, message: str, reason: int = pb.FAILURE_REASON_UNSPECIFIED,
            field: str | None = None) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata that carries a failure's reason and field."""
    status = status_pb2.Status(code=code.value[0], message=message)
    if reason != pb.FAILURE_REASON_UNSPECIFIED:
        status.details.add().Pack(error_details_pb2.ErrorInfo(
            reason=pb.FailureReason.Name(reason).removeprefix(_PREFIX), domain=DOMAIN))
    if field:
        status.details.add().Pack(error_details_pb2.BadRequest(
            field_violations=[error_details_pb2.BadRequest.FieldViolation(field=field, description=message)]))
    return ((DETAILS_KEY, status.SerializeToString()),)


async def abort(context, code: grpc.StatusCode, message: str, reason: int = pb.FAILURE_REASON_UNSPECIFIED,
                field: str | None = None):
    """End the call with the status and its typed details (raises, as context.abort does)."""
    await context.abort(code, message, trailing_metadata=details(code, message, reason, field))


async def abort_invalid(context, e: InvalidArgument) -> None:
    """An InvalidArgument (engine/common/errors.py) naming its field: INVALID_ARGUMENT, or NOT_FOUND for
    a NotFound, FAILED_PRECONDITION for an InUse."""
    code = (grpc.StatusCode.NOT_FOUND if isinstance(e, NotFound) else
            grpc.StatusCode.FAILED_PRECONDITION if isinstance(e, InUse) else grpc.StatusCode.INVALID_ARGUMENT)
    await abort(context, code, str(e), field=e.field)


def failure_of(trailing_metadata) -> Failure:
    """The Failure in a call's trailing metadata (Failure() when it carries none)."""
    raw = next((v for k, v in (trailing_metadata or ()) if k == DETAILS_KEY), None)
    if raw is None:
        return Failure()
    status = status_pb2.Status.FromString(raw)
    reason, field = pb.FAILURE_REASON_UNSPECIFIED, None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            if info.domain == DOMAIN:
                reason = pb.FailureReason.Value(_PREFIX + info.reason) if _PREFIX + info.reason in \
                    pb.FailureReason.keys() else pb.FAILURE_REASON_UNSPECIFIED
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            field = bad.field_violations[0].field if bad.field_violations else None
    return Failure(reason, field)


def failure_of_error(e: grpc.aio.AioRpcError) -> Failure:
    return failure_of(e.trailing_metadata())


async def pass_on(context, e: grpc.aio.AioRpcError):
    """End the call with a backend's failure as it came: code, message and details."""
    trailer = tuple((k, v) for k, v in (e.trailing_metadata() or ()) if k == DETAILS_KEY)
    await context.abort(e.code(), e.details(), trailing_metadata=trailer)
