"""Reasoning parsers through the app over the fake engine (one token per character): the thinking in
``message.reasoning`` / ``delta.reasoning`` and ``reasoning`` output items, the answer alone in the content and
the tool parser, what reaches the engine (end marker, budget), and the refusals."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.entrypoints.fake_engine import SERVED_NAME, FakeAsyncLLM, server_args
from tests.entrypoints.helpers import CHAT, assert_error, sse_chunks
from tests.entrypoints.test_responses import sse_typed_events
from tokenmill.entrypoints.openai.api_server import build_app

RESPONSES = "/v1/responses"
REPLY = "The capital is Paris.\n</think>\n\nParis."
END_IDS = [ord(c) for c in "</think>"]
MESSAGES = [{"role": "user", "content": "Capital of France?"}]
QWEN_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% else %}<think>\n{% endif %}{% endif %}"
)
WEATHER_TOOL = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def make_client(reply: str = REPLY, **args: Any) -> tuple[TestClient, FakeAsyncLLM]:
    engine = FakeAsyncLLM(max_model_len=1024, reply=reply)
    return TestClient(build_app(engine, server_args(**{"reasoning_parser": "deepseek_r1", **args}))), engine


def body(**fields: Any) -> dict[str, Any]:
    return {"model": SERVED_NAME, "messages": MESSAGES, **fields}


def streamed(client: TestClient, payload: dict[str, Any]) -> tuple[list[dict], str, str]:
    r = client.post(CHAT, json={**payload, "stream": True})
    assert r.status_code == 200, r.text
    deltas = [c["choices"][0]["delta"] for c in sse_chunks(r.text) if c["choices"]]
    return (deltas, "".join(d.get("reasoning") or "" for d in deltas),
            "".join(d.get("content") or "" for d in deltas))


def test_message_reasoning_and_content_are_split() -> None:
    client, engine = make_client()
    message = client.post(CHAT, json=body()).json()["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "The capital is Paris."
    assert message["content"] == "Paris."
    reasoning = engine.calls[-1].params.reasoning
    assert reasoning is not None and reasoning.end_token_ids == END_IDS and reasoning.thinking_token_budget is None


def test_without_a_parser_the_thinking_stays_in_the_content() -> None:
    client, engine = make_client(reasoning_parser=None)
    message = client.post(CHAT, json=body()).json()["choices"][0]["message"]
    assert message["content"] == REPLY and "reasoning" not in message
    assert engine.calls[-1].params.reasoning is None


def test_streamed_deltas_split_at_the_marker_one_token_at_a_time() -> None:
    client, _ = make_client()
    deltas, reasoning, content = streamed(client, body())
    assert (reasoning, content) == ("The capital is Paris.", "Paris.")
    for d in deltas:
        assert d.get("reasoning") == d.get("reasoning_content")
        assert "<" not in (d.get("reasoning") or "") + (d.get("content") or "")  # no marker text leaks
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert not any(d.get("reasoning") for d in deltas[first_content:])


def test_include_reasoning_false_drops_the_thinking() -> None:
    client, _ = make_client()
    message = client.post(CHAT, json=body(include_reasoning=False)).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Paris."}
    deltas, reasoning, content = streamed(client, body(include_reasoning=False))
    assert reasoning == "" and content == "Paris."
    assert not any("reasoning_content" in d for d in deltas)


def test_thinking_token_budget_reaches_the_engine_and_needs_a_parser() -> None:
    client, engine = make_client()
    assert client.post(CHAT, json=body(thinking_token_budget=5)).status_code == 200
    assert engine.calls[-1].params.reasoning.thinking_token_budget == 5
    assert_error(client.post(CHAT, json=body(thinking_token_budget=-1)), 400, "thinking_token_budget")
    # past int64: refused here, never a 500 from the engine-core wire encoding
    assert_error(client.post(CHAT, json=body(thinking_token_budget=10**20)), 400, "thinking_token_budget")
    plain, _ = make_client(reasoning_parser=None)
    assert_error(plain.post(CHAT, json=body(thinking_token_budget=5)), 400, "thinking_token_budget")


def test_reasoning_effort_maps_onto_the_template_switch() -> None:
    client, engine = make_client(reply="Paris.", reasoning_parser="qwen3", chat_template=QWEN_TEMPLATE)
    message = client.post(CHAT, json=body(reasoning_effort="none")).json()["choices"][0]["message"]
    prompt = "".join(map(chr, engine.calls[-1].prompt))
    assert prompt.endswith("<think></think>") and message == {"role": "assistant", "content": "Paris."}
    assert engine.calls[-1].params.reasoning is None  # no thinking: a grammar would apply from the start
    assert client.post(CHAT, json=body(reasoning_effort="high")).status_code == 200
    assert "".join(map(chr, engine.calls[-1].prompt)).endswith("<think>\n")
    assert engine.calls[-1].params.reasoning is not None
    # the request's own chat_template_kwargs win over the effort
    client.post(CHAT, json=body(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False}))
    assert "".join(map(chr, engine.calls[-1].prompt)).endswith("<think></think>")
    assert_error(client.post(CHAT, json=body(reasoning_effort="extreme")), 400, "reasoning_effort")


def test_reasoning_effort_is_refused_where_the_template_has_no_switch() -> None:
    client, engine = make_client()
    error = assert_error(client.post(CHAT, json=body(reasoning_effort="low")), 400, "reasoning_effort")
    assert "no reasoning switch" in error["message"]
    assert engine.calls == []


def test_tool_calls_inside_the_thinking_are_not_calls() -> None:
    args = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    client, _ = make_client(reply=f"I could do {CALL} here.</think>No call needed.", **args)
    choice = client.post(CHAT, json=body(tools=WEATHER_TOOL)).json()["choices"][0]
    assert choice["message"]["content"] == "No call needed." and "tool_calls" not in choice["message"]
    assert CALL in choice["message"]["reasoning"] and choice["finish_reason"] == "stop"
    deltas, reasoning, content = streamed(client, body(tools=WEATHER_TOOL))
    assert content == "No call needed." and not any("tool_calls" in d for d in deltas)
    # a call in the answer is a call
    client, _ = make_client(reply=f"Need the weather.</think>{CALL}", **args)
    choice = client.post(CHAT, json=body(tools=WEATHER_TOOL)).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert choice["message"]["reasoning"] == "Need the weather."


def test_a_named_call_cut_off_while_thinking_is_no_call() -> None:
    client, _ = make_client(reply="Let me think about the weather for a while.</think>{}")
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = client.post(CHAT, json=body(tools=WEATHER_TOOL, tool_choice=named, max_tokens=10)).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["reasoning"] == "Let me thi"
    assert not choice["message"].get("tool_calls") and not choice["message"]["content"]
    deltas, reasoning, _ = streamed(client, body(tools=WEATHER_TOOL, tool_choice=named, max_tokens=10))
    assert reasoning == "Let me thi" and not any(d.get("tool_calls") for d in deltas)


def test_mistral_parser_keeps_special_tokens_in_the_text() -> None:
    client, engine = make_client(reply="[THINK]x[/THINK]y", reasoning_parser="mistral")
    message = client.post(CHAT, json=body()).json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("x", "y")
    assert engine.calls[-1].params.skip_special_tokens is False


def test_responses_reasoning_item_whole_and_streamed() -> None:
    client, engine = make_client()
    payload = {"model": SERVED_NAME, "input": "Capital of France?"}
    output = client.post(RESPONSES, json=payload).json()["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "The capital is Paris."}]
    assert output[0]["summary"] == [] and output[1]["content"][0]["text"] == "Paris."
    r = client.post(RESPONSES, json={**payload, "stream": True})
    events = sse_typed_events(r.text)
    types = [e["type"] for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert events[2]["item"]["type"] == "reasoning" and events[2]["output_index"] == 0
    deltas = [e for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(e["delta"] for e in deltas) == "The capital is Paris."
    done = next(e for e in events if e["type"] == "response.reasoning_text.done")
    assert done["text"] == "The capital is Paris." and done["output_index"] == 0
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Paris."
    assert types.index("response.reasoning_text.delta") < types.index("response.output_text.delta")
    # items never interleave: the reasoning item is done before the message item is added
    item_events = [(e["type"], e["output_index"]) for e in events if e["type"].startswith("response.output_item")]
    assert item_events == [("response.output_item.added", 0), ("response.output_item.done", 0),
                           ("response.output_item.added", 1), ("response.output_item.done", 1)]
    assert types.index("response.reasoning_text.done") < types.index("response.content_part.added", 4)
    final = events[-1]["response"]["output"]
    assert [item["type"] for item in final] == ["reasoning", "message"]
    assert engine.calls[-1].params.reasoning.end_token_ids == END_IDS


def test_responses_reasoning_effort_without_a_switch_is_refused() -> None:
    client, _ = make_client()
    payload = {"model": SERVED_NAME, "input": "hi", "reasoning": {"effort": "low"}}
    assert_error(client.post(RESPONSES, json=payload), 400, "reasoning.effort")


@pytest.mark.parametrize("name", ["qwen3", "granite", "nope"])
def test_unknown_parser_fails_at_start_up(name: str) -> None:
    engine = FakeAsyncLLM()
    if name == "nope":
        with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
            build_app(engine, server_args(reasoning_parser=name))
    else:
        build_app(engine, server_args(reasoning_parser=name))
