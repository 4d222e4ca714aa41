"""The OpenAI API's wire format: a request's JSON as Baton's sampling parameters and prompts
(vLLM's extra parameters included), checked with errors that name the parameter; Generate's
responses as OpenAI's completion and chat completion objects, whole or as stream events; gRPC
statuses as HTTP ones."""
from __future__ import annotations

import json
import re

import grpc

from baton.engine.common.errors import InvalidArgument
from baton.services.rpc.chat import tool_calls_for_template
from baton.services.rpc.names import FINISH_REASON_NAMES
from baton.v1 import generate_pb2 as pb

_HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404,
                grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.PERMISSION_DENIED: 403,
                grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
                grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.FAILED_PRECONDITION: 400}
# OpenAI parameter -> (SamplingParams field, expected type); vLLM's extra parameters included.
_SAMPLING = {"max_tokens": ("max_tokens", int), "max_completion_tokens": ("max_tokens", int),
             "temperature": ("temperature", float), "top_p": ("top_p", float), "top_k": ("top_k", int),
             "min_p": ("min_p", float), "seed": ("seed", int), "n": ("n", int),
             "presence_penalty": ("presence_penalty", float), "frequency_penalty": ("frequency_penalty", float),
             "repetition_penalty": ("repetition_penalty", float), "min_tokens": ("min_tokens", int),
             "ignore_eos": ("ignore_eos", bool), "skip_special_tokens": ("skip_special_tokens", bool),
             "include_stop_str_in_output": ("include_stop_str_in_output", bool),
             "prompt_logprobs": ("prompt_logprobs", int)}
# The API's field names (in gRPC errors) as OpenAI's parameters.
_PARAM = {"sampling.max_tokens": "max_tokens", "sampling.stop": "stop", "token_ids": "prompt", "chat": "messages",
          "chat.messages": "messages"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "BadRequestError"):
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind

    def body(self) -> dict:
        """OpenAI's error body (with vLLM's type names, and the HTTP status as the code)."""
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}}


