"""The Messages API (``/v1/messages``) through the app over the fake engine, driven by the official ``anthropic``
SDK and raw HTTP: the translation into the chat path (prompt, sampling params, constraints), blocks and stop
reasons back, the stream's event sequence, usage with cached tokens, count_tokens, Anthropic's error shape and
``x-api-key`` auth."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.entrypoints.fake_engine import DEFAULT_TEMPLATE, REPLY, SERVED_NAME, FakeAsyncLLM, server_args
from tokenmill.entrypoints.openai.api_server import build_app

anthropic = pytest.importorskip("anthropic")

MESSAGES = "/v1/messages"
WEATHER = {"name": "get_weather", "description": "Weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
USER = [{"role": "user", "content": "Weather?"}]


def make(reply: str = REPLY, cached_tokens: int = 0, **args: Any) -> tuple[TestClient, FakeAsyncLLM, Any]:
    engine = FakeAsyncLLM(max_model_len=1024, reply=reply, cached_tokens=cached_tokens)
    client = TestClient(build_app(engine, server_args(**args)), raise_server_exceptions=False)
    sdk = anthropic.Anthropic(base_url=str(client.base_url), api_key=args.get("api_key") or "unused",
                              http_client=client, max_retries=0)
    return client, engine, sdk


def create(sdk: Any, **kw: Any) -> Any:
    kw.setdefault("model", SERVED_NAME)
    kw.setdefault("max_tokens", 100)
    kw.setdefault("messages", USER)
    return sdk.messages.create(**kw)


def sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    """``(event name, data)`` of each event of an Anthropic SSE body, checking the framing."""
    assert text.endswith("\n\n"), text[-200:]
    out = []
    for block in text.split("\n\n")[:-1]:
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), block
        data = json.loads(data_line[len("data: "):])
        assert data["type"] == name_line[len("event: "):]
        out.append((data["type"], data))
    return out


def assert_anthropic_error(response: Any, status: int, type_: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == type_
    assert body["error"]["message"]
    return str(body["error"]["message"])


def test_text_message_and_usage() -> None:
    client, engine, sdk = make(cached_tokens=3)
    with client:
        # temperature / top_p / top_k: newer SDKs no longer take them as arguments; the API still does
        m = create(sdk, system="Be brief.", extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5})
    assert m.type == "message" and m.role == "assistant" and m.model == SERVED_NAME and m.id.startswith("msg_")
    assert [(b.type, b.text) for b in m.content] == [("text", REPLY)]
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    prompt = "<|system|>Be brief.\n<|user|>Weather?\n<|assistant|>"
    assert engine.calls[0].prompt == [ord(c) for c in prompt]
    params = engine.calls[0].params
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (100, 0.5, 0.9, 5)
    assert m.usage.input_tokens == len(prompt) - 3 and m.usage.cache_read_input_tokens == 3
    assert m.usage.output_tokens == len(REPLY)


def test_max_tokens_stop_reason_and_stop_sequences_reach_the_engine() -> None:
    client, engine, sdk = make()
    with client:
        m = create(sdk, max_tokens=4, stop_sequences=["\n\nHuman:", "END"])
    assert m.stop_reason == "max_tokens" and m.content[0].text == REPLY[:4]
    assert engine.calls[0].params.stop == ["\n\nHuman:", "END"]


def test_multi_turn_with_system_blocks_tool_use_and_results() -> None:
    client, engine, sdk = make()
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call the tool.", "signature": "sig"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
            {"type": "text", "text": "And now?"}]},
    ]
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                "{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments | tojson }}{% endif %}"
                "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}<|assistant|>")
    with client:
        engine.tokenizer.chat_template = template
        create(sdk, system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}], messages=messages,
               tools=[WEATHER], tool_choice={"type": "none"})
    prompt = "".join(chr(t) for t in engine.calls[0].prompt)
    assert prompt == ('<|system|>A\nB\n<|user|>Weather in Paris?\n<|assistant|>Checking.{"city": "Paris"}\n'
                      "<|tool|>sunny[toolu_1]\n<|user|>And now?\n<|assistant|>")
    assert engine.calls[0].params.structured_outputs is None  # tool_choice none: no constraint


def test_forced_tool_is_constrained_and_comes_back_as_tool_use() -> None:
    client, engine, sdk = make(reply='{"city": "Paris"}')
    with client:
        m = create(sdk, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    assert engine.calls[0].params.structured_outputs is not None  # the grammar engine forces the arguments
    assert [b.type for b in m.content] == ["tool_use"]
    block = m.content[0]
    assert block.name == "get_weather" and block.input == {"city": "Paris"} and block.id
    assert m.stop_reason == "tool_use"


def test_any_maps_to_required_and_auto_uses_the_parser() -> None:
    client, engine, sdk = make(reply='[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    with client:
        m = create(sdk, tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert engine.calls[0].params.structured_outputs is not None
    assert [(b.type, b.input) for b in m.content] == [("tool_use", {"city": "Oslo"})] and m.stop_reason == "tool_use"
    reply = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    client, engine, sdk = make(reply=reply, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with client:
        m = create(sdk, tools=[WEATHER])
        streamed = sse(client.post(MESSAGES, json={"model": SERVED_NAME, "max_tokens": 200, "messages": USER,
                                                   "tools": [WEATHER], "stream": True}).text)
    assert [(b.type, getattr(b, "text", None) or getattr(b, "input", None)) for b in m.content] == [
        ("text", "Let me check."), ("tool_use", {"city": "Rome"})]
    assert m.stop_reason == "tool_use"
    starts = [d["content_block"]["type"] for name, d in streamed if name == "content_block_start"]
    assert starts == ["text", "tool_use"]
    arguments = "".join(d["delta"]["partial_json"] for name, d in streamed
                        if name == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(arguments) == {"city": "Rome"}
    assert streamed[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_stream_event_sequence_and_sdk_accumulation() -> None:
    client, _, sdk = make(cached_tokens=2)
    body = {"model": SERVED_NAME, "max_tokens": 100, "messages": USER, "stream": True}
    with client:
        r = client.post(MESSAGES, json=body)
        with sdk.messages.stream(model=SERVED_NAME, max_tokens=100, messages=USER) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    deltas = [d["delta"] for name, d in events if name == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas) and "".join(d["text"] for d in deltas) == REPLY
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == len(REPLY)
    assert events[-2][1]["usage"]["cache_read_input_tokens"] == 2
    # message_start splits the prompt the same way message_delta does
    assert start["usage"]["cache_read_input_tokens"] == 2
    assert start["usage"]["input_tokens"] == events[-2][1]["usage"]["input_tokens"]
    assert text == REPLY and final.content[0].text == REPLY and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(REPLY)


def test_count_tokens_is_the_rendered_prompt() -> None:
    client, engine, sdk = make()
    with client:
        counted = sdk.messages.count_tokens(model=SERVED_NAME, system="S", messages=USER)
        create(sdk, system="S")
    assert counted.input_tokens == len(engine.calls[0].prompt) == len("<|system|>S\n<|user|>Weather?\n<|assistant|>")


@pytest.mark.parametrize(("body", "status", "type_", "words"), [
    ({"model": SERVED_NAME, "messages": USER}, 400, "invalid_request_error", "max_tokens"),
    ({"model": SERVED_NAME, "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     400, "invalid_request_error", "'image' is not supported"),
    ({"model": SERVED_NAME, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
     400, "invalid_request_error", "role"),
    ({"model": SERVED_NAME, "max_tokens": 5, "messages": USER, "no_such_field": 1}, 400, "invalid_request_error",
     "no_such_field"),
    ({"model": SERVED_NAME, "max_tokens": 5, "messages": USER, "tools": [WEATHER]}, 400, "invalid_request_error",
     "--enable-auto-tool-choice"),
    ({"model": SERVED_NAME, "max_tokens": 5, "messages": USER, "tools": [{"type": "web_search_20250305",
                                                                          "name": "web_search"}]},
     400, "invalid_request_error", "server tool"),
    ({"model": SERVED_NAME, "max_tokens": 5, "messages": USER, "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error", "nope"),
    ({"model": SERVED_NAME, "max_tokens": 0, "messages": USER}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "claude-no-such-model", "max_tokens": 5, "messages": USER}, 404, "not_found_error", "model"),
])
def test_bad_input_gets_anthropic_errors_and_the_server_keeps_serving(body: dict[str, Any], status: int, type_: str,
                                                                      words: str) -> None:
    client, _, sdk = make()
    with client:
        message = assert_anthropic_error(client.post(MESSAGES, json=body), status, type_)
        assert words in message
        assert create(sdk).content[0].text == REPLY


def test_sdk_raises_its_typed_errors() -> None:
    client, _, sdk = make()
    with client, pytest.raises(anthropic.BadRequestError) as info:
        sdk.messages.create(model=SERVED_NAME, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])
    assert info.value.body["error"]["type"] == "invalid_request_error"


def test_body_too_large_and_non_json_keep_anthropic_shape() -> None:
    client, _, _ = make(max_request_body_bytes=100)
    with client:
        big = {"model": SERVED_NAME, "max_tokens": 5, "messages": [{"role": "user", "content": "x" * 200}]}
        assert_anthropic_error(client.post(MESSAGES, json=big), 413, "request_too_large")
        assert_anthropic_error(client.post(MESSAGES, content=b"{", headers={"content-type": "application/json"}),
                               400, "invalid_request_error")
        # the OpenAI routes keep OpenAI's error object
        assert set(client.post("/v1/chat/completions", content=b"{",
                               headers={"content-type": "application/json"}).json()) == {"error"}


def test_x_api_key_and_bearer_auth() -> None:
    client, _, sdk = make(api_key="sekret")
    body = {"model": SERVED_NAME, "max_tokens": 5, "messages": USER}
    with client:
        assert_anthropic_error(client.post(MESSAGES, json=body), 401, "authentication_error")
        assert_anthropic_error(client.post(MESSAGES, json=body, headers={"x-api-key": "wrong"}), 401,
                               "authentication_error")
        assert client.post(MESSAGES, json=body, headers={"x-api-key": "sekret"}).status_code == 200
        assert client.post(MESSAGES, json=body, headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert create(sdk).content[0].text == REPLY[:100]  # the SDK sends x-api-key
        # x-api-key is for the Messages routes only
        chat = {"model": SERVED_NAME, "max_tokens": 5, "messages": USER}
        assert client.post("/v1/chat/completions", json=chat, headers={"x-api-key": "sekret"}).status_code == 401
        bad = anthropic.Anthropic(base_url=str(client.base_url), api_key="wrong", http_client=client, max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            create(bad)


def test_thinking_switch_and_metadata_reach_the_template() -> None:
    client, engine, sdk = make()
    with client:
        engine.tokenizer.chat_template = DEFAULT_TEMPLATE + "{% if enable_thinking is false %}[no-think]{% endif %}"
        create(sdk, thinking={"type": "disabled"}, metadata={"user_id": "u1"})
    assert "".join(chr(t) for t in engine.calls[0].prompt).endswith("<|assistant|>[no-think]")


def test_output_config_format_constrains_the_answer() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    client, engine, sdk = make(reply='{"a": 1}')
    with client:
        m = create(sdk, output_config={"format": {"type": "json_schema", "schema": schema}})
    constraint = engine.calls[0].params.structured_outputs
    assert constraint is not None
    got = constraint.json
    assert (json.loads(got) if isinstance(got, str) else got) == schema
    assert json.loads(m.content[0].text) == {"a": 1}


def test_engine_failures_mid_stream_shutdown_and_count_tokens_errors() -> None:
    from tokenmill.errors import ServerShuttingDownError

    client, engine, _ = make()
    body = {"model": SERVED_NAME, "max_tokens": 50, "messages": USER}
    with client:
        engine.die_after = 3
        events = sse(client.post(MESSAGES, json={**body, "stream": True}).text)
        assert [name for name, _ in events][:2] == ["message_start", "ping"]
        assert events[-1] == ("error", {"type": "error", "error": {
            "type": "api_error", "message": "The inference engine stopped; the server is shutting down."}})
        engine.dead, engine.die_after = False, None
        engine.stop_error = ServerShuttingDownError("stopping")
        assert_anthropic_error(client.post(MESSAGES, json=body), 529, "overloaded_error")
        engine.stop_error = None
        assert_anthropic_error(client.post(MESSAGES + "/count_tokens", json={"model": "nope", "messages": USER}),
                               404, "not_found_error")
        assert_anthropic_error(client.post(MESSAGES + "/count_tokens", json={"model": SERVED_NAME}), 400,
                               "invalid_request_error")
        assert_anthropic_error(client.post(MESSAGES + "/batches", json=body), 404, "not_found_error")
