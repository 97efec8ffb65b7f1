"""MarkerReasoningParser: thinking delimited by text markers (``<think>`` ... ``</think>`` and the like).

The split is a pure function of the text so far (:meth:`MarkerReasoningParser.split`); a streaming step sends
how much the split grew, so the streamed pieces always add up to the finished split, wherever the token or
delta boundaries fall (a marker cut in two, or a marker and answer text in the same delta).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from tokenmill.reasoning.abs_reasoning_parser import ReasoningDelta, ReasoningParser


class MarkerReasoningParser(ReasoningParser):
    """Base of parsers whose thinking sits between a start marker and an end marker.

    Subclasses set:

    * :attr:`start_markers`: strings that open the thinking at the start of the output (after whitespace);
    * :attr:`end_markers`: strings that close it (the first one is what the engine forces at a budget's end);
    * :attr:`thinks_from_start`: the output is thinking from its first token even without a start marker
      (the chat template put the start marker in the prompt); otherwise an output that does not start with a
      start marker is all answer.

    The reasoning and the answer are returned without the whitespace around them.
    """

    start_markers: ClassVar[tuple[str, ...]] = ()
    end_markers: ClassVar[tuple[str, ...]] = ()
    thinks_from_start: ClassVar[bool] = False

    def __init__(self, tokenizer: Any, chat_template_kwargs: Any = None) -> None:
        super().__init__(tokenizer, chat_template_kwargs)
        self._end_ids: list[int] | None = None
        self._cached: tuple[str, str | None, str] | None = None

    @property
    def reasoning_end_token_ids(self) -> list[int]:
        if self._end_ids is None:
            self._end_ids = marker_token_ids(self.tokenizer, self.end_markers[0]) if self.end_markers else []
        return self._end_ids

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """``(reasoning, content)`` of ``text`` (the output so far); reasoning is ``None`` when the output
        has no thinking section.

        With ``final=False`` text that may still turn into a marker is held back (in neither part), and so is
        whitespace that may end up around a part; each part of a later, longer text starts with this one's.
        """
        if not self.thinking_enabled:
            return None, text
        body = text.lstrip()
        opened = next((m for m in self.start_markers if body.startswith(m)), None)
        if opened is not None:
            begin = len(text) - len(body) + len(opened)
        elif not final and any(m.startswith(body) for m in self.start_markers):
            return "", ""  # too short to tell whether a start marker is coming
        elif self.thinks_from_start:
            begin = 0
        else:
            return None, text
        rest = text[begin:]
        found = min(((i, m) for m in self.end_markers if (i := rest.find(m)) != -1), default=None)
        if found is not None:
            at, marker = found
            return rest[:at].strip(), rest[at + len(marker):].lstrip()
        if final:
            return rest.strip(), ""
        return rest[:len(rest) - partial_marker_length(rest, self.end_markers)].strip(), ""

    def extract_reasoning(self, model_output: str, request: Any = None) -> tuple[str | None, str | None]:
        reasoning, content = self.split(model_output, final=True)
        return reasoning or None, content or None

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> ReasoningDelta | None:
        if self._cached is not None and self._cached[0] == previous_text:
            before_reasoning, before_content = self._cached[1], self._cached[2]
        else:
            before_reasoning, before_content = self.split(previous_text, final=False)
        reasoning, content = self.split(current_text, final=False)
        self._cached = (current_text, reasoning, content)
        delta = ReasoningDelta(reasoning=(reasoning or "")[len(before_reasoning or ""):] or None,
                               content=content[len(before_content):] or None)
        return delta if delta else None


def partial_marker_length(text: str, markers: Sequence[str]) -> int:
    """How many characters at the end of ``text`` are the beginning (not the whole) of one of ``markers``."""
    longest = 0
    for marker in markers:
        if len(marker) < 2:
            continue
        tail = text[-(len(marker) - 1):]
        at = tail.find(marker[0])
        while at != -1:
            if marker.startswith(tail[at:]):
                longest = max(longest, len(tail) - at)
                break
            at = tail.find(marker[0], at + 1)
    return longest


def marker_token_ids(tokenizer: Any, marker: str) -> list[int]:
    """The token ids the model emits for ``marker``: its own id when it is one (special) token, else its
    encoding without special tokens."""
    token_id = tokenizer.convert_tokens_to_ids(marker) if hasattr(tokenizer, "convert_tokens_to_ids") else None
    unk = getattr(tokenizer, "unk_token_id", None)
    if isinstance(token_id, int) and token_id >= 0 and token_id != unk:
        return [token_id]
    return list(tokenizer.encode(marker, add_special_tokens=False))
