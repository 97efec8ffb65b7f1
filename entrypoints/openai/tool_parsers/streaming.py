"""ToolCallStreamer: turns successive parses of the growing text into OpenAI ``delta.tool_calls`` pieces.

Each call is announced once, when its name is known (``index``, ``id``, ``type``, ``function.name`` and the
arguments written so far), then only argument pieces follow, exactly as the OpenAI client's stream helpers
accumulate them. Content is released as the parse allows (never a half marker).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.tool_parsers.abstract_tool_parser import PartialParse, ToolCallInfo


def random_tool_call_id() -> str:
    """An id such as ``call_1f0c...`` (24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """One piece of a streamed call; ``id`` and ``name`` only in the first piece of a call."""

    index: int
    id: str | None
    name: str | None
    arguments: str


class ToolCallStreamer:
    """Diffs parses of the text so far.

    Args:
        parse: ``parse(text, final) -> PartialParse`` (a :meth:`ToolParser.parse`, or the constrained
            ``required`` / named-tool parse).
        max_calls: announce at most this many calls (``parallel_tool_calls=false``: 1); ``None``: all.
    """

    def __init__(self, parse: Callable[[str, bool], PartialParse], max_calls: int | None = None) -> None:
        self.parse = parse
        self.max_calls = max_calls
        self.content = ""
        self.ids: list[str] = []
        self.names: list[str] = []
        self.arguments: list[str] = []

    def update(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """New content and call pieces for ``text`` (all the text generated so far)."""
        result = self.parse(text, final)
        content_delta = ""
        if result.content.startswith(self.content) and len(result.content) > len(self.content):
            content_delta = result.content[len(self.content):]
            self.content = result.content
        calls = result.tool_calls if self.max_calls is None else result.tool_calls[: self.max_calls]
        deltas: list[ToolCallDelta] = []
        for i, call in enumerate(calls):
            if i < len(self.ids):
                previous = self.arguments[i]
                if len(call.arguments) > len(previous) and call.arguments.startswith(previous):
                    deltas.append(ToolCallDelta(i, None, None, call.arguments[len(previous):]))
                    self.arguments[i] = call.arguments
                continue
            if call.name is None:
                break
            call_id = random_tool_call_id()
            self.ids.append(call_id)
            self.names.append(call.name)
            self.arguments.append(call.arguments)
            deltas.append(ToolCallDelta(i, call_id, call.name, call.arguments))
        return content_delta, deltas

    @property
    def tools_called(self) -> bool:
        return bool(self.ids)

    def tool_calls(self) -> list[ToolCallInfo]:
        """The calls streamed so far (name and the arguments sent)."""
        return [ToolCallInfo(n, a) for n, a in zip(self.names, self.arguments)]
