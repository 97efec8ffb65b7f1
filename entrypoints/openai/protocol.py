"""Pydantic models of the HTTP API's requests (chat, completions, tokenize, detokenize) and shared parts.

Request fields follow the OpenAI API reference plus the sampling extras vLLM accepts (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``stop_token_ids``, ``allowed_token_ids``, ``bad_words``,
``prompt_logprobs``, ...). Fields a request model does not declare are checked by
:mod:`tokenmill.entrypoints.openai.request_fields` before validation: each model's ``field_policy`` lists
the fields that are accepted and ignored (ignoring them never changes the output) and those refused with a
400; anything else is a 400 naming it. Response models live in :mod:`tokenmill.entrypoints.openai.responses`.

Pydantic checks types; value ranges are checked once, by :class:`tokenmill.sampling_params.SamplingParams`,
whose errors name the field. Checks that involve several fields live in ``check()`` and raise
:class:`tokenmill.errors.InvalidRequestError` with ``param`` set. Checks that need the model (vocabulary,
context length) are done by the serving classes.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from tokenmill.entrypoints.openai.request_fields import FieldPolicy, Refused, check_request_fields
from tokenmill.entrypoints.openai.protocol_tools import ChatCompletionToolParam, StructuredOutputsField, ToolChoice
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import (
    LogitsProcessorSpec,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

# Defaults applied when a request leaves a sampling field out (vLLM's, which are OpenAI's where both exist).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0
DEFAULT_MIN_P = 0.0
DEFAULT_REPETITION_PENALTY = 1.0
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_TOP_LOGPROBS = 20
# The OpenAI API's range of ``temperature`` (SamplingParams itself allows more, for offline use).
MAX_API_TEMPERATURE = 2.0
# Bad ids or keys listed in one error message at most (the rest are counted).
_MAX_LISTED = 10
# Most sequences (prompts x n) one request may ask for; more is refused rather than queued.
MAX_SEQUENCES_PER_REQUEST = 1024
# SamplingParams' own limit on n (it names ``n`` in its error; larger values are left to it).
_MAX_N = 128


def random_id(prefix: str) -> str:
    """A unique id such as ``chatcmpl-3f2a...`` (32 hex digits after the prefix)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    """Unix time in whole seconds (the ``created`` field)."""
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


