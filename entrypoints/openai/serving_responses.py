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

Two seams are left for tool calling and structured outputs (see their docstrings): :func:`check_tool_calling`
with :func:`extract_tool_calls`, and :func:`structured_outputs_for`. Until they are wired, a request that needs
them is refused with a 400 naming ``tools`` / ``tool_choice`` / ``text.format``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel
from tokenmill.entrypoints.openai.chat_template import ChatRenderer
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
    ResponseErrorInfo,
    ResponseLifecycleEvent,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
    response_id,
)
from tokenmill.entrypoints.openai.serving_engine import EngineClient, OpenAIServing, Tokenization
from tokenmill.entrypoints.openai.serving_models import OpenAIServingModels
from tokenmill.entrypoints.openai.streaming import (
    CLIENT_CLOSED_REQUEST,
    close_quietly,
    run_unless_disconnected,
    sse_response,
)
from tokenmill.errors import EngineDeadError, EngineGenerateError, InvalidRequestError, ServerShuttingDownError
from tokenmill.metrics.stats import RequestStatsTracker
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)

Gen = AsyncGenerator[RequestOutput, None]


# ------------------------------------------------------------------------------------------------ seams


@dataclass
class ToolCall:
    """One function call found in the model's output: ``arguments`` is JSON text."""

    name: str
    arguments: str
    call_id: str = ""

    def __post_init__(self) -> None:
        if not self.call_id:
            self.call_id = response_id("call")


def check_tool_calling(request: ResponsesRequest) -> None:
    """Seam for function tools: accept the request's ``tools`` / ``tool_choice`` or refuse them.

    Wiring tool calling in replaces this refusal: pass ``[t.to_chat_tool() for t in request.tools]`` to the
    chat template (see ``_render_and_encode``), constrain ``tool_choice`` ``required`` / named through the
    structured-output engine (its constraint goes where :func:`structured_outputs_for` puts one), and make
    :func:`extract_tool_calls` run the server's tool parser. ``parallel_tool_calls`` and ``max_tool_calls``
    only matter once there are tools.

    Raises:
        InvalidRequestError: ``tools`` given (``param="tools"``), or a ``tool_choice`` that needs a tool call
            (``param="tool_choice"``).
    """
    if request.tools:
        raise InvalidRequestError("tools: function tools are not supported by this server yet", param="tools")
    if request.tool_choice not in (None, "none", "auto"):
        raise InvalidRequestError("tool_choice: needs tools, which are not supported by this server yet",
                                  param="tool_choice")


def extract_tool_calls(request: ResponsesRequest, text: str) -> tuple[str, list[ToolCall]]:
    """Seam for function tools: split the model's finished text into content and tool calls.

    Without tool calling nothing is a call: returns ``(text, [])``. Each call returned becomes a
    ``function_call`` output item after the message (streamed as ``response.output_item.added``,
    ``response.function_call_arguments.delta`` / ``.done`` and ``response.output_item.done``); the message
    item is left out of a whole response when the content is empty and there are calls. In a stream the text
    deltas go out as they come: a streaming tool parser must also hold the call markup back there
    (``OpenAIServingResponses._events``).
    """
    return text, []


