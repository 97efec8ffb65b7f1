"""Tool parsers' interface and registry: reading tool calls out of generated text for ``tool_choice="auto"``
(see docs/tool_calling.md).

:class:`ToolParser` (subclass it), :class:`ToolParserManager` (the registry the
``tokenmill_register_tool_parsers`` hook fills) and the result types. They sit below the server so that the
public plugin API can offer them; the built-in parsers and the streaming of calls live with the OpenAI server
(:mod:`tokenmill.entrypoints.openai.tool_parsers`).
"""

from __future__ import annotations

from tokenmill.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    PartialParse,
    PartialToolCall,
    ToolCallInfo,
    ToolParser,
)
from tokenmill.tool_parsers.tool_parser_manager import ToolParserManager, UnknownToolParserError

__all__ = [
    "ExtractedToolCalls",
    "PartialParse",
    "PartialToolCall",
    "ToolCallInfo",
    "ToolParser",
    "ToolParserManager",
    "UnknownToolParserError",
]
