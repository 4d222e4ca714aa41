"""Tool calling on /v1/chat/completions: `tools` and `tool_choice` as OpenAI defines them.

The tools go to the chat template (models whose template knows tools render them). With
`tool_choice` naming a function the output is generated under that function's parameter
schema, and with "required" under a schema of a non-empty list of calls to the tools given, so
arguments always parse. With "auto" the model decides: calls it writes in the Hermes format
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Qwen's and others' templates) become
tool_calls, the rest stays content. "none" leaves the tools out.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from baton.services.openai.protocol import ApiError

_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: tuple[dict, ...]  # each {"name", "parameters", ...}: the functions offered
    choice: str  # "auto", "required", or the name of the function to call

    @property
    def names(self) -> list[str]:
        return [t["name"] for t in self.tools]

    def schema(self) -> dict | None:
        """The JSON schema the output must follow (None for "auto")."""
        params = {t["name"]: t.get("parameters") or {"type": "object"} for t in self.tools}
        if self.choice == "auto":
            return None
        if self.choice == "required":
            return {"type": "array", "minItems": 1, "items": {"anyOf": [
                {"type": "object", "properties": {"name": {"enum": [name]}, "arguments": p},
                 "required": ["name", "arguments"], "additionalProperties": False} for name, p in params.items()]}}
        return params[self.choice]

    def calls(self, text: str) -> tuple[str | None, list[dict]]:
        """The message's content and tool_calls for the generated text."""
        if self.choice == "auto":
            found = []
            for m in _HERMES.finditer(text):
                try:
                    call = json.loads(m.group(1))
                except json.JSONDecodeError:
                    continue
                if isinstance(call, dict) and call.get("name") in self.names:
                    found.append((call["name"], call.get("arguments", {})))
            content = _HERMES.sub("", text).strip() if found else text
            return content or None, [tool_call(n, json.dumps(a)) for n, a in found]
        if self.choice == "required":
            try:
                return None, [tool_call(c["name"], json.dumps(c["arguments"])) for c in json.loads(text)]
            except (json.JSONDecodeError, TypeError, KeyError):  # cut short by max_tokens
                return text, []
        return None, [tool_call(self.choice, text)]


def constrain_to_tools(plan: ToolPlan, sampling) -> None:
    """Put the plan's schema on the request's sampling (a baton.v1 SamplingParams)."""
    schema = plan.schema()
    if schema is None:
        return
    if sampling.WhichOneof("structured_output"):
        raise ApiError(400, "tool_choice: a required or named tool call cannot be combined with another "
                            "structured output constraint (response_format, structured_outputs)", "tool_choice")
    sampling.json_schema = json.dumps(schema)


def tool_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def plan_from_body(body: dict) -> ToolPlan | None:
    """The request's tools and tool_choice, checked (errors name the parameter); None when no
    tool is offered or tool_choice is "none"."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice: there are no tools to choose from", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "tools: must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    functions = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ApiError(400, f"tools[{i}]: must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           "tools")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise ApiError(400, f"tools[{i}].function.parameters: must be a JSON schema object", "tools")
        functions.append(f)
    if choice is None or choice in ("auto", "required", "none"):
        choice = choice or "auto"
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        choice = choice["function"].get("name")
        if choice not in [f["name"] for f in functions]:
            raise ApiError(400, f"tool_choice: no tool is named {choice!r}", "tool_choice")
    else:
        raise ApiError(400, "tool_choice: must be none, auto, required or {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}", "tool_choice")
    return None if choice == "none" else ToolPlan(tuple(functions), choice)