def structured_outputs_for(request: ResponsesRequest) -> Any:
    """Seam for structured outputs: the constraint for ``text.format`` (``None``: unconstrained).

    Wiring structured outputs in returns the engine's constraint for ``json_schema`` / ``json_object``
    (``request.text.format.to_response_format()`` gives Chat Completions' ``response_format`` for it), and
    ``to_sampling_params`` puts it into the request's ``SamplingParams``.

    Raises:
        InvalidRequestError: ``text.format`` other than ``text`` (``param="text.format"``).
    """
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    raise InvalidRequestError(
        f"text.format: type {fmt.type!r} is not supported by this server yet (only 'text')", param="text.format"
    )


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
    """Handles Responses API requests (stateless: nothing is stored, ``store`` is always false).

    Args:
        renderer: turns the input items into prompt text (the chat template, as for chat completions).
    """

    def __init__(self, engine: EngineClient, models: OpenAIServingModels, tokenization: Tokenization,
                 on_engine_dead: Any, renderer: ChatRenderer, stats: RequestStatsTracker | None = None,
                 **options: Any) -> None:
        super().__init__(engine, models, tokenization, on_engine_dead, stats, **options)
        self.renderer = renderer

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        """Run one Responses API request.

        Raises:
            ModelNotFoundError: unknown ``model``.
            InvalidRequestError: invalid fields or input items, template failure, input too long, tools or a
                ``text.format`` the server cannot honour (``param`` set).
            EngineDeadError, EngineGenerateError: from the engine (non-streaming, or before the first token).
        """
        arrival = time.time()
        model_name = self.models.resolve(request.model)
        request.check()
        check_tool_calling(request)
        structured_outputs_for(request)
        self.check_priority(request.priority)
        messages = request.input_messages()
        prompt_ids = await self.tokenization.run(self._render_and_encode, messages, request)
        max_tokens = self.resolve_max_tokens(len(prompt_ids), request.max_output_tokens, "input",
                                             "max_output_tokens")
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        params = self.make_sampling_params(
            lambda: request.to_sampling_params(max_tokens, kind, self.vocab_size), "max_output_tokens"
        )
        resp_id = response_id("resp")
        logger.info("request %s (X-Request-Id %s): %d input tokens, max_output_tokens %s", resp_id,
                    getattr(raw_request.state, "request_id", "-"), len(prompt_ids), max_tokens)
        gen = self.generate(prompt_ids, params, resp_id, arrival, request.priority, model_name=model_name)
        state = _ResponseState(self, request, resp_id, model_name, len(prompt_ids))
        if request.stream:
            return await self._stream(raw_request, gen, state)
        return await self._full(raw_request, gen, state)

    def _render_and_encode(self, messages: list[dict[str, Any]], request: ResponsesRequest) -> list[int]:
        """Apply the chat template and tokenize (runs in the tokenizer thread).

        Raises:
            InvalidRequestError: the template failed (``param="input"``) or reserved ``chat_template_kwargs``.
        """
        try:
            text = self.renderer.render(messages, add_generation_prompt=True, continue_final_message=False,
                                        template_kwargs=request.chat_template_kwargs)
        except InvalidRequestError as exc:
            if exc.param != "messages":
                raise
            message = str(exc).removeprefix("messages: ")
            raise InvalidRequestError(f"input: {message}", param="input") from exc
        return self.tokenization.encode(text, add_special_tokens=False)

    async def _full(self, raw_request: Request, gen: Gen, state: _ResponseState) -> Response:
        async def collect() -> RequestOutput | None:
            last = None
            async with aclosing(gen):
                async for out in gen:
                    last = out
            return last

        completed, last = await run_unless_disconnected(raw_request, collect())
        if not completed:
            logger.info("request %s: client disconnected, aborted", state.resp_id)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if last is None or not last.outputs:
            raise EngineGenerateError(f"request {state.resp_id}: the engine returned no output")
        state.add(last, last.outputs[0])
        response = state.final_response()
        return Response(response.model_dump_json(by_alias=True), media_type="application/json")

    async def _stream(self, raw_request: Request, gen: Gen, state: _ResponseState) -> Response:
        # The first output is awaited before answering, so that a request the engine rejects gets a plain 400.
        async def first_output() -> RequestOutput | None:
            return await anext(gen, None)

        try:
            completed, first = await run_unless_disconnected(raw_request, first_output())
        except BaseException:
            await close_quietly(gen)
            raise
        if not completed:
            await close_quietly(gen)
            logger.info("request %s: client disconnected, aborted", state.resp_id)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return sse_response(self._events(gen, first, state))

    async def _events(self, gen: Gen, first: RequestOutput | None, state: _ResponseState
                      ) -> AsyncGenerator[str, None]:
        seq = 0

        def event(model: type[BaseModel], **fields: Any) -> str:
            nonlocal seq
            text = _event(model(sequence_number=seq, **fields))
            seq += 1
            return text

        message = OutputMessage(id=state.message_id, status="in_progress")
        try:
            try:
                yield event(ResponseLifecycleEvent, type="response.created", response=state.snapshot("in_progress"))
                yield event(ResponseLifecycleEvent, type="response.in_progress",
                            response=state.snapshot("in_progress"))
                yield event(OutputItemEvent, type="response.output_item.added", output_index=0, item=message)
                yield event(ContentPartEvent, type="response.content_part.added", item_id=state.message_id,
                            output_index=0, content_index=0, part=OutputText(text=""))
                output = first
                while output is not None:
                    if output.outputs:
                        o = output.outputs[0]
                        new_logprobs = state.add(output, o)
                        if o.text or new_logprobs:
                            yield event(OutputTextDeltaEvent, item_id=state.message_id, output_index=0,
                                        content_index=0, delta=o.text, logprobs=_to_delta_logprobs(new_logprobs))
                    output = await anext(gen, None)
                content, calls = state.result()
                part = OutputText(text=content, logprobs=_to_output_logprobs(state.logprobs))
                yield event(OutputTextDoneEvent, item_id=state.message_id, output_index=0, content_index=0,
                            text=content, logprobs=_to_delta_logprobs(state.logprobs))
                yield event(ContentPartEvent, type="response.content_part.done", item_id=state.message_id,
                            output_index=0, content_index=0, part=part)
                done_message = OutputMessage(id=state.message_id, status=state.item_status, content=[part])
                yield event(OutputItemEvent, type="response.output_item.done", output_index=0, item=done_message)
                for index, (item_id, call) in enumerate(calls, start=1):
                    item = FunctionCallItem(id=item_id, status="in_progress", call_id=call.call_id,
                                            name=call.name, arguments="")
                    yield event(OutputItemEvent, type="response.output_item.added", output_index=index, item=item)
                    yield event(FunctionCallArgumentsDeltaEvent, item_id=item.id, output_index=index,
                                delta=call.arguments)
                    yield event(FunctionCallArgumentsDoneEvent, item_id=item.id, output_index=index,
                                name=call.name, arguments=call.arguments)
                    done = item.model_copy(update={"status": "completed", "arguments": call.arguments})
                    yield event(OutputItemEvent, type="response.output_item.done", output_index=index, item=done)
                final = state.final_response(streamed_message=True)
                kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
                yield event(ResponseLifecycleEvent, type=kind, response=final)
            except Exception as exc:  # noqa: BLE001 - any failure must reach the client as error events
                self._log_stream_error(exc, state.resp_id)
                _, body = error_from_exception(exc)
                info = body["error"]
                yield event(ErrorEvent, code=info.get("code") or info.get("type"), message=info["message"],
                            param=info.get("param"))
                failed = state.snapshot("failed")
                failed.error = ResponseErrorInfo(code="server_error", message=info["message"])
                yield event(ResponseLifecycleEvent, type="response.failed", response=failed)
        finally:
            await close_quietly(gen)

    def _log_stream_error(self, exc: BaseException, request_id: str) -> None:
        if isinstance(exc, EngineDeadError):
            logger.error("request %s: engine core is dead: %s", request_id, exc)
            self.on_engine_dead()
        elif isinstance(exc, ServerShuttingDownError):
            logger.info("request %s stopped: the server is shutting down", request_id)
        elif not isinstance(exc, InvalidRequestError):
            logger.error("request %s failed while streaming", request_id, exc_info=exc)


