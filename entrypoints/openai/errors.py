"""OpenAI error objects and the exception handlers that produce them.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}``:

=====================================================  ======  =========================  ===================
cause                                                  status  type                       param
=====================================================  ======  =========================  ===================
body is not JSON, or JSON but not an object            400     invalid_request_error      null
a string holds a lone UTF-16 surrogate (not Unicode)   400     invalid_request_error      the field path
Content-Type present but not JSON                      415     invalid_request_error      null
body larger than the limit (default 32 MiB)            413     invalid_request_error      null
a field fails validation (pydantic)                    400     invalid_request_error      the field path
InvalidRequestError / SamplingParamsError              400     invalid_request_error      its ``param``
unknown model                                          404     NotFoundError              "model"
missing or wrong API key                               401     invalid_request_error      null
engine core died (the server then shuts down)          500     server_error               null
server stopping (SIGINT/SIGTERM) mid-request           503     server_error               null
anything else (traceback logged, never sent)           500     server_error               null
=====================================================  ======  =========================  ===================
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from tokenmill.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from tokenmill.errors import EngineDeadError, EngineGenerateError, InvalidRequestError, ServerShuttingDownError

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
NOT_FOUND = "NotFoundError"

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Tags pydantic inserts into an error location to say which branch of a union failed.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


class RequestTooLargeError(Exception):
    """The request body exceeds the server's limit (HTTP 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"The request body exceeds the limit of {limit} bytes.")
        self.limit = limit


class UnsupportedMediaTypeError(Exception):
    """The body is declared as something other than JSON (HTTP 415)."""


class ModelNotFoundError(Exception):
    """The request names a model this server does not serve."""

    def __init__(self, model: str, known: list[str] | None = None, what: str = "model", param: str = "model") -> None:
        message = f"The {what} `{model}` does not exist."
        if known is not None:
            message += f" Known {what}s: {', '.join(f'`{k}`' for k in known) or 'none'}."
        super().__init__(message)
        self.model = model
        self.param = param


class AuthenticationError(Exception):
    """The request lacks ``Authorization: Bearer <api key>`` or the key is wrong."""


class ContextLengthExceededError(InvalidRequestError):
    """Prompt plus requested output do not fit in the model's context (OpenAI's ``context_length_exceeded``)."""

    code = "context_length_exceeded"


