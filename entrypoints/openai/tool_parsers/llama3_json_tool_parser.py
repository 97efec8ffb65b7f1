"""``llama3_json``: Llama 3.1 / 3.2 JSON tool calls: the message is one or more JSON objects (separated by
``;``), optionally after ``<|python_tag|>``::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

A message that does not start with ``{`` (or the tag) is plain content.
"""

from __future__ import annotations

from tokenmill.entrypoints.openai.tool_parsers.hermes_tool_parser import is_valid_call, string_member
from tokenmill.tool_parsers.abstract_tool_parser import (
    PartialParse,
    PartialToolCall,
    ToolParser,
    arguments_text,
)
from tokenmill.tool_parsers.json_scan import JSONScanError, scan_object, skip_ws


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    python_tag = "<|python_tag|>"

    @property
    def skip_special_tokens(self) -> bool | None:
        return False

    def parse(self, text: str, final: bool) -> PartialParse:
        i = skip_ws(text, 0)
        if text.startswith(self.python_tag, i):
            i = skip_ws(text, i + len(self.python_tag))
        elif not final and i < len(text) and self.python_tag.startswith(text[i:]):
            return PartialParse()
        if i >= len(text):
            return PartialParse(content=text if final else "")
        if text[i] != "{":
            return PartialParse(content=text)
        calls: list[PartialToolCall] = []
        ok = True
        while True:
            try:
                obj = scan_object(text, i, final)
            except JSONScanError:
                ok = False
                break
            arguments, _ = arguments_text(text, obj)
            name = string_member(text, obj, "name")
            if final and (name is None or not is_valid_call(text, obj, arguments)):
                ok = False
                break
            calls.append(PartialToolCall(name, arguments, obj.end is not None))
            if obj.end is None:
                break
            j = skip_ws(text, obj.end)
            if j >= len(text):
                break
            if text[j] != ";":
                ok = False
                break
            i = skip_ws(text, j + 1)
            if i >= len(text):
                break
            if text[i] != "{":
                ok = False
                break
        if final and not ok:
            return PartialParse(content=text)
        return PartialParse(content="", tool_calls=calls)
