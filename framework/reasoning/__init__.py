"""Reasoning parsers: split a reasoning model's thinking from its answer (``--reasoning-parser NAME``).

Pure text and token logic, below the engine and the servers: the OpenAI and Anthropic front ends use the
parsers to fill ``reasoning`` / ``thinking`` fields, and the engine uses a parser's end marker (through
:class:`tokenmill.sampling_params.ReasoningParams`) to start a grammar after the thinking and to end the
thinking at a token budget. Built-ins: ``deepseek_r1``, ``granite``, ``mistral``, ``qwen3``; a package adds
one with the ``tokenmill_register_reasoning_parsers`` hook.
"""

from __future__ import annotations

from tokenmill.reasoning.abs_reasoning_parser import ReasoningDelta, ReasoningParser, contains_subsequence
from tokenmill.reasoning.marker_parser import MarkerReasoningParser
from tokenmill.reasoning.reasoning_parser_manager import ReasoningParserManager, UnknownReasoningParserError
from tokenmill.reasoning.stream import ReasoningStream

__all__ = [
    "MarkerReasoningParser",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningParserManager",
    "ReasoningStream",
    "UnknownReasoningParserError",
    "contains_subsequence",
]