def error_for_status(code: grpc.StatusCode | None, details: str, field: str | None = None) -> ApiError:
    """A gRPC status as an HTTP one; an INVALID_ARGUMENT's field (from its details) as the parameter."""
    status = _HTTP_STATUS.get(code, 500)
    param = _PARAM.get(field, field.removeprefix("sampling.") if field else None) if status == 400 else None
    kinds = {400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError", 503: "ServiceUnavailableError"}
    return ApiError(status, details, param, kinds.get(status, "InternalServerError"))


def typed(body: dict, name: str, kind: type):
    value = body[name]
    ok = isinstance(value, bool) if kind is bool else (
        isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
        isinstance(value, int) and not isinstance(value, bool))
    if not ok:
        raise ApiError(400, f"{name}: must be "
                            f"{'a boolean' if kind is bool else 'a number' if kind is float else 'an integer'}, "
                            f"got {value!r}", name)
    return value


def in_range(name: str, assign) -> None:
    """Run assign() (a protobuf field set), naming the parameter when a value does not fit it."""
    try:
        assign()
    except (ValueError, TypeError, OverflowError):
        raise ApiError(400, f"{name}: a value is out of range", name) from None


def sampling_from_body(body: dict, chat: bool) -> pb.SamplingParams:
    s = pb.SamplingParams()
    for name, (field, kind) in _SAMPLING.items():
        if body.get(name) is not None:
            value = typed(body, name, kind)
            in_range(name, lambda: setattr(s, field, value))  # noqa: B023 - called at once
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise ApiError(400, "stop: must be a string or a list of strings", "stop")
        s.stop.extend(stops)
    if body.get("stop_token_ids") is not None:
        ids = int_list(body, "stop_token_ids")
        in_range("stop_token_ids", lambda: s.stop_token_ids.extend(ids))
    bias = body.get("logit_bias")
    if bias is not None:
        try:
            s.logit_bias.update({int(k): float(v) for k, v in bias.items()})
        except (AttributeError, TypeError, ValueError, OverflowError):
            raise ApiError(400, "logit_bias: must map token ids (in range) to numbers", "logit_bias") from None
    logprobs = body.get("logprobs")
    if chat:  # logprobs: true, with top_logprobs alternatives
        if logprobs is not None and typed(body, "logprobs", bool):
            top = typed(body, "top_logprobs", int) if body.get("top_logprobs") is not None else 0
            in_range("top_logprobs", lambda: setattr(s, "logprobs", top))
    elif logprobs is not None:
        top = typed(body, "logprobs", int)
        in_range("logprobs", lambda: setattr(s, "logprobs", top))
    if not chat and body.get("tools") not in (None, []):
        raise ApiError(400, "tools: served on /v1/chat/completions only", "tools")
    _structured_output(body, s)
    return s


# Parameters Baton does not serve: refused, never ignored (tools: on chat completions only).
UNSUPPORTED = ("functions", "function_call")
# Every parameter a request may carry; any other is refused naming it, never ignored.
_COMMON = {*_SAMPLING, "model", "stream", "stream_options", "stop", "stop_token_ids", "logit_bias", "logprobs",
           "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
           "user", "metadata", "priority", *UNSUPPORTED}
_KNOWN = {False: {*_COMMON, "prompt", "best_of", "echo", "suffix", "tools"},
          True: {*_COMMON, "messages", "tools", "tool_choice", "top_logprobs", "parallel_tool_calls", "store",
                 "service_tier"}}
# Accepted only at the value that asks for nothing Baton lacks.
_ONLY = {"best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "store": (None, False),
         "service_tier": (None, "auto", "default")}


def check_parameters(body: dict, chat: bool) -> None:
    """Refuse (400 naming it) a parameter Baton does not implement, or one set to a value it cannot honour."""
    unknown = sorted(set(body) - _KNOWN[chat])
    if unknown:
        raise ApiError(400, f"{unknown[0]}: not supported by this server "
                            f"({'/v1/chat/completions' if chat else '/v1/completions'})", unknown[0])
    for name, allowed in _ONLY.items():
        if name in body and body[name] not in allowed:
            raise ApiError(400, f"{name}: only {', '.join(repr(a) for a in allowed if a is not None)} is supported, "
                                f"got {body[name]!r}", name)
# vLLM's older spellings of its structured_outputs keys.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _structured_output(body: dict, s: pb.SamplingParams) -> None:
    """OpenAI's response_format, vLLM's structured_outputs extra and its guided_* fields, onto
    the request's one structured_output; two of them at once are refused."""
    for name in UNSUPPORTED:
        if body.get(name) not in (None, [], "none"):
            raise ApiError(400, f"{name}: not supported by this server", name)
    asked: list[tuple[str, str, object]] = []  # (parameter, kind, value)
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            asked.append(("response_format", "json_object", True))
        elif kind == "json_schema" and isinstance(fmt.get("json_schema"), dict) \
                and isinstance(fmt["json_schema"].get("schema"), dict):
            asked.append(("response_format", "json", fmt["json_schema"]["schema"]))
        elif kind != "text":
            raise ApiError(400, "response_format: must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                "{\"type\": \"json_schema\", \"json_schema\": {\"schema\": {...}}}", "response_format")
    extra = body.get("structured_outputs")
    if extra is not None:
        if not isinstance(extra, dict):
            raise ApiError(400, "structured_outputs: must be an object", "structured_outputs")
        asked += [("structured_outputs", k, v) for k, v in extra.items() if v is not None]
    asked += [(name, kind, body[name]) for name, kind in _GUIDED.items() if body.get(name) is not None]
    if len(asked) > 1:
        raise ApiError(400, f"{asked[1][0]}: only one structured output constraint at a time "
                            f"(also given: {asked[0][0]})", asked[1][0])
    if not asked:
        return
    param, kind, value = asked[0]
    if kind == "json":
        s.json_schema = value if isinstance(value, str) else json.dumps(value)
    elif kind == "json_object" and value is True:
        s.json_object = True
    elif kind in ("regex", "grammar") and isinstance(value, str):
        setattr(s, kind, value)
    elif kind == "choice" and isinstance(value, list) and all(isinstance(c, str) for c in value):
        s.choice.options.extend(value)
    else:
        raise ApiError(400, f"{param}: {kind} must be " + {"json": "a JSON schema", "json_object": "true",
                                                           "choice": "a list of strings"}.get(kind, "a string")
                       + " (one of json, json_object, regex, choice, grammar)", param)


def int_list(body: dict, name: str) -> list[int]:
    value = body[name]
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise ApiError(400, f"{name}: must be a list of integers", name)
    return value


def chat_messages_from_body(body: dict) -> list[pb.ChatMessage]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        images = []
        if isinstance(content, list):  # content parts: the text ones joined, the images before them
            images = [_image_part(p, f"messages[{i}].content[{j}]") for j, p in enumerate(content)
                      if isinstance(p, dict) and p.get("type") == "image_url"]
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if content is None and calls:  # an assistant turn that only called tools
            content = ""
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise ApiError(400, "messages: each needs a role and a text content (an assistant's may be null "
                                "when it has tool_calls)", "messages")
        message = pb.ChatMessage(role=m["role"], content=content, tool_call_id=str(m.get("tool_call_id") or ""),
                                 images=images)
        if calls:
            message.tool_calls_json = json.dumps(calls)
            try:
                tool_calls_for_template(message.tool_calls_json)
            except InvalidArgument as e:
                raise ApiError(400, f"messages: tool_calls {e.reason}", "messages") from None
        out.append(message)
    return out


_IMAGE_FIELD = re.compile(r"chat\.messages(?:\[(\d+)\]\.images\[(\d+)\]|\.images)")


def image_error(error: ApiError, body: dict) -> ApiError:
    """An error about a chat's images named as the request named them: chat.messages[i].images[j]
    as messages[i].content[k] (the message's k-th content part is its j-th image), and
    chat.messages.images as messages."""
    match = _IMAGE_FIELD.match(error.param or "")
    if match is None:
        return error
    param = "messages"
    if match.group(1) is not None:
        i, j = int(match.group(1)), int(match.group(2))
        parts = body["messages"][i]["content"]
        k = [n for n, p in enumerate(parts) if isinstance(p, dict) and p.get("type") == "image_url"][j]
        param = f"messages[{i}].content[{k}]"
    return ApiError(error.status, param + str(error).removeprefix(match.group(0)), param, error.kind)


def _image_part(part: dict, param: str) -> pb.Image:
    """An image_url content part ({"type": "image_url", "image_url": {"url": ...}}) as the server
    reads it (data:, file:// or http(s) URLs)."""
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url:
        raise ApiError(400, f"{param}: an image_url part needs image_url.url", param)
    return pb.Image(url=url)


def prompts_from_body(body: dict) -> list[pb.GenerateRequest]:
    """/v1/completions' prompt: a text, token ids, or a list of either (a request each)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError(400, "prompt: must be a text, token ids, or a non-empty list of either", "prompt")
    requests = []
    for p in prompt:
        msg = pb.GenerateRequest()
        if isinstance(p, str):
            msg.text = p
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            in_range("prompt", lambda: msg.token_ids.ids.extend(p))  # noqa: B023 - called at once
        else:
            raise ApiError(400, "prompt: must be a text, token ids, or a non-empty list of either", "prompt")
        requests.append(msg)
    return requests


class Completion:
    """The OpenAI shapes of one completion request's responses: as a whole, or event by event."""

    def __init__(self, token_text, request_id: str, model: str, chat: bool, created: float, tools=None):
        """token_text(token id) -> the token's text, for logprobs; `tools`: a tools.ToolPlan,
        whose calls the answer carries as tool_calls."""
        self.token_text, self.id, self.model, self.chat = token_text, request_id, model, chat
        self.tools = tools
        self.created = int(created)
        self.choices: dict[int, dict] = {}
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        self._prompts_counted: set[str] = set()
        # text_event's template: sse() of a chunk with one choice, but for its index and text.
        self._text_head = sse(self._chunk([]))[:-len(b"]}\n\n")] + b'{"index":'
        self._text_key = b',"delta":{"content":' if chat else b',"text":'
        self._text_tail = (b"}" if chat else b"") + b',"logprobs":null,"finish_reason":null}]}\n\n'

    def _choice(self, index: int) -> dict:
        return self.choices.setdefault(index, {"text": "", "logprobs": [], "finish_reason": None,
                                               "stop_reason": None, "started": False, "prompt_logprobs": None})

    def _account(self, index: int, resp: pb.GenerateResponse) -> list[dict]:
        """Add resp to its choice; returns its tokens' logprob entries."""
        choice = self._choice(index)
        choice["text"] += resp.text
        entries = self._logprobs(resp)
        choice["logprobs"] += entries
        if resp.prompt_logprobs:  # vLLM's shape: None for the first token, then {token id: ...} per token
            text = self.token_text
            choice["prompt_logprobs"] = [None] + [
                {str(t): {"logprob": v, "decoded_token": text(t)} for t, v in
                 [(lp.token_id, lp.logprob), *zip(lp.top_token_ids, lp.top_logprobs)]} for lp in resp.prompt_logprobs]
        if resp.finish_reason:
            choice["finish_reason"] = FINISH_REASON_NAMES.get(resp.finish_reason, "stop")
            stop = resp.WhichOneof("stop_reason")
            choice["stop_reason"] = getattr(resp, stop) if stop else None
            u = resp.usage
            self.usage["completion_tokens"] += u.completion_tokens
            if resp.request_id not in self._prompts_counted:  # a prompt counts once, not per completion
                self._prompts_counted.add(resp.request_id)
                self.usage["prompt_tokens"] += u.prompt_tokens
                self.usage["cached_tokens"] += u.cached_tokens
        return entries

    def _logprobs(self, resp: pb.GenerateResponse) -> list[dict]:
        text = self.token_text
        return [{"token": text(lp.token_id), "logprob": lp.logprob, "top": [
            (text(t), v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)]} for lp in resp.logprobs]

    def add(self, item: tuple[int, pb.GenerateResponse]) -> None:
        self._account(*item)

    def _usage(self) -> dict:
        u = self.usage
        return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}

    def _logprobs_shape(self, entries: list[dict], offset: int = 0) -> dict | None:
        if not entries:
            return None
        if self.chat:
            return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode()),
                                 "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                                  for t, v in e["top"]]} for e in entries]}
        offsets, at = [], offset
        for e in entries:
            offsets.append(at)
            at += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [dict(e["top"]) for e in entries], "text_offset": offsets}

    def whole(self) -> dict:
        choices = []
        for index in sorted(self.choices):
            c = self.choices[index]
            choice = {"index": index, "finish_reason": c["finish_reason"], "stop_reason": c["stop_reason"],
                      "logprobs": self._logprobs_shape(c["logprobs"])}
            if c["prompt_logprobs"] is not None:
                choice["prompt_logprobs"] = c["prompt_logprobs"]
            if self.chat and self.tools is not None:
                content, calls = self.tools.calls(c["text"])
                choice["message"] = {"role": "assistant", "content": content,
                                     **({"tool_calls": calls} if calls else {})}
                if calls and c["finish_reason"] == "stop":
                    choice["finish_reason"] = "tool_calls"
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": c["text"]}
            else:
                choice["text"] = c["text"]
            choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self._usage()}

    def events(self, item: tuple[int, pb.GenerateResponse]) -> list[dict]:
        index, resp = item
        choice = self._choice(index)
        offset = len(choice["text"])
        first = not choice["started"]
        choice["started"] = True
        logprobs = self._logprobs_shape(self._account(index, resp), offset)
        finish = FINISH_REASON_NAMES.get(resp.finish_reason) if resp.finish_reason else None
        if not (resp.text or logprobs or finish or (first and self.chat)):
            return []
        if self.chat and self.tools is not None:
            delta, finish = self._tool_delta(choice, resp.text, first, finish)
            body = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        elif self.chat:
            delta = {"role": "assistant", "content": resp.text} if first else {"content": resp.text}
            body = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            body = {"index": index, "text": resp.text, "logprobs": logprobs, "finish_reason": finish}
        if finish:
            body["stop_reason"] = choice["stop_reason"]
        return [self._chunk([body])]

    def text_event(self, index: int, text: str) -> bytes:
        """The event of a response with nothing but this text, neither its choice's first nor
        its last (a sink's, DirectContext), as sse(events()) makes it, from a template: most of
        a stream is these."""
        choice = self._choice(index)
        if self.tools is not None or not choice["started"]:
            return b"".join(map(sse, self.events((index, pb.GenerateResponse(text=text)))))
        if not text:
            return b""
        choice["text"] += text
        return b"".join((self._text_head, str(index).encode(), self._text_key, json.dumps(text).encode(),
                         self._text_tail))

    def _chunk(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}

    def _tool_delta(self, choice: dict, text: str, first: bool, finish: str | None) -> tuple[dict, str | None]:
        """A stream's delta under tools: a named function's arguments stream as they come;
        "required" and "auto" answers are parsed whole, so they come with the last event."""
        delta = {"role": "assistant"} if first else {}
        if self.tools.choice not in ("auto", "required"):
            call = {"index": 0, "function": {"arguments": text}}
            if first:
                call.update(id=f"call_{self.id[-24:]}", type="function")
                call["function"]["name"] = self.tools.choice
            delta["tool_calls"] = [call]
        elif finish:
            content, calls = self.tools.calls(choice["text"])
            delta["content"] = content
            if calls:
                delta["tool_calls"] = [dict(c, index=i) for i, c in enumerate(calls)]
        if finish == "stop" and (self.tools.choice not in ("auto",) or delta.get("tool_calls")):
            finish = "tool_calls"
        return delta, finish

    def usage_event(self) -> dict:
        return {**self._chunk([]), "usage": self._usage()}


DONE_EVENT = b"data: [DONE]\n\n"


def sse(event: dict) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
