"""``POST /v1/responses``: the Responses API over the chat template and the engine.

Non-streaming: one response object whose ``output`` holds one assistant ``message`` item with one
``output_text`` part (``status: "incomplete"`` with ``incomplete_details.reason: "max_output_tokens"`` when
the length limit ended it). Streaming (``stream: true``) sends the typed events the OpenAI clients parse, as
``event: <type>`` / ``data: <json>`` pairs with increasing ``sequence_number`` and no ``[DONE]``:
``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` (one per piece of text),
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done`` and
``response.completed`` (``response.incomplete`` when the length limit ended it). A failure after the stream
started is an ``error`` event followed by ``response.failed``.

With function ``tools`` the text goes through the tool calling of chat completions
(:mod:`tokenmill.entrypoints.openai.tool_choice`): ``tool_choice`` ``required`` / a named function constrain the
output to valid calls, ``auto`` parses it with the server's ``--tool-call-parser``. Each call is a
``function_call`` output item (streamed as ``response.output_item.added``,
``response.function_call_arguments.delta`` / ``.done`` and ``response.output_item.done``); call markup never
reaches the text. ``text.format`` ``json_object`` / ``json_schema`` constrain the output through structured
outputs (:func:`structured_outputs_for`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel
from tokenmill.entrypoints.openai.errors import error_from_exception
from tokenmill.entrypoints.openai.logprobs import chat_logprobs
from tokenmill.entrypoints.openai.protocol_responses import (
    ContentPartEvent,
    DeltaLogprob,
    DeltaTopLogprob,
    ErrorEvent,
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    OutputTextLogprob,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDeltaEvent,
    ReasoningTextDoneEvent,
    ResponseErrorInfo,
    ResponseLifecycleEvent,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
    response_id,
)
from tokenmill.entrypoints.openai.protocol_tools import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionToolParam,
    NamedToolChoiceFunction,
)
from tokenmill.entrypoints.openai.reasoning import Reasoning, apply_reasoning_effort
from tokenmill.entrypoints.openai.serving_engine import Gen, OpenAIServing, output_kind
from tokenmill.entrypoints.openai.streaming import CLIENT_CLOSED_REQUEST, close_quietly, sse_response
from tokenmill.entrypoints.openai.structured_outputs import json_schema_to_structured_outputs
from tokenmill.entrypoints.openai.tool_choice import ToolCalling, resolve_tool_calling, template_messages
from tokenmill.tool_parsers import ToolParser
from tokenmill.errors import EngineGenerateError, InvalidRequestError
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------- tools and text.format


@dataclass
class ToolCall:
    """One function call found in the model's output: ``arguments`` is JSON text."""

    name: str
    arguments: str
    call_id: str = ""

    def __post_init__(self) -> None:
        if not self.call_id:
            self.call_id = response_id("call")


def check_tool_calling(request: ResponsesRequest, parser_factory: Callable[[], ToolParser] | None
                       ) -> ToolCalling | None:
    """The request's function tools as Chat Completions' tool handling (``None``: no tool calls).

    ``tool_choice`` ``required`` / a named function constrain the output through the structured-output
    engine (valid calls of the given tools); ``auto`` (the default when tools are given) parses the model's
    text with the server's ``--tool-call-parser``. ``parallel_tool_calls: false`` keeps one call,
    ``max_tool_calls`` at most that many.

    Raises:
        InvalidRequestError: ``tool_choice`` ``auto`` without ``--enable-auto-tool-choice --tool-call-parser``
            (the message names the flags), ``required`` / named without tools, duplicate tool names
            (``param`` is ``tool_choice`` or ``tools``).
    """
    tools = [ChatCompletionToolParam.model_validate(t.to_chat_tool()) for t in request.tools or []]
    choice: Any = request.tool_choice
    if isinstance(choice, dict):  # the Responses API's flat {"type": "function", "name": ...}
        choice = ChatCompletionNamedToolChoiceParam(function=NamedToolChoiceFunction(name=choice["name"]))
    parallel = request.parallel_tool_calls is not False
    return resolve_tool_calling(tools or None, choice, parallel, parser_factory, max_calls=request.max_tool_calls)


