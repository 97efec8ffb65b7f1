"""Request and response models of the Responses API (``POST /v1/responses``).

Shapes follow the OpenAI API reference for Responses (the ``openai`` package's ``types/responses`` models):
the request's ``input`` (a string, or a list of message / ``function_call`` / ``function_call_output``
items), ``instructions``, ``max_output_tokens``, ``temperature``, ``top_p``, ``stream``, ``metadata``,
``include`` / ``top_logprobs`` for logprobs; the response object with its ``output`` items and ``usage``;
and the typed stream events (``response.created`` ... ``response.completed``, each with its
``sequence_number``).

``tools``, ``tool_choice`` and ``text.format`` are parsed and validated here; they become tool calling and
structured outputs in :mod:`tokenmill.entrypoints.openai.serving_responses`.
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator
from tokenmill.entrypoints.openai.protocol import (
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    MAX_TOP_LOGPROBS,
    OpenAIBaseModel,
    RequestModel,
    check_api_temperature,
)
from tokenmill.entrypoints.openai.request_fields import FieldPolicy, Refused
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

# ``include`` values of the OpenAI API. Only the logprobs one adds anything here: the others ask for data of
# output items (web search results, reasoning, images, ...) this server never produces.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
KNOWN_INCLUDES = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content", INCLUDE_LOGPROBS,
})
TOOL_CHOICE_MODES = frozenset({"none", "auto", "required"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def response_id(prefix: str) -> str:
    """An id in the Responses API's style: ``resp_<hex>``, ``msg_<hex>``, ``fc_<hex>``, ``call_<hex>``."""
    return f"{prefix}_{uuid.uuid4().hex}"


# -------------------------------------------------------------------------------------------- request


class FunctionTool(OpenAIBaseModel):
    """A function tool as the Responses API writes it (flat: ``name`` at the top, no ``function`` object)."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def to_chat_tool(self) -> dict[str, Any]:
        """The same tool in the Chat Completions shape (what chat templates and tool parsers take)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters if self.parameters is not None else {"type": "object",
                                                                                     "properties": {}}
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


class TextFormat(OpenAIBaseModel):
    """``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "name", "schema", "description", "strict"}``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    model_config = OpenAIBaseModel.model_config | {"populate_by_name": True}

    def to_response_format(self) -> dict[str, Any]:
        """The same format as Chat Completions' ``response_format``."""
        if self.type != "json_schema":
            return {"type": self.type}
        json_schema: dict[str, Any] = {"name": self.name, "schema": self.schema_}
        if self.description is not None:
            json_schema["description"] = self.description
        if self.strict is not None:
            json_schema["strict"] = self.strict
        return {"type": "json_schema", "json_schema": json_schema}


