"""What chat and text completions share: the engine interface, tokenization off the event loop, context
length checks, client-disconnect handling and server-sent events."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import anyio
from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Send
from tokenmill.entrypoints.openai.errors import (
    ContextLengthExceededError,
    error_from_exception,
)
from tokenmill.entrypoints.openai.serving_models import OpenAIServingModels
from tokenmill.errors import EngineDeadError, InvalidRequestError
from tokenmill.outputs import Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"
# A logprob of -inf cannot be written as JSON; OpenAI-compatible servers send this instead.
MIN_LOGPROB = -9999.0
# Status logged for a request whose client went away (nginx's convention; nobody receives it).
CLIENT_CLOSED_REQUEST = 499


class EngineClient(Protocol):
    """The part of :class:`tokenmill.engine.async_llm.AsyncLLM` the server uses."""

    model_config: Any
    tokenizer: Any

    def generate(self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str
                 ) -> AsyncGenerator[RequestOutput, None]: ...

    async def abort(self, request_id: str) -> None: ...

    @property
    def errored(self) -> bool: ...

    async def check_health(self) -> None: ...


class Tokenization:
    """The tokenizer, used from one worker thread so long prompts never block the event loop and the
    (not thread-safe) fast tokenizer is never called concurrently."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-tokenizer")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text`` (call through :meth:`run`)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class OpenAIServing:
    """Base of the chat and completion handlers.

    Args:
        engine: the engine (an ``AsyncLLM``).
        models: the served model names.
        tokenization: the shared tokenizer worker.
        on_engine_dead: called when a request finds the engine dead (the server then shuts down).
    """

    def __init__(self, engine: EngineClient, models: OpenAIServingModels, tokenization: Tokenization,
                 on_engine_dead: Callable[[], None]) -> None:
        self.engine = engine
        self.models = models
        self.tokenization = tokenization
        self.on_engine_dead = on_engine_dead
        self.max_model_len = int(engine.model_config.max_model_len)
        self.vocab_size = int(engine.model_config.vocab_size)

    def resolve_max_tokens(self, prompt_len: int, requested: int | None, prompt_param: str,
                           max_tokens_param: str = "max_tokens") -> int:
        """The output budget in tokens: ``requested``, or what is left of the context when ``None``.

        Raises:
            ContextLengthExceededError: the prompt leaves no room (``param=prompt_param``), or prompt plus
                ``requested`` exceed the context (``param=max_tokens_param``).
        """
        limit = self.max_model_len
        if prompt_len >= limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens. However, your {prompt_param} "
                f"resulted in {prompt_len} tokens, which leaves no room for the completion. "
                f"Please reduce the length of the {prompt_param}.",
                param=prompt_param,
            )
        if requested is None:
            return limit - prompt_len
        if requested >= 1 and prompt_len + requested > limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the {prompt_param}, {requested} in the "
                f"completion). Please reduce the length of the {prompt_param} or completion.",
                param=max_tokens_param,
            )
        return requested

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """Raises InvalidRequestError when a token id is outside the vocabulary."""
        for t in token_ids:
            if not 0 <= t < self.vocab_size:
                raise InvalidRequestError(
                    f"{param}: token id {t} is out of range (vocabulary size {self.vocab_size})", param=param
                )

    def sse_error(self, exc: BaseException, request_id: str) -> str:
        """The ``data: {"error": ...}`` event for an exception raised inside a stream."""
        if isinstance(exc, EngineDeadError):
            logger.error("request %s: engine core is dead: %s", request_id, exc)
            self.on_engine_dead()
        elif not isinstance(exc, InvalidRequestError):
            logger.error("request %s failed while streaming", request_id, exc_info=exc)
        _, body = error_from_exception(exc)
        return sse_json(body)


def sse_event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def sse_json(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def token_text(tokenizer: Any, token_id: int, logprob: Logprob) -> str:
    """Text of one token for logprobs (the engine's decoded text, else the tokenizer's)."""
    if logprob.decoded_token is not None:
        return logprob.decoded_token
    return str(tokenizer.decode([token_id]))


def top_logprobs_of(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely tokens of one position, best first (the sampled token may rank lower)."""
    ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                   -kv[1].logprob))
    return ranked[:k]


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone away (the body must already have been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run ``work`` until it finishes or the client disconnects, whichever comes first.

    On disconnect ``work`` is cancelled (closing any engine generator it iterates, which aborts the
    request in the engine) and ``(False, None)`` is returned; else ``(True, result)``. Exceptions of
    ``work`` propagate.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        unfinished = not task.done()
        if unfinished:
            task.cancel()
            task.add_done_callback(_consume_result)
    if unfinished:
        return False, None
    return True, task.result()


def _consume_result(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.debug("work of a disconnected request ended with %r", task.exception())


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncGenerator[tuple[int, T], None]:
    """Yield ``(i, item)`` from all iterators as items arrive; closing this closes them all."""
    pending: dict[asyncio.Future[T], int] = {
        asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        for fut in pending:
            fut.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()


async def close_quietly(gen: Any) -> None:
    """Close an async generator even while the calling task is being cancelled."""
    with anyio.CancelScope(shield=True):
        try:
            await gen.aclose()
        except Exception:
            logger.debug("error while closing a generator", exc_info=True)


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body generator, also when the client disconnects while a
    chunk is being sent (Starlette otherwise leaves the generator to the garbage collector, so the engine
    would keep generating for nobody)."""

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await close_quietly(self.body_iterator)


def sse_response(body: AsyncGenerator[str, None]) -> ClosingStreamingResponse:
    return ClosingStreamingResponse(
        body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