def extract_tool_calls(tool_calling: ToolCalling | None, text: str) -> tuple[str, list[ToolCall]]:
    """Split the model's finished text into content and tool calls (``(text, [])`` without tools).

    Each call becomes a ``function_call`` output item after the message; the message item is left out of
    a whole response when the content is empty and there are calls.
    """
    if tool_calling is None:
        return text, []
    extracted = tool_calling.extract(text)
    return extracted.content or "", [ToolCall(c.name, c.arguments) for c in extracted.tool_calls]


def structured_outputs_for(request: ResponsesRequest) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint for ``text.format`` and the field its errors name (``(None, None)``: unconstrained).

    ``json_object``: any JSON object; ``json_schema``: JSON valid against ``text.format.schema`` (``strict``
    also closes every object to properties its schema does not list, as in Chat Completions).

    Raises:
        InvalidRequestError: a schema that is not a JSON object (``param="text.format.schema"``).
    """
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type == "text":
        return None, None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True), "text.format"
    assert fmt.schema_ is not None  # ResponsesRequest.check() refuses a json_schema format without one
    return json_schema_to_structured_outputs(fmt.schema_, strict=fmt.strict, param="text.format.schema"), \
        "text.format.schema"


# --------------------------------------------------------------------------------------------- serving


def _event(event: BaseModel) -> str:
    """One SSE event: ``event: <type>`` then ``data: <json>`` (the Responses API's framing)."""
    return f"event: {getattr(event, 'type')}\ndata: {event.model_dump_json(by_alias=True)}\n\n"


def _to_output_logprobs(entries: list[Any]) -> list[OutputTextLogprob]:
    return [OutputTextLogprob.model_validate(e.model_dump()) for e in entries]


def _to_delta_logprobs(entries: list[Any]) -> list[DeltaLogprob]:
    return [DeltaLogprob(token=e.token, logprob=e.logprob,
                         top_logprobs=[DeltaTopLogprob(token=t.token, logprob=t.logprob) for t in e.top_logprobs])
            for e in entries]


class OpenAIServingResponses(OpenAIServing):
    """Handles Responses API requests (stateless: nothing is stored, ``store`` is always false). The input items
    go through the chat template, as for chat completions; ``tool_choice`` ``auto`` with tools needs the
    server's ``--tool-call-parser``."""

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        """Run one Responses API request.

        Raises:
            ModelNotFoundError: unknown ``model``.
            InvalidRequestError: invalid fields or input items, template failure, input too long, a bad
                ``tools`` / ``tool_choice`` or a ``text.format`` schema that does not compile (``param`` set).
            EngineDeadError, EngineGenerateError: from the engine (non-streaming, or before the first token).
        """
        arrival = time.time()
        model_name = self.admit(request)
        effort = request.reasoning.effort if request.reasoning is not None else None
        request.chat_template_kwargs = apply_reasoning_effort(effort, request.chat_template_kwargs,
                                                              self.renderer.template_variables, "reasoning.effort")
        reasoning = None if self.reasoning_parser_cls is None else Reasoning(
            self.reasoning_parser_cls, self.tokenization.tokenizer, request.chat_template_kwargs)
        tool_calling, constraint = await self.resolve_constraints(request)
        messages = request.input_messages()
        prompt_ids, mm_features = await self.tokenization.run(self._render_and_encode, messages, request)
        max_tokens = self.resolve_max_tokens(len(prompt_ids), request.max_output_tokens, "input",
                                             "max_output_tokens")
        kind = output_kind(request.stream)
        skip_special = tool_calling.skip_special_tokens if tool_calling is not None else None
        params = self.make_sampling_params(
            lambda: request.to_sampling_params(max_tokens, kind, self.vocab_size, structured_outputs=constraint,
                                               skip_special_tokens=skip_special),
            "max_output_tokens",
        )
        if reasoning is not None:
            params = msgspec.structs.replace(params, **reasoning.sampling_changes())
        resp_id = response_id("resp")
        self.log_request(resp_id, raw_request, "%d input tokens, max_output_tokens %s", len(prompt_ids), max_tokens)
        gen = self.generate(prompt_ids, params, resp_id, arrival, request.priority, model_name=model_name,
                            cache_salt=request.cache_salt, mm_features=mm_features)
        state = _ResponseState(self, request, resp_id, model_name, len(prompt_ids), tool_calling, reasoning)
        if request.stream:
            firsts = await self.first_outputs(raw_request, [gen], resp_id)
            if firsts is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            return sse_response(self._events(gen, firsts[0], state))
        results = await self.full_outputs(raw_request, [gen], resp_id)
        if results is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        [(last, _)] = results
        if not last.outputs:
            raise EngineGenerateError(f"request {resp_id}: the engine returned no output")
        state.add(last, last.outputs[0])
        response = state.final_response()
        return Response(response.model_dump_json(by_alias=True), media_type="application/json")

    async def resolve_constraints(self, request: ResponsesRequest
                                  ) -> tuple[ToolCalling | None, StructuredOutputsParams | None]:
        """The request's tool handling and its constraint (``text.format``, or ``tool_choice`` ``required`` /
        named), compile-checked (see :meth:`resolve_structured_outputs`).

        Raises:
            InvalidRequestError: see :func:`check_tool_calling`; ``text.format`` together with a forced tool
                call; a schema the backend cannot compile (``param="text.format.schema"``).
        """
        tool_calling = check_tool_calling(request, self.tool_parser_factory())
        constraint, source = structured_outputs_for(request)
        return tool_calling, await self.resolve_structured_outputs(constraint, source, tool_calling,
                                                                    conflict_param="text.format")

    def _render_and_encode(self, messages: list[dict[str, Any]], request: ResponsesRequest
                           ) -> tuple[list[int], list[Any] | None]:
        """Apply the chat template (with the request's function tools) and tokenize, with the images of
        ``input_image`` parts processed (runs in the tokenizer thread): ``(token ids, image features or None)``.

        Raises:
            InvalidRequestError: the template failed, or an image cannot be used (``param="input"``), or
                reserved ``chat_template_kwargs``.
        """
        tools = [t.to_chat_tool() for t in request.tools] if request.tools else None
        try:
            return self.encode_chat_with_images(template_messages(messages), add_generation_prompt=True,
                                                continue_final_message=False,
                                                template_kwargs=request.chat_template_kwargs, tools=tools,
                                                add_special_tokens=False)
        except InvalidRequestError as exc:
            if not (exc.param or "").startswith("messages"):  # the messages' indices differ from input's
                raise
            message = str(exc).split(": ", 1)[-1]
            raise InvalidRequestError(f"input: {message}", param="input") from exc

    async def _events(self, gen: Gen, first: RequestOutput | None, state: _ResponseState
                      ) -> AsyncGenerator[str, None]:
        seq = 0

        def event(model: type[BaseModel], **fields: Any) -> str:
            nonlocal seq
            text = _event(model(sequence_number=seq, **fields))
            seq += 1
            return text

        items = _StreamedItems(state, event)
        try:
            try:
                yield event(ResponseLifecycleEvent, type="response.created", response=state.snapshot("in_progress"))
                yield event(ResponseLifecycleEvent, type="response.in_progress",
                            response=state.snapshot("in_progress"))
                for text in items.start():
                    yield text
                output = first
                while output is not None:
                    if output.outputs:
                        o = output.outputs[0]
                        new_logprobs = state.add(output, o)
                        for text in items.update(o.text, new_logprobs, o.finish_reason is not None, o.token_ids):
                            yield text
                    output = await anext(gen, None)
                for text in items.finish():
                    yield text
                final = state.final_response(items=items.output_items())
                kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
                yield event(ResponseLifecycleEvent, type=kind, response=final)
            except Exception as exc:  # noqa: BLE001 - any failure must reach the client as error events
                self.log_stream_error(exc, state.resp_id)
                _, body = error_from_exception(exc)
                info = body["error"]
                yield event(ErrorEvent, code=info.get("code") or info.get("type"), message=info["message"],
                            param=info.get("param"))
                failed = state.snapshot("failed")
                failed.error = ResponseErrorInfo(code="server_error", message=info["message"])
                yield event(ResponseLifecycleEvent, type="response.failed", response=failed)
        finally:
            await close_quietly(gen)


class _ResponseState:
    """What one response has produced so far: text, logprobs, token counts, finish reason."""

    def __init__(self, serving: OpenAIServingResponses, request: ResponsesRequest, resp_id: str, model: str,
                 prompt_len: int, tool_calling: ToolCalling | None = None, reasoning: Reasoning | None = None
                 ) -> None:
        self.serving = serving
        self.request = request
        self.tool_calling = tool_calling
        self.reasoning = reasoning
        self.reasoning_id = response_id("rs")
        self.content_text = ""  # the answer part of ``text`` streamed so far (all of it without reasoning)
        self.resp_id = resp_id
        self.model = model
        self.message_id = response_id("msg")
        self.created_at = int(time.time())
        self.text = ""
        self.logprobs: list[Any] = []
        self.input_tokens = prompt_len
        self.cached_tokens = 0
        self.output_tokens = 0
        self.finish_reason: str | None = None
        self._result: tuple[str, list[tuple[str, ToolCall]]] | None = None

    def thinking(self) -> str | None:
        """The finished output's reasoning (``None`` without a reasoning parser or thinking)."""
        return self.reasoning.split(self.text)[0] if self.reasoning is not None else None

    def result(self) -> tuple[str, list[tuple[str, ToolCall]]]:
        """The finished text split into content and ``(item id, call)`` pairs (computed once); the tool parser
        reads the answer only, never the thinking."""
        if self._result is None:
            answer = self.reasoning.split(self.text)[1] if self.reasoning is not None else self.text
            content, calls = extract_tool_calls(self.tool_calling, answer)
            self._result = content, [(response_id("fc"), call) for call in calls]
        return self._result

    def add(self, output: RequestOutput, o: CompletionOutput) -> list[Any]:
        """Take in one engine output; returns the chat-shaped logprob entries of its new tokens."""
        self.input_tokens = len(output.prompt_token_ids) or self.input_tokens
        self.cached_tokens = output.num_cached_tokens
        self.text += o.text
        self.output_tokens += len(o.token_ids)
        if o.finish_reason is not None:
            self.finish_reason = o.finish_reason
        new: list[Any] = []
        if self.request.wants_logprobs and o.logprobs:
            tokenization = self.serving.tokenization
            new = list(chat_logprobs(tokenization.tokenizer, o.token_ids, o.logprobs,
                                     self.request.top_logprobs or 0).content or [])
            self.logprobs.extend(new)
        return new

    @property
    def status(self) -> Literal["completed", "incomplete"]:
        return "incomplete" if self.finish_reason == "length" else "completed"

    @property
    def item_status(self) -> Literal["completed", "incomplete"]:
        return self.status

    def snapshot(self, status: Literal["completed", "failed", "in_progress", "incomplete"]) -> ResponsesResponse:
        return ResponsesResponse.for_request(self.request, self.resp_id, self.model, self.created_at, status)

    def usage(self) -> ResponseUsage:
        return ResponseUsage(
            input_tokens=self.input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=self.cached_tokens),
            output_tokens=self.output_tokens,
            total_tokens=self.input_tokens + self.output_tokens,
        )

    def final_response(self, items: list[OutputItem] | None = None) -> ResponsesResponse:
        """The finished response object: ``items`` (a stream's items, as they were streamed), or the
        ``message`` item (left out when it is empty and there are calls) followed by any ``function_call``
        items.
        """
        if items is None:
            content, calls = self.result()
            thinking = self.thinking()
            items = [] if not thinking else [ReasoningItem(id=self.reasoning_id, status=self.item_status,
                                                            content=[ReasoningText(text=thinking)])]
            if content or not calls:
                part = OutputText(text=content, logprobs=_to_output_logprobs(self.logprobs))
                items.append(OutputMessage(id=self.message_id, status=self.item_status, content=[part]))
            items.extend(FunctionCallItem(id=item_id, call_id=c.call_id, name=c.name, arguments=c.arguments)
                         for item_id, c in calls)
        output: list[OutputItem] = list(items)
        response = self.snapshot(self.status)
        response.output = output
        response.usage = self.usage()
        response.completed_at = int(time.time()) if self.status == "completed" else None
        if self.status == "incomplete":
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        return response


