"""Structured outputs and tool calling through a real ``tokenmill serve`` (default model) and the official
``openai`` client: JSON mode, JSON schemas (validated with ``jsonschema``), regex, choice, grammar, tool_choice
``required`` / named / ``auto`` (hermes parser), streamed tool-call deltas equal to the whole response, 400s for
bad constraints, and unconstrained requests unaffected by constrained ones in the same batch."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.conftest import TOOL_SERVER_KEY, RealServer
from tests.entrypoints.helpers import assert_error

pytestmark = pytest.mark.slow

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
USER = [{"role": "user", "content": "Describe a person as JSON."}]

SCHEMAS = {
    "nested-object": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20},
                       "address": {"type": "object",
                                   "properties": {"city": {"type": "string", "maxLength": 20},
                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                   "required": ["city", "zip"]}},
        "required": ["name", "address"],
    },
    "array-min-items": {
        "type": "object",
        "properties": {"hobbies": {"type": "array", "items": {"type": "string", "maxLength": 15},
                                   "minItems": 2, "maxItems": 4}},
        "required": ["hobbies"],
    },
    "enums-and-required": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "integer", "minimum": 1, "maximum": 10},
                       "ok": {"type": "boolean"}},
        "required": ["color", "size", "ok"],
    },
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
TOOL_USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_MAX_TOKENS = 80


@pytest.fixture(scope="module")
def server(tool_server: RealServer) -> RealServer:
    return tool_server


@pytest.fixture(scope="module")
def oai(server: RealServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=TOOL_SERVER_KEY, max_retries=0, timeout=300)


def post(url: str, **kwargs: Any) -> httpx.Response:
    """``httpx.post`` with the shared server's API key."""
    return httpx.post(url, headers={"Authorization": f"Bearer {TOOL_SERVER_KEY}"}, **kwargs)


def async_client(server: RealServer) -> openai.AsyncOpenAI:
    """A client for one ``asyncio.run`` (its connection pool belongs to that event loop)."""
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=TOOL_SERVER_KEY, max_retries=0, timeout=300)


def chat(oai: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("messages", USER)
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 200)
    return oai.chat.completions.create(model=MODEL, **kw)


def test_json_mode_output_parses(oai: openai.OpenAI) -> None:
    r = chat(oai, response_format={"type": "json_object"}, max_tokens=200)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_json_schemas_validate(server: RealServer) -> None:
    aoai = async_client(server)

    async def one(schema: dict[str, Any]) -> Any:
        return await aoai.chat.completions.create(
            model=MODEL, messages=USER, temperature=0, max_tokens=200,
            response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}})

    async def run() -> list[Any]:
        return await asyncio.gather(*(one(s) for s in SCHEMAS.values()))

    for (name, schema), r in zip(SCHEMAS.items(), asyncio.run(run())):
        content = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (name, content)
        jsonschema.validate(json.loads(content), schema)


def test_regex_choice_and_grammar(oai: openai.OpenAI) -> None:
    r = chat(oai, extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]{2,8} is [0-9]{1,3} years old\."}})
    assert re.fullmatch(r"[A-Z][a-z]{2,8} is [0-9]{1,3} years old\.", r.choices[0].message.content)
    r = chat(oai, extra_body={"structured_outputs": {"choice": ["positive", "negative", "neutral"]}})
    assert r.choices[0].message.content in ("positive", "negative", "neutral")
    grammar = 'root ::= "SELECT " col (", " col)* " FROM users;"\ncol ::= "id" | "name" | "email"'
    r = chat(oai, extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"SELECT (id|name|email)(, (id|name|email))* FROM users;", r.choices[0].message.content)
    c = oai.completions.create(model=MODEL, prompt="The answer is", max_tokens=20, temperature=0,
                               extra_body={"structured_outputs": {"regex": "(yes|no)!"}})
    assert c.choices[0].text in ("yes!", "no!")


