"""Mistral's reasoning models (Magistral): ``[THINK]`` ... ``[/THINK]`` special tokens open and close the
thinking; an output that does not open with ``[THINK]`` is all answer. The markers are special tokens, so the
text is detokenized with them (``skip_special_tokens`` is turned off)."""

from __future__ import annotations

from typing import ClassVar

from tokenmill.reasoning.marker_parser import MarkerReasoningParser


class MistralReasoningParser(MarkerReasoningParser):
    name: ClassVar[str] = "mistral"
    start_markers: ClassVar[tuple[str, ...]] = ("[THINK]",)
    end_markers: ClassVar[tuple[str, ...]] = ("[/THINK]",)

    @property
    def skip_special_tokens(self) -> bool | None:
        return False
