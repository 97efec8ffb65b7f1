"""Anthropic Messages requests -> chat completion requests, and chat completion results -> Anthropic messages.

The Messages API is served by the chat completion path (same chat template, tool parsers, structured-output
engine, reasoning parser); this module is the whole mapping between the two:

====================================  ====================================================================
Messages request                      chat completion request
====================================  ====================================================================
``system`` (string or text blocks)    a first ``system`` message (blocks joined by newlines)
``user`` text blocks                  a ``user`` message (blocks joined by newlines)
``user`` ``tool_result`` blocks       ``tool`` messages with ``tool_call_id`` (in block order)
``assistant`` ``tool_use`` blocks     the assistant message's ``tool_calls`` (``input`` as JSON text)
``thinking`` / ``redacted_thinking``  dropped (as Anthropic does with earlier turns' thinking)
``max_tokens``                        ``max_tokens``
``stop_sequences``                    ``stop``
``temperature`` / ``top_p`` / top_k   the same fields
``tools`` (``input_schema``)          function tools (``parameters``)
``tool_choice`` auto / any / tool     ``auto`` / ``required`` / the named function; ``none`` -> ``none``
``disable_parallel_tool_use``         ``parallel_tool_calls: false``
``thinking`` enabled / disabled       ``chat_template_kwargs.enable_thinking`` true / false
``metadata.user_id``                  ``user``
``output_config.format`` (JSON)       ``response_format`` ``json_schema`` (also the older ``output_format``)
====================================  ====================================================================

Back: ``message.reasoning`` becomes a ``thinking`` block, ``content`` a ``text`` block, each tool call a
``tool_use`` block (``arguments`` parsed into ``input``); ``finish_reason`` ``length`` -> ``max_tokens``,
a matched stop string -> ``stop_sequence`` (with ``stop_sequence`` set), a tool call -> ``tool_use``,
anything else -> ``end_turn``.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.entrypoints.anthropic.protocol import (
    ContentBlock,
    CountTokensRequest,
    MessageParam,
    MessageResponse,
    MessagesRequest,
    TextBlock,
    TextBlockParam,
    ThinkingBlock,
    ToolResultBlockParam,
    ToolUseBlock,
    ToolUseBlockParam,
    Usage,
)
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.errors import InvalidRequestError


def _system_text(system: str | list[TextBlockParam] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    return "\n".join(block.text for block in system)


def _tool_call(block: ToolUseBlockParam) -> dict[str, Any]:
    return {"id": block.id, "type": "function",
            "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}


def _turn_messages(index: int, turn: MessageParam, tool_use_ids: set[str]) -> list[dict[str, Any]]:
    """The chat messages of one Messages turn; ``tool_use_ids``: the ids of earlier turns' ``tool_use`` blocks
    (this turn's are added), which a ``tool_result`` must answer (as Anthropic's API requires)."""
    if isinstance(turn.content, str):
        return [{"role": turn.role, "content": turn.content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(turn.content):
        where = f"messages.[{index}].content.[{i}]"
        if isinstance(block, TextBlockParam):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlockParam):
            if turn.role != "user":
                raise InvalidRequestError(f"{where}: tool_result blocks belong in user turns", param=where)
            if texts:  # keep the order of text and results within the turn
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            if block.tool_use_id not in tool_use_ids:
                raise InvalidRequestError(f"{where}: tool_result for tool_use_id {block.tool_use_id!r}, which no "
                                          "earlier assistant tool_use block has", param=where)
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        elif isinstance(block, ToolUseBlockParam):
            if turn.role != "assistant":
                raise InvalidRequestError(f"{where}: tool_use blocks belong in assistant turns", param=where)
            calls.append(_tool_call(block))
            tool_use_ids.add(block.id)
        # thinking / redacted_thinking: not part of the prompt
    if turn.role == "assistant":
        if texts or calls:
            message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    elif texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    """The request's ``system`` and turns as chat messages (OpenAI's format).

    Raises:
        InvalidRequestError: a ``tool_result`` in an assistant turn, a ``tool_use`` in a user turn, or a
            ``tool_result`` whose ``tool_use_id`` no earlier ``tool_use`` block has.
    """
    messages: list[dict[str, Any]] = []
    tool_use_ids: set[str] = set()
    system = _system_text(request.system)
    if system:
        messages.append({"role": "system", "content": system})
    for index, turn in enumerate(request.messages):
        messages.extend(_turn_messages(index, turn, tool_use_ids))
    return messages


def _tools_and_choice(request: CountTokensRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if request.tools:
        for i, tool in enumerate(request.tools):
            if tool.type not in (None, "custom"):
                raise InvalidRequestError(
                    f"tools.[{i}]: server tool {tool.type!r} is not supported by this server (only client tools "
                    "with an input_schema)", param=f"tools.[{i}]")
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}} for t in request.tools]
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise InvalidRequestError("tool_choice.name: required when tool_choice.type is 'tool'",
                                          param="tool_choice.name")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    return fields


def _output_format(request: CountTokensRequest, reasoning: bool) -> dict[str, Any]:
    config = request.output_config
    effort: dict[str, Any] = {}
    if config is not None and config.effort is not None:
        if not reasoning:
            raise InvalidRequestError("output_config.effort: needs a server started with --reasoning-parser",
                                      param="output_config.effort")
        # The chat path maps it to the template's switch, or refuses it where the template has none.
        effort = {"reasoning_effort": config.effort}
    fmt = config.format if config is not None else None
    if fmt is not None and request.output_format is not None:
        raise InvalidRequestError("output_format: cannot be combined with output_config.format (give one)",
                                  param="output_format")
    fmt = fmt or request.output_format
    if fmt is None:
        return effort
    return {**effort,
            "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}}


def _template_kwargs(request: CountTokensRequest, reasoning: bool) -> dict[str, Any]:
    thinking = request.thinking
    if thinking is None or thinking.type not in ("enabled", "disabled"):
        return {}
    # The switch templates of thinking models read (Qwen3 and others); templates without one ignore it.
    fields: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": thinking.type == "enabled"}}
    if reasoning and thinking.type == "enabled" and thinking.budget_tokens is not None:
        # Enforced by the engine (it forces the end-of-thinking marker), only where a reasoning parser knows it.
        fields["thinking_token_budget"] = thinking.budget_tokens
    return fields


def to_chat_request(request: CountTokensRequest, reasoning: bool = False) -> ChatCompletionRequest:
    """The chat completion request serving ``request`` (a :class:`MessagesRequest`, or a count-tokens request,
    whose chat request is only rendered, never run). A final assistant turn of text is continued (prefill).
    ``reasoning``: the server has a ``--reasoning-parser``, so
    ``thinking.budget_tokens`` becomes the engine's ``thinking_token_budget`` and ``output_config.effort`` the
    chat request's ``reasoning_effort`` (without one the budget is not enforced and an effort is refused).

    Raises:
        InvalidRequestError: see :func:`chat_messages`; a server tool; ``tool_choice`` ``tool`` without a name.
        pydantic.ValidationError: a translated field the chat request refuses.
    """
    fields: dict[str, Any] = {"model": request.model, "messages": chat_messages(request),
                              **_tools_and_choice(request), **_template_kwargs(request, reasoning),
                              **_output_format(request, reasoning)}
    last = fields["messages"][-1] if fields["messages"] else None
    if last is not None and last["role"] == "assistant" and not last.get("tool_calls") and last["content"]:
        # Prefill: a final assistant turn is the start of the answer, which the model continues (as Anthropic's
        # API does); the reply holds only the continuation.
        fields.update(add_generation_prompt=False, continue_final_message=True)
    if isinstance(request, MessagesRequest):
        fields.update(max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
                      top_k=request.top_k, stop=request.stop_sequences, stream=request.stream)
        if request.stream:
            # Every chunk carries the usage so far: message_start reports the prompt's tokens.
            fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        if request.metadata is not None and request.metadata.user_id is not None:
            fields["user"] = request.metadata.user_id
    return ChatCompletionRequest.model_validate(fields)


# ------------------------------------------------------------------------------------------- results


def stop_reason(finish_reason: str | None, matched: Any, stop_sequences: list[str] | None,
                tool_called: bool) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a chat choice's ``finish_reason`` and
    ``stop_reason`` (the stop string or token id that ended it, vLLM's field)."""
    if finish_reason == "length":
        return "max_tokens", None
    if tool_called:
        return "tool_use", None
    if isinstance(matched, str) and matched in (stop_sequences or []):
        return "stop_sequence", matched
    return "end_turn", None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(input_tokens=prompt_tokens - cached_tokens, output_tokens=completion_tokens,
                 cache_read_input_tokens=cached_tokens)


