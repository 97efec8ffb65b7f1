"""Tool calls and structured outputs through the app over the fake engine (no model, fast): what reaches the
engine (the constraint, the parser's special-token setting) and how the reply becomes ``message.tool_calls``
and ``delta.tool_calls``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.entrypoints.fake_engine import SERVED_NAME, FakeAsyncLLM, server_args
from tests.entrypoints.helpers import CHAT, COMPLETIONS, assert_error, sse_chunks
from tokenmill.entrypoints.openai.api_server import build_app

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]
HERMES_REPLY = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
                '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
MESSAGES = [{"role": "user", "content": "Weather?"}]


def make_client(reply: str, **args: Any) -> tuple[TestClient, FakeAsyncLLM]:
    engine = FakeAsyncLLM(max_model_len=1024, reply=reply)
    return TestClient(build_app(engine, server_args(**args))), engine


def body(**fields: Any) -> dict[str, Any]:
    return {"model": SERVED_NAME, "messages": MESSAGES, **fields}


def streamed(client: TestClient, payload: dict[str, Any]) -> tuple[dict[int, str], dict[int, list[dict]], dict]:
    """Content and calls per choice index rebuilt from the SSE chunks, and the finish reasons."""
    r = client.post(CHAT, json={**payload, "stream": True})
    assert r.status_code == 200, r.text
    content: dict[int, str] = {}
    calls: dict[int, list[dict]] = {}
    finish: dict[int, str] = {}
    for chunk in sse_chunks(r.text):
        for choice in chunk["choices"]:
            i = choice["index"]
            delta = choice["delta"]
            content[i] = content.get(i, "") + (delta.get("content") or "")
            for piece in delta.get("tool_calls", []):
                mine = calls.setdefault(i, [])
                if "id" in piece:
                    assert piece["index"] == len(mine) and piece["type"] == "function"
                    mine.append({"id": piece["id"], "name": piece["function"]["name"],
                                 "arguments": piece["function"].get("arguments", "")})
                else:
                    assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
                    mine[piece["index"]]["arguments"] += piece["function"]["arguments"]
            if choice["finish_reason"]:
                finish[i] = choice["finish_reason"]
    return content, calls, finish


def test_auto_with_hermes_parser_whole_and_streamed() -> None:
    client, engine = make_client(HERMES_REPLY, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with client:
        whole = client.post(CHAT, json=body(tools=TOOLS)).json()["choices"][0]
        content, calls, finish = streamed(client, body(tools=TOOLS))
    assert whole["finish_reason"] == "tool_calls" and finish == {0: "tool_calls"}
    assert whole["message"]["content"] == "Let me check." == content[0]
    names = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["message"]["tool_calls"]]
    assert names == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert [(c["name"], c["arguments"]) for c in calls[0]] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    assert all(call.params.skip_special_tokens is False for call in engine.calls)  # the tags must reach the parser
    assert all(call.params.structured_outputs is None for call in engine.calls)


def test_auto_parallel_tool_calls_false_keeps_the_first_call() -> None:
    client, _ = make_client(HERMES_REPLY, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with client:
        whole = client.post(CHAT, json=body(tools=TOOLS, parallel_tool_calls=False)).json()["choices"][0]
        _, calls, _ = streamed(client, body(tools=TOOLS, parallel_tool_calls=False))
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather"]
    assert [c["name"] for c in calls[0]] == ["get_weather"]


def test_auto_with_n_2_streams_each_choice() -> None:
    client, _ = make_client(HERMES_REPLY, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with client:
        content, calls, finish = streamed(client, body(tools=TOOLS, n=2))
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    assert [len(calls[i]) for i in (0, 1)] == [2, 2] and content == {0: "Let me check.", 1: "Let me check."}


def test_auto_without_the_flags_is_a_400_naming_them() -> None:
    client, engine = make_client(HERMES_REPLY)
    with client:
        for payload in (body(tools=TOOLS), body(tools=TOOLS, tool_choice="auto")):
            error = assert_error(client.post(CHAT, json=payload), 400, "tool_choice")
            assert "--enable-auto-tool-choice" in error["message"] and "--tool-call-parser" in error["message"]
        ok = client.post(CHAT, json=body(tools=TOOLS, tool_choice="none")).json()["choices"][0]
    assert ok["message"]["content"] == HERMES_REPLY and "tool_calls" not in ok["message"]
    assert len(engine.calls) == 1


def test_required_sends_the_calls_schema_and_parses_the_array() -> None:
    reply = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    client, engine = make_client(reply)
    with client:
        whole = client.post(CHAT, json=body(tools=TOOLS, tool_choice="required")).json()["choices"][0]
        _, calls, finish = streamed(client, body(tools=TOOLS, tool_choice="required"))
    so = engine.calls[0].params.structured_outputs
    assert so is not None and so.backend == "xgrammar" and so.disable_any_whitespace
    schema = so.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert whole["finish_reason"] == "tool_calls" == finish[0] and whole["message"]["content"] is None
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    assert got == [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Oslo"}')]
    assert [(c["name"], c["arguments"]) for c in calls[0]] == got
    with client:
        client.post(CHAT, json=body(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert engine.calls[-1].params.structured_outputs.json["maxItems"] == 1


def test_named_function_constrains_to_its_arguments() -> None:
    client, engine = make_client('{"city": "Rome"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    with client:
        whole = client.post(CHAT, json=body(tools=TOOLS, tool_choice=named)).json()["choices"][0]
        _, calls, finish = streamed(client, body(tools=TOOLS, tool_choice=named))
    assert engine.calls[0].params.structured_outputs.json == TOOLS[0]["function"]["parameters"]
    assert whole["finish_reason"] == "stop" == finish[0]
    (call,) = whole["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert [(c["name"], c["arguments"]) for c in calls[0]] == [("get_weather", '{"city": "Rome"}')]


@pytest.mark.parametrize(("fields", "check"), [
    ({"response_format": {"type": "json_object"}}, lambda so: so.json_object),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                 "schema": {"type": "object"}}}},
     lambda so: so.json == {"type": "object"} and so.disable_additional_properties),
    ({"structured_outputs": {"choice": ["a", "b"], "disable_any_whitespace": True}},
     lambda so: so.choice == ["a", "b"] and so.disable_any_whitespace),
    ({"guided_regex": "[ab]+"}, lambda so: so.regex == "[ab]+"),
    ({"structured_outputs": {"regex": "x", "disable_fallback": True}}, lambda so: so.backend == "xgrammar"),
])
def test_constraints_reach_the_engine(fields: dict[str, Any], check: Any) -> None:
    client, engine = make_client("ok")
    with client:
        assert client.post(CHAT, json=body(**fields)).status_code == 200
        assert client.post(COMPLETIONS, json={"model": SERVED_NAME, "prompt": "x", **fields}).status_code == 200
    for call in engine.calls:
        so = call.params.structured_outputs
        assert so is not None and so.backend in ("xgrammar", "guidance") and check(so)


def test_tools_and_history_reach_the_template() -> None:
    template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}(call {{ c.function.name }} {{ c.function.arguments.city }})"
                "{% endfor %}{% endfor %}")
    client, engine = make_client("ok", chat_template=template)
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
    ]
    with client:
        assert client.post(CHAT, json=body(messages=history, tools=TOOLS, tool_choice="none")).status_code == 200
    prompt = engine.tokenizer.decode(engine.calls[0].prompt)
    assert prompt.startswith("[tool get_weather][tool get_time]")
    assert "(call get_weather Paris)" in prompt and "<tool>21C" in prompt
