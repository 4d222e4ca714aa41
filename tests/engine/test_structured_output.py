"""Output under a constraint (JSON schema, JSON object, regex, choice, grammar) from a model of
random weights, which would never produce it by chance: every output parses and validates,
offline, through a gRPC server, and split across prefill and decode servers (equal to
colocated); a constraint that does not compile is refused naming its field while the other
requests carry on; unconstrained requests in the same batch are unchanged; the OpenAI front
maps response_format, vLLM's structured_outputs and guided_* fields (tools: test_tool_calls.py)."""
from __future__ import annotations

import asyncio
import json
import re

import grpc
import jsonschema
import openai
import pytest
from helpers import TOKEN, collect, wait_serving

from baton import LLM, SamplingParams
from baton.engine.common.errors import InvalidArgument
from baton.engine.common.structured_output import StructuredOutput
from baton.services.client import AsyncClient
from baton.services.rpc.errors import failure_of_error

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
     "required": ["name", "ok"], "additionalProperties": False},
    # Nested objects, an array with min/max items, enums, a bounded number, a pattern, $ref, an optional key.
    {"type": "object", "$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
     "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1,
                             "maxItems": 3},
                    "at": {"$ref": "#/$defs/point"}, "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                    "note": {"type": "string", "maxLength": 4}},
     "required": ["tags", "at", "code"], "additionalProperties": False},
]
PROMPTS = ["Describe it:", "x", [5, 6, 7, 8, 9, 10]]
GRAMMAR = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-d] | "z" [0-9]'
GRAMMAR_RE = re.compile(r"\((?:[a-d]|z[0-9])(?:,(?:[a-d]|z[0-9]))*\)")


def constrained(so: StructuredOutput, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 160), structured_output=so, **kw)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(tiny_llama, dtype="float32", device="cpu") as llm:  # (its grammar compiler's thread stopped after)
        yield llm


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=3)])
def test_every_output_validates_against_its_schema(llm, sampling):
    for schema in SCHEMAS:
        so = StructuredOutput("json_schema", json.dumps(schema))
        for out in llm.generate(PROMPTS, constrained(so, **sampling)):
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), schema)


def test_preempted_and_prefix_cached_requests_keep_their_constraint(llm, tiny_llama):
    """Under a pool too small for the batch (preempted, recomputed, the matcher kept) and with
    their prompts found in the prefix cache, outputs equal an uninterrupted run's."""
    from helpers import random_prompts

    schema = SCHEMAS[1]
    params = constrained(StructuredOutput("json_schema", json.dumps(schema)), temperature=0)
    prompts = random_prompts([40, 70, 33, 90, 55, 20], seed=12)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    small = LLM(tiny_llama, dtype="float32", device="cpu", num_kv_blocks=24, max_model_len=384)
    first = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    again = [small.generate(prompts[3], params)[0] for _ in range(2)]  # the second finds the prompt cached
    assert [o.token_ids for o in first] == want and [o.token_ids for o in again] == [want[3]] * 2
    assert again[1].num_cached_tokens == 80
    for out in first:  # (validation proper: above; a random model here writes an encoded surrogate, which
        # xgrammar counts as one character of a maxLength and Python decodes as three replacement characters)
        assert set(json.loads(out.text)) >= set(schema["required"]) and out.finish_reason == "stop"
    assert small.engine.kv.num_free_blocks == small.engine.num_kv_blocks


def test_regex_choice_grammar_and_json_object_outputs_match(llm):
    sampled = dict(temperature=1.0, seed=5)
    for out in llm.generate(PROMPTS, constrained(StructuredOutput("regex", r"[a-c]{3}-[0-9]{2,4}"), **sampled)):
        assert re.fullmatch(r"[a-c]{3}-[0-9]{2,4}", out.text), out.text
    for out in llm.generate(PROMPTS, constrained(StructuredOutput("choice", ("yes", "no", "maybe so")), **sampled)):
        assert out.text in ("yes", "no", "maybe so")
    for out in llm.generate(PROMPTS, constrained(StructuredOutput("grammar", GRAMMAR), max_tokens=200, **sampled)):
        assert out.finish_reason == "length" or GRAMMAR_RE.fullmatch(out.text), out.text
    for out in llm.generate(PROMPTS, constrained(StructuredOutput("json_object"), max_tokens=200, temperature=0)):
        assert out.finish_reason == "length" or isinstance(json.loads(out.text), dict), out.text