class TextConfig(OpenAIBaseModel):
    """``text``: the output's ``format``; ``verbosity`` is refused (the model decides its length)."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningOptions(OpenAIBaseModel):
    """``reasoning``: ``effort`` maps onto the chat template's thinking switch as chat's ``reasoning_effort``
    does; ``summary`` is accepted, but no summary is written (the reasoning item carries the whole thinking)."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(RequestModel):
    """``POST /v1/responses``.

    ``input`` is a string (one user message) or a list of items: messages (``{"role", "content"}``, with or
    without ``"type": "message"``; content a string or ``input_text`` / ``output_text`` / ``refusal``
    parts, and ``input_image`` parts with a ``data:`` URL for a model that takes images), ``function_call`` items (an earlier turn's tool calls) and ``function_call_output`` items (their
    results). ``instructions`` becomes a leading system message. ``max_output_tokens`` left out means "up
    to the context length". vLLM-style sampling extras (``top_k``, ``min_p``, ``repetition_penalty``,
    ``seed``, ``stop``, ``ignore_eos``, ``priority``, ``chat_template_kwargs``, ``cache_salt``) are accepted as in
    chat.
    """

    field_policy: ClassVar[FieldPolicy] = FieldPolicy(
        ignored={
            "user": "an end-user id for OpenAI's abuse monitoring",
            "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
            "store": "this server stores no responses (the answer says store: false)",
            "service_tier": "OpenAI's processing tier",
            "prompt_cache_key": "prefix caching is automatic (--enable-prefix-caching)",
            "prompt_cache_retention": "prefix caching is automatic (--enable-prefix-caching)",
            "prompt_cache_options": "prefix caching is automatic (--enable-prefix-caching)",
        },
        refused={
            "background": Refused("background responses are not supported (nothing is stored)", (False,)),
            "previous_response_id": Refused("responses are not stored; send the whole conversation as input"),
            "conversation": Refused("conversations are not stored; send the whole conversation as input"),
            "prompt": Refused("stored prompt templates are not supported; send input (and instructions)"),
            "context_management": Refused("not supported by this server", ([],)),
            "moderation": Refused("moderation is not supported by this server"),
            "background_options": Refused("background responses are not supported"),
            "structured_outputs": Refused("the Responses API constrains the output with text.format (json_schema "
                                          "or json_object); vLLM's structured_outputs object is for chat and "
                                          "completions"),
        },
    )

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    priority: int = 0
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning: ReasoningOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1)

    @field_validator("tools", mode="before")
    @classmethod
    def _check_tool_types(cls, value: Any) -> Any:
        if isinstance(value, list):
            for i, tool in enumerate(value):
                if isinstance(tool, dict) and tool.get("type") != "function":
                    raise ValueError(f"tool {i}: type {tool.get('type')!r} is not supported (only 'function' "
                                     "tools; this server has no built-in tools)")
        return value

    def check(self) -> None:
        """Checks across fields and of the input items.

        Raises:
            InvalidRequestError: ``param`` names the offending field.
        """
        check_api_temperature(self.temperature)
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs: must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}",
                param="top_logprobs",
            )
        unknown = [value for value in self.include or [] if value not in KNOWN_INCLUDES]
        if unknown:
            raise InvalidRequestError(f"include: unknown values {unknown}; known: {sorted(KNOWN_INCLUDES)}",
                                      param="include")
        if self.truncation == "auto":
            raise InvalidRequestError(
                "truncation: 'auto' (dropping the start of the conversation) is not supported; an input that "
                "does not fit is refused", param="truncation")
        if self.text is not None and self.text.verbosity is not None:
            raise InvalidRequestError("text.verbosity: not supported by this server", param="text.verbosity")
        if self.text is not None and self.text.format is not None and self.text.format.type == "json_schema":
            fmt = self.text.format
            if not fmt.name or fmt.schema_ is None:
                raise InvalidRequestError("text.format: a json_schema format needs 'name' and 'schema'",
                                          param="text.format")
        self._check_tool_choice()
        if self.max_tool_calls is not None and self.max_tool_calls < 1:
            raise InvalidRequestError(f"max_tool_calls: must be at least 1, got {self.max_tool_calls}",
                                      param="max_tool_calls")
        self.input_messages()  # input items are checked here, before any work

    def _check_tool_choice(self) -> None:
        choice = self.tool_choice
        if choice is None or (isinstance(choice, str) and choice in TOOL_CHOICE_MODES):
            return
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
            names = {tool.name for tool in self.tools or []}
            if choice["name"] not in names:
                raise InvalidRequestError(f"tool_choice: no function tool named {choice['name']!r} in tools",
                                          param="tool_choice")
            return
        raise InvalidRequestError(
            "tool_choice: must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
            param="tool_choice",
        )

    @property
    def wants_logprobs(self) -> bool:
        return INCLUDE_LOGPROBS in (self.include or []) or self.top_logprobs is not None

    def input_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat-template messages (``instructions`` first, as a system message).

        ``function_call`` items become the ``tool_calls`` of an assistant message (consecutive calls share
        one), ``function_call_output`` items ``tool`` messages with their ``tool_call_id``.

        Raises:
            InvalidRequestError: an empty input, an unsupported item or content part (``param`` is its path,
                e.g. ``input.[2].content.[0].type``).
        """
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
            return messages
        if not self.input:
            raise InvalidRequestError("input: must not be empty", param="input")
        for i, item in enumerate(self.input):
            _append_item(messages, item, f"input.[{i}]")
        return messages

    def to_sampling_params(self, max_tokens: int | None, output_kind: RequestOutputKind, vocab_size: int, *,
                           structured_outputs: StructuredOutputsParams | None = None,
                           skip_special_tokens: bool | None = None) -> SamplingParams:
        """The engine's parameters.

        Args:
            structured_outputs: the constraint of ``text.format`` or of a forced tool call (checked by the
                serving class).
            skip_special_tokens: ``False`` when the tool parser's markers are special tokens (``None``: the
                default, skip them).

        Raises:
            SamplingParamsError: an out-of-range value.
        """
        top_k = self.top_k if self.top_k is not None else 0
        return SamplingParams(
            structured_outputs=structured_outputs,
            skip_special_tokens=True if skip_special_tokens is None else skip_special_tokens,
            temperature=self.effective_temperature,
            top_p=self.effective_top_p,
            top_k=min(top_k, vocab_size),
            min_p=self.min_p if self.min_p is not None else 0.0,
            repetition_penalty=self.repetition_penalty if self.repetition_penalty is not None else 1.0,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            ignore_eos=self.ignore_eos,
            logprobs=(self.top_logprobs or 0) if self.wants_logprobs else None,
            output_kind=output_kind,
        )

    @property
    def effective_temperature(self) -> float:
        return DEFAULT_TEMPERATURE if self.temperature is None else self.temperature

    @property
    def effective_top_p(self) -> float:
        return DEFAULT_TOP_P if self.top_p is None else self.top_p


def _text_of(content: Any, path: str) -> str | list[dict[str, Any]]:
    """The text of a message's ``content``: a string, or text parts joined by newlines; with ``input_image``
    parts, chat content parts (``text`` and ``image_url``) for the chat template (docs/multimodal.md)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{path}: must be a string or a list of content parts", param=path)
    texts = []
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        where = f"{path}.[{j}]"
        if not isinstance(part, dict):
            raise InvalidRequestError(f"{where}: a content part must be an object", param=where)
        kind = part.get("type")
        if kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise InvalidRequestError(f"{where}.image_url: must be a string (a data: URL; file_id is not "
                                          "supported)", param=f"{where}.image_url")
            parts.append({"type": "image_url", "image_url": {"url": url}})
            continue
        if kind in _TEXT_PARTS:
            text = part.get("text")
        elif kind == "refusal":
            text = part.get("refusal")
        else:
            raise InvalidRequestError(
                f"{where}.type: content part type {kind!r} is not supported (input_text, output_text, refusal, "
                "input_image)", param=f"{where}.type")
        if not isinstance(text, str):
            field = "refusal" if kind == "refusal" else "text"
            raise InvalidRequestError(f"{where}.{field}: must be a string", param=f"{where}.{field}")
        texts.append(text)
        parts.append({"type": "text", "text": text})
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "\n".join(texts)


