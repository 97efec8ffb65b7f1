"""DeepSeek-R1 (and its distills): the chat template ends the prompt with ``<think>\\n``, so the output is thinking
up to ``</think>`` whether or not it repeats the opening tag; an output without ``</think>`` (cut by
``max_tokens``) is all thinking."""

from __future__ import annotations

from typing import ClassVar

from tokenmill.reasoning.marker_parser import MarkerReasoningParser


class DeepSeekR1ReasoningParser(MarkerReasoningParser):
    name: ClassVar[str] = "deepseek_r1"
    start_markers: ClassVar[tuple[str, ...]] = ("<think>",)
    end_markers: ClassVar[tuple[str, ...]] = ("</think>",)
    thinks_from_start: ClassVar[bool] = True
