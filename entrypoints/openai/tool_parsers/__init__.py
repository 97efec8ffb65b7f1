"""The OpenAI server's tool parsers (``hermes``, ``llama3_json``, ``mistral``, ``pythonic``, registered by the
entry point ``builtin_tool_parsers``) and the streaming of tool calls as deltas (:class:`ToolCallStreamer`).

The parser interface and the registry are :mod:`tokenmill.tool_parsers` (see docs/tool_calling.md).
"""

from __future__ import annotations

from tokenmill.entrypoints.openai.tool_parsers.streaming import ToolCallDelta, ToolCallStreamer, random_tool_call_id

__all__ = ["ToolCallDelta", "ToolCallStreamer", "random_tool_call_id"]
