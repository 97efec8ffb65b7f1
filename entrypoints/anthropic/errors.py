"""Anthropic's error shape on the Messages routes.

The server's handlers produce OpenAI error objects; :class:`AnthropicErrorMiddleware` rewrites every JSON
error leaving a route under ``/v1/messages`` (validation, refused fields, unknown model, auth, body too large,
engine failures, unknown paths) into ``{"type": "error", "error": {"type": ..., "message": ...}}``, so the error
policy stays in one place. Types by status, as Anthropic documents them:

======  ==========================  =====================================================================
status  type                        here
======  ==========================  =====================================================================
400     invalid_request_error       bad or refused field, unsupported block type, template failure, ...
401     authentication_error        missing or wrong ``x-api-key`` / ``Authorization: Bearer``
403     permission_error
404     not_found_error             unknown model or path
413     request_too_large           body over ``--max-request-body-bytes``
429     rate_limit_error
500     api_error                   engine failure, unexpected error
529     overloaded_error            the server is shutting down (OpenAI routes answer 503 there)
======  ==========================  =====================================================================

Other 4xx statuses (415 for a non-JSON body) keep their status with ``invalid_request_error``.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MESSAGES_PATH = "/v1/messages"
OVERLOADED_STATUS = 529
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    OVERLOADED_STATUS: "overloaded_error",
}


def anthropic_status(status: int) -> int:
    """The status Anthropic uses for ours: 503 (shutting down, engine not running) is 529 ``overloaded``."""
    return OVERLOADED_STATUS if status == 503 else status


def anthropic_error_body(openai_error: dict[str, Any] | str, status: int) -> dict[str, Any]:
    """``{"error": {"type", "message"}}`` (Anthropic's members, to be put after ``"type": "error"``) for an
    OpenAI ``error`` member (or a bare message) with HTTP ``status``."""
    message = openai_error if isinstance(openai_error, str) else str(openai_error.get("message") or "Error.")
    status = anthropic_status(status)
    type_ = _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"error": {"type": type_, "message": message}}


def anthropic_error_json(openai_body: bytes, status: int) -> bytes | None:
    """The Anthropic error document for an OpenAI error response body, or ``None`` when it is not one."""
    try:
        body = json.loads(openai_body)
    except ValueError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return None
    return json.dumps({"type": "error", **anthropic_error_body(body["error"], status)}).encode("utf-8")


class AnthropicErrorMiddleware:
    """Rewrites JSON error responses of ``/v1/messages...`` into Anthropic's shape (see the module docstring).

    Pure ASGI: successful responses and streams pass through untouched; only an error response's body (small,
    JSON) is buffered.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body = bytearray()

        async def rewriting_send(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                is_json = headers.get(b"content-type", b"").startswith(b"application/json")
                if message["status"] >= 400 and is_json:
                    start = message  # held until the whole body is here
                    return
            elif message["type"] == "http.response.body" and start is not None:
                body.extend(message.get("body", b""))
                if message.get("more_body", False):
                    return
                status = int(start["status"])
                rewritten = anthropic_error_json(bytes(body), status)
                payload = rewritten if rewritten is not None else bytes(body)
                new_status = anthropic_status(status) if rewritten is not None else status
                headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                headers.append((b"content-length", str(len(payload)).encode("ascii")))
                await send({**start, "status": new_status, "headers": headers})
                await send({"type": "http.response.body", "body": payload})
                return
            await send(message)

        await self.app(scope, receive, rewriting_send)
