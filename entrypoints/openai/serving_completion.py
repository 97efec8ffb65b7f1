"""``POST /v1/completions``: one or more prompts (text or token ids), optional echo, the OpenAI response or
SSE stream. Choice ``i * n + j`` is output ``j`` of prompt ``i``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable
from contextlib import aclosing
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response
from tokenmill.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    UsageInfo,
    random_id,
)
from tokenmill.entrypoints.openai.serving_engine import (
    CLIENT_CLOSED_REQUEST,
    MIN_LOGPROB,
    SSE_DONE,
    OpenAIServing,
    close_quietly,
    merge_async_iterators,
    run_unless_disconnected,
    sse_event,
    sse_response,
    token_text,
    top_logprobs_of,
)
from tokenmill.errors import EngineGenerateError
from tokenmill.outputs import CompletionOutput, RequestOutput, SampleLogprobs
from tokenmill.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)

Gen = AsyncGenerator[RequestOutput, None]
T = TypeVar("T")


async def _collect(gen: Gen) -> tuple[RequestOutput | None, dict[int, CompletionOutput]]:
    last: RequestOutput | None = None
    by_index: dict[int, CompletionOutput] = {}
    async with aclosing(gen):
        async for out in gen:
            last = out
            for o in out.outputs:
                by_index[o.index] = o
    return last, by_index


async def _gather_or_cancel(*aws: Awaitable[T]) -> list[T]:
    """``asyncio.gather`` that cancels the others when one fails (or when the caller is cancelled)."""
    tasks: list[asyncio.Future[T]] = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _first_then_rest(first: RequestOutput | None, gen: Gen) -> Gen:
    async with aclosing(gen):
        if first is None:
            return
        yield first
        async for out in gen:
            yield out


class OpenAIServingCompletion(OpenAIServing):
    """Handles text completion requests."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        """Run one completion request (all its prompts concurrently).

        Raises:
            ModelNotFoundError: unknown ``model``.
            InvalidRequestError: invalid fields, empty prompt, out-of-vocabulary token ids, prompt too long.
            EngineDeadError, EngineGenerateError: from the engine (non-streaming, or before the first token).
        """
        model_name = self.models.resolve(request.model)
        request.check()
        prompts = request.prompts()
        prompt_ids = await self.tokenization.run(self._encode_all, prompts, request.add_special_tokens)
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        params = []
        for ids in prompt_ids:
            self.check_token_ids(ids, "prompt")
            max_tokens = self.resolve_max_tokens(len(ids), request.max_tokens, "prompt")
            params.append(request.to_sampling_params(max_tokens, kind))
        echoes = [""] * len(prompts)
        if request.echo:
            echoes = await self.tokenization.run(self._prompt_texts, prompts)
        request_id = random_id("cmpl")
        gens = [
            self.engine.generate(ids, p, request_id if len(prompt_ids) == 1 else f"{request_id}-{i}")
            for i, (ids, p) in enumerate(zip(prompt_ids, params))
        ]
        lens = [len(ids) for ids in prompt_ids]
        if request.stream:
            return await self._stream(request, raw_request, gens, request_id, model_name, lens, echoes)
        return await self._full(request, raw_request, gens, request_id, model_name, lens, echoes)

    def _encode_all(self, prompts: list[str | list[int]], add_special_tokens: bool) -> list[list[int]]:
        return [self.tokenization.encode(p, add_special_tokens) if isinstance(p, str) else list(p)
                for p in prompts]

    def _prompt_texts(self, prompts: list[str | list[int]]) -> list[str]:
        return [p if isinstance(p, str) else self.tokenization.decode(p) for p in prompts]

    # ------------------------------------------------------------------------------------ non-streaming

    async def _full(self, request: CompletionRequest, raw_request: Request, gens: list[Gen], request_id: str,
                    model_name: str, prompt_lens: list[int], echoes: list[str]) -> Response:
        completed, results = await run_unless_disconnected(raw_request, _gather_or_cancel(*map(_collect, gens)))
        if not completed or results is None:
            logger.info("request %s: client disconnected, aborted", request_id)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        choices: list[CompletionChoice] = []
        prompt_tokens = completion_tokens = cached_tokens = 0
        for i, (last, by_index) in enumerate(results):
            if last is None:
                raise EngineGenerateError(f"request {request_id}: the engine returned no output")
            prompt_tokens += len(last.prompt_token_ids) or prompt_lens[i]
            cached_tokens += last.num_cached_tokens
            for j in sorted(by_index):
                o = by_index[j]
                completion_tokens += len(o.token_ids)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._logprobs(o.token_ids, o.logprobs, request.logprobs, len(echoes[i]))
                choices.append(CompletionChoice(
                    index=i * request.n + j, text=echoes[i] + o.text, logprobs=logprobs,
                    finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                ))
        response = CompletionResponse(
            id=request_id, model=model_name, choices=choices,
            usage=UsageInfo.of(prompt_tokens, completion_tokens, cached_tokens),
        )
        return Response(response.model_dump_json(), media_type="application/json")

    # ---------------------------------------------------------------------------------------- streaming

    async def _stream(self, request: CompletionRequest, raw_request: Request, gens: list[Gen],
                      request_id: str, model_name: str, prompt_lens: list[int], echoes: list[str]) -> Response:
        # First outputs are awaited before answering so that rejected prompts get a plain 400.
        try:
            completed, firsts = await run_unless_disconnected(
                raw_request, _gather_or_cancel(*(anext(g, None) for g in gens))
            )
        except BaseException:
            for g in gens:
                await close_quietly(g)
            raise
        if not completed or firsts is None:
            for g in gens:
                await close_quietly(g)
            logger.info("request %s: client disconnected, aborted", request_id)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        streams = [_first_then_rest(first, g) for first, g in zip(firsts, gens)]
        return sse_response(self._chunks(request, streams, request_id, model_name, prompt_lens, echoes))

    async def _chunks(self, request: CompletionRequest, streams: list[Gen], request_id: str, model_name: str,
                      prompt_lens: list[int], echoes: list[str]) -> AsyncGenerator[str, None]:
        created = int(time.time())
        n = request.n

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            return sse_event(CompletionStreamResponse(
                id=request_id, created=created, model=model_name, choices=choices, usage=usage
            ))

        prompt_tokens = list(prompt_lens)
        cached_tokens = [0] * len(streams)
        completion_tokens = 0
        text_offsets = [0] * (len(streams) * n)
        finished: set[int] = set()
        merged = merge_async_iterators(*streams)
        try:
            try:
                for i, echo in enumerate(echoes):
                    if echo:
                        for j in range(n):
                            text_offsets[i * n + j] = len(echo)
                            yield chunk([CompletionChoice(index=i * n + j, text=echo)])
                async for i, output in merged:
                    prompt_tokens[i] = len(output.prompt_token_ids) or prompt_tokens[i]
                    cached_tokens[i] = output.num_cached_tokens
                    for o in output.outputs:
                        index = i * n + o.index
                        if index in finished:
                            continue
                        completion_tokens += len(o.token_ids)
                        logprobs = None
                        if request.logprobs is not None and o.logprobs:
                            logprobs = self._logprobs(o.token_ids, o.logprobs, request.logprobs,
                                                      text_offsets[index])
                        text_offsets[index] += len(o.text)
                        if o.text or logprobs is not None:
                            yield chunk([CompletionChoice(index=index, text=o.text, logprobs=logprobs)])
                        if o.finish_reason is not None:
                            finished.add(index)
                            yield chunk([CompletionChoice(index=index, text="", finish_reason=o.finish_reason,
                                                          stop_reason=o.stop_reason)])
                if request.include_usage:
                    yield chunk([], usage=UsageInfo.of(sum(prompt_tokens), completion_tokens, sum(cached_tokens)))
            except Exception as exc:  # noqa: BLE001 - any failure must reach the client as an SSE error event
                yield self.sse_error(exc, request_id)
            yield SSE_DONE
        finally:
            await close_quietly(merged)

    # ----------------------------------------------------------------------------------------- logprobs

    def _logprobs(self, token_ids: list[int], logprobs: SampleLogprobs | None, k: int,
                  start_offset: int) -> CompletionLogprobs:
        """Legacy logprobs of generated tokens; ``start_offset`` is the character offset of the first one."""
        tokenizer = self.tokenization.tokenizer
        result = CompletionLogprobs()
        offset = start_offset
        for token_id, entry in zip(token_ids, logprobs or []):
            sampled = entry.get(token_id)
            text = token_text(tokenizer, token_id, sampled) if sampled is not None else str(
                tokenizer.decode([token_id]))
            result.tokens.append(text)
            result.token_logprobs.append(max(sampled.logprob, MIN_LOGPROB) if sampled is not None else None)
            result.top_logprobs.append(
                {token_text(tokenizer, tid, lp): max(lp.logprob, MIN_LOGPROB) for tid, lp in top_logprobs_of(entry, k)}
                if k > 0 else None
            )
            result.text_offset.append(offset)
            offset += len(text)
        return result