class _ResponseState:
    """What one response has produced so far: text, logprobs, token counts, finish reason."""

    def __init__(self, serving: OpenAIServingResponses, request: ResponsesRequest, resp_id: str, model: str,
                 prompt_len: int) -> None:
        self.serving = serving
        self.request = request
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

    def result(self) -> tuple[str, list[tuple[str, ToolCall]]]:
        """The finished text split into content and ``(item id, call)`` pairs (computed once)."""
        if self._result is None:
            content, calls = extract_tool_calls(self.request, self.text)
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

    def final_response(self, streamed_message: bool = False) -> ResponsesResponse:
        """The finished response object (the ``message`` item first, then any ``function_call`` items).

        ``streamed_message``: the message item was announced in the stream, so it stays even when empty.
        """
        content, calls = self.result()
        output: list[OutputItem] = []
        if content or not calls or streamed_message:
            part = OutputText(text=content, logprobs=_to_output_logprobs(self.logprobs))
            output.append(OutputMessage(id=self.message_id, status=self.item_status, content=[part]))
        output.extend(FunctionCallItem(id=item_id, call_id=c.call_id, name=c.name, arguments=c.arguments)
                      for item_id, c in calls)
        response = self.snapshot(self.status)
        response.output = output
        response.usage = self.usage()
        response.completed_at = int(time.time()) if self.status == "completed" else None
        if self.status == "incomplete":
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        return response
