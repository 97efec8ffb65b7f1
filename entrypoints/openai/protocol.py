"""Pydantic models of the OpenAI HTTP API (chat completions, completions, models, errors).

Request fields follow the OpenAI API reference plus the sampling extras vLLM accepts (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ...). Unknown request fields are ignored, as
OpenAI-compatible servers commonly do, so newer clients keep working.

Pydantic checks types; value ranges are checked once, by :class:`tokenmill.sampling_params.SamplingParams`,
whose errors name the field. Checks that involve several fields live in ``check()`` and raise
:class:`tokenmill.errors.InvalidRequestError` with ``param`` set.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

# Defaults applied when a request leaves a sampling field out (vLLM's, which are OpenAI's where both exist).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0
DEFAULT_MIN_P = 0.0
DEFAULT_REPETITION_PENALTY = 1.0
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_TOP_LOGPROBS = 20


def random_id(prefix: str) -> str:
    """A unique id such as ``chatcmpl-3f2a...`` (32 hex digits after the prefix)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# --------------------------------------------------------------------------------------------- errors


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ---------------------------------------------------------------------------------------------- usage


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    """Token counts of a request; ``cached_tokens`` are prompt tokens served from the prefix cache."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


# ------------------------------------------------------------------------------------------- requests


class _SamplingRequest(OpenAIBaseModel):
    """Fields shared by chat and text completion requests."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    echo: bool = False

    def check(self) -> None:
        """Checks across fields.

        Raises:
            InvalidRequestError: ``param`` names the offending field.
        """
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options: only allowed when stream is true", param="stream_options")
        if self.logit_bias:
            for key, value in self.logit_bias.items():
                if not key.lstrip("-").isdigit():
                    raise InvalidRequestError(f"logit_bias: keys must be token ids, got {key!r}", param="logit_bias")
                if not -100.0 <= value <= 100.0:
                    raise InvalidRequestError(f"logit_bias: values must be in [-100, 100], got {value}",
                                              param="logit_bias")
            raise InvalidRequestError("logit_bias: not supported by this server yet", param="logit_bias")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int, logprobs: int | None, output_kind: RequestOutputKind
                         ) -> SamplingParams:
        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        return SamplingParams(
            n=self.n,
            temperature=pick(self.temperature, DEFAULT_TEMPERATURE),
            top_p=pick(self.top_p, DEFAULT_TOP_P),
            top_k=pick(self.top_k, DEFAULT_TOP_K),
            min_p=pick(self.min_p, DEFAULT_MIN_P),
            seed=self.seed,
            presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            repetition_penalty=pick(self.repetition_penalty, DEFAULT_REPETITION_PENALTY),
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logprobs=logprobs,
            output_kind=output_kind,
        )


class ChatMessage(OpenAIBaseModel):
    """One input message; ``content`` is a string or a list of ``{"type": "text", "text": ...}`` parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    # pydantic reports only ValueError (not TypeError) from validators as a validation error.
    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of content parts")  # noqa: TRY004
        for i, part in enumerate(value):
            if not isinstance(part, dict):
                raise ValueError(f"content part {i} must be an object")  # noqa: TRY004
            if part.get("type") != "text":
                raise ValueError(f"content part {i}: type {part.get('type')!r} is not supported (only 'text')")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i}: 'text' must be a string")  # noqa: TRY004
        return value

    def text(self) -> str:
        """The content as one string (text parts joined by newlines; ``""`` when absent)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part["text"] for part in self.content)

    def to_template_dict(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``.

    ``max_completion_tokens`` (or the older ``max_tokens``) left out means "up to the context length".
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise InvalidRequestError("top_logprobs: requires logprobs to be true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(
                    f"top_logprobs: must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}",
                    param="top_logprobs",
                )
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise InvalidRequestError(
                    "continue_final_message: cannot be combined with add_generation_prompt=true",
                    param="continue_final_message",
                )
            if self.messages[-1].role != "assistant":
                raise InvalidRequestError(
                    "continue_final_message: the last message must have role 'assistant'",
                    param="continue_final_message",
                )
        if self.tools:
            raise InvalidRequestError("tools: tool calling is not supported by this server yet", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidRequestError(
                f"response_format: type {self.response_format.get('type')!r} is not supported (only 'text')",
                param="response_format",
            )

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def to_sampling_params(self, max_tokens: int, output_kind: RequestOutputKind) -> SamplingParams:
        """Raises :class:`~tokenmill.sampling_params.SamplingParamsError` for an out-of-range value."""
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, output_kind)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, token ids, or a list of those."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise InvalidRequestError("suffix: not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of: only best_of equal to n is supported", param="best_of")
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError("echo: cannot be combined with logprobs yet", param="echo")
        self.prompts()

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list (one entry per prompt, each text or token ids).

        Raises:
            InvalidRequestError: no prompt, or an empty one (``param="prompt"``).
        """
        prompt = self.prompt
        prompts: list[str | list[int]]
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]  # type: ignore[arg-type]
        else:
            prompts = list(prompt)  # type: ignore[arg-type]
        if not prompts:
            raise InvalidRequestError("prompt: must not be empty", param="prompt")
        for p in prompts:
            if len(p) == 0:
                raise InvalidRequestError("prompt: must not be empty", param="prompt")
        return prompts

    def to_sampling_params(self, max_tokens: int, output_kind: RequestOutputKind) -> SamplingParams:
        """Raises :class:`~tokenmill.sampling_params.SamplingParamsError` for an out-of-range value."""
        return self._sampling_params(max_tokens, self.logprobs, output_kind)


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
    role: str = "assistant"
    content: str | None = None


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(OpenAIBaseModel):
    """A streamed piece of a message; absent fields are left out of the JSON (``{}`` in the final chunk)."""

    role: str | None = None
    content: str | None = None

    @model_serializer(mode="plain")
    def _drop_none(self) -> dict[str, Any]:
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ------------------------------------------------------------------------------- completion responses


class CompletionLogprobs(OpenAIBaseModel):
    """The legacy completions logprobs shape; ``text_offset`` counts characters from the choice's text start."""

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


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------------------------- models


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tokenmill"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
