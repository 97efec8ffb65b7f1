"""``POST /v1/chat/completions``: chat template, generation, and the OpenAI response or SSE stream."""

from __future__ import annotations

import inspect
import logging
import os
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import Response
from tokenmill.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobToken,
    ChatResponseMessage,
    ChatTopLogprob,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from tokenmill.entrypoints.openai.serving_engine import (
    CLIENT_CLOSED_REQUEST,
    MIN_LOGPROB,
    SSE_DONE,
    EngineClient,
    OpenAIServing,
    Tokenization,
    close_quietly,
    run_unless_disconnected,
    sse_event,
    sse_response,
    token_text,
    top_logprobs_of,
)
from tokenmill.entrypoints.openai.serving_models import OpenAIServingModels
from tokenmill.errors import EngineGenerateError, InvalidRequestError
from tokenmill.outputs import CompletionOutput, RequestOutput, SampleLogprobs
from tokenmill.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)

_TEMPLATE_ERRORS = (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError)


def load_chat_template(value: str | None) -> str | None:
    """The ``--chat-template`` argument as template text: a file's contents, or the value itself when it is
    an inline Jinja template.

    Raises:
        FileNotFoundError: ``value`` is neither an existing file nor a template.
    """
    if value is None:
        return None
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise FileNotFoundError(f"chat_template: {value!r} is neither a file nor a Jinja template")


def _reserved_template_kwargs(tokenizer: Any) -> frozenset[str]:
    try:
        params = inspect.signature(tokenizer.apply_chat_template).parameters
    except (TypeError, ValueError):
        return frozenset({"conversation", "tokenize", "chat_template"})
    return frozenset(name for name, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD)


class OpenAIServingChat(OpenAIServing):
    """Handles chat completion requests.

    Args:
        chat_template: template text that replaces the tokenizer's own (``None``: the tokenizer's).
    """

    def __init__(self, engine: EngineClient, models: OpenAIServingModels, tokenization: Tokenization,
                 on_engine_dead: Any, chat_template: str | None = None) -> None:
        super().__init__(engine, models, tokenization, on_engine_dead)
        self.chat_template = chat_template
        self._reserved_kwargs = _reserved_template_kwargs(tokenization.tokenizer)

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        """Run one chat request.

        Raises:
            ModelNotFoundError: unknown ``model``.
            InvalidRequestError: invalid fields, template failure, prompt too long (``param`` set).
            EngineDeadError, EngineGenerateError: from the engine (non-streaming, or before the first token).
        """
        model_name = self.models.resolve(request.model)
        request.check()
        prompt_ids = await self.tokenization.run(self._render_and_encode, request)
        max_tokens = self.resolve_max_tokens(
            len(prompt_ids), request.requested_max_tokens, "messages", request.max_tokens_param
        )
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        params = request.to_sampling_params(max_tokens, kind)
        request_id = random_id("chatcmpl")
        echo = request.messages[-1].text() if request.echo and request.messages[-1].role == "assistant" else ""
        logger.debug("request %s: %d prompt tokens, max_tokens %d", request_id, len(prompt_ids), max_tokens)
        gen = self.engine.generate(prompt_ids, params, request_id)
        if request.stream:
            return await self._stream(request, raw_request, gen, request_id, model_name, len(prompt_ids), echo)
        return await self._full(request, raw_request, gen, request_id, model_name, len(prompt_ids), echo)

    def _render_and_encode(self, request: ChatCompletionRequest) -> list[int]:
        """Apply the chat template and tokenize (runs in the tokenizer thread)."""
        extra = dict(request.chat_template_kwargs or {})
        clash = sorted(set(extra) & self._reserved_kwargs)
        if clash:
            raise InvalidRequestError(f"chat_template_kwargs: reserved keys {clash}", param="chat_template_kwargs")
        messages = [m.to_template_dict() for m in request.messages]
        try:
            text = self.tokenization.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template=self.chat_template,
                **extra,
            )
        except _TEMPLATE_ERRORS as exc:
            raise InvalidRequestError(
                f"messages: the chat template could not be applied: {exc}", param="messages"
            ) from exc
        if not isinstance(text, str):
            raise InvalidRequestError("messages: the chat template did not produce text", param="messages")
        return self.tokenization.encode(text, add_special_tokens=request.add_special_tokens)

    # ------------------------------------------------------------------------------------ non-streaming

    async def _full(self, request: ChatCompletionRequest, raw_request: Request,
                    gen: AsyncGenerator[RequestOutput, None], request_id: str, model_name: str,
                    prompt_len: int, echo: str) -> Response:
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
        k = request.top_logprobs or 0
        choices = []
        for index in sorted(by_index):
            o = by_index[index]
            logprobs = self._logprobs(o.token_ids, o.logprobs, k) if request.logprobs else None
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
        response = ChatCompletionResponse(id=request_id, model=model_name, choices=choices, usage=usage)
        return Response(response.model_dump_json(), media_type="application/json")

    # ---------------------------------------------------------------------------------------- streaming

    async def _stream(self, request: ChatCompletionRequest, raw_request: Request,
                      gen: AsyncGenerator[RequestOutput, None], request_id: str, model_name: str,
                      prompt_len: int, echo: str) -> Response:
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

    async def _chunks(self, request: ChatCompletionRequest, gen: AsyncGenerator[RequestOutput, None],
                      first: RequestOutput | None, request_id: str, model_name: str, prompt_len: int,
                      echo: str) -> AsyncGenerator[str, None]:
        created = int(time.time())

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse_event(ChatCompletionStreamResponse(
                id=request_id, created=created, model=model_name, choices=choices, usage=usage
            ))

        k = request.top_logprobs or 0
        prompt_tokens, completion_tokens, cached_tokens = prompt_len, 0, 0
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
                            logprobs = self._logprobs(o.token_ids, o.logprobs, k)
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
                if request.include_usage:
                    yield chunk([], usage=UsageInfo.of(prompt_tokens, completion_tokens, cached_tokens))
            except Exception as exc:  # noqa: BLE001 - any failure must reach the client as an SSE error event
                yield self.sse_error(exc, request_id)
            yield SSE_DONE
        finally:
            await close_quietly(gen)

    # ----------------------------------------------------------------------------------------- logprobs

    def _logprobs(self, token_ids: list[int], logprobs: SampleLogprobs | None, k: int) -> ChatChoiceLogprobs:
        tokenizer = self.tokenization.tokenizer
        content: list[ChatLogprobToken] = []
        for token_id, entry in zip(token_ids, logprobs or []):
            sampled = entry.get(token_id)
            text = token_text(tokenizer, token_id, sampled) if sampled is not None else str(
                tokenizer.decode([token_id]))
            tops = []
            for tid, lp in top_logprobs_of(entry, k):
                t = token_text(tokenizer, tid, lp)
                tops.append(ChatTopLogprob(token=t, logprob=max(lp.logprob, MIN_LOGPROB),
                                           bytes=list(t.encode("utf-8"))))
            content.append(ChatLogprobToken(
                token=text,
                logprob=max(sampled.logprob, MIN_LOGPROB) if sampled is not None else MIN_LOGPROB,
                bytes=list(text.encode("utf-8")),
                top_logprobs=tops,
            ))
        return ChatChoiceLogprobs(content=content)