def _append_item(messages: list[dict[str, Any]], item: Any, path: str) -> None:
    if not isinstance(item, dict):
        raise InvalidRequestError(f"{path}: an input item must be an object", param=path)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"{path}.role: must be a non-empty string", param=f"{path}.role")
        if item.get("content") is None:
            raise InvalidRequestError(f"{path}.content: a message needs content", param=f"{path}.content")
        messages.append({"role": role, "content": _text_of(item["content"], f"{path}.content")})
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise InvalidRequestError(f"{path}.{key}: must be a string", param=f"{path}.{key}")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise InvalidRequestError(f"{path}.call_id: must be a string", param=f"{path}.call_id")
        if item.get("output") is None:
            raise InvalidRequestError(f"{path}.output: required", param=f"{path}.output")
        messages.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _text_of(item["output"], f"{path}.output")})
    else:
        raise InvalidRequestError(
            f"{path}.type: input item type {kind!r} is not supported (only message, function_call, "
            "function_call_output)", param=f"{path}.type")


# ------------------------------------------------------------------------------------------- response


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int]


class OutputTextLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class DeltaTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float


class DeltaLogprob(DeltaTopLogprob):
    """A token's logprob in a ``response.output_text.delta`` / ``.done`` event (no ``bytes`` there)."""

    top_logprobs: list[DeltaTopLogprob] = Field(default_factory=list)


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[OutputTextLogprob] = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(OpenAIBaseModel):
    """A ``function_call`` output item (a tool call the model made)."""

    id: str
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    call_id: str
    name: str
    arguments: str


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(OpenAIBaseModel):
    """A ``reasoning`` output item: the model's thinking, whole, as one ``reasoning_text`` part (``summary``
    stays empty: the server writes no summaries)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = ReasoningItem | OutputMessage | FunctionCallItem


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    """``input_tokens`` of the rendered prompt (``cached_tokens`` of them from the prefix cache),
    ``output_tokens`` generated. ``cache_write_tokens`` and ``reasoning_tokens`` are always 0."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseErrorInfo(OpenAIBaseModel):
    code: str
    message: str


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponsesResponse(OpenAIBaseModel):
    """The response object (also the ``response`` of lifecycle stream events)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "failed", "in_progress", "incomplete"]
    completed_at: int | None = None
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = False
    background: bool = False
    temperature: float
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int = 0
    top_p: float
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: ResponseUsage | None = None

    @classmethod
    def for_request(cls, request: ResponsesRequest, response_id_: str, model: str, created_at: int,
                    status: Literal["completed", "failed", "in_progress", "incomplete"]) -> ResponsesResponse:
        """The response object's request-derived fields (what was asked, with defaults filled in)."""
        fmt = request.text.format if request.text is not None else None
        return cls(
            id=response_id_, created_at=created_at, status=status, model=model,
            instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            max_tool_calls=request.max_tool_calls, metadata=dict(request.metadata or {}),
            parallel_tool_calls=request.parallel_tool_calls if request.parallel_tool_calls is not None else True,
            temperature=request.effective_temperature, top_p=request.effective_top_p,
            text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            tool_choice=request.tool_choice if request.tool_choice is not None else "auto",
            tools=[tool.model_dump(exclude_none=True) for tool in request.tools or []],
            top_logprobs=request.top_logprobs or 0,
        )


