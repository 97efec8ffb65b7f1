"""The Messages translation on crafted chat results (no engine): reasoning -> thinking blocks (whole and
streamed), stop reasons, tool_use blocks, mid-stream errors, and request translation errors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tokenmill.entrypoints.anthropic.protocol import MessagesRequest
from tokenmill.entrypoints.anthropic.streaming import anthropic_events
from tokenmill.entrypoints.anthropic.translate import to_chat_request, to_message
from tokenmill.errors import InvalidRequestError

USER = [{"role": "user", "content": "Hi"}]


def request(**fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"max_tokens": 16, "messages": USER, **fields})


def chat_body(message: dict[str, Any], finish_reason: str = "stop", stop_reason: Any = None) -> dict[str, Any]:
    return {"id": "chatcmpl-abc", "model": "m", "choices": [{"index": 0, "message": message,
                                                            "finish_reason": finish_reason,
                                                            "stop_reason": stop_reason}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 6}}}


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_reasoning_becomes_a_thinking_block(key: str) -> None:
    m = to_message(chat_body({"role": "assistant", key: "Let me think.", "content": "42"}), request())
    assert [b.model_dump() for b in m.content] == [
        {"type": "thinking", "thinking": "Let me think.", "signature": ""}, {"type": "text", "text": "42"}]
    assert m.id == "msg_abc" and m.stop_reason == "end_turn"
    assert m.usage.model_dump() == {"input_tokens": 4, "output_tokens": 4, "cache_creation_input_tokens": 0,
                                    "cache_read_input_tokens": 6}


def test_stop_reasons_and_tool_use() -> None:
    req = request(stop_sequences=["END"])
    m = to_message(chat_body({"content": "a"}, "stop", "END"), req)
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "END")
    assert to_message(chat_body({"content": "a"}, "stop", 2), req).stop_reason == "end_turn"  # EOS token id
    assert to_message(chat_body({"content": "a"}, "length"), req).stop_reason == "max_tokens"
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    m = to_message(chat_body({"content": None, "tool_calls": [call]}, "stop"), req)
    assert [b.model_dump() for b in m.content] == [{"type": "tool_use", "id": "call_1", "name": "f", "input": {"x": 1}}]
    assert m.stop_reason == "tool_use"
    assert to_message(chat_body({"content": ""}), req).content[0].model_dump() == {"type": "text", "text": ""}


async def _chunks(payloads: list[dict[str, Any] | str]) -> AsyncIterator[str]:
    for p in payloads:
        yield "data: " + (p if isinstance(p, str) else json.dumps(p)) + "\n\n"


def _events(payloads: list[dict[str, Any] | str], stop_sequences: list[str] | None = None
            ) -> list[tuple[str, dict[str, Any]]]:
    async def collect() -> list[str]:
        return [e async for e in anthropic_events(_chunks(payloads), stop_sequences)]

    out = []
    for text in asyncio.run(collect()):
        name, data = text.rstrip("\n").split("\n")
        out.append((name[len("event: "):], json.loads(data[len("data: "):])))
    return out


def _chunk(delta: dict[str, Any], finish: str | None = None, stop_reason: Any = None) -> dict[str, Any]:
    return {"id": "chatcmpl-s", "model": "m", "usage": {"prompt_tokens": 7, "completion_tokens": 1},
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "stop_reason": stop_reason}]}


def test_stream_thinking_text_and_tool_blocks_in_order() -> None:
    events = _events([
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"reasoning": "Hmm, "}), _chunk({"reasoning_content": "weather."}),
        _chunk({"content": "Checking."}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                "function": {"name": "get_weather", "arguments": ""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}),
        _chunk({}, "tool_calls"),
        {"id": "chatcmpl-s", "model": "m", "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 9}},
        "[DONE]",
    ])
    names = [n for n, _ in events]
    assert names == ["message_start", "ping",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    assert events[0][1]["message"]["id"] == "msg_s" and events[0][1]["message"]["usage"]["input_tokens"] == 7
    assert [d["index"] for n, d in events if n.startswith("content_block")] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert events[2][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert [events[i][1]["delta"] for i in (3, 4)] == [{"type": "thinking_delta", "thinking": "Hmm, "},
                                                       {"type": "thinking_delta", "thinking": "weather."}]
    assert events[7][1]["delta"] == {"type": "text_delta", "text": "Checking."}
    assert events[9][1]["content_block"] == {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {}}
    assert "".join(events[i][1]["delta"]["partial_json"] for i in (10, 11)) == '{"city": "Oslo"}'
    assert events[13][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[13][1]["usage"]["output_tokens"] == 9


def test_stream_stop_sequence_and_mid_stream_error() -> None:
    events = _events([_chunk({"content": "a"}), _chunk({}, "stop", "END"), "[DONE]"], ["END"])
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    events = _events([_chunk({"content": "a"}),
                      {"error": {"message": "The inference engine stopped.", "type": "server_error"}}, "[DONE]"])
    assert [n for n, _ in events][-1] == "error"
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error",
                                                        "message": "The inference engine stopped."}}


@pytest.mark.parametrize(("fields", "param"), [
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages.[0].content.[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages.[0].content.[0]"),
    ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
])
def test_translation_errors_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        to_chat_request(request(**fields))
    assert info.value.param == param


def test_output_format_becomes_a_json_schema_response_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = to_chat_request(request(output_config={"format": {"type": "json_schema", "schema": schema}}))
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    chat = to_chat_request(request(stream=True, stop_sequences=["x"], metadata={"user_id": "u"}))
    assert chat.stream and chat.include_usage and chat.continuous_usage and chat.stop == ["x"] and chat.user == "u"


def test_thinking_budget_and_effort_reach_the_chat_request_only_with_a_reasoning_parser() -> None:
    fields = {"thinking": {"type": "enabled", "budget_tokens": 64}, "output_config": {"effort": "low"}}
    chat = to_chat_request(request(**fields), reasoning=True)
    assert chat.thinking_token_budget == 64
    assert chat.reasoning_effort == "low"
    assert chat.chat_template_kwargs == {"enable_thinking": True}
    chat = to_chat_request(request(thinking={"type": "enabled", "budget_tokens": 64}))
    assert chat.thinking_token_budget is None
    chat = to_chat_request(request(thinking={"type": "disabled"}), reasoning=True)
    assert chat.thinking_token_budget is None and chat.chat_template_kwargs == {"enable_thinking": False}


def test_a_tool_result_must_answer_an_earlier_tool_use() -> None:
    orphan = {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]}
    with pytest.raises(InvalidRequestError) as info:
        to_chat_request(request(**orphan))
    assert info.value.param == "messages.[0].content.[0]"
    answered = {"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}]}
    chat = to_chat_request(request(**answered))
    assert chat.messages[-1].role == "tool" and chat.messages[-1].tool_call_id == "t1"


def test_a_final_assistant_turn_is_continued() -> None:
    prefill = {"messages": [{"role": "user", "content": "Count to 5."},
                            {"role": "assistant", "content": "1, 2,"}]}
    chat = to_chat_request(request(**prefill))
    assert chat.continue_final_message and not chat.add_generation_prompt
    assert chat.messages[-1].role == "assistant"
    chat = to_chat_request(request())
    assert not chat.continue_final_message and chat.add_generation_prompt
