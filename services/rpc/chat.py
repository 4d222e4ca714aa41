"""A Generate request's chat (messages, an assistant's tool calls, the tools offered) as chat
templates take it; what is malformed raises InvalidArgument naming the field."""
from __future__ import annotations

import json

from baton.engine.common.errors import InvalidArgument
from baton.v1 import generate_pb2 as pb


def chat_messages(chat: pb.Chat, image_text: str = "") -> list[dict]:
    """The conversation as chat templates take it, each message's images as `image_text` (the
    model's image token) before its text, a line each. Raises InvalidArgument naming
    chat.messages.tool_calls_json when an assistant's calls are not a JSON list of calls."""
    out = []
    for m in chat.messages:
        message = {"role": m.role, "content": image_text * len(m.images) + m.content}
        if m.tool_calls_json:
            message["tool_calls"] = tool_calls_for_template(m.tool_calls_json)
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def has_images(chat: pb.Chat) -> bool:
    """Whether any message has an image (false for an empty Chat: the prompt is text or ids)."""
    return any(m.images for m in chat.messages)


def chat_images(chat: pb.Chat) -> list[tuple[str, pb.Image]]:
    """Every message's images in order, each with its field (chat.messages[i].images[j])."""
    return [(f"chat.messages[{i}].images[{j}]", image) for i, m in enumerate(chat.messages)
            for j, image in enumerate(m.images)]


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
