"""Server-sent events and client-disconnect handling shared by the chat and completion handlers."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Send

logger = logging.getLogger(__name__)

T = TypeVar("T")

SSE_DONE = "data: [DONE]\n\n"
# Status logged for a request whose client went away (nginx's convention; nobody receives it).
CLIENT_CLOSED_REQUEST = 499


def sse_event(chunk: BaseModel, exclude: set[str] | None = None) -> str:
    """One ``data:`` event holding ``chunk`` as JSON (fields in ``exclude`` left out)."""
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


def sse_json(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


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
