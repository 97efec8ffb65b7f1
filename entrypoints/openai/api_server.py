"""The OpenAI-compatible HTTP server: FastAPI routes over an ``AsyncLLM``, served by uvicorn.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /v1/models/{model}``, ``GET /health`` (200, or 503 once the engine is dead), ``GET /version``.
With an API key (``--api-key`` or ``TOKENMILL_API_KEY``) every ``/v1`` route needs
``Authorization: Bearer <key>``; ``/health`` and ``/version`` stay open for probes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import os
import re
import signal
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from tokenmill import __version__
from tokenmill.entrypoints.openai.errors import (
    SERVER_ERROR,
    AuthenticationError,
    error_response,
    install_exception_handlers,
    parse_json_body,
)
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
)
from tokenmill.entrypoints.openai.serving_chat import (
    OpenAIServingChat,
    load_chat_template,
)
from tokenmill.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenmill.entrypoints.openai.serving_engine import EngineClient, Tokenization
from tokenmill.entrypoints.openai.serving_models import OpenAIServingModels
from tokenmill.errors import EngineDeadError

logger = logging.getLogger(__name__)

API_KEY_ENV = "TOKENMILL_API_KEY"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
REQUEST_ID_HEADER = "X-Request-Id"
_ENGINE_WATCH_INTERVAL_S = 1.0
_GRACEFUL_SHUTDOWN_S = 5
_REQUEST_ID_RE = re.compile(r"^[\x21-\x7e]{1,256}$")


class ServerState:
    """Whether the engine is dead, and who to tell when it dies (``run_server`` stops uvicorn)."""

    def __init__(self) -> None:
        self.engine_dead = False
        self._listeners: list[Callable[[], None]] = []

    def add_engine_dead_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def mark_engine_dead(self) -> None:
        if self.engine_dead:
            return
        self.engine_dead = True
        logger.error("the engine core is dead; the server is shutting down")
        for listener in self._listeners:
            listener()


class RequestIdMiddleware:
    """Echo ``X-Request-Id`` (the client's when it sent a sane one, else a new one) on every response.

    The id is also available to handlers as ``request.state.request_id``.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope.get("headers", [])
                      if k.lower() == b"x-request-id"), None)
        request_id = given if given is not None and _REQUEST_ID_RE.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _api_key_dependency(api_key: str | None) -> Callable[[Request], None]:
    expected = api_key.encode("utf-8") if api_key else None

    def require_api_key(request: Request) -> None:
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8"), expected):
            raise AuthenticationError("Invalid or missing API key. Send the header 'Authorization: Bearer <key>'.")

    return require_api_key


def build_app(engine: EngineClient, args: argparse.Namespace) -> FastAPI:
    """The FastAPI app serving ``engine``.

    Args:
        engine: an ``AsyncLLM`` (or anything with the same interface).
        args: parsed CLI arguments; read: ``api_key`` (else ``$TOKENMILL_API_KEY``), ``chat_template``
            (file or inline template). Missing attributes take their defaults.

    Raises:
        FileNotFoundError: ``chat_template`` is neither a file nor a template.
    """
    model_config = engine.model_config
    served_name = getattr(model_config, "served_model_name", None) or str(getattr(model_config, "model", "model"))
    models = OpenAIServingModels([served_name], getattr(model_config, "model", None),
                                 int(model_config.max_model_len))
    state = ServerState()
    tokenization = Tokenization(engine.tokenizer)
    chat_template = load_chat_template(getattr(args, "chat_template", None))
    serving_chat = OpenAIServingChat(engine, models, tokenization, state.mark_engine_dead, chat_template)
    serving_completion = OpenAIServingCompletion(engine, models, tokenization, state.mark_engine_dead)
    api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        tokenization.shutdown()

    app = FastAPI(title="tokenmill OpenAI-compatible API", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.server_state = state
    app.state.models = models
    install_exception_handlers(app, state.mark_engine_dead)
    app.add_middleware(RequestIdMiddleware)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_dependency(api_key))])

    @v1.post("/chat/completions")
    async def create_chat_completion(raw_request: Request) -> Response:
        request = await parse_json_body(raw_request, ChatCompletionRequest)
        return await serving_chat.create_chat_completion(request, raw_request)

    @v1.post("/completions")
    async def create_completion(raw_request: Request) -> Response:
        request = await parse_json_body(raw_request, CompletionRequest)
        return await serving_completion.create_completion(request, raw_request)

    @v1.get("/models")
    async def list_models() -> Response:
        return Response(models.list_models().model_dump_json(), media_type="application/json")

    @v1.get("/models/{model:path}")
    async def retrieve_model(model: str) -> Response:
        return Response(models.card(model).model_dump_json(), media_type="application/json")

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if state.engine_dead or engine.errored:
            state.mark_engine_dead()
            return error_response(503, "The inference engine is not running.", SERVER_ERROR)
        try:
            await engine.check_health()
        except EngineDeadError:
            state.mark_engine_dead()
            return error_response(503, "The inference engine is not running.", SERVER_ERROR)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    return app


