"""``tools`` + ``tool_choice`` of a chat request: the constraint for ``required`` / a named function, the
parser for ``auto``, and turning the generated text into ``message.tool_calls``.

Entry points (also for other API front ends, e.g. a Responses API):

* :func:`resolve_tool_calling` -- a request's tools and choice -> :class:`ToolCalling` (or ``None``);
* :meth:`ToolCalling.extract` -- a finished text -> content and tool calls;
* :meth:`ToolCalling.streamer` -- a :class:`ToolCallStreamer` for streamed deltas.

``required`` constrains the output to a JSON array of ``{"name": ..., "parameters": {...}}`` objects, each
valid for one of the tools (vLLM's format; one element only when ``parallel_tool_calls`` is false); a named
function constrains the output to that function's arguments. Both go through the structured-output engine, so
the arguments are valid against the tool's JSON schema.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.entrypoints.openai.protocol_tools import ChatCompletionNamedToolChoiceParam, ChatCompletionToolParam
from tokenmill.entrypoints.openai.structured_outputs import json_schema_to_structured_outputs
from tokenmill.entrypoints.openai.tool_parsers import ToolCallStreamer
from tokenmill.entrypoints.openai.tool_parsers.hermes_tool_parser import is_valid_call, string_member
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.tool_parsers import ExtractedToolCalls, PartialParse, PartialToolCall, ToolParser
from tokenmill.tool_parsers.abstract_tool_parser import arguments_text
from tokenmill.tool_parsers.json_scan import JSONScanError, scan_array_of_objects, skip_ws

AUTO_FLAGS_MESSAGE = (
    'tool_choice: "auto" needs a tool parser: start the server with --enable-auto-tool-choice '
    "--tool-call-parser NAME (built in: hermes, llama3_json, mistral, pythonic)"
)


def tool_parameters(tool: ChatCompletionToolParam) -> dict[str, Any]:
    """The JSON schema of a tool's arguments (no ``parameters``: an object with no properties)."""
    return tool.function.parameters or {"type": "object", "properties": {}}


def required_calls_schema(tools: list[ChatCompletionToolParam], parallel_tool_calls: bool,
                          max_calls: int | None = None) -> dict[str, Any]:
    """JSON schema of ``[{"name": ..., "parameters": ...}, ...]`` over ``tools``: at least one call, at most
    one without ``parallel_tool_calls``, else at most ``max_calls`` (``None``: no limit)."""
    variants = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t.function.name]}, "parameters": tool_parameters(t)},
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": variants[0] if len(variants) == 1 else {"anyOf": variants}}
    limit = 1 if not parallel_tool_calls else max_calls
    if limit is not None:
        schema["maxItems"] = limit
    return schema


def parse_required(text: str, final: bool) -> PartialParse:
    """Parse of a ``required`` output (a JSON array of name/parameters objects)."""
    start = skip_ws(text, 0)
    if start >= len(text):
        return PartialParse(content=text if final else "")
    try:
        objects, end = scan_array_of_objects(text, start, final)
    except JSONScanError:
        return PartialParse(content=text) if final else PartialParse()
    calls = []
    for obj in objects:
        arguments, _ = arguments_text(text, obj, ("parameters", "arguments"))
        name = string_member(text, obj, "name")
        if final and (name is None or not is_valid_call(text, obj, arguments)):
            break
        calls.append(PartialToolCall(name, arguments, obj.end is not None))
    if final and not calls:
        return PartialParse(content=text)
    return PartialParse(tool_calls=calls)


def named_parse(name: str) -> Callable[[str, bool], PartialParse]:
    """Parse of a named-function output: the whole text is that function's arguments. No text, no call: a
    reasoning model cut off (``length``) before its thinking ended never started the arguments."""

    def parse(text: str, final: bool) -> PartialParse:
        if not text:
            return PartialParse()
        return PartialParse(tool_calls=[PartialToolCall(name, text, final)])

    return parse


@dataclass
class ToolCalling:
    """How one request's output becomes tool calls.

    Attributes:
        mode: ``"auto"``, ``"required"`` or ``"named"``.
        parse: ``parse(text, final)``: the parser's, or the constrained format's.
        structured_outputs: the constraint (``required`` / named), else ``None``.
        max_calls: at most this many calls are kept (1 when ``parallel_tool_calls`` is false; ``None``: all).
        skip_special_tokens: override of the request's setting the parser needs (``None``: keep it).
    """

    mode: str
    parse: Callable[[str, bool], PartialParse]
    structured_outputs: StructuredOutputsParams | None = None
    max_calls: int | None = None
    skip_special_tokens: bool | None = None

    def extract(self, text: str) -> ExtractedToolCalls:
        """Content and tool calls of a finished output."""
        result = ExtractedToolCalls.from_parse(self.parse(text, True))
        if self.max_calls is not None:
            result.tool_calls = result.tool_calls[: self.max_calls]
        return result

    def streamer(self) -> ToolCallStreamer:
        return ToolCallStreamer(self.parse, self.max_calls)

    def finish_reason(self, engine_reason: str | None, tools_called: bool) -> str | None:
        """OpenAI's: ``tool_calls`` when the model chose to call (auto / required) and stopped by itself; a
        forced named call ends with ``stop``; ``length`` stays ``length``."""
        if tools_called and engine_reason == "stop" and self.mode != "named":
            return "tool_calls"
        return engine_reason


