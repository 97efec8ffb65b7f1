"""Function tools on ``POST /v1/responses`` over the fake engine (the reply is fixed text, so this tests the
front end): what reaches the template and the engine, ``function_call`` output items, and the stream events
(raw and through the official client's ``responses.stream``), which must add up to the whole response and
never show call markup as text."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from tokenmill.entrypoints.openai.api_server import build_app

from tests.entrypoints.fake_engine import SERVED_NAME, FakeAsyncLLM, server_args
from tests.entrypoints.test_responses import RESPONSES, sse_typed_events

TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"type": "function", "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}},
]
HERMES_REPLY = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
                '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
REQUIRED_REPLY = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
AUTO = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}


def make_client(reply: str, **args: Any) -> tuple[TestClient, FakeAsyncLLM]:
    engine = FakeAsyncLLM(max_model_len=1024, reply=reply)
    return TestClient(build_app(engine, server_args(**args))), engine


def oai_client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def calls_of(output: list[Any]) -> list[tuple[str, str]]:
    return [(item.name, item.arguments) for item in output if item.type == "function_call"]


def streamed(http: TestClient, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """Text and calls rebuilt from the raw events (checking their order and indexes), and the final response."""
    events = sse_typed_events(http.post(RESPONSES, json={**body, "stream": True}).text)
    text = ""
    items: dict[int, dict[str, Any]] = {}
    closed: set[int] = set()
    for e in events:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert e["output_index"] == len(items)  # items are announced in output order
            items[e["output_index"]] = dict(e["item"])
        elif kind == "response.output_text.delta":
            assert items[e["output_index"]]["type"] == "message" and e["output_index"] not in closed
            text += e["delta"]
        elif kind == "response.function_call_arguments.delta":
            item = items[e["output_index"]]
            assert item["type"] == "function_call" and item["id"] == e["item_id"] and e["output_index"] not in closed
            item["arguments"] += e["delta"]
        elif kind == "response.function_call_arguments.done":
            assert items[e["output_index"]]["arguments"] == e["arguments"]
        elif kind == "response.output_item.done":
            closed.add(e["output_index"])
    assert closed == set(items)
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [item["id"] for item in final["output"]] == [items[i]["id"] for i in sorted(items)]
    calls = [items[i] for i in sorted(items) if items[i]["type"] == "function_call"]
    return text, calls, final


def test_auto_with_the_hermes_parser() -> None:
    client, engine = make_client(HERMES_REPLY, **AUTO)
    with client as http:
        oai = oai_client(http)
        whole = oai.responses.create(model=SERVED_NAME, input="Weather?", tools=TOOLS)
        text, calls, final = streamed(http, {"input": "Weather?", "tools": TOOLS})
        with oai.responses.stream(model=SERVED_NAME, input="Weather?", tools=TOOLS) as stream:
            kinds = [e.type for e in stream]
            helper_final = stream.get_final_response()
    assert [item.type for item in whole.output] == ["message", "function_call", "function_call"]
    assert whole.output_text == "Let me check." == text == helper_final.output_text
    expected = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')]
    assert calls_of(whole.output) == expected == [(c["name"], c["arguments"]) for c in calls]
    assert calls_of(helper_final.output) == expected
    assert all(c["call_id"].startswith("call_") and c["status"] == "completed" for c in final["output"][1:])
    assert len({item.call_id for item in whole.output[1:]}) == 2
    assert kinds.count("response.output_item.added") == 3 and kinds.count("response.output_item.done") == 3
    assert all(call.params.skip_special_tokens is False for call in engine.calls)  # the tags reach the parser
    assert all(call.params.structured_outputs is None for call in engine.calls)


def test_tools_and_function_call_history_reach_the_template() -> None:
    template = ("{% for t in tools or [] %}[tool {{ t.function.name }}: {{ t.function.description }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}(call {{ c.function.name }} {{ c.function.arguments.city }})"
                "{% endfor %}{% endfor %}")
    client, engine = make_client("ok", chat_template=template)
    history = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "21C"},
    ]
    with client as http:
        r = http.post(RESPONSES, json={"input": history, "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200, r.text
    prompt = engine.tokenizer.decode(engine.calls[0].prompt)
    assert prompt.startswith("[tool get_weather: Weather of a city][tool get_time: ]")
    assert "(call get_weather Paris)" in prompt and "<tool>21C" in prompt


@pytest.mark.parametrize("limit", [{"parallel_tool_calls": False}, {"max_tool_calls": 1}])
def test_auto_call_limits_keep_the_first_call(limit: dict[str, Any]) -> None:
    client, _ = make_client(HERMES_REPLY, **AUTO)
    with client as http:
        whole = oai_client(http).responses.create(model=SERVED_NAME, input="Weather?", tools=TOOLS, **limit)
        _, calls, final = streamed(http, {"input": "Weather?", "tools": TOOLS, **limit})
    assert calls_of(whole.output) == [("get_weather", '{"city": "Paris"}')]
    assert [c["name"] for c in calls] == ["get_weather"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]


def test_required_is_constrained_to_the_calls_schema() -> None:
    client, engine = make_client(REQUIRED_REPLY)
    with client as http:
        whole = oai_client(http).responses.create(model=SERVED_NAME, input="Weather?", tools=TOOLS,
                                                  tool_choice="required")
        text, calls, final = streamed(http, {"input": "Weather?", "tools": TOOLS, "tool_choice": "required"})
        http.post(RESPONSES, json={"input": "x", "tools": TOOLS, "tool_choice": "required", "max_tool_calls": 3})
    so = engine.calls[0].params.structured_outputs
    assert so is not None and so.disable_any_whitespace
    assert so.json["type"] == "array" and so.json["minItems"] == 1 and "maxItems" not in so.json
    assert [v["properties"]["name"]["enum"] for v in so.json["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert engine.calls[-1].params.structured_outputs.json["maxItems"] == 3
    expected = [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Oslo"}')]
    assert [item.type for item in whole.output] == ["function_call", "function_call"]  # no empty message
    assert calls_of(whole.output) == expected == [(c["name"], c["arguments"]) for c in calls]
    assert text == "" and [item["type"] for item in final["output"]] == ["function_call", "function_call"]


def test_named_function_is_constrained_to_its_arguments() -> None:
    client, engine = make_client('{"city": "Rome"}')
    named = {"type": "function", "name": "get_weather"}
    with client as http:
        whole = oai_client(http).responses.create(model=SERVED_NAME, input="Weather?", tools=TOOLS,
                                                  tool_choice=named)
        _, calls, final = streamed(http, {"input": "Weather?", "tools": TOOLS, "tool_choice": named})
    assert engine.calls[0].params.structured_outputs.json == TOOLS[0]["parameters"]
    assert calls_of(whole.output) == [("get_weather", '{"city": "Rome"}')]
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Rome"}')]
    assert final["tool_choice"] == named


def test_text_without_calls_streams_as_one_message() -> None:
    client, _ = make_client("No tool needed <tool", **AUTO)  # a half tag at the end is text after all
    with client as http:
        whole = oai_client(http).responses.create(model=SERVED_NAME, input="Hi", tools=TOOLS)
        text, calls, final = streamed(http, {"input": "Hi", "tools": TOOLS})
    assert whole.output_text == "No tool needed <tool" == text and calls == []
    assert [item["type"] for item in final["output"]] == ["message"]


def test_call_markup_never_reaches_the_text_deltas() -> None:
    client, _ = make_client(HERMES_REPLY, **AUTO)
    with client as http:
        events = sse_typed_events(http.post(RESPONSES, json={"input": "Hi", "tools": TOOLS, "stream": True}).text)
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == "Let me check." and not any("<" in d for d in deltas)
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert args == '{"city": "Paris"}{"zone": "CET"}'
