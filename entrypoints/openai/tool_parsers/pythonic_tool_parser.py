"""``pythonic``: calls written as a Python list of function calls with keyword arguments (Llama 3.2 / 4
"pythonic" format, ToolACE)::

    [get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]

optionally between ``<|python_start|>`` and ``<|python_end|>``. Argument values must be Python literals; they
are sent as JSON. A message that does not start with ``[`` is content. While streaming, each call is sent
when it is complete (its arguments are converted from Python, so they cannot be streamed piece by piece).
"""

from __future__ import annotations

import ast
import json

from tokenmill.tool_parsers.abstract_tool_parser import (
    PartialParse,
    PartialToolCall,
    ToolParser,
)
from tokenmill.tool_parsers.json_scan import skip_ws


def _call_of(source: str) -> PartialToolCall | None:
    """``name(k=v, ...)`` -> a complete call with JSON arguments, or ``None`` when it is not one."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    func = node.func
    parts: list[str] = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return None
    parts.append(func.id)
    try:
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if len(arguments) != len(node.keywords):
        return None
    try:
        text = json.dumps(arguments, ensure_ascii=False)
    except (TypeError, ValueError):
        return None
    return PartialToolCall(".".join(reversed(parts)), text, True)


def _top_level_items(text: str, start: int) -> tuple[list[str], int | None]:
    """The complete items of the list whose ``[`` is at ``start``, and the index just past its ``]`` (``None``
    while the list is open)."""
    items: list[str] = []
    depth = 0
    quote: str | None = None
    item_start = start + 1
    i = start + 1
    while i < len(text):
        c = text[i]
        if quote is not None:
            if c == "\\":
                i += 2
                continue
            if text.startswith(quote, i):
                i += len(quote)
                quote = None
                continue
        elif c in "'\"":
            quote = c * 3 if text.startswith(c * 3, i) else c
            i += len(quote)
            continue
        elif c in "([{":
            depth += 1
        elif c in ")}":
            depth -= 1
        elif c == "]":
            if depth == 0:
                if text[item_start:i].strip():
                    items.append(text[item_start:i])
                return items, i + 1
            depth -= 1
        elif c == "," and depth == 0:
            items.append(text[item_start:i])
            item_start = i + 1
        i += 1
    return items, None


class PythonicToolParser(ToolParser):
    name = "pythonic"
    start_tag = "<|python_start|>"
    end_tag = "<|python_end|>"

    @property
    def skip_special_tokens(self) -> bool | None:
        return False

    def parse(self, text: str, final: bool) -> PartialParse:
        i = skip_ws(text, 0)
        if text.startswith(self.start_tag, i):
            i = skip_ws(text, i + len(self.start_tag))
        elif not final and i < len(text) and self.start_tag.startswith(text[i:]):
            return PartialParse()
        if i >= len(text):
            return PartialParse(content=text if final else "")
        if text[i] != "[":
            return PartialParse(content=text)
        items, end = _top_level_items(text, i)
        calls = []
        for item in items:
            call = _call_of(item)
            if call is None:
                return PartialParse(content=text) if final else PartialParse(tool_calls=calls)
            calls.append(call)
        if final:
            if end is None or not calls:
                return PartialParse(content=text)
            tail = text[end:].strip()
            if tail not in ("", self.end_tag):
                return PartialParse(content=text)
        return PartialParse(content="", tool_calls=calls)
