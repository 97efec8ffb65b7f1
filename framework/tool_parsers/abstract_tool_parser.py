"""ToolParser: how a model writes tool calls in its text, for ``tool_choice="auto"``.

A parser implements one method, :meth:`ToolParser.parse`, which reads the text generated so far and says which
part of it is content for the user and which tool calls it holds. The same method serves the finished text
(``final=True``: the response's ``message.tool_calls``) and every streaming step (``final=False``), so the
streamed pieces always add up to the final answer, provided the parser keeps its promise: each partial result's
``content`` and each call's ``arguments`` are prefixes of the later ones (hold text back while unsure, e.g. a
trailing ``<tool_`` that may become a tag).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tokenmill.tool_parsers.json_scan import ObjectScan


@dataclass
class PartialToolCall:
    """A tool call as far as the text goes.

    Attributes:
        name: the function name (``None`` until it is complete).
        arguments: the JSON text of the arguments so far (a prefix of the final arguments).
        complete: the call is finished.
    """

    name: str | None
    arguments: str = ""
    complete: bool = False


@dataclass
class PartialParse:
    """What a parser found in the text so far.

    Attributes:
        content: text for ``message.content`` (a prefix of the final content while streaming).
        tool_calls: the calls, in order.
    """

    content: str = ""
    tool_calls: list[PartialToolCall] = field(default_factory=list)


@dataclass
class ToolCallInfo:
    """A finished call: function name and arguments (JSON text)."""

    name: str
    arguments: str


@dataclass
class ExtractedToolCalls:
    """The tool calls of a finished message and the content around them (``None`` when there is none)."""

    content: str | None
    tool_calls: list[ToolCallInfo] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)

    @classmethod
    def from_parse(cls, parse: PartialParse) -> ExtractedToolCalls:
        calls = [ToolCallInfo(c.name, c.arguments or "{}") for c in parse.tool_calls if c.name is not None]
        content = parse.content if parse.content or not calls else None
        return cls(content=content, tool_calls=calls)


class ToolParser(ABC):
    """Base of tool parsers (register one with the ``tokenmill_register_tool_parsers`` hook).

    Args:
        tokenizer: the served model's ``transformers`` tokenizer.
    """

    name: ClassVar[str] = ""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @property
    def skip_special_tokens(self) -> bool | None:
        """``False`` when the parser's markers are special tokens that must stay in the text (the request's
        ``skip_special_tokens`` is then overridden); ``None``: keep the request's setting."""
        return None

    @abstractmethod
    def parse(self, text: str, final: bool) -> PartialParse:
        """Split ``text`` (all the text generated so far) into content and tool calls.

        With ``final=False`` the text may stop anywhere (inside a tag, a JSON string, a number); the result must
        only grow as the text grows. With ``final=True`` only complete, valid calls count; text that turns out
        not to be a valid call is content.
        """

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The tool calls and content of a finished message."""
        return ExtractedToolCalls.from_parse(self.parse(text, final=True))


def arguments_text(text: str, obj: ObjectScan, keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[str, bool]:
    """The arguments of a call object scanned in ``text``: ``(JSON text so far, complete)``.

    An object value is taken as written (streams piece by piece); a string value is the JSON text it encodes
    (some models quote their arguments), held back until the string is complete; a missing member is ``{}`` once
    the object is closed.
    """
    import json

    member = next((m for key in keys if (m := obj.member(key)) is not None), None)
    if member is None or member.value_start is None:
        return ("{}", True) if obj.end is not None else ("", False)
    start = member.value_start
    if member.value_end is None:
        return ("", False) if text[start] == '"' else (text[start:], False)
    raw = text[start:member.value_end]
    if raw.startswith('"'):
        return str(json.loads(raw)), True
    return raw, True


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers`` (text to hold
    back from the content while a marker may be starting)."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:k]):
                longest = k
                break
    return longest
