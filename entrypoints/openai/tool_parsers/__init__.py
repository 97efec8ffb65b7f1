"""Tool parsers: reading tool calls out of generated text for ``tool_choice="auto"`` (see docs/tool_calling.md).

Public surface: :class:`ToolParser` (subclass it), :class:`ToolParserManager` (the registry the
``tokenmill_register_tool_parsers`` hook fills), :class:`ToolCallStreamer` (streaming deltas from any parse
function), and the result types.
"""

from __future__ import annotations

from tokenmill.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    PartialParse,
    PartialToolCall,
    ToolCallInfo,
    ToolParser,
)
from tokenmill.entrypoints.openai.tool_parsers.streaming import ToolCallDelta, ToolCallStreamer, random_tool_call_id
from tokenmill.entrypoints.openai.tool_parsers.tool_parser_manager import ToolParserManager, UnknownToolParserError

__all__ = [
    "ExtractedToolCalls",
    "PartialParse",
    "PartialToolCall",
    "ToolCallDelta",
    "ToolCallInfo",
    "ToolCallStreamer",
    "ToolParser",
    "ToolParserManager",
    "UnknownToolParserError",
    "random_tool_call_id",
]
