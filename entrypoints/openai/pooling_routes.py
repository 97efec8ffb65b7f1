"""The pooling routes of the HTTP app: ``POST /v1/embeddings``, ``POST /classify``, ``POST /score`` (also
``/v1/score``), ``POST /rerank``, ``/v1/rerank`` and ``/v2/rerank`` (docs/pooling.md). On a model served with
the generation runner they answer a 400 naming the runner."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from tokenmill.entrypoints.openai.errors import parse_json_body, read_json_object
from tokenmill.entrypoints.openai.openapi import ERROR_RESPONSES, json_body
from tokenmill.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingChatRequest,
    EmbeddingCompletionRequest,
    EmbeddingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    parse_embedding_request,
)
from tokenmill.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from tokenmill.entrypoints.openai.serving_engine import ServingContext
from tokenmill.entrypoints.openai.serving_score import OpenAIServingScores

POOLING_REQUEST_MODELS: list[type[BaseModel]] = [EmbeddingCompletionRequest, EmbeddingChatRequest,
                                                 ClassificationRequest, ScoreRequest, RerankRequest]


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def pooling_router(context: ServingContext, dependencies: list[Any]) -> APIRouter:
    """The router of the pooling routes.

    Args:
        context: what every handler of the app shares.
        dependencies: route dependencies (the API-key check).
    """
    embedding = OpenAIServingEmbedding(context)
    scores = OpenAIServingScores(context)
    router = APIRouter(dependencies=dependencies, responses=ERROR_RESPONSES)

    @router.post("/v1/embeddings", openapi_extra=json_body(EmbeddingCompletionRequest, EmbeddingChatRequest),
                 response_model=EmbeddingResponse)
    async def create_embedding(raw_request: Request) -> Response:
        request = parse_embedding_request(await read_json_object(raw_request))
        return _json(await embedding.create_embedding(request))

    @router.post("/classify", openapi_extra=json_body(ClassificationRequest), response_model=ClassificationResponse)
    async def create_classification(raw_request: Request) -> Response:
        return _json(await embedding.create_classification(await parse_json_body(raw_request, ClassificationRequest)))

    async def create_score(raw_request: Request) -> Response:
        return _json(await scores.create_score(await parse_json_body(raw_request, ScoreRequest)))

    async def create_rerank(raw_request: Request) -> Response:
        return _json(await scores.create_rerank(await parse_json_body(raw_request, RerankRequest)))

    for path in ("/score", "/v1/score"):
        router.add_api_route(path, create_score, methods=["POST"], openapi_extra=json_body(ScoreRequest),
                             response_model=ScoreResponse)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        router.add_api_route(path, create_rerank, methods=["POST"], openapi_extra=json_body(RerankRequest),
                             response_model=RerankResponse)
    return router
