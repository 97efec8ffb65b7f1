"""ReasoningParserManager: the registry of reasoning parsers, filled by the
``tokenmill_register_reasoning_parsers`` hook.

The built-in parsers (``deepseek_r1``, ``granite``, ``mistral``, ``qwen3``) register through the same hook,
from the entry point ``builtin_reasoning_parsers`` of group ``tokenmill.plugins``, as a model author's package
does::

    # my_model_pkg/plugin.py, named by an entry point in group "tokenmill.plugins"
    from tokenmill.plugin_api import hookimpl

    @hookimpl
    def tokenmill_register_reasoning_parsers(registry):
        registry.register_reasoning_parser("my_model", "my_model_pkg.reasoning:MyReasoningParser")

``tokenmill serve --reasoning-parser my_model`` then uses it.
"""

from __future__ import annotations

from typing import ClassVar

from tokenmill.plugins.fed_registry import HookFedRegistry, Target
from tokenmill.reasoning.abs_reasoning_parser import ReasoningParser


class UnknownReasoningParserError(ValueError):
    """``--reasoning-parser`` names no registered parser."""


class ReasoningParserManager(HookFedRegistry):
    """Reasoning parser name -> ``"module:Class"`` (or class); entries from scripts, then plugins (the
    built-ins are a plugin too)."""

    hook_name: ClassVar[str] = "tokenmill_register_reasoning_parsers"
    kind: ClassVar[str] = "reasoning parser"
    _builtin: ClassVar[dict[str, Target]] = {}

    @classmethod
    def register_reasoning_parser(cls, name: str, target: Target) -> None:
        """Register ``target`` (a :class:`ReasoningParser` subclass or its ``"module:Class"`` path) as ``name``."""
        cls._register(name, target)

    @classmethod
    def list_reasoning_parsers(cls) -> list[str]:
        return cls._names()

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        """The parser class of ``name``.

        Raises:
            UnknownReasoningParserError: no such parser (the message lists the known ones).
            ImportError / TypeError: the registered path cannot be imported or is not a ReasoningParser class.
        """
        target = cls._lookup(name)
        if target is None:
            raise UnknownReasoningParserError(
                f"reasoning_parser: unknown reasoning parser {name!r}; registered: "
                f"{', '.join(cls._names()) or 'none'}. A package adds one with the "
                "tokenmill_register_reasoning_parsers hook (see docs/reasoning.md)."
            )
        parser_cls = cls._load(name, target)
        if not issubclass(parser_cls, ReasoningParser):
            raise TypeError(f"reasoning parser {name!r}: {parser_cls!r} is not a subclass of ReasoningParser")
        return parser_cls
