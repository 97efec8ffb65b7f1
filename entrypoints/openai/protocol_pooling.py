"""Pydantic models of the pooling routes: ``/v1/embeddings`` (OpenAI's shape, plus vLLM's chat-style
``messages`` input), ``/classify``, ``/score`` and ``/rerank`` (vLLM's shapes; ``/rerank`` follows the
Jina / Cohere rerank API)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tokenmill.entrypoints.openai.protocol import (
    OpenAIBaseModel,
    RequestModel,
    UsageInfo,
    _ChatTemplateFields,
    now_s,
    random_id,
)
from tokenmill.pooling_params import PoolingParams

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class _PoolingFields(RequestModel):
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class EmbeddingCompletionRequest(_PoolingFields):
    """``POST /v1/embeddings`` with ``input``: a string, strings, token ids, or lists of token ids."""

    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None
    add_special_tokens: bool = True

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(task="embed", dimensions=self.dimensions, normalize=self.normalize,
                             truncate_prompt_tokens=self.truncate_prompt_tokens)


class EmbeddingChatRequest(_ChatTemplateFields, _PoolingFields):
    """``POST /v1/embeddings`` with chat ``messages`` rendered by the model's chat template (vLLM's extension)."""

    add_generation_prompt: bool = False
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(task="embed", dimensions=self.dimensions, normalize=self.normalize,
                             truncate_prompt_tokens=self.truncate_prompt_tokens)


class EmbeddingData(OpenAIBaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64 of little-endian float32 with encoding_format="base64"


class EmbeddingResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now_s)
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class ClassificationRequest(_PoolingFields):
    """``POST /classify``: ``input`` is a string, strings, or token-id lists."""

    input: EmbeddingInput
    activation: bool | None = None
    add_special_tokens: bool = True

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(task="classify", activation=self.activation,
                             truncate_prompt_tokens=self.truncate_prompt_tokens)


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("classify"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now_s)
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class ScoreRequest(_PoolingFields):
    """``POST /score``: ``text_1`` (one text or N) against ``text_2`` (N texts): 1:1, 1:N or N:N pairs."""

    text_1: str | list[str]
    text_2: str | list[str]


class ScoreData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now_s)
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankRequest(_PoolingFields):
    """``POST /rerank`` (and ``/v1/rerank``, ``/v2/rerank``): the Jina / Cohere rerank request."""

    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("rerank"))
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def parse_embedding_request(data: dict[str, Any]) -> EmbeddingCompletionRequest | EmbeddingChatRequest:
    """The request model for a ``/v1/embeddings`` body: chat when it has ``messages``, else ``input``.

    Raises:
        pydantic.ValidationError: a field is invalid or missing.
        InvalidRequestError: a field the request model does not accept.
    """
    model = EmbeddingChatRequest if "messages" in data else EmbeddingCompletionRequest
    return model.model_validate(model.check_request_fields(data))
