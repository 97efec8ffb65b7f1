"""Messages between the front end (LLMEngine / AsyncLLM) and the EngineCore.

They are msgspec structs so they cross the ZMQ hop as msgpack frames without a copy of Python objects;
the in-process engine passes the same objects directly.
"""

from __future__ import annotations

import enum

import msgspec

from tokenmill.lora.request import LoRARequest
from tokenmill.multimodal.inputs import MultiModalFeature
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.metrics import SpecDecodingStats


class FinishReason(enum.IntEnum):
    """Why a request stopped. ``str()`` gives the OpenAI ``finish_reason`` string."""

    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # aborted by the client or the front end
    ERROR = 3  # the engine could not run it (message in EngineCoreOutput.error)

    def __str__(self) -> str:
        return ("stop", "length", "abort", "error")[self.value]


class EngineCoreRequestType(enum.Enum):
    """First frame of a message to the engine core process."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"


class EngineCoreEventType(enum.IntEnum):
    """What happened to a request in the engine core (see :class:`EngineCoreEvent`)."""

    QUEUED = 1  # added to the scheduler's waiting queue
    SCHEDULED = 2  # admitted to the running batch (again after a preemption)
    PREEMPTED = 3  # sent back to the waiting queue to be recomputed


class EngineCoreEvent(msgspec.Struct, array_like=True):
    """A timestamped event of one request in the engine core.

    Attributes:
        type: what happened.
        timestamp: ``time.time()`` in the engine core when it happened (seconds; the same clock as the front
            end's ``arrival_time``, so front-end metrics can mix the two).
    """

    type: EngineCoreEventType
    timestamp: float


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A tokenized request, as the engine core receives it.

    Attributes:
        request_id: unique among requests in flight.
        prompt_token_ids: the prompt, ``len >= 1`` token ids.
        sampling_params: how to sample; ``n`` is always 1 here (the front end fans ``n > 1`` out).
        eos_token_id: the tokenizer's EOS id (``None``: none), checked unless ``ignore_eos``.
        arrival_time: ``time.time()`` when the front end received it (seconds).
        priority: lower runs earlier under the ``priority`` policy.
        cache_salt: mixed into prefix-cache block hashes (isolates tenants).
        lora_request: the LoRA adapter to run with (``None``: the base model).
        pooling_params: set for a pooling request (embedding, classification): its prompt is run and pooled,
            nothing is sampled (``sampling_params`` is then a placeholder with ``max_tokens=1``).
        mm_features: the prompt's images, in prompt order (``prompt_token_ids`` already holds each one's
            placeholder tokens; docs/multimodal.md).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None
    mm_features: list[MultiModalFeature] | None = None


class PooledData(msgspec.Struct, array_like=True):
    """A pooling request's output tensor on the wire: float32 values in C order.

    Attributes:
        data: the values, little-endian float32 bytes.
        shape: the tensor's shape (``[d]`` for an embedding or class probabilities, ``[n, d]`` per token).
    """

    data: bytes
    shape: list[int]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step produced for one request.

    Attributes:
        request_id: the request.
        new_token_ids: tokens generated this step (usually one).
        finish_reason: set on the request's last output.
        stop_reason: the stop token id that ended it (``None`` for EOS or length).
        num_cached_tokens: prompt tokens served from the prefix cache (set on the first output).
        error: message when ``finish_reason`` is ERROR.
        new_logprobs: per new token, ``(token_ids, logprobs, sampled_rank)`` for the top ``logprobs``
            candidates plus the sampled token (first entry).
        prompt_logprobs: with the request's first output when ``prompt_logprobs`` was asked: per prompt token
            from the second on, ``(token_ids, logprobs, rank)`` with the actual prompt token first, then the
            top ``prompt_logprobs`` candidates; ``rank`` is the 1-based rank of the actual token.
        events: engine-core events of the request since its previous output, oldest first (queued, scheduled,
            preempted; ``None`` when none). Front ends derive queue / prefill / decode times from them.
        pooling_output: a pooling request's result, with its only (finishing) output.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None
    prompt_logprobs: list[tuple[list[int], list[float], int]] | None = None
    events: list[EngineCoreEvent] | None = None
    pooling_output: PooledData | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Engine-side gauges and counters, sent with the outputs of a step.

    Attributes:
        num_running_reqs: requests scheduled in the running queue.
        num_waiting_reqs: requests waiting for admission.
        kv_cache_usage: fraction of KV blocks in use, 0..1.
        prefix_cache_queries: prompt tokens looked up in the prefix cache since the last stats.
        prefix_cache_hits: of those, tokens found.
        num_preemptions: requests preempted since the last stats.
        spec_decoding_stats: speculative decoding counters since the last stats (``None`` without it).
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    spec_decoding_stats: SpecDecodingStats | None = None


def merge_scheduler_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The stats of several data-parallel engine cores as one: counts summed, KV-cache usage averaged (speculative
    decoding counters are left out: the front ends add them up per step). One item is returned as it is.

    Raises:
        ValueError: ``stats`` is empty.
    """
    if not stats:
        raise ValueError("merge_scheduler_stats needs at least one SchedulerStats")
    if len(stats) == 1:
        return stats[0]
    return SchedulerStats(
        num_running_reqs=sum(s.num_running_reqs for s in stats),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage for s in stats) / len(stats),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
    )


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """All outputs of one engine-core step (or one utility reply).

    Attributes:
        outputs: one entry per request that produced tokens or finished.
        timestamp: ``time.monotonic()`` of the engine core when the step ended (seconds).
        scheduler_stats: gauges after the step.
        utility_output: reply to a UTILITY request ``(call_id, result, error)``.
        engine_index: the data-parallel engine core that sent them (0 without data parallelism).
    """

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    timestamp: float = 0.0
    scheduler_stats: SchedulerStats | None = None
    utility_output: tuple[int, object, str | None] | None = None
    engine_index: int = 0
