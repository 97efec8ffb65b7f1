"""User-facing results of generation: RequestOutput, CompletionOutput, Logprob (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