# --------------------------------------------------------------------------------------------- running


class _SignalState:
    """SIGINT/SIGTERM during startup interrupt it. Once a uvicorn server is set, uvicorn handles them while it
    serves (draining connections) and re-raises them when it stops; they must then only stop the server,
    never kill the process before the engine core is shut down."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.server: Any = None

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        if self.server is None:
            raise KeyboardInterrupt(f"signal {signum}")
        self.server.should_exit = True


def _bind(host: str, port: int) -> socket.socket:
    """Bind the listening socket before the (slow) engine start, so a busy port fails fast.

    Raises:
        OSError: the address is in use or not available.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind(address)
    sock.set_inheritable(False)
    return sock


def run_server(args: argparse.Namespace) -> int:
    """Start the engine and serve the API until SIGINT/SIGTERM or engine death.

    The server listens on ``args.host:args.port``, by default ``127.0.0.1:8000``: unlike vLLM (which binds
    ``0.0.0.0``) tokenmill only accepts local connections unless ``--host 0.0.0.0`` is given, so a model is
    never exposed to the network by accident.

    Returns:
        The process exit code: 0 after a requested shutdown, 1 when the engine core died.

    Raises:
        OSError: the address cannot be bound.
        FileNotFoundError: the model or ``--chat-template`` does not exist.
    """
    import uvicorn
    from tokenmill.engine_args import EngineArgs

    signals = _SignalState()
    previous = {sig: signal.signal(sig, signals.handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        load_chat_template(getattr(args, "chat_template", None))
        host = getattr(args, "host", None) or DEFAULT_HOST
        port = DEFAULT_PORT if getattr(args, "port", None) is None else int(args.port)
        sock = _bind(host, port)
        try:
            engine_args = EngineArgs.from_cli_args(args)
            return asyncio.run(_serve(args, engine_args, sock, signals, uvicorn))
        except KeyboardInterrupt:
            logger.info("interrupted (signal %s); stopped", signals.received)
            return 0
        finally:
            sock.close()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def _serve(args: argparse.Namespace, engine_args: Any, sock: socket.socket, signals: _SignalState,
                 uvicorn: Any) -> int:
    from tokenmill.engine.async_llm import AsyncLLM

    host, port = sock.getsockname()[:2]
    logger.info("starting the engine (model: %s)", engine_args.model or "embedded default")
    engine = AsyncLLM.from_engine_args(engine_args)
    watcher: asyncio.Task[None] | None = None
    try:
        app = build_app(engine, args)
        state: ServerState = app.state.server_state
        config = uvicorn.Config(
            app,
            log_level=getattr(args, "uvicorn_log_level", None) or "info",
            timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
            timeout_keep_alive=5,
        )
        server = uvicorn.Server(config)

        def stop_serving() -> None:
            server.should_exit = True

        state.add_engine_dead_listener(stop_serving)
        watcher = asyncio.ensure_future(_watch(engine, server, state, f"http://{_url_host(host)}:{port}"))
        signals.server = server
        await server.serve(sockets=[sock])
        return 1 if state.engine_dead else 0
    finally:
        if watcher is not None:
            watcher.cancel()
        logger.info("shutting down the engine")
        engine.shutdown()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def _watch(engine: EngineClient, server: Any, state: ServerState, url: str) -> None:
    """Log readiness once uvicorn serves; stop the server when the engine dies with no request in flight."""
    announced = False
    while True:
        await asyncio.sleep(0.1 if not announced else _ENGINE_WATCH_INTERVAL_S)
        if not announced and server.started:
            announced = True
            logger.info("Uvicorn running on %s (Press CTRL+C to quit)", url)
            logger.info("tokenmill API server ready")
        if engine.errored:
            state.mark_engine_dead()
            return
