"""``POST /v1/chat/completions``: chat template, generation, and the OpenAI response or SSE stream.

Streaming follows OpenAI: per choice, a first chunk with ``delta.role`` (and empty content), content chunks,
then one chunk with an empty delta and the ``finish_reason``; with ``n > 1`` every chunk carries its choice's
``index``. With ``stream_options.include_usage`` every chunk has ``"usage": null`` and one last chunk with
``choices: []`` carries the usage; without it no chunk has a ``usage`` key. An error after the stream started
is sent as ``data: {"error": ...}`` followed by ``data: [DONE]``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from tokenmill.entrypoints.openai.chat_template import ChatRenderer
from tokenmill.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_json
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, UsageInfo, random_id
from tokenmill.entrypoints.openai.responses import (
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
)
from tokenmill.entrypoints.openai.serving_engine import EngineClient, OpenAIServing, Tokenization
from tokenmill.entrypoints.openai.serving_models import OpenAIServingModels
from tokenmill.entrypoints.openai.streaming import (
    CLIENT_CLOSED_REQUEST,
    SSE_DONE,
    close_quietly,
    run_unless_disconnected,
    sse_event,
    sse_response,
)
from tokenmill.errors import EngineGenerateError
from tokenmill.metrics.stats import RequestStatsTracker
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)

Gen = AsyncGenerator[RequestOutput, None]


class OpenAIServingChat(OpenAIServing):
    """Handles chat completion requests.

    Args:
        renderer: turns messages into prompt text (the chat template).
    """

    def __init__(self, engine: EngineClient, models: OpenAIServingModels, tokenization: Tokenization,
                 on_engine_dead: Any, renderer: ChatRenderer, stats: RequestStatsTracker | None = None,
                 **options: Any) -> None:
        super().__init__(engine, models, tokenization, on_engine_dead, stats, **options)
        self.renderer = renderer

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        """Run one chat request.

        Raises:
            ModelNotFoundError: unknown ``model``.
            InvalidRequestError: invalid fields, template failure, prompt too long (``param`` set).
            EngineDeadError, EngineGenerateError: from the engine (non-streaming, or before the first token).
        """
        arrival = time.time()
        model_name = self.models.resolve(request.model)
        request.check()
        self.check_priority(request.priority)
        for param, ids in request.token_id_fields().items():
            self.check_token_ids(ids, param)
        prompt_ids = request.truncated(await self.tokenization.run(self._render_and_encode, request),
                                       self.max_model_len)
        max_tokens = self.resolve_max_tokens(
            len(prompt_ids), request.requested_max_tokens, "messages", request.max_tokens_param
        )
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        params = self.make_sampling_params(
            lambda: request.to_sampling_params(max_tokens, kind, self.vocab_size), request.max_tokens_param
        )
        request_id = random_id("chatcmpl")
        echo = request.messages[-1].text() if request.echo and request.messages[-1].role == "assistant" else ""
        logger.info("request %s (X-Request-Id %s): %d prompt tokens, max_tokens %s", request_id,
                    getattr(raw_request.state, "request_id", "-"), len(prompt_ids), max_tokens)
        gen = self.generate(prompt_ids, params, request_id, arrival, request.priority, model_name=model_name)
        if request.stream:
            return await self._stream(request, raw_request, gen, request_id, model_name, len(prompt_ids), echo)
        return await self._full(request, raw_request, gen, request_id, model_name, len(prompt_ids), echo)

    def _render_and_encode(self, request: ChatCompletionRequest) -> list[int]:
        """Apply the chat template and tokenize (runs in the tokenizer thread)."""
        text = self.renderer.render(
            [m.to_template_dict() for m in request.messages],
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            template_kwargs=request.chat_template_kwargs,
        )
        return self.tokenization.encode(text, add_special_tokens=request.add_special_tokens)

    # ------------------------------------------------------------------------------------ non-streaming

    async def _full(self, request: ChatCompletionRequest, raw_request: Request, gen: Gen, request_id: str,
                    model_name: str, prompt_len: int, echo: str) -> Response:
        async def collect() -> tuple[RequestOutput | None, dict[int, CompletionOutput]]:
            last: RequestOutput | None = None
            by_index: dict[int, CompletionOutput] = {}
            async with aclosing(gen):
                async for out in gen:
                    last = out
                    for o in out.outputs:
                        by_index[o.index] = o
            return last, by_index

        completed, result = await run_unless_disconnected(raw_request, collect())
        if not completed or result is None:
            logger.info("request %s: client disconnected, aborted", request_id)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        last, by_index = result
        if last is None:
            raise EngineGenerateError(f"request {request_id}: the engine returned no output")
        tokenizer = self.tokenization.tokenizer
        k = request.top_logprobs or 0
        as_ids = self.tokens_as_ids(request.return_tokens_as_token_ids)
        choices = []
        for index in sorted(by_index):
            o = by_index[index]
            logprobs = chat_logprobs(tokenizer, o.token_ids, o.logprobs, k, as_ids) if request.logprobs else None
            choices.append(ChatCompletionChoice(
                index=index,
                message=ChatResponseMessage(role="assistant", content=echo + o.text),
                logprobs=logprobs,
                finish_reason=o.finish_reason,
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
                      model_name: str, prompt_len: int, echo: str) -> Response:
        # The first output is awaited before answering, so that a request the engine rejects gets a
        # plain 400 rather than a stream that starts and then fails.
        async def first_output() -> RequestOutput | None:
            return await anext(gen, None)

        try:
            completed, first = await run_unless_disconnected(raw_request, first_output())
        except BaseException:
            await close_quietly(gen)
            raise
        if not completed:
            await close_quietly(gen)
            logger.info("request %s: client disconnected, aborted", request_id)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return sse_response(self._chunks(request, gen, first, request_id, model_name, prompt_len, echo))

    async def _chunks(self, request: ChatCompletionRequest, gen: Gen, first: RequestOutput | None,
                      request_id: str, model_name: str, prompt_len: int, echo: str) -> AsyncGenerator[str, None]:
        created = int(time.time())
        include_usage = request.include_usage
        continuous = include_usage and request.continuous_usage
        exclude = None if include_usage else {"usage"}
        tokenizer = self.tokenization.tokenizer
        k = request.top_logprobs or 0
        as_ids = self.tokens_as_ids(request.return_tokens_as_token_ids)
        prompt_tokens, completion_tokens, cached_tokens = prompt_len, 0, 0

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            if usage is None and continuous:
                usage = UsageInfo.of(prompt_tokens, completion_tokens, cached_tokens)
            return sse_event(ChatCompletionStreamResponse(
                id=request_id, created=created, model=model_name, choices=choices, usage=usage
            ), exclude)

        finished: set[int] = set()
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
                        if o.text or logprobs is not None:
                            yield chunk([ChatCompletionStreamChoice(
                                index=o.index, delta=DeltaMessage(content=o.text), logprobs=logprobs
                            )])
                        if o.finish_reason is not None:
                            finished.add(o.index)
                            yield chunk([ChatCompletionStreamChoice(
                                index=o.index, delta=DeltaMessage(), finish_reason=o.finish_reason,
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
