"""Pydantic models of the HTTP API's responses: chat and text completions (whole and streamed), logprobs,
models, tokenization.

Shapes follow the OpenAI API reference; ``stop_reason`` and ``prompt_logprobs`` are vLLM's extras
(``prompt_logprobs`` is left out of the JSON unless it was asked for).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_serializer
from tokenmill.entrypoints.openai.protocol import OpenAIBaseModel, UsageInfo, now_s
from tokenmill.entrypoints.openai.protocol_tools import DeltaToolCall, ToolCall


def _is_none(value: Any) -> bool:
    return value is None


class LogprobInfo(OpenAIBaseModel):
    """One token's entry in ``prompt_logprobs`` (vLLM's shape); ``rank`` is 1-based."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per prompt token (the first is ``null``): token id (as a JSON key) -> its logprob.
PromptLogprobsJSON = list[dict[int, LogprobInfo] | None]


# ------------------------------------------------------------------------------------- chat responses


class ChatTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    """``tool_calls`` is left out of the JSON when the model called no tool."""

    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=_is_none)


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobsJSON | None = Field(default=None, exclude_if=_is_none)


class DeltaMessage(OpenAIBaseModel):
    """A streamed piece of a message; absent fields are left out of the JSON (``{}`` in the final chunk)."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="plain")
    def _drop_none(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}
        if self.tool_calls is not None:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    """One chunk. ``usage`` is serialised only when the stream asked for usage (``null`` until the last)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ------------------------------------------------------------------------------- completion responses

# The completion models repeat the chat ones' envelope fields on purpose: each model spells out its wire shape
# as OpenAI's API reference does, and the OpenAPI schema is generated from them.


class CompletionLogprobs(OpenAIBaseModel):
    """The legacy completions logprobs shape; ``text_offset`` counts characters from the choice's text start.

    With ``echo`` the prompt's tokens come first; the first prompt token has ``null`` logprobs.
    """

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsJSON | None = Field(default=None, exclude_if=_is_none)


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    """One chunk; ``usage`` as in :class:`ChatCompletionStreamResponse`."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------------------------- models


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "tokenmill"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---------------------------------------------------------------------------------------- tokenization


class TokenizeResponse(OpenAIBaseModel):
    """``count`` tokens, the context length, the ids and (with ``return_token_strs``) each token's string."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class VersionResponse(OpenAIBaseModel):
    version: str
