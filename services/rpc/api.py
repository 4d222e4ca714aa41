"""The public API's vocabulary as every service uses it: the service's name, finish reasons,
the metadata keys of the stack, chat messages."""
from __future__ import annotations

import json

from baton.engine.common.errors import InvalidArgument
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
    """The conversation as chat templates take it. Raises InvalidArgument naming
    chat.messages.tool_calls_json when an assistant's calls are not a JSON list of calls."""
    out = []
    for m in chat.messages:
        message = {"role": m.role, "content": m.content}
        if m.tool_calls_json:
            message["tool_calls"] = tool_calls_for_template(m.tool_calls_json)
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def tool_calls_for_template(calls_json: str) -> list[dict]:
    """An assistant's tool calls with each function's arguments as an object, as templates
    (Qwen2.5's, Llama 3.1's) render them; OpenAI sends them as a JSON string."""
    field = "chat.messages.tool_calls_json"
    try:
        calls = json.loads(calls_json)
    except json.JSONDecodeError as e:
        raise InvalidArgument(field, f"is not JSON: {e}") from None
    out = []
    for call in calls if isinstance(calls, list) else [None]:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidArgument(field, 'must be a list of {"type": "function", "function": {"name", "arguments"}}')
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass  # not JSON: the model wrote it so, and sees it so
        out.append({**call, "type": "function", "function": {**function, "arguments": arguments}})
    return out


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