def resolve_tool_calling(tools: list[ChatCompletionToolParam] | None, tool_choice: Any, parallel_tool_calls: bool,
                         parser_factory: Callable[[], ToolParser] | None, max_calls: int | None = None
                         ) -> ToolCalling | None:
    """The tool handling of a request, or ``None`` when tool calls are off (no tools, or ``none``).

    Args:
        tools: the request's tools.
        tool_choice: ``None`` (``auto`` when tools are given, as in OpenAI's API), ``"none"``, ``"auto"``
            (with no tools the same as ``none``), ``"required"`` or a named function.
        parallel_tool_calls: allow several calls in one message.
        parser_factory: makes the server's tool parser (``None`` without ``--enable-auto-tool-choice``).
        max_calls: keep at most this many calls (the Responses API's ``max_tool_calls``; ``None``: no limit).

    Raises:
        InvalidRequestError (``param="tool_choice"`` or ``"tools"``): ``required`` / named without tools, an
            unknown function name, duplicate tool names, or ``auto`` without a parser (the message says which
            flags to pass).
    """
    if tools:
        names = [t.function.name for t in tools]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise InvalidRequestError(f"tools: duplicate function names {duplicates}", param="tools")
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none" or (tool_choice == "auto" and not tools):
        return None  # no tool can be called (``auto`` without tools asks for nothing)
    max_calls = max_calls if parallel_tool_calls else 1
    if isinstance(tool_choice, ChatCompletionNamedToolChoiceParam):
        name = tool_choice.function.name
        tool = next((t for t in tools or [] if t.function.name == name), None)
        if tool is None:
            raise InvalidRequestError(
                f"tool_choice: function {name!r} is not among the request's tools "
                f"({', '.join(t.function.name for t in tools or []) or 'none given'})",
                param="tool_choice",
            )
        so = json_schema_to_structured_outputs(tool_parameters(tool), strict=tool.function.strict,
                                               param="tool_choice")
        return ToolCalling("named", named_parse(name), compact(so), 1)
    if not tools:
        raise InvalidRequestError(f"tool_choice: {tool_choice!r} needs a non-empty 'tools' list", param="tool_choice")
    if tool_choice == "required":
        so = json_schema_to_structured_outputs(required_calls_schema(tools, parallel_tool_calls, max_calls),
                                               strict=any(t.function.strict for t in tools), param="tool_choice")
        return ToolCalling("required", parse_required, compact(so), max_calls)
    if parser_factory is None:
        raise InvalidRequestError(AUTO_FLAGS_MESSAGE, param="tool_choice")
    parser = parser_factory()
    return ToolCalling("auto", parser.parse, None, max_calls, parser.skip_special_tokens)


def compact(so: StructuredOutputsParams) -> StructuredOutputsParams:
    """Tool arguments are generated as compact JSON (one space after ``:`` and ``,``, no other whitespace):
    what OpenAI's arguments look like, and fewer tokens."""
    import msgspec

    return msgspec.structs.replace(so, disable_any_whitespace=True)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as chat templates expect them: an assistant's ``tool_calls[].function.arguments`` given as
    JSON text (OpenAI's format) become objects, which templates render with ``tojson`` (Qwen, Hermes,
    Llama 3); text that is not a JSON object is left as it is."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if not calls:
            out.append(message)
            continue
        fixed = []
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(arguments, str):
                try:
                    parsed = json.loads(arguments)
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict):
                    call = {**call, "function": {**function, "arguments": parsed}}
            fixed.append(call)
        out.append({**message, "tool_calls": fixed})
    return out


def resolve_tool_parser(args: Any) -> type[ToolParser] | None:
    """The ``--tool-call-parser`` class when ``--enable-auto-tool-choice`` is on (``None`` otherwise).

    Raises:
        ValueError: ``--enable-auto-tool-choice`` without ``--tool-call-parser``, or an unknown parser name
            (the message lists the registered ones).
    """
    from tokenmill.tool_parsers import ToolParserManager

    name = getattr(args, "tool_call_parser", None)
    if not getattr(args, "enable_auto_tool_choice", False):
        if name is not None:
            ToolParserManager.get_tool_parser(name)  # still reject a misspelt name at startup
        return None
    if name is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (built in: hermes, llama3_json, "
                         "mistral, pythonic)")
    return ToolParserManager.get_tool_parser(name)
