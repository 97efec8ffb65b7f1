"""ASGI middleware of the server: request ids and the request-body size limit.

Both are pure ASGI (not Starlette's ``BaseHTTPMiddleware``), so streaming responses and client-disconnect
detection pass through untouched.
"""

from __future__ import annotations

import re
import uuid

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from tokenmill.entrypoints.openai.errors import RequestTooLargeError, error_from_exception

REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID_KEY = REQUEST_ID_HEADER.lower().encode("latin-1")  # ASGI header names are lower-case bytes
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
_REQUEST_ID_RE = re.compile(r"^[\x21-\x7e]{1,256}$")


class RequestIdMiddleware:
    """Echo ``X-Request-Id`` (the client's when it sent a sane one, else a new one) on every response.

    A sane id is 1 to 256 printable ASCII characters without spaces. The id is also available to handlers
    as ``request.state.request_id`` (the server logs it next to the completion id).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope.get("headers", [])
                      if k.lower() == _REQUEST_ID_KEY), None)
        request_id = given if given is not None and _REQUEST_ID_RE.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != _REQUEST_ID_KEY]
                headers.append((_REQUEST_ID_KEY, request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodySizeLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` with 413 (OpenAI error object).

    A declared ``Content-Length`` over the limit is refused before anything is read; a body sent without
    one (chunked) is counted as it arrives and reading it raises :class:`RequestTooLargeError` once it passes
    the limit, which the exception handlers turn into the same 413.

    Args:
        max_bytes: the largest accepted body in bytes.
    """

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope.get("headers", []) if k.lower() == b"content-length"), None)
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_bytes:
            status, body = error_from_exception(RequestTooLargeError(self.max_bytes))
            await JSONResponse(body, status_code=status, headers={"Connection": "close"})(scope, receive, send)
            return
        received = 0
        limit = self.max_bytes

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise RequestTooLargeError(limit)
            return message

        await self.app(scope, counting_receive, send)
