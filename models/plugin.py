"""Registers tokenmill's built-in architectures (entry point ``builtin_models`` in group ``tokenmill.plugins``).

Built-in models use the same hook a third-party model package would.
"""

from __future__ import annotations

from typing import Any

from tokenmill.plugins import hookimpl

BUILTIN_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "tokenmill.models.llama:LlamaForCausalLM",
}


@hookimpl
def tokenmill_register_models(registry: Any) -> None:
    for arch, path in BUILTIN_MODELS.items():
        registry.register_model(arch, path)
