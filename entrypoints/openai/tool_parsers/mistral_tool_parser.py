"""``mistral``: Mistral's ``[TOOL_CALLS]`` marker, followed either by a JSON array (tokenizers before v11)::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

or by ``name[ARGS]{...}`` per call (v11 and later), each call after its own ``[TOOL_CALLS]``. Content is the
text before the first marker. The markers are special tokens, so special tokens stay in the text.
"""

from __future__ import annotations

from tokenmill.entrypoints.openai.tool_parsers.hermes_tool_parser import is_valid_call, string_member
from tokenmill.tool_parsers.abstract_tool_parser import (
    PartialParse,
    PartialToolCall,
    ToolParser,
    arguments_text,
    held_back,
)
from tokenmill.tool_parsers.json_scan import (
    JSONScanError,
    scan_array_of_objects,
    skip_ws,
    value_end,
)


class MistralToolParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    args_marker = "[ARGS]"

    @property
    def skip_special_tokens(self) -> bool | None:
        return False

    def parse(self, text: str, final: bool) -> PartialParse:
        first = text.find(self.marker)
        if first < 0:
            return PartialParse(content=text if final else text[: len(text) - held_back(text, (self.marker,))])
        start = skip_ws(text, first + len(self.marker))
        if start >= len(text):
            return PartialParse(content=text if final else text[:first])
        if text[start] == "[":
            calls, ok = self._json_array(text, start, final)
        else:
            calls, ok = self._name_args(text, start, final)
        if final and (not ok or not calls):
            return PartialParse(content=text)
        return PartialParse(content=text[:first], tool_calls=calls)

    def _json_array(self, text: str, start: int, final: bool) -> tuple[list[PartialToolCall], bool]:
        try:
            objects, end = scan_array_of_objects(text, start, final)
        except JSONScanError:
            return [], False
        calls = []
        for obj in objects:
            arguments, _ = arguments_text(text, obj)
            name = string_member(text, obj, "name")
            if final and (name is None or not is_valid_call(text, obj, arguments)):
                return calls, False
            calls.append(PartialToolCall(name, arguments, obj.end is not None))
        return calls, end is not None or not final

    def _name_args(self, text: str, i: int, final: bool) -> tuple[list[PartialToolCall], bool]:
        import json

        calls: list[PartialToolCall] = []
        while i < len(text):
            k = text.find(self.args_marker, i)
            if k < 0:
                return calls, not final
            name = text[i:k].strip()
            j = skip_ws(text, k + len(self.args_marker))
            try:
                end = value_end(text, j, final) if j < len(text) else None
            except JSONScanError:
                return calls, False
            if end is None:
                partial = text[j:] if j < len(text) and text[j] == "{" else ""
                calls.append(PartialToolCall(name, partial, False))
                return calls, not final
            arguments = text[j:end]
            if final:
                try:
                    if not isinstance(json.loads(arguments), dict):
                        return calls, False
                except ValueError:
                    return calls, False
            calls.append(PartialToolCall(name, arguments, True))
            i = skip_ws(text, end)
            if text.startswith(self.marker, i):
                i = skip_ws(text, i + len(self.marker))
            elif i < len(text):
                return calls, False
        return calls, True
