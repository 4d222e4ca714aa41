"""Names every service uses: the API's service name, the router's liveness service, the
stack's metadata keys, finish reasons."""
from __future__ import annotations

from baton.v1 import generate_pb2 as pb
from baton.v1 import internal_pb2

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name
STREAMS_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerateStreams"].full_name
GENERATE_METHOD = f"/{SERVICE_NAME}/Generate"
STREAMS_METHOD = f"/{STREAMS_SERVICE_NAME}/Generate"
PREFILL_SERVICE_NAME = internal_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
PREFILL_METHOD = f"/{PREFILL_SERVICE_NAME}/Prefill"
PREFILL_STREAMS_METHOD = f"/{PREFILL_SERVICE_NAME}/Streams"  # Prefill calls many on one stream
# The router's health service for its own process (liveness and startup probes): SERVING while
# its event loop answers, whether or not a decode is reachable (that is "" and SERVICE_NAME).
ROUTER_LIVENESS = "baton.router.liveness"
TOKEN_KEY = "x-baton-token"  # the stack's shared secret, in the metadata of internal calls
# An Abort one router replica passes to the others: answered from the receiver's own calls only.
ABORT_FORWARDED_KEY = "x-baton-abort-forwarded"
# GenerateStreams' version, in the caller's metadata and the server's initial metadata (2: the
# caller reads StreamTokens; the server reads StreamCommand.more). Either side may be older.
STREAMS_VERSION = ("baton-streams-version", "2")
DECODE_STEP_KEY = "x-baton-first-decode-step"  # a decode's initial metadata: seconds from KV landed to first token
FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                  "abort": pb.FINISH_REASON_ABORT, "error": pb.FINISH_REASON_ERROR}
FINISH_REASON_NAMES = {code: name for name, code in FINISH_REASONS.items()}


def token_metadata(token: str | None) -> tuple:
    return ((TOKEN_KEY, token),) if token is not None else ()
