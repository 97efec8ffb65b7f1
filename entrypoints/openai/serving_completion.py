"""``POST /v1/completions``: one or more prompts (text or token ids), optional echo, the OpenAI response or
SSE stream. Choice ``i * n + j`` is output ``j`` of prompt ``i``.

With ``echo`` and ``logprobs`` the prompt's tokens lead the choice's logprobs (the first with ``null``), as
OpenAI's legacy API does; ``prompt_logprobs`` (vLLM's extra) adds the engine's per-prompt-token entries.
``text_offset`` comes from one :class:`~tokenmill.entrypoints.openai.logprobs.TextOffsets` per choice, fed
the same tokens whether the answer is streamed or not.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

import msgspec
from fastapi import Request
from fastapi.responses import Response
from tokenmill.entrypoints.openai.logprobs import (
    TextOffsets,
    completion_logprobs,
    echo_logprobs,
    prompt_logprobs_json,
)
from tokenmill.entrypoints.openai.protocol import CompletionRequest, UsageInfo, random_id
from tokenmill.entrypoints.openai.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamResponse,
)
from tokenmill.entrypoints.openai.serving_engine import Gen, OpenAIServing, output_kind
from tokenmill.entrypoints.openai.streaming import (
    CLIENT_CLOSED_REQUEST,
    SSE_DONE,
    close_quietly,
    merge_async_iterators,
    sse_event,
    sse_response,
)
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


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
        arrival = time.time()
        model_name = self.admit(request)
        for param, ids in request.token_id_fields().items():
            self.check_token_ids(ids, param)
        constraint = await self.resolve_constraint(request)
        prompts = request.prompts()
        encoded = await self.tokenization.run(self._encode_all, prompts, request.add_special_tokens)
        prompt_ids = [request.truncated(ids, self.max_model_len) for ids in encoded]
        # A truncated prompt is echoed as what the model saw.
        prompts = [p if len(ids) == len(full) else ids for p, ids, full in zip(prompts, prompt_ids, encoded)]
        kind = output_kind(request.stream)
        params = []
        for ids in prompt_ids:
            self.check_token_ids(ids, "prompt")
            max_tokens = self.resolve_max_tokens(len(ids), request.max_tokens, "prompt")
            params.append(self.make_sampling_params(
                lambda m=max_tokens: request.to_sampling_params(m, kind, self.vocab_size), "max_tokens"
            ))
        if constraint is not None:
            params = [msgspec.structs.replace(p, structured_outputs=constraint) for p in params]
        echoes = [""] * len(prompts)
        if request.echo:
            echoes = await self.tokenization.run(self._prompt_texts, prompts)
        request_id = random_id("cmpl")
        self.log_request(request_id, raw_request, "%d prompt(s), %d prompt tokens", len(prompts),
                         sum(map(len, prompt_ids)))
        gens = [
            self.generate(ids, p, request_id if len(prompt_ids) == 1 else f"{request_id}-{i}", arrival,
                          request.priority, model_name=model_name, cache_salt=request.cache_salt)
            for i, (ids, p) in enumerate(zip(prompt_ids, params))
        ]
        if request.stream:
            return await self._stream(request, raw_request, gens, request_id, model_name, prompt_ids, echoes)
        return await self._full(request, raw_request, gens, request_id, model_name, prompt_ids, echoes)

    async def resolve_constraint(self, request: CompletionRequest) -> StructuredOutputsParams | None:
        """The request's structured-output constraint (``structured_outputs``, ``response_format`` or
        ``guided_*``), checked with the server's backend in the tokenizer thread.

        Raises:
            InvalidRequestError: two constraints, or one that does not compile (``param`` names the field).
        """
        return await self.resolve_structured_outputs(*request.structured_outputs_params())

    def _encode_all(self, prompts: list[str | list[int]], add_special_tokens: bool) -> list[list[int]]:
        return [self.tokenization.encode(p, add_special_tokens) if isinstance(p, str) else list(p)
                for p in prompts]

    def _prompt_texts(self, prompts: list[str | list[int]]) -> list[str]:
        return [p if isinstance(p, str) else self.tokenization.decode(p) for p in prompts]

    def _offsets(self, request: CompletionRequest, prompt_ids: list[int], start: int) -> TextOffsets:
        """Text offsets of one choice's generated tokens (after ``start`` characters of echo)."""
        return TextOffsets(self.tokenization.view, prompt_ids, start, skip_special_tokens=request.skip_special_tokens,
                           spaces_between_special_tokens=request.spaces_between_special_tokens)

    def _echo_logprobs(self, request: CompletionRequest, output: RequestOutput | None, prompt_ids: list[int],
                       echo: str) -> CompletionLogprobs:
        return echo_logprobs(self.tokenization.tokenizer, self.tokenization.view, prompt_ids, echo,
                             output.prompt_logprobs if output else None, request.logprobs or 0,
                             self.tokens_as_ids(request.return_tokens_as_token_ids))

    def _logprobs(self, request: CompletionRequest, o: CompletionOutput, offsets: TextOffsets,
                  into: CompletionLogprobs | None = None) -> CompletionLogprobs:
        """The legacy logprobs of ``o``'s tokens (appended to ``into``, e.g. an echo's)."""
        return completion_logprobs(self.tokenization.tokenizer, o.token_ids, o.logprobs, request.logprobs or 0,
                                   offsets, into, self.tokens_as_ids(request.return_tokens_as_token_ids))

    # ------------------------------------------------------------------------------------ non-streaming

    async def _full(self, request: CompletionRequest, raw_request: Request, gens: list[Gen], request_id: str,
                    model_name: str, prompt_ids: list[list[int]], echoes: list[str]) -> Response:
        results = await self.full_outputs(raw_request, gens, request_id)
        if results is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        choices: list[CompletionChoice] = []
        prompt_tokens = completion_tokens = cached_tokens = 0
        for i, (last, by_index) in enumerate(results):
            prompt_tokens += len(last.prompt_token_ids) or len(prompt_ids[i])
            cached_tokens += last.num_cached_tokens
            prompt_lps = prompt_logprobs_json(last.prompt_logprobs) if request.prompt_logprobs is not None else None
            for j in sorted(by_index):
                o = by_index[j]
                completion_tokens += len(o.token_ids)
                logprobs = None
                if request.logprobs is not None:
                    echo_lps = self._echo_logprobs(request, last, prompt_ids[i], echoes[i]) if request.echo else None
                    logprobs = self._logprobs(request, o, self._offsets(request, prompt_ids[i], len(echoes[i])),
                                              echo_lps)
                choices.append(CompletionChoice(
                    index=i * request.n + j, text=echoes[i] + o.text, logprobs=logprobs,
                    finish_reason=o.finish_reason, stop_reason=o.stop_reason, prompt_logprobs=prompt_lps,
                ))
        response = CompletionResponse(
            id=request_id, model=model_name, choices=choices,
            usage=UsageInfo.of(prompt_tokens, completion_tokens, cached_tokens),
        )
        return Response(response.model_dump_json(), media_type="application/json")

    # ---------------------------------------------------------------------------------------- streaming

    async def _stream(self, request: CompletionRequest, raw_request: Request, gens: list[Gen],
                      request_id: str, model_name: str, prompt_ids: list[list[int]], echoes: list[str]
                      ) -> Response:
        firsts = await self.first_outputs(raw_request, gens, request_id)
        if firsts is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return sse_response(self._chunks(request, gens, firsts, request_id, model_name, prompt_ids, echoes))

    async def _chunks(self, request: CompletionRequest, gens: list[Gen], firsts: list[RequestOutput | None],
                      request_id: str, model_name: str, prompt_ids: list[list[int]], echoes: list[str]
                      ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        n = request.n
        include_usage = request.include_usage
        continuous = include_usage and request.continuous_usage
        exclude = None if include_usage else {"usage"}
        prompt_tokens = [len(ids) for ids in prompt_ids]
        cached_tokens = [0] * len(gens)
        completion_tokens = 0

        def usage_now() -> UsageInfo:
            return UsageInfo.of(sum(prompt_tokens), completion_tokens, sum(cached_tokens))

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            if usage is None and continuous:
                usage = usage_now()
            return sse_event(CompletionStreamResponse(
                id=request_id, created=created, model=model_name, choices=choices, usage=usage
            ), exclude)

        offsets: dict[int, TextOffsets] = {}
        finished: set[int] = set()
        merged = merge_async_iterators(*(_first_then_rest(first, g) for first, g in zip(firsts, gens)))
        try:
            try:
                for i, echo in enumerate(echoes):
                    if not echo:
                        continue
                    lps = None
                    if request.logprobs is not None:
                        lps = self._echo_logprobs(request, firsts[i], prompt_ids[i], echo)
                    for j in range(n):
                        yield chunk([CompletionChoice(index=i * n + j, text=echo, logprobs=lps)])
                async for i, output in merged:
                    prompt_tokens[i] = len(output.prompt_token_ids) or prompt_tokens[i]
                    cached_tokens[i] = output.num_cached_tokens
                    for o in output.outputs:
                        index = i * n + o.index
                        if index in finished:
                            continue
                        completion_tokens += len(o.token_ids)
                        logprobs = None
                        if request.logprobs is not None:
                            if index not in offsets:
                                offsets[index] = self._offsets(request, prompt_ids[i], len(echoes[i]))
                            logprobs = self._logprobs(request, o, offsets[index])
                            if not logprobs.tokens:
                                logprobs = None
                        if o.text or logprobs is not None:
                            yield chunk([CompletionChoice(index=index, text=o.text, logprobs=logprobs)])
                        if o.finish_reason is not None:
                            finished.add(index)
                            yield chunk([CompletionChoice(index=index, text="", finish_reason=o.finish_reason,
                                                          stop_reason=o.stop_reason)])
                if include_usage:
                    yield chunk([], usage=usage_now())
            except Exception as exc:  # noqa: BLE001 - any failure must reach the client as an SSE error event
                yield self.sse_error(exc, request_id)
            yield SSE_DONE
        finally:
            await close_quietly(merged)
            for g in gens:
                await close_quietly(g)