def error_body(message: str, type_: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object as a dict."""
    return ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code)).model_dump()


def error_response(status: int, message: str, type_: str = INVALID_REQUEST, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def error_from_exception(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """HTTP status and OpenAI error object for ``exc`` (used for responses and for errors inside a stream).

    Unexpected exceptions get a generic message: internals never reach the client.
    """
    if isinstance(exc, InvalidRequestError):
        return 400, error_body(str(exc), INVALID_REQUEST, exc.param, getattr(exc, "code", None))
    if isinstance(exc, ModelNotFoundError):
        return 404, error_body(str(exc), NOT_FOUND, exc.param, "model_not_found")
    if isinstance(exc, RequestTooLargeError):
        return 413, error_body(str(exc), INVALID_REQUEST, code="request_too_large")
    if isinstance(exc, UnsupportedMediaTypeError):
        return 415, error_body(str(exc), INVALID_REQUEST, code="unsupported_media_type")
    if isinstance(exc, EngineDeadError):
        return 500, error_body("The inference engine stopped; the server is shutting down.", SERVER_ERROR,
                               code="engine_dead")
    if isinstance(exc, ServerShuttingDownError):
        return 503, error_body("The server is shutting down; the request was stopped before it finished.",
                               SERVER_ERROR, code="server_shutting_down")
    if isinstance(exc, EngineGenerateError):
        return 500, error_body(f"The engine failed to process the request: {exc}", SERVER_ERROR)
    return 500, error_body("Internal server error.", SERVER_ERROR)


def param_from_loc(loc: Sequence[int | str]) -> str | None:
    """OpenAI-style field path of a pydantic error location: ``("messages", 0, "role")`` -> ``messages.[0].role``.

    A leading ``"body"`` is dropped; the path stops at the first union-branch tag pydantic adds.
    """
    parts: list[str] = []
    items = list(loc)
    if items and items[0] == "body":
        items = items[1:]
    for item in items:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif _IDENTIFIER.match(item) and item not in _UNION_TAGS:
            parts.append(item)
        else:
            break
    return ".".join(parts) or None


def validation_error_response(errors: Sequence[Any]) -> JSONResponse:
    """400 for pydantic errors; the first error decides ``param`` and the message."""
    if not errors:
        return error_response(400, "Invalid request.")
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return error_response(400, f"The request body is not valid JSON: {first.get('msg', '')}")
    param = param_from_loc(loc)
    if param is None:
        return error_response(400, "The request body must be a JSON object.")
    return error_response(400, f"{param}: {first.get('msg', 'invalid value')}", param=param)


def check_json_content_type(request: Request) -> None:
    """Accept ``application/json`` (and ``*/*+json``), or no Content-Type at all.

    Raises:
        UnsupportedMediaTypeError: another media type (form data, ``text/plain``, ...). Refusing these also
            keeps browsers' cross-origin "simple" requests (which cannot send JSON) away from the API.
    """
    content_type = request.headers.get("content-type")
    if content_type is None:
        return
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise UnsupportedMediaTypeError(
            f"Unsupported Content-Type {media_type or content_type!r}: send the body as 'application/json'."
        )


async def read_json_object(request: Request) -> dict[str, Any]:
    """The request body as a JSON object.

    Raises:
        UnsupportedMediaTypeError: the Content-Type is not JSON.
        RequestTooLargeError: the body exceeds the server's limit (raised while reading).
        InvalidRequestError: the body is empty, not JSON (or nested absurdly deep), not a JSON object, or
            holds a string that is not valid Unicode (``param`` names its field).
    """
    check_json_content_type(request)
    raw = await request.body()
    if not raw.strip():
        raise InvalidRequestError("The request body is empty; expected a JSON object.", param=None)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"The request body is not valid JSON: {exc}", param=None) from exc
    except RecursionError as exc:
        raise InvalidRequestError("The request body is nested too deeply.", param=None) from exc
    if not isinstance(data, dict):
        raise InvalidRequestError(
            f"The request body must be a JSON object, got a JSON {type(data).__name__}.", param=None
        )
    path = _find_lone_surrogate(data, ())
    if path is not None:
        param = param_from_loc(path)
        raise InvalidRequestError(f"{param or 'body'}: the text holds a lone UTF-16 surrogate (not valid Unicode)",
                                  param=param)
    return data


async def parse_json_body(request: Request, model: type[M]) -> M:
    """Read the request body as a JSON object (see :func:`read_json_object`) and validate it as ``model``.

    A model with a ``check_request_fields(data)`` class method (the request models) first checks the fields
    it does not declare (see :mod:`tokenmill.entrypoints.openai.request_fields`).

    Raises:
        UnsupportedMediaTypeError, RequestTooLargeError, InvalidRequestError: see :func:`read_json_object`;
            also a field the model refuses or does not know.
        pydantic.ValidationError: a field is invalid (the handler turns it into a 400 with ``param``).
    """
    data = await read_json_object(request)
    check_fields = getattr(model, "check_request_fields", None)
    if check_fields is not None:
        data = check_fields(data)
    return model.model_validate(data)


def _find_lone_surrogate(value: Any, path: tuple[int | str, ...]) -> tuple[int | str, ...] | None:
    """Location of the first string (value or key) that cannot be encoded as UTF-8, else ``None``."""
    stack: list[tuple[Any, tuple[int | str, ...]]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not _is_unicode(item):
                return where
        elif isinstance(item, dict):
            for key, child in item.items():
                if not _is_unicode(key):
                    return where
                stack.append((child, (*where, key)))
        elif isinstance(item, list):
            stack.extend((child, (*where, i)) for i, child in enumerate(item))
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def install_exception_handlers(app: FastAPI, on_engine_dead: Callable[[], None]) -> None:
    """Register the handlers described in this module's docstring on ``app``."""

    async def on_request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc.errors())

    async def on_validation(_: Request, exc: ValidationError) -> JSONResponse:
        return validation_error_response(exc.errors(include_url=False))

    async def on_known(_: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, EngineDeadError):
            logger.error("engine core is dead: %s", exc)
            on_engine_dead()
        elif isinstance(exc, EngineGenerateError):
            logger.error("engine failed a request: %s", exc)
        status, body = error_from_exception(exc)
        return JSONResponse(body, status_code=status)

    async def on_auth(_: Request, exc: AuthenticationError) -> JSONResponse:
        return error_response(401, str(exc) or "Invalid API key.", code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})

    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "Error"
        detail = exc.detail if isinstance(exc.detail, str) else phrase
        type_ = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
        return error_response(exc.status_code, detail, type_, headers=getattr(exc, "headers", None))

    app.add_exception_handler(RequestValidationError, on_request_validation)  # type: ignore[arg-type]
    app.add_exception_handler(ValidationError, on_validation)  # type: ignore[arg-type]
    for cls in (InvalidRequestError, ModelNotFoundError, EngineDeadError, EngineGenerateError, RequestTooLargeError,
                UnsupportedMediaTypeError, ServerShuttingDownError):
        app.add_exception_handler(cls, on_known)
    app.add_exception_handler(AuthenticationError, on_auth)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http)  # type: ignore[arg-type]
    app.add_middleware(InternalErrorMiddleware)


class InternalErrorMiddleware:
    """Turns an unexpected exception into a 500 OpenAI error with a logged traceback.

    Pure ASGI (not ``BaseHTTPMiddleware``) so streaming responses and disconnect detection are untouched.
    An exception after the response started can only be logged; the connection is then closed.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as exc:
            logger.exception("unexpected error while handling %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            status, body = error_from_exception(exc)
            await JSONResponse(body, status_code=status)(scope, receive, send)
