"""ToolParserManager: the registry of tool parsers, filled by the ``tokenmill_register_tool_parsers`` hook.

The built-in parsers (``hermes``, ``llama3_json``, ``mistral``, ``pythonic``) register through the same hook,
from the entry point ``builtin_tool_parsers`` of group ``tokenmill.plugins``, as a model author's package
does::

    # my_model_pkg/plugin.py, named by an entry point in group "tokenmill.plugins"
    from tokenmill.plugins import hookimpl

    @hookimpl
    def tokenmill_register_tool_parsers(registry):
        registry.register_tool_parser("my_format", "my_model_pkg.tools:MyToolParser")

``tokenmill serve --enable-auto-tool-choice --tool-call-parser my_format`` then uses it.
"""

from __future__ import annotations

from typing import ClassVar

from tokenmill.tool_parsers.abstract_tool_parser import ToolParser
from tokenmill.plugins.fed_registry import HookFedRegistry, Target


class UnknownToolParserError(ValueError):
    """``--tool-call-parser`` names no registered parser."""


class ToolParserManager(HookFedRegistry):
    """Tool parser name -> ``"module:Class"`` (or class); entries from scripts, plugins, then nothing built in
    (the built-ins are a plugin too)."""

    hook_name: ClassVar[str] = "tokenmill_register_tool_parsers"
    kind: ClassVar[str] = "tool parser"
    _builtin: ClassVar[dict[str, Target]] = {}

    @classmethod
    def register_tool_parser(cls, name: str, target: Target) -> None:
        """Register ``target`` (a :class:`ToolParser` subclass or its ``"module:Class"`` path) as ``name``."""
        cls._register(name, target)

    @classmethod
    def list_tool_parsers(cls) -> list[str]:
        return cls._names()

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        """The parser class of ``name``.

        Raises:
            UnknownToolParserError: no such parser (the message lists the known ones and how to add one).
            ImportError / TypeError: the registered path cannot be imported or is not a ToolParser class.
        """
        target = cls._lookup(name)
        if target is None:
            raise UnknownToolParserError(
                f"tool_call_parser: unknown tool parser {name!r}; registered: {', '.join(cls._names()) or 'none'}. "
                "A package adds one with the tokenmill_register_tool_parsers hook (see docs/tool_calling.md)."
            )
        parser_cls = cls._load(name, target)
        if not issubclass(parser_cls, ToolParser):
            raise TypeError(f"tool parser {name!r}: {parser_cls!r} is not a subclass of ToolParser")
        return parser_cls
