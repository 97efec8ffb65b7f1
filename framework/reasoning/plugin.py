"""Registers tokenmill's built-in reasoning parsers (entry point ``builtin_reasoning_parsers`` in group
``tokenmill.plugins``), through the hook a third-party package uses."""

from __future__ import annotations

from typing import Any

from tokenmill.plugins.hookspecs import hookimpl

BUILTIN_REASONING_PARSERS: dict[str, str] = {
    "deepseek_r1": "tokenmill.reasoning.deepseek_r1_reasoning_parser:DeepSeekR1ReasoningParser",
    "granite": "tokenmill.reasoning.granite_reasoning_parser:GraniteReasoningParser",
    "mistral": "tokenmill.reasoning.mistral_reasoning_parser:MistralReasoningParser",
    "qwen3": "tokenmill.reasoning.qwen3_reasoning_parser:Qwen3ReasoningParser",
}


@hookimpl
def tokenmill_register_reasoning_parsers(registry: Any) -> None:
    for name, path in BUILTIN_REASONING_PARSERS.items():
        registry.register_reasoning_parser(name, path)
