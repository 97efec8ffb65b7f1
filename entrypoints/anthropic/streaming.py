"""A chat completion's SSE chunks -> Anthropic's stream events.

Anthropic's event sequence: ``message_start`` (the message with empty content and the prompt's usage), a
``ping``, then per content block ``content_block_start``, ``content_block_delta`` events (``thinking_delta``,
``text_delta`` or ``input_json_delta``) and ``content_block_stop``; then ``message_delta`` (``stop_reason``,
``stop_sequence`` and the output usage) and ``message_stop``. Each event is ``event: <type>`` plus
``data: <json>``. A failure after the stream started is an ``error`` event (Anthropic's error shape) and ends
the stream.

Chat deltas map to blocks in the order they arrive: ``delta.reasoning`` to a thinking block, ``delta.content``
to a text block, each new ``delta.tool_calls`` entry (the piece with an ``id``) to a tool_use block whose
``arguments`` pieces are ``input_json_delta`` events. A block is closed when a block of another kind starts.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from tokenmill.entrypoints.anthropic.errors import anthropic_error_body
from tokenmill.entrypoints.anthropic.protocol import MessageResponse
from tokenmill.entrypoints.anthropic.translate import chat_usage, message_id_of, stop_reason
from tokenmill.entrypoints.openai.streaming import close_quietly


def event(type_: str, data: dict[str, Any]) -> str:
    """One SSE event in Anthropic's framing."""
    return f"event: {type_}\ndata: {json.dumps({'type': type_, **data}, ensure_ascii=False)}\n\n"


def chat_payloads(raw: str) -> list[str]:
    """The ``data:`` payloads in a piece of a chat SSE body (a piece holds whole events)."""
    payloads = []
    for chunk in raw.split("\n\n"):
        for line in chunk.splitlines():
            if line.startswith("data: "):
                payloads.append(line[len("data: "):])
    return payloads


class _Blocks:
    """The content blocks opened so far and the one still open."""

    def __init__(self) -> None:
        self.count = 0
        self.open: tuple[str, int | None] | None = None  # (kind, chat tool-call index for tool_use)
        self.tool_blocks: dict[int, int] = {}  # chat tool-call index -> block index

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.count - 1})]

    def start(self, kind: str, block: dict[str, Any], tool_index: int | None = None) -> list[str]:
        out = self.close()
        self.open = (kind, tool_index)
        if tool_index is not None:
            self.tool_blocks[tool_index] = self.count
        out.append(event("content_block_start", {"index": self.count, "content_block": block}))
        self.count += 1
        return out

    def delta(self, kind: str, delta: dict[str, Any]) -> list[str]:
        """A delta for the open block of ``kind`` (``thinking`` / ``text``), opening one if needed."""
        out: list[str] = []
        if self.open is None or self.open[0] != kind:
            empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
                else {"type": "text", "text": ""}
            out = self.start(kind, empty)
        out.append(event("content_block_delta", {"index": self.count - 1, "delta": delta}))
        return out

    def tool_piece(self, piece: dict[str, Any]) -> list[str]:
        out: list[str] = []
        index = int(piece.get("index", 0))
        function = piece.get("function") or {}
        if piece.get("id") is not None:
            out = self.start("tool_use", {"type": "tool_use", "id": piece["id"], "name": function.get("name", ""),
                                          "input": {}}, index)
        arguments = function.get("arguments")
        block = self.tool_blocks.get(index)
        if arguments and block is not None:
            out.append(event("content_block_delta", {"index": block,
                                                     "delta": {"type": "input_json_delta", "partial_json": arguments}}))
        return out


async def anthropic_events(chunks: AsyncIterator[str], stop_sequences: list[str] | None
                           ) -> AsyncGenerator[str, None]:
    """Anthropic's events for the chat SSE body ``chunks`` (which must be a stream with continuous usage).

    Closing this generator closes ``chunks`` (which aborts the request in the engine).
    """
    blocks = _Blocks()
    started = False
    finish: tuple[str | None, Any] = (None, None)
    tool_called = False
    last_usage: dict[str, Any] | None = None
    try:
        async for raw in chunks:
            for payload in chat_payloads(raw):
                if payload == "[DONE]":
                    continue
                chunk = json.loads(payload)
                if "error" in chunk:
                    yield event("error", anthropic_error_body(chunk["error"], 500))
                    return
                last_usage = chunk.get("usage") or last_usage
                if not started:
                    started = True
                    start = MessageResponse(id=message_id_of(chunk.get("id", "")), model=chunk.get("model", ""),
                                            content=[], usage=chat_usage(last_usage))
                    yield event("message_start", {"message": start.model_dump()})
                    yield event("ping", {})
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    reasoning = delta.get("reasoning") or delta.get("reasoning_content")
                    if reasoning:
                        for e in blocks.delta("thinking", {"type": "thinking_delta", "thinking": reasoning}):
                            yield e
                    if delta.get("content"):
                        for e in blocks.delta("text", {"type": "text_delta", "text": delta["content"]}):
                            yield e
                    for piece in delta.get("tool_calls") or []:
                        tool_called = True
                        for e in blocks.tool_piece(piece):
                            yield e
                    if choice.get("finish_reason") is not None:
                        finish = (choice["finish_reason"], choice.get("stop_reason"))
        for e in blocks.close():
            yield e
        reason, sequence = stop_reason(finish[0], finish[1], stop_sequences, tool_called)
        yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": chat_usage(last_usage).model_dump()})
        yield event("message_stop", {})
    finally:
        await close_quietly(chunks)
