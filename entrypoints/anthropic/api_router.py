"""The Messages API routes, added to the server's app by :func:`add_messages_routes`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from tokenmill.entrypoints.anthropic.errors import AnthropicErrorMiddleware
from tokenmill.entrypoints.anthropic.protocol import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
)
from tokenmill.entrypoints.anthropic.serving_messages import AnthropicServingMessages
from tokenmill.entrypoints.openai.errors import parse_json_body
from tokenmill.entrypoints.openai.openapi import json_body
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat

REQUEST_MODELS = [MessagesRequest, CountTokensRequest]
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": AnthropicErrorResponse, "description": description}
    for status, description in ((400, "Invalid request"), (401, "Missing or wrong API key"), (404, "Unknown model"),
                                (413, "Request body too large"), (500, "Engine failure"),
                                (529, "The server is shutting down"))
}
_STREAM_DOC = {"text/event-stream": {"schema": {"type": "string"}, "description": "with `stream: true`"}}


def add_messages_routes(app: FastAPI, chat: OpenAIServingChat, auth: Callable[[Request], None]) -> None:
    """Add ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` to ``app``, served by ``chat``; ``auth``
    checks the API key (``x-api-key`` or ``Authorization: Bearer``). Errors of these routes take Anthropic's
    shape (:class:`~tokenmill.entrypoints.anthropic.errors.AnthropicErrorMiddleware`, added here)."""
    serving = AnthropicServingMessages(chat)
    router = APIRouter(prefix="/v1", dependencies=[Depends(auth)], responses=_ERRORS)

    @router.post("/messages", openapi_extra=json_body(MessagesRequest),
                 responses={200: {"model": MessageResponse, "content": _STREAM_DOC}})
    async def create_message(raw_request: Request) -> Response:
        """Anthropic's Messages API, served by the chat completion path."""
        request = await parse_json_body(raw_request, MessagesRequest)
        return await serving.create_message(request, raw_request)

    @router.post("/messages/count_tokens", openapi_extra=json_body(CountTokensRequest),
                 response_model=CountTokensResponse)
    async def count_tokens(raw_request: Request) -> Response:
        """The prompt's token count, as ``/v1/messages`` would render it."""
        request = await parse_json_body(raw_request, CountTokensRequest)
        result = await serving.count_tokens(request)
        return Response(result.model_dump_json(), media_type="application/json")

    app.include_router(router)
    app.add_middleware(AnthropicErrorMiddleware)