# ---------------------------------------------------------------------------------------- stream events


class ResponseLifecycleEvent(OpenAIBaseModel):
    """``response.created`` / ``.in_progress`` / ``.completed`` / ``.incomplete`` / ``.failed``."""

    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    sequence_number: int
    response: ResponsesResponse


class OutputItemEvent(OpenAIBaseModel):
    """``response.output_item.added`` / ``.done``."""

    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(OpenAIBaseModel):
    """``response.content_part.added`` / ``.done``."""

    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


# Each streaming event spells out its wire shape as OpenAI's Responses API reference does (the OpenAPI schema
# is generated from these models).
class OutputTextDeltaEvent(OpenAIBaseModel):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[DeltaLogprob] = Field(default_factory=list)


class OutputTextDoneEvent(OpenAIBaseModel):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[DeltaLogprob] = Field(default_factory=list)


class FunctionCallArgumentsDeltaEvent(OpenAIBaseModel):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(OpenAIBaseModel):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class ReasoningTextDeltaEvent(OpenAIBaseModel):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDoneEvent(OpenAIBaseModel):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


class ErrorEvent(OpenAIBaseModel):
    """``error``: the stream failed (followed by ``response.failed``)."""

    type: Literal["error"] = "error"
    sequence_number: int
    code: str | None = None
    message: str
    param: str | None = None