def chat_usage(body: dict[str, Any] | None) -> Usage:
    """:class:`Usage` of a chat ``usage`` object (``None``: all zero)."""
    if not body:
        return Usage()
    cached = (body.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return usage(int(body.get("prompt_tokens") or 0), int(body.get("completion_tokens") or 0), int(cached))


def tool_input(arguments: str | None) -> dict[str, Any]:
    """A tool call's ``arguments`` text as Anthropic's ``input`` object (text that is not a JSON object, which
    an unconstrained parser may let through, is kept under ``"arguments"`` rather than lost)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def message_id_of(chat_id: str) -> str:
    """``chatcmpl-<hex>`` -> ``msg_<hex>`` (one id for the request in both APIs' logs)."""
    return "msg_" + chat_id.split("-", 1)[-1]


def to_message(chat: dict[str, Any], request: MessagesRequest) -> MessageResponse:
    """The Messages response of a (non-streamed) chat completion body."""
    choice = chat["choices"][0]
    message = choice.get("message") or {}
    blocks: list[ContentBlock] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        blocks.append(ThinkingBlock(thinking=reasoning))
    if message.get("content"):
        blocks.append(TextBlock(text=message["content"]))
    calls = message.get("tool_calls") or []
    for call in calls:
        function = call.get("function") or {}
        blocks.append(ToolUseBlock(id=call["id"], name=function.get("name", ""),
                                   input=tool_input(function.get("arguments"))))
    if not blocks:
        blocks.append(TextBlock(text=""))
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), request.stop_sequences,
                                   bool(calls))
    return MessageResponse(id=message_id_of(chat["id"]), model=chat["model"], content=blocks, stop_reason=reason,
                           stop_sequence=sequence, usage=chat_usage(chat.get("usage")))
