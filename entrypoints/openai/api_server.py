"""The OpenAI-compatible HTTP app: FastAPI routes over an ``AsyncLLM`` (see docs/serving.md).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``, ``GET /v1/models``,
``GET /v1/models/{model}``, ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic's Messages
API over the chat path, see :mod:`tokenmill.entrypoints.anthropic`), ``POST /v1/load_lora_adapter``,
``POST /v1/unload_lora_adapter`` (docs/lora.md), ``POST /tokenize``, ``POST /detokenize``, the pooling routes
(``/v1/embeddings``, ``/classify``, ``/score``, ``/rerank``; docs/pooling.md), ``GET /health`` (200, or 503 once
the engine is dead), ``GET /version``, ``GET /metrics`` (Prometheus). With an API key (``--api-key`` or
``TOKENMILL_API_KEY``) the ``/v1`` routes and ``/tokenize`` / ``/detokenize`` need
``Authorization: Bearer <key>`` (the Messages routes also take ``x-api-key: <key>``); ``/health``, ``/version``
and ``/metrics`` stay open for probes and scrapers.
Running the app (uvicorn, signals, engine death) is :mod:`tokenmill.entrypoints.openai.launcher`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import os
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import PlainTextResponse, Response
from tokenmill import __version__
from tokenmill.entrypoints.anthropic.api_router import REQUEST_MODELS as ANTHROPIC_REQUEST_MODELS
from tokenmill.entrypoints.anthropic.api_router import add_messages_routes
from tokenmill.entrypoints.openai.chat_template import ChatRenderer, load_chat_template
from tokenmill.entrypoints.openai.errors import (
    SERVER_ERROR,
    AuthenticationError,
    error_response,
    install_exception_handlers,
    parse_json_body,
    read_json_object,
)
from tokenmill.entrypoints.openai.middleware import (
    DEFAULT_MAX_BODY_BYTES,
    BodySizeLimitMiddleware,
    REQUEST_ID_HEADER,
    RequestIdMiddleware,
)
from tokenmill.entrypoints.openai.openapi import ERROR_RESPONSES, install_openapi, json_body
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from tokenmill.entrypoints.openai.protocol_lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from tokenmill.entrypoints.openai.protocol_responses import ResponsesRequest, ResponsesResponse
from tokenmill.entrypoints.openai.reasoning import resolve_reasoning_parser
from tokenmill.entrypoints.openai.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from tokenmill.entrypoints.openai.pooling_routes import POOLING_REQUEST_MODELS, pooling_router
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenmill.entrypoints.openai.serving_engine import EngineClient, ServingContext, Tokenization
from tokenmill.entrypoints.openai.serving_models import OpenAIServingModels
from tokenmill.entrypoints.openai.serving_responses import OpenAIServingResponses
from tokenmill.entrypoints.openai.serving_tokenization import OpenAIServingTokenization, parse_tokenize_request
from tokenmill.entrypoints.openai.tool_choice import resolve_tool_parser
from tokenmill.errors import EngineDeadError
from tokenmill.metrics.prometheus import CONTENT_TYPE, PrometheusStatLogger
from tokenmill.metrics.stats import RequestStatsTracker

logger = logging.getLogger(__name__)

API_KEY_ENV = "TOKENMILL_API_KEY"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# /metrics asks an idle engine core for fresh gauges; it never waits longer than this (seconds).
_METRICS_REFRESH_TIMEOUT_S = 1.0
_STREAM_DOC = {"text/event-stream": {"schema": {"type": "string"}, "description": "with `stream: true`"}}


class ServerState:
    """Whether the engine is dead, and who to tell when it dies (the launcher stops uvicorn)."""

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


def _api_key_dependency(api_key: str | None, x_api_key: bool = False) -> Callable[[Request], None]:
    """Checks ``Authorization: Bearer <key>`` (also Anthropic's ``x-api-key: <key>`` header when
    ``x_api_key``)."""
    expected = api_key.encode("utf-8") if api_key else None

    def require_api_key(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("x-api-key") if x_api_key else None
        if given is not None and hmac.compare_digest(given.strip().encode("utf-8"), expected):
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("utf-8"), expected):
            raise AuthenticationError("Invalid or missing API key. Send the header 'Authorization: Bearer <key>'"
                                      + (" or 'x-api-key: <key>'." if x_api_key else "."))

    return require_api_key


def _split_list(value: str | list[str] | None, default: list[str]) -> list[str]:
    """A CLI list value: a list, a JSON list (``'["a", "b"]'``) or comma-separated text."""
    if value is None:
        return default
    if isinstance(value, list):
        return value
    text = value.strip()
    if text.startswith("["):
        import json

        return [str(v) for v in json.loads(text)]
    return [v.strip() for v in text.split(",") if v.strip()]


def _add_cors(app: FastAPI, args: argparse.Namespace) -> None:
    origins = _split_list(getattr(args, "allowed_origins", None), [])
    if not origins:
        return
    app.add_middleware(
        CORSMiddleware,
        allow_origins=origins,
        allow_credentials=bool(getattr(args, "allow_credentials", False)),
        allow_methods=_split_list(getattr(args, "allowed_methods", None), ["*"]),
        allow_headers=_split_list(getattr(args, "allowed_headers", None), ["*"]),
        expose_headers=[REQUEST_ID_HEADER],
    )


def build_app(engine: EngineClient, args: argparse.Namespace) -> FastAPI:
    """The FastAPI app serving ``engine``.

    Args:
        engine: an ``AsyncLLM`` (or anything with the same interface).
        args: parsed CLI arguments; read (missing ones take their defaults): ``api_key`` (else
            ``$TOKENMILL_API_KEY``), ``chat_template`` (file or inline template), ``allowed_origins``,
            ``allowed_methods``, ``allowed_headers``, ``allow_credentials`` (CORS; off without origins),
            ``max_request_body_bytes``, ``return_tokens_as_token_ids``, ``enable_auto_tool_choice``,
            ``tool_call_parser`` and ``reasoning_parser``.

    Raises:
        FileNotFoundError: ``chat_template`` is neither a file nor a template.
        ValueError: ``enable_auto_tool_choice`` without a known ``tool_call_parser``; an unknown
            ``reasoning_parser``.
    """
    model_config = engine.model_config
    served_name = getattr(model_config, "served_model_name", None) or str(getattr(model_config, "model", "model"))
    lora_enabled = getattr(getattr(engine, "engine_config", None), "lora_config", None) is not None
    models = OpenAIServingModels([served_name], getattr(model_config, "model", None),
                                 int(model_config.max_model_len), lora_enabled=lora_enabled)
    state = ServerState()
    tokenization = Tokenization(engine.tokenizer)
    renderer = ChatRenderer(engine.tokenizer, load_chat_template(getattr(args, "chat_template", None)))
    stat_logger = PrometheusStatLogger(served_name, num_engines=int(getattr(engine, "num_engines", 1) or 1))
    stats = RequestStatsTracker([stat_logger])
    add_listener = getattr(engine, "add_stats_listener", None)
    if add_listener is not None:
        add_listener(stats.on_engine_outputs)
    context = ServingContext(
        engine, models, tokenization, renderer, state.mark_engine_dead, stats,
        tool_parser_cls=resolve_tool_parser(args), reasoning_parser_cls=resolve_reasoning_parser(args),
        return_tokens_as_token_ids=bool(getattr(args, "return_tokens_as_token_ids", False)),
    )
    serving_chat = OpenAIServingChat(context)
    serving_completion = OpenAIServingCompletion(context)
    serving_responses = OpenAIServingResponses(context)
    serving_tokenization = OpenAIServingTokenization(context)
    api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        tokenization.shutdown()

    app = FastAPI(title="tokenmill OpenAI-compatible API", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.server_state = state
    app.state.models = models
    app.state.stats = stats
    app.state.stat_logger = stat_logger
    # The handlers, also used without HTTP (tokenmill run-batch).
    app.state.tokenization = tokenization
    app.state.serving_chat = serving_chat
    app.state.serving_completion = serving_completion
    install_exception_handlers(app, state.mark_engine_dead)
    app.add_middleware(BodySizeLimitMiddleware,
                       max_bytes=int(getattr(args, "max_request_body_bytes", None) or DEFAULT_MAX_BODY_BYTES))
    _add_cors(app, args)
    app.add_middleware(RequestIdMiddleware)

    auth = [Depends(_api_key_dependency(api_key))]
    v1 = APIRouter(prefix="/v1", dependencies=auth, responses=ERROR_RESPONSES)

    @v1.post("/chat/completions", openapi_extra=json_body(ChatCompletionRequest),
             responses={200: {"model": ChatCompletionResponse, "content": _STREAM_DOC}})
    async def create_chat_completion(raw_request: Request) -> Response:
        request = await parse_json_body(raw_request, ChatCompletionRequest)
        return await serving_chat.create_chat_completion(request, raw_request)

    @v1.post("/completions", openapi_extra=json_body(CompletionRequest),
             responses={200: {"model": CompletionResponse, "content": _STREAM_DOC}})
    async def create_completion(raw_request: Request) -> Response:
        request = await parse_json_body(raw_request, CompletionRequest)
        return await serving_completion.create_completion(request, raw_request)

    @v1.post("/responses", openapi_extra=json_body(ResponsesRequest),
             responses={200: {"model": ResponsesResponse, "content": _STREAM_DOC}})
    async def create_response(raw_request: Request) -> Response:
        request = await parse_json_body(raw_request, ResponsesRequest)
        return await serving_responses.create_response(request, raw_request)

    @v1.get("/models", response_model=ModelList)
    async def list_models() -> Response:
        return Response(models.list_models().model_dump_json(), media_type="application/json")

    @v1.get("/models/{model:path}", response_model=ModelCard)
    async def retrieve_model(model: str) -> Response:
        return Response(models.card(model).model_dump_json(), media_type="application/json")

    @v1.post("/load_lora_adapter", openapi_extra=json_body(LoadLoRAAdapterRequest))
    async def load_lora_adapter(raw_request: Request) -> Response:
        """Load a PEFT adapter under ``lora_name`` (vLLM's route and body); requests then use it as ``model``."""
        body = await parse_json_body(raw_request, LoadLoRAAdapterRequest)
        return PlainTextResponse(await models.load_lora_adapter(engine, body.lora_name, body.lora_path))

    @v1.post("/unload_lora_adapter", openapi_extra=json_body(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(raw_request: Request) -> Response:
        """Unload the adapter ``lora_name`` (404 when none of that name is loaded)."""
        body = await parse_json_body(raw_request, UnloadLoRAAdapterRequest)
        return PlainTextResponse(await models.unload_lora_adapter(engine, body.lora_name))

    app.include_router(v1)
    tok = APIRouter(dependencies=auth, responses=ERROR_RESPONSES)

    @tok.post("/tokenize", openapi_extra=json_body(TokenizeCompletionRequest, TokenizeChatRequest),
              response_model=TokenizeResponse)
    async def tokenize(raw_request: Request) -> Response:
        request = parse_tokenize_request(await read_json_object(raw_request))
        result = await serving_tokenization.tokenize(request)
        return Response(result.model_dump_json(), media_type="application/json")

    @tok.post("/detokenize", openapi_extra=json_body(DetokenizeRequest), response_model=DetokenizeResponse)
    async def detokenize(raw_request: Request) -> Response:
        request = await parse_json_body(raw_request, DetokenizeRequest)
        result = await serving_tokenization.detokenize(request)
        return Response(result.model_dump_json(), media_type="application/json")

    app.include_router(tok)
    app.include_router(pooling_router(context, auth))
    add_messages_routes(app, serving_chat, _api_key_dependency(api_key, x_api_key=True))

    @app.get("/health", responses={503: {"model": ERROR_RESPONSES[500]["model"],
                                         "description": "The engine is dead"}})
    async def health() -> Response:
        """200 while the engine runs; 503 once it is dead (the server then exits)."""
        if state.engine_dead or engine.errored:
            state.mark_engine_dead()
            return error_response(503, "The inference engine is not running.", SERVER_ERROR, code="engine_dead")
        try:
            await engine.check_health()
        except EngineDeadError:
            state.mark_engine_dead()
            return error_response(503, "The inference engine is not running.", SERVER_ERROR, code="engine_dead")
        return Response(status_code=200)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> Response:
        return Response(VersionResponse(version=__version__).model_dump_json(), media_type="application/json")

    @app.get("/metrics", responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}},
                                          "description": "Prometheus text format"}})
    async def metrics() -> Response:
        """Prometheus metrics; gauges are refreshed from the engine core first (at most 1 s)."""
        refresh = getattr(engine, "refresh_stats", None)
        if refresh is not None and not state.engine_dead and not engine.errored:
            with contextlib.suppress(asyncio.TimeoutError, EngineDeadError):
                await asyncio.wait_for(refresh(), timeout=_METRICS_REFRESH_TIMEOUT_S)
        return Response(stat_logger.render(), media_type=CONTENT_TYPE)

    install_openapi(app, [ChatCompletionRequest, CompletionRequest, ResponsesRequest, TokenizeCompletionRequest,
                          TokenizeChatRequest, DetokenizeRequest, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest,
                          *POOLING_REQUEST_MODELS, *ANTHROPIC_REQUEST_MODELS])
    return app
