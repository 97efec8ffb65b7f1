"""ReasoningStream: one streamed choice run through a reasoning parser, delta by delta."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tokenmill.reasoning.abs_reasoning_parser import ReasoningDelta, ReasoningParser

logger = logging.getLogger(__name__)


class ReasoningStream:
    """Feeds a parser the text and token ids of one choice as they arrive and gives each step's split.

    At the end of the stream it sends whatever the streaming calls held back, so that everything sent adds up
    to :meth:`ReasoningParser.extract_reasoning` of the whole text.

    Args:
        parser: a parser built for this request.
        request: passed to :meth:`ReasoningParser.extract_reasoning` at the end.
    """

    def __init__(self, parser: ReasoningParser, request: Any = None) -> None:
        self.parser = parser
        self.request = request
        self.text = ""
        self.token_ids: list[int] = []
        self.sent_reasoning = ""
        self.sent_content = ""

    @property
    def reasoning_ended(self) -> bool:
        """True once the answer has started (some content was sent)."""
        return bool(self.sent_content)

    def update(self, delta_text: str, delta_token_ids: Sequence[int], final: bool) -> ReasoningDelta:
        """The reasoning and content this delta adds; with ``final`` also everything still held back."""
        previous_text, previous_ids = self.text, self.token_ids
        self.text = previous_text + delta_text
        self.token_ids = previous_ids + list(delta_token_ids)
        delta = self.parser.extract_reasoning_streaming(
            previous_text, self.text, delta_text, previous_ids, self.token_ids, list(delta_token_ids)
        ) or ReasoningDelta()
        reasoning, content = delta.reasoning or "", delta.content or ""
        self.sent_reasoning += reasoning
        self.sent_content += content
        if final:
            full_reasoning, full_content = self.parser.extract_reasoning(self.text, self.request)
            reasoning += self._rest("reasoning", self.sent_reasoning, full_reasoning or "")
            content += self._rest("content", self.sent_content, full_content or "")
            self.sent_reasoning, self.sent_content = full_reasoning or "", full_content or ""
        return ReasoningDelta(reasoning=reasoning or None, content=content or None)

    def _rest(self, part: str, sent: str, full: str) -> str:
        if full.startswith(sent):
            return full[len(sent):]
        # a parser whose streamed pieces disagree with its final split: what was sent stands
        logger.warning("reasoning parser %s: streamed %s is not a prefix of the final %s",
                       type(self.parser).__name__, part, part)
        return ""
