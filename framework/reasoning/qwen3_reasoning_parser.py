"""Qwen3: ``<think>`` ... ``</think>`` before the answer; thinking is on unless the request's
``chat_template_kwargs`` say ``enable_thinking: false`` (the template then closes an empty thinking block in the
prompt and the output is the answer alone)."""

from __future__ import annotations

from typing import ClassVar

from tokenmill.reasoning.marker_parser import MarkerReasoningParser


class Qwen3ReasoningParser(MarkerReasoningParser):
    name: ClassVar[str] = "qwen3"
    start_markers: ClassVar[tuple[str, ...]] = ("<think>",)
    end_markers: ClassVar[tuple[str, ...]] = ("</think>",)
    # newer Qwen3 templates open the block in the prompt, older ones let the model write "<think>"
    thinks_from_start: ClassVar[bool] = True

    @property
    def thinking_enabled(self) -> bool:
        return self.chat_template_kwargs.get("enable_thinking", True) is not False