def arguments_valid(call: Any, tools: list[dict[str, Any]] = TOOLS) -> dict[str, Any]:
    tool = next(t for t in tools if t["function"]["name"] == call.function.name)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    assert call.id.startswith("call_") and call.type == "function"
    return arguments


def test_tool_choice_required_gives_valid_calls(oai: openai.OpenAI) -> None:
    r = chat(oai, messages=TOOL_USER, tools=TOOLS, tool_choice="required", max_tokens=TOOL_MAX_TOKENS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        arguments_valid(call)
    r = chat(oai, messages=TOOL_USER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
             max_tokens=TOOL_MAX_TOKENS)
    assert len(r.choices[0].message.tool_calls) == 1


def test_named_tool_gives_valid_arguments(oai: openai.OpenAI) -> None:
    r = chat(oai, messages=TOOL_USER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
             max_tokens=TOOL_MAX_TOKENS)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # a forced call ends as OpenAI's API does
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    arguments_valid(call)


# A regex that makes the small model write a Hermes-style call, so the auto path's parser has something to read.
HERMES_CALL = (r'Checking\.<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,9}", '
               r'"unit": "(celsius|fahrenheit)"\}\}\n</tool_call>')


def test_auto_tool_choice_parses_hermes_calls(oai: openai.OpenAI) -> None:
    r = chat(oai, messages=TOOL_USER, tools=TOOLS, extra_body={"structured_outputs": {"regex": HERMES_CALL}},
             max_tokens=TOOL_MAX_TOKENS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments_valid(call)
    r = chat(oai, messages=TOOL_USER, tools=TOOLS, tool_choice="auto", max_tokens=10)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def reassemble(stream: Any) -> tuple[str, list[dict[str, str]], str | None]:
    content, calls, finish = "", [], None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                if piece.id is not None:
                    assert piece.index == len(calls) and piece.type == "function" and piece.function.name
                    calls.append({"id": piece.id, "name": piece.function.name,
                                  "arguments": piece.function.arguments or ""})
                else:
                    assert piece.function.name is None
                    calls[piece.index]["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("mode", ["required", "named", "auto"])
def test_streamed_tool_call_deltas_equal_the_whole_response(oai: openai.OpenAI, mode: str) -> None:
    kw: dict[str, Any] = {"messages": TOOL_USER, "tools": TOOLS, "max_tokens": TOOL_MAX_TOKENS}
    if mode == "required":
        kw["tool_choice"] = "required"
    elif mode == "named":
        kw["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    else:
        kw["extra_body"] = {"structured_outputs": {"regex": HERMES_CALL}}
    whole = chat(oai, **kw).choices[0]
    content, calls, finish = reassemble(chat(oai, stream=True, **kw))
    assert finish == whole.finish_reason
    assert content == (whole.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    if mode == "required":  # the official client's stream helper accumulates the same calls
        with oai.chat.completions.stream(model=MODEL, temperature=0, **kw) as stream:
            final = stream.get_final_completion()
        assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == [
            (c["name"], c["arguments"]) for c in calls]


def test_tool_history_goes_through_the_template(oai: openai.OpenAI) -> None:
    plain = chat(oai, messages=TOOL_USER, max_tokens=1)
    with_tools = chat(oai, messages=TOOL_USER, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the template rendered the tools
    history = TOOL_USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    followed = chat(oai, messages=history, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert followed.usage.prompt_tokens > with_tools.usage.prompt_tokens + 20


@pytest.mark.parametrize(("body", "param", "match"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema", "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "yaml"}}, "response_format", "not supported"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"grammar": 'root ::= "a" | nothing'}}, "structured_outputs", "nothing"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs.jsonn", None),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "cannot be combined"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "tool_choice"),
])
def test_bad_constraints_are_400_with_the_field(server: RealServer, body: dict[str, Any], param: str,
                                                match: str | None) -> None:
    payload = {"model": MODEL, "messages": USER, "max_tokens": 5, **body}
    error = assert_error(post(server.url + "/v1/chat/completions", json=payload, timeout=60), 400, param)
    if match is not None:
        assert match in error["message"]


def test_completions_refuse_bad_constraints_and_serve_after(server: RealServer, oai: openai.OpenAI) -> None:
    payload = {"model": MODEL, "prompt": "x", "max_tokens": 5, "response_format": {"type": "json_schema",
                                                                                  "json_schema": {"schema": 3}}}
    assert_error(post(server.url + "/v1/completions", json=payload, timeout=60), 400,
                 "response_format.json_schema.schema")
    r = chat(oai, extra_body={"structured_outputs": {"choice": ["ok"]}})
    assert r.choices[0].message.content == "ok"


def test_mixed_batch_leaves_unconstrained_requests_unchanged(server: RealServer) -> None:
    aoai = async_client(server)
    prompts = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]

    async def plain(prompt: str) -> list[str]:
        r = await aoai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True})
        return r.choices[0].text

    async def constrained(i: int) -> str:
        r = await aoai.chat.completions.create(
            model=MODEL, messages=USER, temperature=0, max_tokens=200,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "o", "schema": SCHEMAS["enums-and-required"]}})
        return r.choices[0].message.content

    async def run() -> tuple[list[str], list[Any]]:
        solo = [await plain(p) for p in prompts]
        mixed = await asyncio.gather(*(plain(p) for p in prompts), *(constrained(i) for i in range(3)))
        return solo, mixed

    solo, mixed = asyncio.run(run())
    assert list(mixed[:3]) == solo
    for content in mixed[3:]:
        jsonschema.validate(json.loads(content), SCHEMAS["enums-and-required"])