class _StreamedItems:
    """The output items of a streamed response, announced as the text reveals them.

    Without tools: one ``message`` item, announced first; every piece of text is a
    ``response.output_text.delta``. With tools the text goes through the tool calling's
    :class:`~tokenmill.entrypoints.openai.tool_parsers.ToolCallStreamer`, so call markup never reaches the
    text: the message item is announced with the first piece of content, and each call as a ``function_call``
    item (``response.output_item.added``) once its name is known, its arguments following as
    ``response.function_call_arguments.delta`` events. ``output_index`` counts items in the order they were
    announced; :meth:`finish` closes them all in that order.

    Args:
        state: the response's state.
        event: ``event(model, **fields)`` -> one SSE event (numbers it).
    """

    def __init__(self, state: _ResponseState, event: Callable[..., str]) -> None:
        self.state = state
        self.event = event
        self.streamer = state.tool_calling.streamer() if state.tool_calling is not None else None
        self.final_seen = False
        self.message_index: int | None = None
        self.content = ""
        self.calls: list[tuple[int, str, ToolCall]] = []  # (output_index, item id, call so far)
        self.num_items = 0
        self.pending_logprobs: list[Any] = []
        self._items: list[tuple[int, OutputItem]] = []
        self.thinking = state.reasoning.stream() if state.reasoning is not None else None
        self.reasoning_index: int | None = None
        self.reasoning_text = ""
        self.reasoning_closed = False

    def start(self) -> list[str]:
        return self._open_message() if self.streamer is None and self.thinking is None else []

    def update(self, new_text: str, new_logprobs: list[Any], final: bool, token_ids: Any = ()) -> list[str]:
        """Events for the next piece of generated text (``final``: the last piece)."""
        events: list[str] = []
        self.final_seen = self.final_seen or final
        if self.thinking is not None:  # the thinking becomes a reasoning item; the rest goes on as answer
            split = self.thinking.update(new_text, token_ids, final)
            if split.reasoning:
                events += self._reasoning_delta(split.reasoning)
            new_text = split.content or ""
            self.state.content_text += new_text
        return events + self._answer_update(new_text, new_logprobs, final)

    def _reasoning_delta(self, text: str) -> list[str]:
        events: list[str] = []
        if self.reasoning_index is None:
            self.reasoning_index = self._next_index()
            item = ReasoningItem(id=self.state.reasoning_id, status="in_progress")
            events.append(self.event(OutputItemEvent, type="response.output_item.added",
                                     output_index=self.reasoning_index, item=item))
            events.append(self.event(ContentPartEvent, type="response.content_part.added",
                                     item_id=self.state.reasoning_id, output_index=self.reasoning_index,
                                     content_index=0, part=ReasoningText(text="")))
        self.reasoning_text += text
        events.append(self.event(ReasoningTextDeltaEvent, item_id=self.state.reasoning_id,
                                 output_index=self.reasoning_index, content_index=0, delta=text))
        return events

    def _answer_update(self, new_text: str, new_logprobs: list[Any], final: bool) -> list[str]:
        if self.streamer is None:
            return self._text_delta(new_text, new_logprobs) if new_text or new_logprobs else []
        self.final_seen = self.final_seen or final
        self.pending_logprobs.extend(new_logprobs)
        answer = self.state.content_text if self.thinking is not None else self.state.text
        content, pieces = self.streamer.update(answer, final)
        events: list[str] = []
        if content:
            events += self._text_delta(content, self.pending_logprobs)
            self.pending_logprobs = []
        for piece in pieces:
            if piece.id is not None:
                events += self._close_reasoning()
                index, item_id = self._next_index(), response_id("fc")
                self.calls.append((index, item_id, ToolCall(piece.name or "", "", piece.id)))
                item = FunctionCallItem(id=item_id, status="in_progress", call_id=piece.id, name=piece.name or "",
                                        arguments="")
                events.append(self.event(OutputItemEvent, type="response.output_item.added", output_index=index,
                                         item=item))
            index, item_id, call = self.calls[piece.index]
            if piece.arguments:
                call.arguments += piece.arguments
                events.append(self.event(FunctionCallArgumentsDeltaEvent, item_id=item_id, output_index=index,
                                         delta=piece.arguments))
        return events

    def _close_reasoning(self, status: Literal["completed", "incomplete"] = "completed") -> list[str]:
        """Close the reasoning item (once): when the answer's first item opens, so that items never interleave,
        or at the end of the output."""
        if self.reasoning_index is None or self.reasoning_closed:
            return []
        self.reasoning_closed = True
        part = ReasoningText(text=self.reasoning_text)
        item = ReasoningItem(id=self.state.reasoning_id, status=status, content=[part])
        self._items.append((self.reasoning_index, item))
        index = self.reasoning_index
        return [
            self.event(ReasoningTextDoneEvent, item_id=item.id, output_index=index, content_index=0, text=part.text),
            self.event(ContentPartEvent, type="response.content_part.done", item_id=item.id, output_index=index,
                       content_index=0, part=part),
            self.event(OutputItemEvent, type="response.output_item.done", output_index=index, item=item),
        ]

    def finish(self) -> list[str]:
        """Close every item, in output order (a response with neither content nor calls gets an empty
        message, as a whole response does)."""
        events: list[str] = []
        if (self.streamer is not None or self.thinking is not None) and not self.final_seen:
            events += self.update("", [], True)
        status = self.state.item_status
        events += self._close_reasoning(status)
        if self.message_index is None and not self.calls:
            events += self._open_message()
        closing: list[tuple[int, str]] = []
        if self.message_index is not None:
            part = OutputText(text=self.content, logprobs=_to_output_logprobs(self.state.logprobs))
            done = OutputMessage(id=self.state.message_id, status=status, content=[part])
            self._items.append((self.message_index, done))
            closing.append((self.message_index, "message"))
        for index, item_id, call in self.calls:
            self._items.append((index, FunctionCallItem(id=item_id, status=status, call_id=call.call_id,
                                                        name=call.name, arguments=call.arguments)))
            closing.append((index, "call"))
        self._items.sort(key=lambda pair: pair[0])
        items = dict(self._items)
        for index, kind in sorted(closing):
            item = items[index]
            if kind == "message":
                part = item.content[0]
                events.append(self.event(OutputTextDoneEvent, item_id=item.id, output_index=index, content_index=0,
                                         text=part.text, logprobs=_to_delta_logprobs(self.state.logprobs)))
                events.append(self.event(ContentPartEvent, type="response.content_part.done", item_id=item.id,
                                         output_index=index, content_index=0, part=part))
            else:
                events.append(self.event(FunctionCallArgumentsDoneEvent, item_id=item.id, output_index=index,
                                         name=item.name, arguments=item.arguments))
            events.append(self.event(OutputItemEvent, type="response.output_item.done", output_index=index,
                                     item=item))
        return events

    def output_items(self) -> list[OutputItem]:
        """The closed items in output order (after :meth:`finish`)."""
        return [item for _, item in self._items]

    def _next_index(self) -> int:
        index = self.num_items
        self.num_items += 1
        return index

    def _open_message(self) -> list[str]:
        closed = self._close_reasoning()
        self.message_index = self._next_index()
        message = OutputMessage(id=self.state.message_id, status="in_progress")
        return closed + [
            self.event(OutputItemEvent, type="response.output_item.added", output_index=self.message_index,
                       item=message),
            self.event(ContentPartEvent, type="response.content_part.added", item_id=self.state.message_id,
                       output_index=self.message_index, content_index=0, part=OutputText(text="")),
        ]

    def _text_delta(self, text: str, logprobs: list[Any]) -> list[str]:
        events = self._open_message() if self.message_index is None else []
        self.content += text
        events.append(self.event(OutputTextDeltaEvent, item_id=self.state.message_id,
                                 output_index=self.message_index, content_index=0, delta=text,
                                 logprobs=_to_delta_logprobs(logprobs)))
        return events
