"""``POST /v1/chat/completions``: chat template, generation, and the OpenAI response or SSE stream.

Streaming follows OpenAI: per choice, a first chunk with ``delta.role`` (and empty content), content chunks,
then one chunk with an empty delta and the ``finish_reason``; with ``n > 1`` every chunk carries its choice's
``index``. With ``stream_options.include_usage`` every chunk has ``"usage": null`` and one last chunk with
``choices: []`` carries the usage; without it no chunk has a ``usage`` key. An error after the stream started
is sent as ``data: {"error": ...}`` followed by ``data: [DONE]``.

Structured outputs (``response_format``, ``structured_outputs``) and tools are resolved by
:meth:`OpenAIServingChat.resolve_constraints`; with tools, text is turned into ``message.tool_calls`` (whole) or
``delta.tool_calls`` pieces (streamed) by a :class:`~tokenmill.entrypoints.openai.tool_choice.ToolCalling`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response
from tokenmill.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_json
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, UsageInfo, random_id
from tokenmill.entrypoints.openai.protocol_tools import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from tokenmill.entrypoints.openai.reasoning import Reasoning, apply_reasoning_effort
from tokenmill.entrypoints.openai.responses import (
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
)
from tokenmill.entrypoints.openai.serving_engine import Gen, OpenAIServing, output_kind
from tokenmill.entrypoints.openai.streaming import (
    CLIENT_CLOSED_REQUEST,
    SSE_DONE,
    close_quietly,
    sse_event,
    sse_response,
)
from tokenmill.entrypoints.openai.tool_choice import ToolCalling, resolve_tool_calling, template_messages
from tokenmill.entrypoints.openai.tool_parsers import ToolCallDelta, random_tool_call_id
from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import RequestOutput
from tokenmill.reasoning import ReasoningStream
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


class OpenAIServingChat(OpenAIServing):
    """Handles chat completion requests (the chat template and ``--tool-call-parser`` come from the
    :class:`~tokenmill.entrypoints.openai.serving_engine.ServingContext`)."""

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        """Run one chat request.

        Raises:
            ModelNotFoundError: unknown ``model``.
            InvalidRequestError: invalid fields, template failure, prompt too long (``param`` set).
            EngineDeadError, EngineGenerateError: from the engine (non-streaming, or before the first token).
        """
        arrival = time.time()
        model_name = self.admit(request)
        for param, ids in request.token_id_fields().items():
            self.check_token_ids(ids, param)
        reasoning = self.resolve_reasoning(request)
        tool_calling, constraint = await self.resolve_constraints(request)
        prompt_ids, mm_features = await self.tokenization.run(self._render_and_encode, request)
        if mm_features is None:
            prompt_ids = request.truncated(prompt_ids, self.max_model_len)
        elif request.truncate_prompt_tokens is not None:  # cutting the prompt could split an image's placeholder
            raise InvalidRequestError("truncate_prompt_tokens: not supported for prompts with images",
                                      param="truncate_prompt_tokens")
        max_tokens = self.resolve_max_tokens(
            len(prompt_ids), request.requested_max_tokens, "messages", request.max_tokens_param
        )
        kind = output_kind(request.stream)
        params = self.make_sampling_params(
            lambda: request.to_sampling_params(max_tokens, kind, self.vocab_size), request.max_tokens_param
        )
        params = apply_constraints(params, tool_calling, constraint)
        if reasoning is not None:
            params = msgspec.structs.replace(params, **reasoning.sampling_changes())
        request_id = random_id("chatcmpl")
        echo = request.messages[-1].text() if request.echo and request.messages[-1].role == "assistant" else ""
        self.log_request(request_id, raw_request, "%d prompt tokens, max_tokens %s", len(prompt_ids), max_tokens)
        gen = self.generate(prompt_ids, params, request_id, arrival, request.priority, model_name=model_name,
                            cache_salt=request.cache_salt, mm_features=mm_features)
        if request.stream:
            return await self._stream(request, raw_request, gen, request_id, model_name, len(prompt_ids), echo,
                                      tool_calling, reasoning)
        return await self._full(request, raw_request, gen, request_id, model_name, len(prompt_ids), echo,
                                tool_calling, reasoning)

    def resolve_reasoning(self, request: ChatCompletionRequest) -> Reasoning | None:
        """Map ``reasoning_effort`` onto the template's switch (into ``request.chat_template_kwargs``) and
        build the request's reasoning handling (``None`` without ``--reasoning-parser``).

        Raises:
            InvalidRequestError: ``reasoning_effort`` on a template without a switch, or
                ``thinking_token_budget`` without a reasoning parser.
        """
        request.chat_template_kwargs = apply_reasoning_effort(
            request.reasoning_effort, request.chat_template_kwargs, self.renderer.template_variables)
        if self.reasoning_parser_cls is None:
            if request.thinking_token_budget is not None:
                raise InvalidRequestError("thinking_token_budget: the server runs no reasoning parser (start it "
                                          "with --reasoning-parser NAME)", param="thinking_token_budget")
            return None
        return Reasoning(self.reasoning_parser_cls, self.tokenization.tokenizer, request.chat_template_kwargs,
                         request.include_reasoning, request.thinking_token_budget)

    def _render_and_encode(self, request: ChatCompletionRequest) -> tuple[list[int], list[Any] | None]:
        """Apply the chat template and tokenize, with the images of the messages processed (runs in the
        tokenizer thread): ``(token ids, image features or None)``."""
        return self.encode_chat_with_images(
            template_messages([m.to_template_dict(allow_images=True) for m in request.messages]),
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            template_kwargs=request.chat_template_kwargs,
            tools=[t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None,
            add_special_tokens=request.add_special_tokens,
            mm_processor_kwargs=request.mm_processor_kwargs,
        )

    # ----------------------------------------------------------------------- tools and structured outputs

    async def resolve_constraints(self, request: ChatCompletionRequest
                                  ) -> tuple[ToolCalling | None, StructuredOutputsParams | None]:
        """The request's tool handling and its structured-output constraint (compile-checked, see
        :meth:`resolve_structured_outputs`).

        Raises:
            InvalidRequestError: a bad ``tools`` / ``tool_choice`` (``auto`` without the server flags), two
                constraints at once, or a constraint that does not compile (``param`` names the field).
        """
        tool_calling = resolve_tool_calling(request.tools, request.tool_choice, request.parallel_tool_calls,
                                            self.tool_parser_factory())
        constraint, source = request.structured_outputs_params()
        return tool_calling, await self.resolve_structured_outputs(constraint, source, tool_calling)

    # ------------------------------------------------------------------------------------ non-streaming

    async def _full(self, request: ChatCompletionRequest, raw_request: Request, gen: Gen, request_id: str,
                    model_name: str, prompt_len: int, echo: str, tool_calling: ToolCalling | None,
                    reasoning: Reasoning | None = None) -> Response:
        results = await self.full_outputs(raw_request, [gen], request_id)
        if results is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        [(last, by_index)] = results
        tokenizer = self.tokenization.tokenizer
        k = request.top_logprobs or 0
        as_ids = self.tokens_as_ids(request.return_tokens_as_token_ids)
        choices = []
        for index in sorted(by_index):
            o = by_index[index]
            logprobs = chat_logprobs(tokenizer, o.token_ids, o.logprobs, k, as_ids) if request.logprobs else None
            thinking, text = reasoning.split(o.text) if reasoning is not None else (None, o.text)
            message, finish_reason = tool_message(tool_calling, echo, text, o.finish_reason)
            if thinking is not None:
                message.reasoning = message.reasoning_content = thinking
                message.content = message.content or None
            choices.append(ChatCompletionChoice(
                index=index,
                message=message,
                logprobs=logprobs,
                finish_reason=finish_reason,
                stop_reason=o.stop_reason,
            ))
        usage = UsageInfo.of(
            len(last.prompt_token_ids) or prompt_len,
            sum(len(o.token_ids) for o in by_index.values()),
            last.num_cached_tokens,
        )
        response = ChatCompletionResponse(
            id=request_id, model=model_name, choices=choices, usage=usage,
            prompt_logprobs=prompt_logprobs_json(last.prompt_logprobs) if request.prompt_logprobs is not None
            else None,
        )
        return Response(response.model_dump_json(), media_type="application/json")

    # ---------------------------------------------------------------------------------------- streaming

    async def _stream(self, request: ChatCompletionRequest, raw_request: Request, gen: Gen, request_id: str,
                      model_name: str, prompt_len: int, echo: str, tool_calling: ToolCalling | None,
                      reasoning: Reasoning | None = None) -> Response:
        firsts = await self.first_outputs(raw_request, [gen], request_id)
        if firsts is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return sse_response(self._chunks(request, gen, firsts[0], request_id, model_name, prompt_len, echo,
                                         tool_calling, reasoning))

    async def _chunks(self, request: ChatCompletionRequest, gen: Gen, first: RequestOutput | None,
                      request_id: str, model_name: str, prompt_len: int, echo: str,
                      tool_calling: ToolCalling | None = None,
                      reasoning: Reasoning | None = None) -> AsyncGenerator[str, None]:
        created = int(time.time())
        include_usage = request.include_usage
        continuous = include_usage and request.continuous_usage
        exclude = None if include_usage else {"usage"}
        tokenizer = self.tokenization.tokenizer
        k = request.top_logprobs or 0
        as_ids = self.tokens_as_ids(request.return_tokens_as_token_ids)
        prompt_tokens, completion_tokens, cached_tokens = prompt_len, 0, 0
        if first is not None:  # the role chunk's continuous usage already counts the prefix-cache hits
            prompt_tokens = len(first.prompt_token_ids) or prompt_tokens
            cached_tokens = first.num_cached_tokens

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            if usage is None and continuous:
                usage = UsageInfo.of(prompt_tokens, completion_tokens, cached_tokens)
            return sse_event(ChatCompletionStreamResponse(
                id=request_id, created=created, model=model_name, choices=choices, usage=usage
            ), exclude)

        finished: set[int] = set()
        tools = StreamedToolCalls(tool_calling) if tool_calling is not None else None
        thinking: dict[int, ReasoningStream] = {}
        try:
            try:
                for i in range(request.n):
                    yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                                        content=""))])
                    if echo:
                        yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=echo))])
                output = first
                while output is not None:
                    prompt_tokens = len(output.prompt_token_ids) or prompt_tokens
                    cached_tokens = output.num_cached_tokens
                    for o in output.outputs:
                        if o.index in finished:
                            continue
                        completion_tokens += len(o.token_ids)
                        logprobs = None
                        if request.logprobs and o.logprobs:
                            logprobs = chat_logprobs(tokenizer, o.token_ids, o.logprobs, k, as_ids)
                        text, thought = o.text, None
                        if reasoning is not None:  # the tool parser sees the answer only
                            stream = thinking.get(o.index) or thinking.setdefault(o.index, reasoning.stream())
                            split = stream.update(o.text, o.token_ids, o.finish_reason is not None)
                            text, thought = split.content or "", split.reasoning if reasoning.include_reasoning else None
                        delta = (DeltaMessage(content=text) if tools is None
                                 else tools.delta(o.index, text, o.finish_reason is not None))
                        if thought:
                            delta.reasoning = delta.reasoning_content = thought
                        if delta.content or delta.tool_calls or thought or logprobs is not None:
                            yield chunk([ChatCompletionStreamChoice(index=o.index, delta=delta, logprobs=logprobs)])
                        if o.finish_reason is not None:
                            finished.add(o.index)
                            reason = o.finish_reason if tools is None else tools.finish_reason(o.index, o.finish_reason)
                            yield chunk([ChatCompletionStreamChoice(
                                index=o.index, delta=DeltaMessage(), finish_reason=reason,
                                stop_reason=o.stop_reason,
                            )])
                    output = await anext(gen, None)
                if include_usage:
                    yield chunk([], usage=UsageInfo.of(prompt_tokens, completion_tokens, cached_tokens))
            except Exception as exc:  # noqa: BLE001 - any failure must reach the client as an SSE error event
                yield self.sse_error(exc, request_id)
            yield SSE_DONE
        finally:
            await close_quietly(gen)


# ------------------------------------------------------------------------------------------ tool output


def apply_constraints(params: SamplingParams, tool_calling: ToolCalling | None,
                      constraint: StructuredOutputsParams | None) -> SamplingParams:
    """``params`` with the request's constraint and the tool parser's special-token setting."""
    changes: dict[str, Any] = {}
    if constraint is not None:
        changes["structured_outputs"] = constraint
    if tool_calling is not None and tool_calling.skip_special_tokens is not None:
        changes["skip_special_tokens"] = tool_calling.skip_special_tokens
    return msgspec.structs.replace(params, **changes) if changes else params


def tool_message(tool_calling: ToolCalling | None, echo: str, text: str, finish_reason: str | None
                 ) -> tuple[ChatResponseMessage, str | None]:
    """The assistant message of a finished choice (with ``tool_calls`` when the text holds calls)."""
    if tool_calling is None:
        return ChatResponseMessage(role="assistant", content=echo + text), finish_reason
    extracted = tool_calling.extract(text)
    calls = [ToolCall(id=random_tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
             for c in extracted.tool_calls]
    content = extracted.content
    if echo:
        content = echo + (content or "")
    message = ChatResponseMessage(role="assistant", content=content, tool_calls=calls or None)
    return message, tool_calling.finish_reason(finish_reason, bool(calls))


class StreamedToolCalls:
    """Per choice: the text so far and its :class:`ToolCallStreamer`, giving each chunk's delta."""

    def __init__(self, tool_calling: ToolCalling) -> None:
        self.tool_calling = tool_calling
        self.texts: dict[int, str] = {}
        self.streamers: dict[int, Any] = {}

    def delta(self, index: int, new_text: str, final: bool) -> DeltaMessage:
        text = self.texts.get(index, "") + new_text
        self.texts[index] = text
        streamer = self.streamers.get(index)
        if streamer is None:
            streamer = self.streamers[index] = self.tool_calling.streamer()
        content, pieces = streamer.update(text, final)
        return DeltaMessage(content=content or None, tool_calls=[_delta_tool_call(p) for p in pieces] or None)

    def finish_reason(self, index: int, engine_reason: str | None) -> str | None:
        streamer = self.streamers.get(index)
        return self.tool_calling.finish_reason(engine_reason, streamer is not None and streamer.tools_called)


def _delta_tool_call(piece: ToolCallDelta) -> DeltaToolCall:
    if piece.id is not None:
        return DeltaToolCall(index=piece.index, id=piece.id, type="function",
                             function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments))
    return DeltaToolCall(index=piece.index, function=DeltaFunctionCall(arguments=piece.arguments))
