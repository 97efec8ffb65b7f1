"""Registers tokenmill's built-in tool parsers (entry point ``builtin_tool_parsers`` in group
``tokenmill.plugins``), through the hook a third-party package uses."""

from __future__ import annotations

from typing import Any

from tokenmill.plugins import hookimpl

BUILTIN_TOOL_PARSERS: dict[str, str] = {
    "hermes": "tokenmill.entrypoints.openai.tool_parsers.hermes_tool_parser:HermesToolParser",
    "llama3_json": "tokenmill.entrypoints.openai.tool_parsers.llama3_json_tool_parser:Llama3JsonToolParser",
    "mistral": "tokenmill.entrypoints.openai.tool_parsers.mistral_tool_parser:MistralToolParser",
    "pythonic": "tokenmill.entrypoints.openai.tool_parsers.pythonic_tool_parser:PythonicToolParser",
}


# Same form as tokenmill.models' plugin: each built-in registry is filled through its own plugin hook.
@hookimpl
def tokenmill_register_tool_parsers(registry: Any) -> None:
    for name, path in BUILTIN_TOOL_PARSERS.items():
        registry.register_tool_parser(name, path)
