"""``hermes``: Hermes 2 Pro / Qwen 2.5 style calls, one JSON object per ``<tool_call>`` ... ``</tool_call>``::

    I'll look that up.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Content is the text before the first ``<tool_call>``. The tags are special tokens in Qwen's vocabulary, so the
parser keeps special tokens in the text.
"""

from __future__ import annotations

import json

from tokenmill.tool_parsers.abstract_tool_parser import (
    PartialParse,
    PartialToolCall,
    ToolParser,
    arguments_text,
    held_back,
)
from tokenmill.tool_parsers.json_scan import JSONScanError, ObjectScan, scan_object, skip_ws


def string_member(text: str, obj: ObjectScan, key: str) -> str | None:
    """The decoded string value of ``key`` once complete, else ``None``."""
    member = obj.member(key)
    if member is None or member.value_start is None or member.value_end is None:
        return None
    raw = text[member.value_start:member.value_end]
    if not raw.startswith('"'):
        return None
    value = json.loads(raw)
    return value if isinstance(value, str) else None


def is_valid_call(text: str, obj: ObjectScan, arguments: str) -> bool:
    """A finished call object: valid JSON throughout, and its arguments a JSON object."""
    if obj.end is None:
        return False
    try:
        json.loads(text[obj.start:obj.end])
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


class HermesToolParser(ToolParser):
    name = "hermes"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    @property
    def skip_special_tokens(self) -> bool | None:
        return False

    def parse(self, text: str, final: bool) -> PartialParse:
        first = text.find(self.start_tag)
        if first < 0:
            return PartialParse(content=text if final else text[: len(text) - held_back(text, (self.start_tag,))])
        result = PartialParse(content=text[:first])
        pos = first
        while pos >= 0:
            body = skip_ws(text, pos + len(self.start_tag))
            if body >= len(text):
                break
            try:
                obj = scan_object(text, body, final)
            except JSONScanError:
                break
            arguments, _ = arguments_text(text, obj)
            name = string_member(text, obj, "name")
            if final and (name is None or not is_valid_call(text, obj, arguments)):
                break
            result.tool_calls.append(PartialToolCall(name, arguments, obj.end is not None))
            if obj.end is None:
                break
            pos = text.find(self.start_tag, obj.end)
        else:
            return result
        if final:
            # An unfinished or invalid call: the whole text is content (no call is made).
            return PartialParse(content=text)
        return result
