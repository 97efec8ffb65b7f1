"""Pydantic models of Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``).

Shapes follow Anthropic's API reference for Messages (the ``anthropic`` package's ``types`` models): the
request's ``system``, ``messages`` with content blocks (``text``, ``tool_use``, ``tool_result``, ``thinking``,
``redacted_thinking``), ``max_tokens``, ``stop_sequences``, ``temperature`` / ``top_p`` / ``top_k``, ``tools``
and ``tool_choice``, ``metadata``, ``thinking``; the response ``message`` with ``text`` / ``tool_use`` /
``thinking`` blocks, ``stop_reason``, ``stop_sequence`` and ``usage``; and the streamed events
(``message_start`` ... ``message_stop``).

Fields these models do not declare are checked as the OpenAI routes check theirs (see
:mod:`tokenmill.entrypoints.openai.request_fields`): accepted and ignored when ignoring them never changes the
output, refused with a 400 naming them otherwise. How a request becomes a chat completion is
:mod:`tokenmill.entrypoints.anthropic.translate`.
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from tokenmill.entrypoints.openai.protocol import RequestModel
from tokenmill.entrypoints.openai.request_fields import FieldPolicy, Refused

# Block types a request may hold; any other is refused (images and documents need a multimodal model).
TEXT_BLOCK = "text"
TOOL_USE_BLOCK = "tool_use"
TOOL_RESULT_BLOCK = "tool_result"
THINKING_BLOCK = "thinking"
REDACTED_THINKING_BLOCK = "redacted_thinking"
INPUT_BLOCK_TYPES = (TEXT_BLOCK, TOOL_USE_BLOCK, TOOL_RESULT_BLOCK, THINKING_BLOCK, REDACTED_THINKING_BLOCK)


def message_id() -> str:
    """An id in Anthropic's style: ``msg_<hex>``."""
    return f"msg_{uuid.uuid4().hex}"


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# -------------------------------------------------------------------------------------------- request


class TextBlockParam(AnthropicModel):
    """``{"type": "text", "text": ...}`` (``cache_control`` and ``citations`` are accepted and ignored)."""

    type: Literal["text"]
    text: str


class ToolUseBlockParam(AnthropicModel):
    """A tool call of an earlier assistant turn."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlockParam(AnthropicModel):
    """A tool's result, sent back in a user turn; ``content`` is text or text blocks."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlockParam] | None = None
    is_error: bool = False

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(block.text for block in self.content)


class ThinkingBlockParam(AnthropicModel):
    """A thinking block of an earlier assistant turn (dropped from the prompt, as Anthropic does)."""

    type: Literal["thinking"]
    thinking: str = ""
    signature: str | None = None


class RedactedThinkingBlockParam(AnthropicModel):
    type: Literal["redacted_thinking"]
    data: str = ""


ContentBlockParam = (TextBlockParam | ToolUseBlockParam | ToolResultBlockParam | ThinkingBlockParam
                     | RedactedThinkingBlockParam)


class MessageParam(AnthropicModel):
    """One turn: ``role`` ``user`` or ``assistant``; ``content`` a string or a list of blocks."""

    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        # A clear message for an unsupported block type instead of pydantic's five-way union failure.
        if isinstance(value, list):
            for i, block in enumerate(value):
                if not isinstance(block, dict):
                    raise ValueError(f"content block {i} must be an object")  # noqa: TRY004
                kind = block.get("type")
                if kind not in INPUT_BLOCK_TYPES:
                    raise ValueError(f"content block {i}: type {kind!r} is not supported by this server "
                                     f"(supported: {', '.join(INPUT_BLOCK_TYPES)})")
        return value


class ToolParam(AnthropicModel):
    """A client tool: ``input_schema`` is the JSON schema of its input. Anthropic's server tools (web search,
    code execution, ...) have a versioned ``type`` and are refused by the translation."""

    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    type: str | None = None


class ToolChoiceParam(AnthropicModel):
    """``auto`` (the model decides), ``any`` (some tool), ``tool`` (the one named), ``none``."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingParam(AnthropicModel):
    """``{"type": "enabled", "budget_tokens": N}``, ``{"type": "disabled"}``, ``adaptive`` or ``between_tools``
    (``display`` is accepted and ignored: thinking is always returned as it is)."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None


class OutputFormatParam(AnthropicModel):
    """``{"type": "json_schema", "schema": {...}}``: the text answer is JSON valid against ``schema``."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfigParam(AnthropicModel):
    """``format`` constrains the answer (through the grammar engine); ``effort`` is refused (no effort switch)."""

    format: OutputFormatParam | None = None
    effort: str | None = None


class MetadataParam(AnthropicModel):
    user_id: str | None = None


_IGNORED = {
    "service_tier": "Anthropic's capacity tier",
    "inference_geo": "Anthropic's data-residency option",
    "speed": "Anthropic's speed mode",
    "cache_control": "prefix caching is automatic",
    "diagnostics": "Anthropic's request diagnostics",
    "user_profile_id": "Anthropic's usage attribution",
    "workspace_id": "Anthropic's workspaces",
}
_REFUSED = {
    "container": Refused("containers (server-side code execution) are not supported by this server"),
    "mcp_servers": Refused("MCP servers are not supported by this server", ([],)),
    "context_management": Refused("context management is not supported by this server"),
}


class CountTokensRequest(RequestModel):
    """``POST /v1/messages/count_tokens``: the prompt part of a Messages request."""

    field_policy: ClassVar[FieldPolicy] = FieldPolicy(ignored=_IGNORED, refused=_REFUSED)

    model: str | None = None
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfigParam | None = None
    output_format: OutputFormatParam | None = None  # the older spelling of output_config.format


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``. ``max_tokens`` is required, as in Anthropic's API."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: MetadataParam | None = None


# ------------------------------------------------------------------------------------------- response


class TextBlock(AnthropicModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(AnthropicModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(AnthropicModel):
    """The model's reasoning (from the server's reasoning parser); ``signature`` is always empty: nothing here
    is encrypted or verified."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


ContentBlock = TextBlock | ToolUseBlock | ThinkingBlock


class Usage(AnthropicModel):
    """Token counts. As in Anthropic's API, ``input_tokens`` excludes the prompt tokens read from the prefix
    cache (``cache_read_input_tokens``); nothing is ever written on request, so
    ``cache_creation_input_tokens`` is 0."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageResponse(AnthropicModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(AnthropicModel):
    input_tokens: int


class AnthropicErrorInfo(AnthropicModel):
    type: str
    message: str


class AnthropicErrorResponse(AnthropicModel):
    """``{"type": "error", "error": {"type": ..., "message": ...}}``."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
