"""Tool calling on the OpenAI front, read by the official `openai` client: a named function's
arguments and "required" calls always parse under the tools' parameter schemas (a model of
random weights would never write them by chance), whole and streamed; "auto" turns calls a
model writes in the Hermes format into tool_calls and leaves plain answers as content; bad
tools and choices get 400 naming the parameter."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from baton.services.openai.tools import ToolPlan

WEATHER = {"name": "get_weather", "description": "The weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
    "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                           "required": ["zone"], "additionalProperties": False}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
SCHEMAS = {"get_weather": WEATHER["parameters"], "get_time": TIME["parameters"]}
ASKS = ["What is the weather in Paris?", "hi", "Tell me the time."]


@pytest.fixture(scope="module")
def front(tiny_llama):
    from servers import ServerThread

    srv = ServerThread(tiny_llama, {"http_port": 0}).start()
    try:
        yield openai.OpenAI(base_url=srv.server.http.url + "/v1", api_key="none", max_retries=0), srv.server.model_name
    finally:
        srv.close()


def chat(client, model, ask, **kwargs):
    kwargs = {"max_tokens": 200, "temperature": 0, **kwargs}
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": ask}], tools=TOOLS,
                                          **kwargs)


def test_a_named_function_s_arguments_parse_whole_and_streamed(front):
    client, model = front
    named = {"type": "function", "function": {"name": "get_weather"}}
    for ask in ASKS:
        choice = chat(client, model, ask, tool_choice=named).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
        streamed, finish, names = "", None, set()
        for chunk in chat(client, model, ask, tool_choice=named, stream=True):
            delta = chunk.choices[0].delta
            for c in delta.tool_calls or []:
                streamed += c.function.arguments or ""
                names |= {c.function.name} - {None}
            finish = chunk.choices[0].finish_reason or finish
        assert streamed == call.function.arguments and names == {"get_weather"} and finish == "tool_calls"


def test_required_calls_parse_under_their_tools_schemas(front):
    client, model = front
    for ask in ASKS:
        choice = chat(client, model, ask, tool_choice="required", temperature=1.0, seed=7).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        streamed = [c for chunk in chat(client, model, ask, tool_choice="required", temperature=1.0, seed=7,
                                        stream=True) for c in chunk.choices[0].delta.tool_calls or []]
        assert [(c.function.name, c.function.arguments) for c in streamed] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_auto_turns_hermes_calls_into_tool_calls_and_leaves_answers_as_content(front):
    plan = ToolPlan(tuple(t["function"] for t in TOOLS), "auto")
    content, calls = plan.calls('Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n'
                                '</tool_call>')
    assert content == "Let me check." and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                           for c in calls] == [("get_time", {"zone": "utc"})]
    assert plan.calls("<tool_call>{\"name\": \"unknown\", \"arguments\": {}}</tool_call>")[1] == []
    client, model = front  # a random model writes no call: its answer is content
    choice = chat(client, model, "hi", max_tokens=8).choices[0]
    assert choice.message.tool_calls is None and choice.message.content and choice.finish_reason == "length"


@pytest.mark.parametrize("kwargs,param", [
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="sometimes"), "tool_choice"),
    (dict(tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
])
def test_bad_tool_choices_are_refused_naming_the_parameter(front, kwargs, param):
    client, model = front
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, model, "hi", **kwargs)
    assert err.value.body["param"] == param


def test_bad_tools_are_refused_naming_the_parameter(front):
    client, model = front
    for tools in ([{"type": "function"}], [{"type": "function", "function": {"name": "f", "parameters": 3}}]):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], tools=tools)
        assert err.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="hi", extra_body={"tools": TOOLS})
    assert err.value.body["param"] == "tools"


def test_auto_end_to_end_with_a_model_that_writes_a_call(front):
    """A model that writes a Hermes call (here made to, by a regex constraint): "auto" returns it
    as tool_calls with finish_reason tool_calls, whole and streamed."""
    client, model = front
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>'
    regex = call.replace("{", "\\{").replace("}", "\\}")
    whole = chat(client, model, "Tell me the time.", extra_body={"structured_outputs": {"regex": regex}})
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_time", {"zone": "cet"})]
    chunks = list(chat(client, model, "Tell me the time.", stream=True,
                       extra_body={"structured_outputs": {"regex": regex}}))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert "".join(d.tool_calls[0].function.arguments or "" for d in deltas) == '{"zone": "cet"}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_templates_without_tools_get_the_built_in_tool_prompt(tiny_llama):
    from baton.engine.common.tokenizer import apply_chat_template, load_tokenizer

    tokenizer = load_tokenizer(tiny_llama)  # ChatML, which renders no tools
    asked = [{"role": "user", "content": "Tell me the time."}]
    with_tools = tokenizer.decode(apply_chat_template(tokenizer, asked, TOOLS))
    assert "<tools>" in with_tools and '"name": "get_time"' in with_tools and "<tool_call>" in with_tools
    assert with_tools.index("<tools>") < with_tools.index("Tell me the time.")
    system = [{"role": "system", "content": "Be brief."}, *asked]  # joined to the conversation's own system prompt
    text = tokenizer.decode(apply_chat_template(tokenizer, system, TOOLS))
    assert text.count("<|im_start|>system") == 1 and "Be brief." in text and "<tools>" in text
    # A template that renders tools itself gets them as they are.
    tokenizer.chat_template = ("{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
                               "{% for m in messages %}{{ m.content }}\n{% endfor %}")
    text = tokenizer.decode(apply_chat_template(tokenizer, asked, TOOLS))
    assert "TOOL get_weather" in text and "<tools>" not in text


AGENT = [{"role": "user", "content": "Tell me the time."},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "cet"}'}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "12:30"}]


def test_an_agents_history_of_calls_and_results_is_rendered(tiny_llama):
    """An assistant turn that called tools and the tool's result: as Hermes writes them for a
    template that renders no tool turns, with the arguments as an object for one that does."""
    from baton.engine.common.tokenizer import apply_chat_template, load_tokenizer
    from baton.services.openai.protocol import chat_messages_from_body
    from baton.services.rpc.chat import chat_messages
    from baton.v1 import generate_pb2 as pb

    messages = chat_messages(pb.Chat(messages=chat_messages_from_body({"messages": AGENT})))
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"zone": "cet"}
    tokenizer = load_tokenizer(tiny_llama)  # ChatML
    text = tokenizer.decode(apply_chat_template(tokenizer, messages, TOOLS))
    call = text.index('<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>')
    assert text.index("Tell me the time.") < call < text.index("<tool_response>\n12:30\n</tool_response>")
    tokenizer.chat_template = ("{% for m in messages %}{{ m.role }}:{% for c in m.tool_calls or [] %}"
                               "{{ c.function.name }}({{ c.function.arguments.zone }}){% endfor %}"
                               "{{ m.content }}\n{% endfor %}")
    assert tokenizer.decode(apply_chat_template(tokenizer, messages)).splitlines()[1:] == [
        "assistant:get_time(cet)", "tool:12:30"]


def test_a_second_turn_after_a_call_is_served_and_bad_history_refused(front):
    client, model = front
    reply = client.chat.completions.create(model=model, messages=AGENT, tools=TOOLS, max_tokens=5, temperature=0)
    assert reply.choices[0].finish_reason in ("length", "stop", "tool_calls")
    bad = [AGENT[0], {"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=bad, tools=TOOLS, max_tokens=5)
    assert err.value.body["param"] == "messages" and "tool_calls" in err.value.body["message"]