@pytest.mark.parametrize("so,field", [
    (StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"type": "nonsense"}}}'),
     "structured_output.json_schema"),
    (StructuredOutput("regex", "[a-"), "structured_output.regex"),
    (StructuredOutput("grammar", "root ::= undefined_rule"), "structured_output.grammar"),
])
def test_a_constraint_that_does_not_compile_is_refused_naming_its_field(llm, so, field):
    with pytest.raises(InvalidArgument) as err:
        llm.generate(["x"], constrained(so))
    assert err.value.field == field
    with pytest.raises(InvalidArgument, match="^structured_output.json_schema: is not JSON"):
        StructuredOutput("json_schema", "{not json")


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(llm):
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(PROMPTS, plain)]
    so = StructuredOutput("json_schema", json.dumps(SCHEMAS[1]))
    mixed = llm.generate(PROMPTS + PROMPTS, [plain] * 3 + [constrained(so, temperature=0)] * 3)
    assert [o.token_ids for o in mixed[:3]] == alone


def grpc_outputs(address: str, **sampling) -> list[list[int]]:
    async def go():
        async with AsyncClient(address) as client:
            return await asyncio.gather(*(collect(client, p, **sampling) for p in PROMPTS))
    return [ids for ids, _, _ in asyncio.run(go())]


def test_through_a_server_and_split_across_prefill_and_decode_equal_offline(serve, spawn, llm, tiny_llama):
    schema = SCHEMAS[1]
    want = [o.token_ids for o in llm.generate(PROMPTS, constrained(
        StructuredOutput("json_schema", json.dumps(schema)), temperature=0))]
    server = serve(tiny_llama)
    assert grpc_outputs(server.address, max_tokens=160, temperature=0, json_schema=json.dumps(schema)) == want
    prefill = spawn(tiny_llama, "--role", "prefill", "--internal-token", TOKEN)
    decode = spawn(tiny_llama, "--role", "decode", "--internal-token", TOKEN)
    router = spawn(tiny_llama, "--role", "router", "--internal-token", TOKEN, "--prefill", prefill.address,
                   "--decode", decode.address)
    wait_serving(router.address)
    assert grpc_outputs(router.address, max_tokens=160, temperature=0, json_schema=json.dumps(schema)) == want

    async def bad_beside_good():
        async with AsyncClient(server.address) as client:
            bad = collect(client, "x", max_tokens=8, regex="[a-")
            good = collect(client, "x", max_tokens=8, temperature=0, choice={"options": ["yes", "no"]})
            return await asyncio.gather(bad, good, return_exceptions=True)
    bad, good = asyncio.run(bad_beside_good())
    assert isinstance(bad, grpc.aio.AioRpcError) and bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert failure_of_error(bad).field == "sampling.structured_output.regex"
    assert good[1] in ("yes", "no")
    assert server.wait_pool_full()


def test_the_openai_front_maps_response_format_and_refuses_what_it_does_not_serve(serve, tiny_llama):
    srv = serve(tiny_llama, {"http_port": 0})
    client = openai.OpenAI(base_url=srv.server.http.url + "/v1", api_key="none", max_retries=0)
    model, schema = srv.server.model_name, SCHEMAS[0]
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    text = client.completions.create(model=model, prompt="x", max_tokens=16, temperature=0,
                                     extra_body={"structured_outputs": {"choice": ["up", "down"]}}).choices[0].text
    assert text in ("up", "down")
    text = client.completions.create(model=model, prompt="x", max_tokens=16, temperature=0,
                                     extra_body={"guided_regex": "[0-9]{3}"}).choices[0].text
    assert re.fullmatch("[0-9]{3}", text)
    for kwargs, param in [
        (dict(extra_body={"functions": [{"name": "f"}]}), "functions"),  # the deprecated spelling: refused
        (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}), "guided_regex"),
        (dict(response_format={"type": "xml"}), "response_format"),
        (dict(extra_body={"guided_regex": "[a-"}), "structured_output.regex"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           **kwargs)
        assert err.value.body["param"] == param, err.value.body
