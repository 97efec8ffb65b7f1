"""IBM Granite 3.2+: with ``chat_template_kwargs: {"thinking": true}`` the model writes "Here is my thought
process:" (or "Here's ..."), its thinking, then "Here is my response:" and the answer; without the switch the
output is the answer alone. The markers are plain text, several tokens long."""

from __future__ import annotations

from typing import ClassVar

from tokenmill.reasoning.marker_parser import MarkerReasoningParser


class GraniteReasoningParser(MarkerReasoningParser):
    name: ClassVar[str] = "granite"
    start_markers: ClassVar[tuple[str, ...]] = ("Here is my thought process:", "Here's my thought process:")
    end_markers: ClassVar[tuple[str, ...]] = ("Here is my response:", "Here's my response:")

    @property
    def thinking_enabled(self) -> bool:
        return bool(self.chat_template_kwargs.get("thinking", False))