def listed(items: list[Any]) -> str:
    """``items`` for an error message: at most ``_MAX_LISTED`` of them, then how many more."""
    shown = ", ".join(repr(i) if isinstance(i, str) else str(i) for i in items[:_MAX_LISTED])
    return shown + (f" and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else "")


class RequestModel(OpenAIBaseModel):
    """A request body: fields it does not declare are ignored or refused per ``field_policy``."""

    field_policy: ClassVar[FieldPolicy] = FieldPolicy()

    @classmethod
    def check_request_fields(cls, data: dict[str, Any]) -> dict[str, Any]:
        """``data`` without the ignored fields.

        Raises:
            InvalidRequestError: refused or unrecognized fields (all named).
        """
        return check_request_fields(cls, data, cls.field_policy)


# Fields of OpenAI's (and vLLM's) request bodies that ask nothing of the model's output.
_IGNORED_HINTS = {
    "metadata": "tags for OpenAI's stored completions; this server stores nothing",
    "store": "this server stores no responses (nothing can be retrieved later)",
    "service_tier": "OpenAI's processing tier",
    "prompt_cache_key": "prefix caching is automatic (--enable-prefix-caching)",
    "prompt_cache_retention": "prefix caching is automatic (--enable-prefix-caching)",
    "prompt_cache_options": "prefix caching is automatic (--enable-prefix-caching)",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
}
_NOT_IMPLEMENTED = "not supported by this server"
# vLLM's extras that tokenmill does not implement (shared by chat and completions).
_VLLM_REFUSED = {
    "use_beam_search": Refused("beam search is " + _NOT_IMPLEMENTED, (False,)),
    "length_penalty": Refused("only used by beam search, which is " + _NOT_IMPLEMENTED, (1.0, 1)),
    "kv_transfer_params": Refused("KV transfer (disaggregated prefill) is " + _NOT_IMPLEMENTED),
    "vllm_xargs": Refused(_NOT_IMPLEMENTED),
    "request_id": Refused("send the X-Request-Id header instead (echoed in the response headers and logged)"),
    "return_token_ids": Refused(_NOT_IMPLEMENTED + "; use logprobs with return_tokens_as_token_ids", (False,)),
    "mm_processor_kwargs": Refused("multimodal inputs are " + _NOT_IMPLEMENTED, ({},)),
    "guided_decoding_backend": Refused("the backend is chosen per server (--structured-outputs-backend)"),
    "guided_whitespace_pattern": Refused("a custom whitespace pattern is " + _NOT_IMPLEMENTED
                                         + "; use structured_outputs.disable_any_whitespace"),
}


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


class LogitsProcessorConstructor(OpenAIBaseModel):
    """vLLM's ``{"qualname": ..., "args": [...], "kwargs": {...}}``: a factory of a per-request logits processor."""

    qualname: str = Field(min_length=1)
    args: list[Any] | None = None
    kwargs: dict[str, Any] | None = None


class StreamOptions(OpenAIBaseModel):
    """``include_usage``: one last chunk with the usage; ``continuous_usage_stats`` (vLLM): usage so far in
    every chunk."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


# ------------------------------------------------------------------------------------------- requests


class _SamplingRequest(RequestModel):
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
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    return_tokens_as_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    # Mixed into the prefix-cache hashes: only requests with the same salt share cached prompt blocks.
    cache_salt: str | None = Field(default=None, min_length=1)
    # Per-request logits processors by qualified name (allowed by --logits-processor-pattern)
    logits_processors: list[str | LogitsProcessorConstructor] | None = None
    # structured outputs (see structured_outputs.py): OpenAI's response_format, vLLM's structured_outputs and
    # its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's constraint and the field its errors name (``(None, None)``: unconstrained):
        ``response_format.json_schema.schema`` for a schema given in ``response_format``, else the field.

        Raises:
            InvalidRequestError: several sources at once, or an ill-formed one (``param`` names the field).
        """
        from tokenmill.entrypoints.openai import structured_outputs as so

        found: list[tuple[StructuredOutputsParams, str, str]] = []  # (constraint, field, param of its errors)
        rf = so.response_format_to_structured_outputs(self.response_format)
        if rf is not None:
            schema_given = (self.response_format or {}).get("type") == "json_schema"
            found.append((rf, "response_format", "response_format.json_schema.schema" if schema_given
                          else "response_format"))
        if self.structured_outputs is not None:
            found.append((so.structured_outputs_from_field(self.structured_outputs), "structured_outputs",
                          "structured_outputs"))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append((so._params(name, **{kind: value}), name, name))
        if len(found) > 1:
            first, second = found[0][1], found[1][1]
            raise InvalidRequestError(f"{second}: cannot be combined with {first} (give one constraint)",
                                      param=second)
        return (found[0][0], found[0][2]) if found else (None, None)

    def check(self) -> None:
        """Checks across fields, and the OpenAI ranges that are narrower than ``SamplingParams``' own.

        Raises:
            InvalidRequestError: ``param`` names the offending field.
        """
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options: only allowed when stream is true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError("prompt_logprobs: not available when stream is true",
                                      param="prompt_logprobs")
        check_api_temperature(self.temperature)
        if self.logit_bias:
            check_logit_bias(self.logit_bias)
        k = self.truncate_prompt_tokens
        if k is not None and k < 1 and k != -1:
            raise InvalidRequestError(f"truncate_prompt_tokens: must be -1 or at least 1, got {k}",
                                      param="truncate_prompt_tokens")

    def truncated(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt after ``truncate_prompt_tokens`` (vLLM's extra): only its last k tokens (-1: the
        context length) are kept."""
        k = self.truncate_prompt_tokens
        if k == -1:
            k = max_model_len
        return prompt_ids[-k:] if k is not None and len(prompt_ids) > k else prompt_ids

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)

    def token_id_fields(self) -> dict[str, list[int]]:
        """Token ids the request names, by field (the server checks them against the vocabulary)."""
        fields: dict[str, list[int]] = {}
        if self.logit_bias:
            fields["logit_bias"] = [int(k) for k in self.logit_bias]
        if self.allowed_token_ids is not None:
            fields["allowed_token_ids"] = list(self.allowed_token_ids)
        if self.stop_token_ids:
            fields["stop_token_ids"] = list(self.stop_token_ids)
        return fields

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                         output_kind: RequestOutputKind, vocab_size: int) -> SamplingParams:
        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        top_k = pick(self.top_k, DEFAULT_TOP_K)
        return SamplingParams(
            n=self.n,
            temperature=pick(self.temperature, DEFAULT_TEMPERATURE),
            top_p=pick(self.top_p, DEFAULT_TOP_P),
            # Beyond the vocabulary top-k keeps everything; clamping keeps the value a small integer.
            top_k=min(top_k, vocab_size) if isinstance(top_k, int) else top_k,
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
            prompt_logprobs=prompt_logprobs,
            output_kind=output_kind,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            bad_words=list(self.bad_words) if self.bad_words else None,
            logits_processors=[_logits_processor_spec(p) for p in self.logits_processors or []] or None,
        )


def _logits_processor_spec(entry: str | LogitsProcessorConstructor) -> LogitsProcessorSpec:
    if isinstance(entry, str):
        return LogitsProcessorSpec(qualname=entry)
    return LogitsProcessorSpec(qualname=entry.qualname, args=entry.args, kwargs=entry.kwargs)


def check_api_temperature(temperature: float | None) -> None:
    """Raises InvalidRequestError when ``temperature`` is above the OpenAI API's maximum of 2.

    (Negative and non-finite values are left to ``SamplingParams``, whose error names the field too.)
    """
    if temperature is not None and temperature > MAX_API_TEMPERATURE:
        raise InvalidRequestError(
            f"temperature: must be between 0 and {MAX_API_TEMPERATURE:g}, got {temperature}", param="temperature"
        )


def check_logit_bias(logit_bias: dict[str, float]) -> None:
    """Raises InvalidRequestError naming every key that is not a token id and every value outside
    [-100, 100] (the OpenAI API's range)."""
    bad_keys = [key for key in logit_bias if not key.strip().lstrip("-").isdigit()]
    bad_values = [f"{key!r}: {value}" for key, value in logit_bias.items() if not -100.0 <= value <= 100.0]
    problems = []
    if bad_keys:
        problems.append(f"keys must be token ids, got {listed(bad_keys)}")
    if bad_values:
        shown = ", ".join(bad_values[:_MAX_LISTED]) + (
            f" and {len(bad_values) - _MAX_LISTED} more" if len(bad_values) > _MAX_LISTED else "")
        problems.append(f"values must be in [-100, 100], got {shown}")
    if problems:
        raise InvalidRequestError("logit_bias: " + "; ".join(problems), param="logit_bias")


class ChatMessage(OpenAIBaseModel):
    """One input message; ``content`` is a string or a list of ``{"type": "text", "text": ...}`` parts (the
    same text as a string: parts are joined with newlines) and, for chat completions with a model that takes
    images, ``{"type": "image_url", "image_url": {"url": ...}}`` parts (docs/multimodal.md).

    ``role`` is one of OpenAI's (``system``, ``developer``, ``user``, ``assistant``, ``tool``) or any other
    non-empty name, passed to the chat template as it is (vLLM's custom roles). ``content`` may be left out
    or ``null`` only in an assistant message (e.g. one that only made tool calls), as in the OpenAI API.
    ``tool_calls`` of earlier assistant turns and ``tool_call_id`` of tool results are passed to the chat
    template as they are. Other keys (``refusal``, ``annotations``, ... of a reply sent back) are ignored.
    """

    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    # pydantic reports only ValueError (not TypeError) from validators as a validation error.
    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            role = info.data.get("role")
            if role is not None and role != "assistant":
                raise ValueError(f"a message with role {role!r} must have content (a string or text parts)")
            return value
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of content parts")  # noqa: TRY004
        for i, part in enumerate(value):
            if not isinstance(part, dict):
                raise ValueError(f"content part {i} must be an object")  # noqa: TRY004
            kind = part.get("type")
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ValueError(f"content part {i}: 'image_url' must be an object with a string 'url'")
                continue
            if kind != "text":
                raise ValueError(f"content part {i}: type {kind!r} is not supported (only 'text' and 'image_url')")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i}: 'text' must be a string")  # noqa: TRY004
        return value

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(p.get("type") == "image_url" for p in self.content)

    def text(self) -> str:
        """The content as one string (text parts joined by newlines; ``""`` when absent)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part["text"] for part in self.content if part.get("type") == "text")

    def to_template_dict(self, allow_images: bool = False) -> dict[str, Any]:
        """The message for the chat template: content as one string, or (``allow_images``, with image parts)
        the parts as given, for :func:`tokenmill.multimodal.chat_parts.render_messages_with_images`.

        Raises:
            InvalidRequestError: image parts where they are not allowed (``param="messages"``).
        """
        if self.has_images and not allow_images:
            raise InvalidRequestError("messages: image content parts are accepted by /v1/chat/completions only",
                                      param="messages")
        content: Any = self.content if self.has_images else self.text()
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            message["tool_calls"] = self.tool_calls
        return message


class _ChatTemplateFields(OpenAIBaseModel):
    """How chat messages become a prompt (shared by chat completions and ``/tokenize``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check_template_fields(self) -> None:
        """Raises InvalidRequestError for contradictory template options."""
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


class ChatCompletionRequest(_ChatTemplateFields, _SamplingRequest):
    """``POST /v1/chat/completions``.

    ``max_completion_tokens`` (or the older ``max_tokens``) left out means "up to the context length".
    """

    field_policy: ClassVar[FieldPolicy] = FieldPolicy(
        ignored={
            **_IGNORED_HINTS,
            "prediction": "predicted outputs only make OpenAI faster; the output is the same without them",
        },
        refused={
            **_VLLM_REFUSED,
            "audio": Refused("audio output is " + _NOT_IMPLEMENTED),
            "modalities": Refused("only text output is supported", (["text"],)),
            "functions": Refused("the deprecated functions API is " + _NOT_IMPLEMENTED + "; use tools", ([],)),
            "function_call": Refused("the deprecated functions API is " + _NOT_IMPLEMENTED + "; use tool_choice",
                                     ("none", "auto")),
            "moderation": Refused("moderation is " + _NOT_IMPLEMENTED),
            "verbosity": Refused(_NOT_IMPLEMENTED),
            "web_search_options": Refused("web search is " + _NOT_IMPLEMENTED),
            "documents": Refused("documents for the chat template are " + _NOT_IMPLEMENTED),
            "chat_template": Refused("a request cannot bring its own chat template; start the server with "
                                     "--chat-template"),
            "media_io_kwargs": Refused("multimodal inputs are " + _NOT_IMPLEMENTED, ({},)),
        },
    )

    mm_processor_kwargs: dict[str, Any] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # reasoning models (docs/reasoning.md): vLLM's include_reasoning and thinking_token_budget, OpenAI's effort
    include_reasoning: bool = True
    reasoning_effort: str | None = None
    thinking_token_budget: int | None = None

    def check(self) -> None:
        super().check()
        if self.thinking_token_budget is not None and (isinstance(self.thinking_token_budget, bool)
                                                       or not 0 <= self.thinking_token_budget < 2**63):
            raise InvalidRequestError(f"thinking_token_budget: must be an integer from 0 to 2**63 - 1, got "
                                      f"{self.thinking_token_budget!r}", param="thinking_token_budget")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise InvalidRequestError("top_logprobs: requires logprobs to be true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(
                    f"top_logprobs: must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}",
                    param="top_logprobs",
                )
        self.check_template_fields()

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def to_sampling_params(self, max_tokens: int | None, output_kind: RequestOutputKind,
                           vocab_size: int) -> SamplingParams:
        """Raises :class:`~tokenmill.sampling_params.SamplingParamsError` for an out-of-range value."""
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, self.prompt_logprobs, output_kind, vocab_size)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, token ids, or a list of those."""

    field_policy: ClassVar[FieldPolicy] = FieldPolicy(
        ignored=dict(_IGNORED_HINTS),
        refused={
            **_VLLM_REFUSED,
            "prompt_embeds": Refused("prompt embeddings are " + _NOT_IMPLEMENTED),
        },
    )

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
        prompts = self.prompts()
        if 0 < self.n <= _MAX_N and len(prompts) * self.n > MAX_SEQUENCES_PER_REQUEST:
            raise InvalidRequestError(
                f"prompt: {len(prompts)} prompts x n={self.n} exceeds {MAX_SEQUENCES_PER_REQUEST} sequences per "
                "request; send several requests",
                param="prompt",
            )

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

    @property
    def effective_prompt_logprobs(self) -> int | None:
        """Prompt logprobs to ask the engine for: ``prompt_logprobs``, and ``logprobs`` when echoing."""
        wanted = [v for v in (self.prompt_logprobs, self.logprobs if self.echo else None) if v is not None]
        return max(wanted) if wanted else None

    def to_sampling_params(self, max_tokens: int | None, output_kind: RequestOutputKind,
                           vocab_size: int) -> SamplingParams:
        """Raises :class:`~tokenmill.sampling_params.SamplingParamsError` for an out-of-range value."""
        return self._sampling_params(max_tokens, self.logprobs, self.effective_prompt_logprobs, output_kind,
                                     vocab_size)


# ------------------------------------------------------------------------------------- tokenization


class TokenizeCompletionRequest(RequestModel):
    """``POST /tokenize`` with a text prompt (vLLM's shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_ChatTemplateFields, RequestModel):
    """``POST /tokenize`` with chat messages, rendered by the chat template first (vLLM's shape)."""

    model: str | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(RequestModel):
    """``POST /detokenize`` (vLLM's shape)."""

    model: str | None = None
    tokens: list[int]
