"""``POST /score`` and ``POST /rerank`` (also ``/v1/rerank`` and ``/v2/rerank``), vLLM's shapes.

A cross-encoder (a classifier with one label, e.g. a BGE or Qwen3 reranker) reads each (query, document)
pair as one input, the tokenizer's own pair encoding, and scores it with the sigmoid of its logit. An
embedding model (bi-encoder) embeds each distinct text once and scores a pair with the cosine similarity of
the two embeddings.
"""

from __future__ import annotations

from tokenmill.entrypoints.openai.protocol import UsageInfo
from tokenmill.entrypoints.openai.protocol_pooling import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from tokenmill.entrypoints.openai.serving_pooling import MAX_INPUTS_PER_REQUEST, OpenAIServingPooling
from tokenmill.entrypoints.score_utils import cosine, make_pairs, pair_token_ids
from tokenmill.errors import InvalidRequestError
from tokenmill.pooling_params import PoolingParams


class OpenAIServingScores(OpenAIServingPooling):
    """Handles ``/score`` and the rerank routes."""

    async def create_score(self, request: ScoreRequest) -> ScoreResponse:
        """Raises ModelNotFoundError, or InvalidRequestError (a model that neither classifies nor embeds,
        mismatched ``text_1`` / ``text_2``, too long a pair without ``truncate_prompt_tokens``, ...)."""
        model_name = self.models.resolve(request.model)
        self.check_priority(request.priority)
        pairs = make_pairs(request.text_1, request.text_2)
        scores, num_tokens = await self._score_pairs(pairs, request.truncate_prompt_tokens, model_name,
                                                     request.priority, "text_2")
        return ScoreResponse(model=model_name, data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens))

    async def create_rerank(self, request: RerankRequest) -> RerankResponse:
        """Scores every document against the query; results sorted by ``relevance_score``, highest first,
        cut to ``top_n`` (0 or absent: all). Raises as :meth:`create_score`."""
        model_name = self.models.resolve(request.model)
        self.check_priority(request.priority)
        pairs = make_pairs(request.query, request.documents, "query", "documents")
        scores, num_tokens = await self._score_pairs(pairs, request.truncate_prompt_tokens, model_name,
                                                     request.priority, "documents")
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if request.top_n:
            order = order[: request.top_n]
        results = [
            RerankResult(index=i, relevance_score=scores[i],
                         document=RerankDocument(text=request.documents[i]) if request.return_documents else None)
            for i in order
        ]
        return RerankResponse(model=model_name, usage=RerankUsage(total_tokens=num_tokens), results=results)

    async def _score_pairs(self, pairs: list[tuple[str, str]], truncate: int | None, model_name: str,
                           priority: int, param: str) -> tuple[list[float], int]:
        """The scores of ``pairs`` and the prompt tokens read."""
        if len(pairs) > MAX_INPUTS_PER_REQUEST:
            raise InvalidRequestError(f"{param}: at most {MAX_INPUTS_PER_REQUEST} pairs per request, got "
                                      f"{len(pairs)}", param=param)
        if self.runner_type == "pooling" and self.convert == "classify":
            self.check_task("score")
            token_lists = await self.tokenization.run(
                lambda: [pair_token_ids(self.tokenization.tokenizer, a, b) for a, b in pairs])
            for ids in token_lists:
                self.check_token_ids(ids, param)
            outputs = await self.encode_all(token_lists, PoolingParams(task="score", truncate_prompt_tokens=truncate),
                                            model_name=model_name, priority=priority, param=param)
            return ([float(o.outputs.data.reshape(-1)[0]) for o in outputs],
                    sum(len(o.prompt_token_ids) for o in outputs))
        self.check_task("embed")
        texts = sorted({t for pair in pairs for t in pair})
        token_lists = await self.tokenize_all(texts, True, param)
        outputs = await self.encode_all(token_lists, PoolingParams(task="embed", truncate_prompt_tokens=truncate),
                                        model_name=model_name, priority=priority, param=param)
        by_text = {t: o for t, o in zip(texts, outputs)}
        scores = [cosine(by_text[a].outputs.data, by_text[b].outputs.data) for a, b in pairs]
        return scores, sum(len(by_text[a].prompt_token_ids) + len(by_text[b].prompt_token_ids) for a, b in pairs)
