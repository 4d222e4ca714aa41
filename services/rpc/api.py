"""The public API's vocabulary as every service uses it: the service's name, finish reasons,
the metadata keys of the stack, chat messages."""
from __future__ import annotations

import json

from baton.engine.errors import InvalidArgument
from baton.v1 import generate_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name
# The router's health service for its own process (liveness and startup probes): SERVING while
# its event loop answers, whether or not a decode is reachable (that is "" and SERVICE_NAME).
ROUTER_LIVENESS = "baton.router.liveness"
TOKEN_KEY = "x-baton-token"  # the stack's shared secret, in the metadata of internal calls
DECODE_STEP_KEY = "x-baton-first-decode-step"  # a decode's initial metadata: seconds from KV landed to first token
FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                  "abort": pb.FINISH_REASON_ABORT, "error": pb.FINISH_REASON_ERROR}
FINISH_REASON_NAMES = {code: name for name, code in FINISH_REASONS.items()}


def token_metadata(token: str | None) -> tuple:
    return ((TOKEN_KEY, token),) if token is not None else ()


def chat_messages(chat: pb.Chat) -> list[dict]:
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def chat_tools(chat: pb.Chat) -> list[dict] | None:
    """The tools a chat offers (OpenAI's list), for the chat template; None when it offers none.
    Raises InvalidArgument naming chat.tools_json when it is not a JSON list."""
    if not chat.tools_json:
        return None
    try:
        tools = json.loads(chat.tools_json)
    except json.JSONDecodeError as e:
        raise InvalidArgument("chat.tools_json", f"is not JSON: {e}") from None
    if not isinstance(tools, list):
        raise InvalidArgument("chat.tools_json", "must be a JSON list")
    return tools
