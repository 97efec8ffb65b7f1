"""The Messages API end to end: one real ``tokenmill serve`` (embedded default model, hermes tool parser, an API
key) driven by the official ``anthropic`` SDK: text, a forced tool (valid input), the stream's events in order
and equal to the whole answer, ``stop_sequences``, ``count_tokens`` equal to the prompt the chat path runs,
Anthropic errors with the server still serving, ``x-api-key`` auth. Few tokens per request."""

from __future__ import annotations

from typing import Any

import httpx
import jsonschema
import pytest

from tests.entrypoints.conftest import REAL_SERVED_NAME, TOOL_SERVER_KEY, RealServer

anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow

KEY = TOOL_SERVER_KEY
USER = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"]}}
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def server(tool_server: RealServer) -> RealServer:
    return tool_server


@pytest.fixture(scope="module")
def client(server: RealServer) -> Any:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


def create(client: Any, **kw: Any) -> Any:
    kw.setdefault("model", REAL_SERVED_NAME)
    kw.setdefault("max_tokens", 8)
    kw.setdefault("messages", USER)
    for key, value in GREEDY.items():
        kw.setdefault(key, value)
    return client.messages.create(**kw)


def test_text_and_count_tokens(server: RealServer, client: Any) -> None:
    m = create(client, system="Answer briefly.")
    assert m.type == "message" and m.role == "assistant" and m.model == REAL_SERVED_NAME
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and 0 < m.usage.output_tokens <= 8
    counted = client.messages.count_tokens(model=REAL_SERVED_NAME, system="Answer briefly.", messages=USER)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    # with tools: the same count as the chat completion the request becomes
    counted = client.messages.count_tokens(model=REAL_SERVED_NAME, messages=USER, tools=[WEATHER],
                                           tool_choice={"type": "tool", "name": "get_weather"})
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=300, headers={"Authorization": f"Bearer {KEY}"},
                      json={"messages": USER, "max_tokens": 1, "tools": [{"type": "function", "function": {
                          "name": WEATHER["name"], "description": WEATHER["description"],
                          "parameters": WEATHER["input_schema"]}}],
                            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert chat.status_code == 200, chat.text
    assert counted.input_tokens == chat.json()["usage"]["prompt_tokens"]


def test_forced_tool_gives_a_valid_tool_use_block(client: Any) -> None:
    m = create(client, max_tokens=60, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
               messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert m.stop_reason == "tool_use", m.content
    [block] = m.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id
    jsonschema.validate(block.input, WEATHER["input_schema"])
    # the result goes back as a tool_result block in the next user turn
    follow = create(client, tools=[WEATHER], tool_choice={"type": "none"}, messages=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": block.id, "name": block.name,
                                           "input": block.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "Sunny, 21 C"}]},
    ])
    assert follow.content[0].type == "text" and follow.stop_reason in ("end_turn", "max_tokens")


def test_stream_events_in_order_equal_the_whole_answer(client: Any) -> None:
    whole = create(client, max_tokens=10)
    with client.messages.stream(model=REAL_SERVED_NAME, max_tokens=10, messages=USER, **GREEDY) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    core = [e for e in events if e in ("message_start", "content_block_start", "content_block_delta",
                                       "content_block_stop", "message_delta", "message_stop")]
    assert core[0] == "message_start" and core[1] == "content_block_start"
    assert core[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(core[2:-3]) == {"content_block_delta"}
    assert final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)


def test_stop_sequences(client: Any) -> None:
    text = create(client, max_tokens=16).content[0].text
    assert len(text.strip()) >= 6, text
    middle = text.strip()[3:6]
    m = create(client, max_tokens=16, stop_sequences=[middle])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", middle)
    assert m.content[0].text == text[: text.find(middle)]


def test_bad_input_is_an_anthropic_400_and_the_server_keeps_serving(server: RealServer, client: Any) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=REAL_SERVED_NAME, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/messages", json={"model": REAL_SERVED_NAME, "messages": USER},
                   headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "max_tokens: Field required"}}
    assert create(client, max_tokens=2).content[0].text


def test_api_key(server: RealServer) -> None:
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        create(wrong, max_tokens=1)
    assert info.value.body["error"]["type"] == "authentication_error"
    bearer = httpx.post(server.url + "/v1/messages", headers={"Authorization": f"Bearer {KEY}"}, timeout=300,
                        json={"model": REAL_SERVED_NAME, "max_tokens": 1, "messages": USER})
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
