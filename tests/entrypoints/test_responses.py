"""``POST /v1/responses`` against the fake engine: the response object, input items, the typed stream events
(raw, and through the official client's ``responses.create`` / ``responses.stream``), logprobs, errors, the
checks of tools and ``text.format``, and client disconnects."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from tokenmill.entrypoints.openai.api_server import build_app
from tokenmill.entrypoints.openai.protocol_responses import ResponsesRequest
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import RequestOutputKind

from tests.entrypoints.fake_engine import REPLY, SERVED_NAME, FakeAsyncLLM, server_args
from tests.entrypoints.helpers import assert_error
from tests.entrypoints.test_openai_api import _call_asgi

RESPONSES = "/v1/responses"
STREAM_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                 "response.content_part.done", "response.output_item.done", "response.completed"]


def prompt_text(engine: FakeAsyncLLM) -> str:
    prompt = engine.calls[-1].prompt
    assert isinstance(prompt, list)
    return "".join(map(chr, prompt))


def sse_typed_events(text: str) -> list[dict[str, Any]]:
    """The events of a Responses stream, checking the ``event:`` / ``data:`` framing and the numbering."""
    assert text.endswith("\n\n")
    events = []
    for block in text.split("\n\n")[:-1]:
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        data = json.loads(data_line[len("data: "):])
        assert data["type"] == event_line[len("event: "):]
        events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


@pytest.fixture
def oai(fake_app: Any) -> Any:
    with TestClient(fake_app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def test_create_with_string_input(oai: openai.OpenAI, fake_engine: FakeAsyncLLM) -> None:
    r = oai.responses.create(model=SERVED_NAME, input="Hi", instructions="Be brief.", max_output_tokens=64,
                             temperature=0.5, top_p=0.9, metadata={"k": "v"})
    assert r.object == "response" and r.id.startswith("resp_") and r.model == SERVED_NAME
    assert r.status == "completed" and r.error is None and r.incomplete_details is None
    assert r.output_text == REPLY
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    assert (r.instructions, r.max_output_tokens, r.temperature, r.top_p) == ("Be brief.", 64, 0.5, 0.9)
    assert r.metadata == {"k": "v"} and r.tools == [] and r.tool_choice == "auto" and r.text.format.type == "text"
    prompt_len = len(fake_engine.calls[0].prompt)
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        prompt_len, len(REPLY), prompt_len + len(REPLY))
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert prompt_text(fake_engine) == "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>"
    params = fake_engine.calls[0].params
    assert (params.temperature, params.top_p, params.max_tokens) == (0.5, 0.9, 64)
    assert params.output_kind == RequestOutputKind.FINAL_ONLY and params.logprobs is None


def test_message_list_input_items(oai: openai.OpenAI, fake_engine: FakeAsyncLLM) -> None:
    oai.responses.create(model=SERVED_NAME, input=[
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "c", "annotations": []}]},
        {"role": "user", "content": "d"},
    ])
    assert prompt_text(fake_engine) == "<|developer|>Rules.\n<|user|>a\nb\n<|assistant|>c\n<|user|>d\n<|assistant|>"
    assert fake_engine.calls[-1].params.max_tokens is None  # up to the context length


def test_function_call_items_become_tool_calls_and_tool_messages() -> None:
    request = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call", "call_id": "c2", "name": "get", "arguments": "{\"city\": \"Rome\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
    ]})
    assert request.input_messages() == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "get", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]


def test_length_limit_is_incomplete(oai: openai.OpenAI, client: TestClient) -> None:
    r = oai.responses.create(model=SERVED_NAME, input="Hi", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == REPLY[:5] and r.output[0].status == "incomplete" and r.completed_at is None
    events = sse_typed_events(client.post(RESPONSES, json={"input": "Hi", "max_output_tokens": 5,
                                                           "stream": True}).text)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_stream_events(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    r = client.post(RESPONSES, json={"input": "Hi", "stream": True, "max_output_tokens": 64})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_typed_events(r.text)
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert kinds == STREAM_EVENTS[:4] + ["response.output_text.delta"] * len(deltas) + STREAM_EVENTS[5:]
    assert "".join(d["delta"] for d in deltas) == REPLY
    created, in_progress, added, part_added = events[:4]
    resp_id = created["response"]["id"]
    assert created["response"]["status"] == in_progress["response"]["status"] == "in_progress"
    assert created["response"]["output"] == []
    item_id = added["item"]["id"]
    assert added["item"] == {"id": item_id, "type": "message", "status": "in_progress", "role": "assistant",
                             "content": []}
    assert part_added["part"] == {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    assert all(d["item_id"] == item_id and d["output_index"] == 0 and d["content_index"] == 0 for d in deltas)
    text_done, part_done, item_done, completed = events[-4:]
    assert text_done["text"] == part_done["part"]["text"] == REPLY
    assert item_done["item"]["status"] == "completed" and item_done["item"]["content"][0]["text"] == REPLY
    final = completed["response"]
    assert final["id"] == resp_id and final["status"] == "completed"
    assert final["output"] == [item_done["item"]]
    assert final["usage"]["output_tokens"] == len(REPLY)
    assert fake_engine.calls[0].params.output_kind == RequestOutputKind.DELTA
    assert not fake_engine.active


def test_openai_client_stream_helper(oai: openai.OpenAI) -> None:
    full = oai.responses.create(model=SERVED_NAME, input="Hi", temperature=0)
    with oai.responses.stream(model=SERVED_NAME, input=[{"role": "user", "content": "Hi"}], temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.type for e in events if e.type != "response.output_text.delta"] == [
        k for k in STREAM_EVENTS if k != "response.output_text.delta"]
    snapshots = [e.snapshot for e in events if e.type == "response.output_text.delta"]
    assert snapshots[-1] == REPLY
    assert final.output_text == full.output_text == REPLY
    assert final.usage.output_tokens == full.usage.output_tokens
    created = oai.responses.create(model=SERVED_NAME, input="Hi", stream=True)
    assert [e.type for e in created][-1] == "response.completed"


def test_logprobs(oai: openai.OpenAI, client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    r = oai.responses.create(model=SERVED_NAME, input="Hi", max_output_tokens=3, top_logprobs=2,
                             include=["message.output_text.logprobs"])
    assert fake_engine.calls[-1].params.logprobs == 2
    lps = r.output[0].content[0].logprobs
    assert [lp.token for lp in lps] == list(REPLY[:3])
    assert [t.token for t in lps[0].top_logprobs] == ["P", "a"] and lps[0].bytes == list(b"P")
    events = sse_typed_events(client.post(RESPONSES, json={
        "input": "Hi", "max_output_tokens": 3, "stream": True, "include": ["message.output_text.logprobs"]}).text)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [d["logprobs"][0]["token"] for d in deltas] == list(REPLY[:3])
    assert "bytes" not in deltas[0]["logprobs"][0]  # the delta events' logprob shape
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert [lp["token"] for lp in done["logprobs"]] == list(REPLY[:3])
    # Without include/top_logprobs no logprobs are computed.
    oai.responses.create(model=SERVED_NAME, input="Hi", max_output_tokens=3)
    assert fake_engine.calls[-1].params.logprobs is None


def test_extras_reach_the_sampling_params(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    body = {"input": "Hi", "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "seed": 7, "stop": ["x"],
            "store": True, "user": "u", "background": False, "reasoning": {}, "stream_options": {}}
    assert client.post(RESPONSES, json=body).status_code == 200
    p = fake_engine.calls[-1].params
    assert (p.top_k, p.min_p, p.repetition_penalty, p.seed, p.stop) == (5, 0.1, 1.2, 7, ["x"])
    assert client.post(RESPONSES, json=body).json()["store"] is False


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
     "input.[0].content.[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "x"}]}]},
     "input.[0].content.[0].image_url"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input.[0].content.[0].text"),
    ({"input": [{"role": "user"}]}, "input.[0].content"),
    ({"input": [{"content": "x"}]}, "input.[0].role"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input.[0].output"),
    ({"input": "Hi", "temperature": 2.5}, "temperature"),
    ({"input": "Hi", "top_p": 0}, "top_p"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "max_output_tokens": 10_000}, "max_output_tokens"),
    ({"input": "x" * 200}, "input"),
    ({"input": "Hi", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "Hi", "include": ["everything"]}, "include"),
    ({"input": "Hi", "truncation": "auto"}, "truncation"),
    ({"input": "Hi", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "Hi", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "Hi", "tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
    ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "Hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "Hi", "background": True}, "background"),
    ({"input": "Hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": "Hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "Hi", "no_such_field": 1}, "no_such_field"),
    ({"input": "Hi", "priority": 1}, "priority"),
    ({"input": "Hi", "model": "gpt-9"}, "model"),
])
def test_bad_requests(client: TestClient, fake_engine: FakeAsyncLLM, body: dict[str, Any], param: str) -> None:
    r = client.post(RESPONSES, json=body)
    assert_error(r, 404 if param == "model" else 400, param, "NotFoundError" if param == "model" else
                 "invalid_request_error")
    assert fake_engine.calls == []
    assert client.post(RESPONSES, json={"input": "Hi"}).status_code == 200


def test_template_failure_names_the_input(fake_engine: FakeAsyncLLM) -> None:
    fake_engine.tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}")
    with TestClient(build_app(fake_engine, server_args())) as c:
        error = assert_error(c.post(RESPONSES, json={"input": "Hi", "instructions": "x"}), 400, "input")
        assert "no system role" in error["message"]
        assert c.post(RESPONSES, json={"input": "Hi"}).status_code == 200


def test_tools_and_text_format_requests(client: TestClient, fake_engine: FakeAsyncLLM) -> None:
    """Tools and ``text.format`` are served (their output is tested in test_responses_tools.py); what they
    cannot do is a 400 naming the field, before anything reaches the engine."""
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    schema = {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}
    # tools with tool_choice auto (the default) need the server's tool parser flags
    error = assert_error(client.post(RESPONSES, json={"input": "Hi", "tools": [tool]}), 400, "tool_choice")
    assert "--enable-auto-tool-choice" in error["message"] and "--tool-call-parser" in error["message"]
    assert_error(client.post(RESPONSES, json={"input": "Hi", "tool_choice": "required"}), 400, "tool_choice")
    error = assert_error(client.post(RESPONSES, json={"input": "Hi", "tools": [tool, tool], "tool_choice": "required"}),
                         400, "tools")
    assert "duplicate" in error["message"]
    error = assert_error(client.post(RESPONSES, json={"input": "Hi", "tools": [tool], "tool_choice": "required",
                                                      "text": {"format": schema}}), 400, "text.format")
    assert "cannot be combined" in error["message"]
    bad_schema = {**schema, "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}
    assert_error(client.post(RESPONSES, json={"input": "Hi", "text": {"format": bad_schema}}), 400,
                 "text.format.schema")
    assert fake_engine.calls == []
    for extra in ({"tools": []}, {"tool_choice": "none"}, {"tool_choice": "auto", "parallel_tool_calls": False},
                  {"text": {"format": {"type": "text"}}}, {"tools": [tool], "tool_choice": "none"},
                  {"text": {"format": schema}}, {"text": {"format": {"type": "json_object"}}}):
        assert client.post(RESPONSES, json={"input": "Hi", **extra}).status_code == 200
    so = [call.params.structured_outputs for call in fake_engine.calls]
    assert so[:5] == [None] * 5
    assert so[5].json == {"type": "object"} and so[5].disable_additional_properties
    assert so[6].json_object
    # The parsed models convert to the Chat Completions shapes.
    request = ResponsesRequest.model_validate({"input": "Hi", "tools": [tool], "text": {"format": schema}})
    assert request.tools is not None and request.text is not None and request.text.format is not None
    assert request.tools[0].to_chat_tool() == {"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
    assert request.text.format.to_response_format() == {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": True}}


def test_error_after_the_stream_started(fake_engine: FakeAsyncLLM) -> None:
    fake_engine.die_after = 3
    with TestClient(build_app(fake_engine, server_args()), raise_server_exceptions=False) as c:
        events = sse_typed_events(c.post(RESPONSES, json={"input": "Hi", "stream": True}).text)
    error, failed = events[-2:]
    assert error["type"] == "error" and error["code"] == "engine_dead" and error["message"]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == REPLY[:3]


def test_request_rejected_by_the_engine_is_a_plain_400(fake_engine: FakeAsyncLLM) -> None:
    fake_engine.fail_with = InvalidRequestError("prompt: refused by the engine", param="prompt")
    with TestClient(build_app(fake_engine, server_args())) as c:
        assert_error(c.post(RESPONSES, json={"input": "Hi", "stream": True}), 400, "prompt")


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts(fake_engine: FakeAsyncLLM, stream: bool) -> None:
    fake_engine.delay_s = 0.01
    app = build_app(fake_engine, server_args())
    body = {"input": "x", "stream": stream, "max_output_tokens": 30}
    if stream:
        asyncio.run(_call_asgi(app, RESPONSES, body, disconnect_after_chunks=2))
    else:
        asyncio.run(_call_asgi(app, RESPONSES, body, disconnect_after_chunks=None, disconnect_after_s=0.1))
    assert fake_engine.aborted == [fake_engine.calls[0].request_id]
    assert not fake_engine.active
