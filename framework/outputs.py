"""User-facing results: RequestOutput, CompletionOutput, Logprob, and the pooling outputs (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """Log-probability of one token.

    Attributes:
        logprob: natural log of the token's probability under the model's raw distribution.
        rank: 1-based rank of the token in that distribution.
        decoded_token: its text, when detokenized.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing predicts it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        index: position among the request's ``n`` outputs.
        text: generated text so far (without a matched stop string unless asked).
        token_ids: generated token ids so far.
        cumulative_logprob: sum of the sampled tokens' logprobs when logprobs were requested.
        logprobs: per generated token, a map token id -> Logprob (``None`` unless requested).
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``None`` while running.
        stop_reason: the stop string or stop token id that ended it, ``None`` for EOS / length.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps of one request, in seconds (``time.time()``)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request, returned by ``LLM.generate`` and streamed by ``AsyncLLM.generate``.

    Attributes:
        request_id: the request's id.
        prompt: the prompt text when the request had one.
        prompt_token_ids: the tokenized prompt.
        outputs: one CompletionOutput per requested sequence (``n``).
        finished: all outputs finished.
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: timestamps.
        prompt_logprobs: per prompt token, a map token id -> Logprob for the actual token and the top
            ``prompt_logprobs`` candidates (``None`` for the first token, and unless requested).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class PoolingOutput:
    """The pooler's output for one prompt.

    Attributes:
        data: float32 tensor: ``[d]`` (an embedding, or class probabilities), ``[n, d]`` per token (ALL).
    """

    data: Any


@dataclass
class PoolingRequestOutput:
    """The result of one pooling request, returned by ``LLM.encode`` (vLLM's name).

    Attributes:
        request_id: the request's id.
        outputs: the pooled output.
        prompt_token_ids: the tokenized prompt (after truncation, if any).
        finished: always true once returned (a pooling request has one output).
        prompt: the prompt text when the request had one.
    """

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None


@dataclass
class EmbeddingOutput:
    """An embedding. Attributes: embedding: its values (``dimensions`` or the hidden size floats)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """The result of ``LLM.embed`` for one prompt (vLLM's name)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        data = output.outputs.data
        if data.dim() != 1:
            raise ValueError(f"an embedding is one vector, got shape {tuple(data.shape)}")
        return cls(output.request_id, EmbeddingOutput(data.tolist()), output.prompt_token_ids, output.finished)


@dataclass
class ClassificationOutput:
    """Class probabilities (logits with ``activation=False``). Attributes: probs: one float per label."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """The result of ``LLM.classify`` for one prompt (vLLM's name)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(output.request_id, ClassificationOutput(output.outputs.data.tolist()), output.prompt_token_ids,
                   output.finished)


@dataclass
class ScoringOutput:
    """The relevance score of a text pair. Attributes: score: a cross-encoder's probability (the sigmoid of its
    one logit) or the cosine similarity of two embeddings."""

    score: float


@dataclass
class ScoringRequestOutput:
    """The result of ``LLM.score`` for one pair (vLLM's name)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
