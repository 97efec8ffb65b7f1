"""A scanner for JSON that may still be growing: where each member of an object (or each element of an array)
starts and ends in the text, without parsing values.

Streaming tool calls need spans rather than values: the arguments of a call are streamed as the exact text the
model wrote, so that the pieces sent concatenate to the arguments of the finished call. ``json`` parses only
complete documents and re-serialises them, which would break that equality.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_WS = " \t\n\r"


class JSONScanError(ValueError):
    """The text is not (a prefix of) JSON of the expected shape."""


@dataclass
class Member:
    """One ``"key": value`` of an object.

    Attributes:
        key: the decoded key (``None`` while the key string is still open).
        value_start: index of the value's first character (``None`` before it starts).
        value_end: index just past the value (``None`` while it may still grow).
    """

    key: str | None = None
    value_start: int | None = None
    value_end: int | None = None


@dataclass
class ObjectScan:
    """An object from ``start``; ``end`` is just past its ``}`` (``None`` while open)."""

    start: int
    members: list[Member] = field(default_factory=list)
    end: int | None = None

    def member(self, key: str) -> Member | None:
        for m in self.members:
            if m.key == key:
                return m
        return None


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """``text[i]`` is ``"``: index just past the closing quote, or ``None`` when the string is still open."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int, final: bool) -> int | None:
    """Index just past the JSON value starting at ``text[i]``, or ``None`` when it may still grow (a scalar at the
    very end of the text counts as complete only when ``final``).

    Raises:
        JSONScanError: not a JSON value.
    """
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth = 0
        j = i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in _WS + ",}]":
        j += 1
    if j == i:
        raise JSONScanError(f"unexpected {c!r} at {i}")
    if j == len(text) and not final:
        return None
    return j


def scan_object(text: str, start: int, final: bool = False) -> ObjectScan:
    """Scan the object whose ``{`` is at ``text[start]`` as far as the text goes.

    Raises:
        JSONScanError: the text is not a prefix of a JSON object.
    """
    if start >= len(text) or text[start] != "{":
        raise JSONScanError(f"expected '{{' at {start}")
    scan = ObjectScan(start)
    i = skip_ws(text, start + 1)
    if i < len(text) and text[i] == "}":
        scan.end = i + 1
        return scan
    while i < len(text):
        if text[i] != '"':
            raise JSONScanError(f"expected a key at {i}")
        member = Member()
        scan.members.append(member)
        key_end = _string_end(text, i)
        if key_end is None:
            return scan
        member.key = json.loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text):
            return scan
        if text[i] != ":":
            raise JSONScanError(f"expected ':' at {i}")
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return scan
        member.value_start = i
        end = value_end(text, i, final)
        if end is None:
            return scan
        member.value_end = end
        i = skip_ws(text, end)
        if i >= len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != ",":
            raise JSONScanError(f"expected ',' or '}}' at {i}")
        i = skip_ws(text, i + 1)
    return scan


def scan_array_of_objects(text: str, start: int, final: bool = False) -> tuple[list[ObjectScan], int | None]:
    """Scan the array of objects whose ``[`` is at ``text[start]``; returns its objects and the index just past
    its ``]`` (``None`` while open).

    Raises:
        JSONScanError: not a prefix of an array of objects.
    """
    if start >= len(text) or text[start] != "[":
        raise JSONScanError(f"expected '[' at {start}")
    objects: list[ObjectScan] = []
    i = skip_ws(text, start + 1)
    if i < len(text) and text[i] == "]":
        return objects, i + 1
    while i < len(text):
        obj = scan_object(text, i, final)
        objects.append(obj)
        if obj.end is None:
            return objects, None
        i = skip_ws(text, obj.end)
        if i >= len(text):
            return objects, None
        if text[i] == "]":
            return objects, i + 1
        if text[i] != ",":
            raise JSONScanError(f"expected ',' or ']' at {i}")
        i = skip_ws(text, i + 1)
    return objects, None