# ------------------------------------------------------------------------------------- /v1/responses


def responses_tools() -> list[dict[str, Any]]:
    """``TOOLS`` in the Responses API's flat function-tool shape."""
    return [{"type": "function", **t["function"]} for t in TOOLS]


def test_responses_text_format_json_schema_validates(oai: openai.OpenAI) -> None:
    for name, schema in SCHEMAS.items():
        r = oai.responses.create(model=MODEL, input=USER[0]["content"], temperature=0, max_output_tokens=200,
                                 text={"format": {"type": "json_schema", "name": "out", "schema": schema,
                                                  "strict": True}})
        assert r.status == "completed", (name, r.output_text)
        jsonschema.validate(json.loads(r.output_text), schema)
    r = oai.responses.create(model=MODEL, input=USER[0]["content"], temperature=0, max_output_tokens=200,
                             text={"format": {"type": "json_object"}})
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


def test_responses_forced_tool_calls_whole_and_streamed(oai: openai.OpenAI) -> None:
    tools = responses_tools()
    for choice in ("required", {"type": "function", "name": "get_time"}):
        kw: dict[str, Any] = {"model": MODEL, "input": TOOL_USER[0]["content"], "tools": tools,
                              "tool_choice": choice, "temperature": 0, "max_output_tokens": TOOL_MAX_TOKENS}
        whole = oai.responses.create(**kw)
        calls = [item for item in whole.output if item.type == "function_call"]
        assert calls and whole.status == "completed"
        for call in calls:
            tool = next(t for t in tools if t["name"] == call.name)
            jsonschema.validate(json.loads(call.arguments), tool["parameters"])
            assert call.call_id.startswith("call_")
        if isinstance(choice, dict):
            assert [c.name for c in calls] == ["get_time"]
        with oai.responses.stream(**kw) as stream:
            final = stream.get_final_response()
        assert [(c.name, c.arguments) for c in final.output if c.type == "function_call"] == [
            (c.name, c.arguments) for c in calls]


def test_responses_bad_schema_is_a_400_and_the_server_serves_after(server: RealServer, oai: openai.OpenAI) -> None:
    payload = {"model": MODEL, "input": "x", "max_output_tokens": 5,
               "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}}
    error = assert_error(post(server.url + "/v1/responses", json=payload, timeout=60), 400,
                         "text.format.schema")
    assert "strin" in error["message"]
    r = oai.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=3)
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens > 0
