"""Request: the engine core's view of one generation request (one sequence; ``n > 1`` is fanned out earlier)."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from tokenmill.engine.messages import EngineCoreEvent, EngineCoreEventType, FinishReason
from tokenmill.core.reasoning_state import ReasoningState
from tokenmill.structured_output.request import StructuredOutputRequest

if TYPE_CHECKING:
    from tokenmill.engine.messages import EngineCoreRequest
    from tokenmill.lora.request import LoRARequest
    from tokenmill.multimodal.inputs import MultiModalFeature
    from tokenmill.pooling_params import PoolingParams
    from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every status above PREEMPTED is final.

    ``WAITING_FOR_GRAMMAR``: in the waiting queue, but its structured-output grammar is still compiling; the
    scheduler passes over it (keeping its place) until the grammar is ready.
    """

    WAITING = 0
    WAITING_FOR_GRAMMAR = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """Token state of one sequence as the scheduler tracks it.

    Attributes:
        request_id: unique among requests in flight.
        prompt_token_ids: the prompt (never empty).
        sampling_params: the request's SamplingParams (``n == 1``).
        max_tokens: most output tokens, resolved against ``max_model_len``.
        num_computed_tokens: tokens whose KV is in the cache (or scheduled to be, within the current step).
        num_cached_tokens: prompt tokens served by the prefix cache on first admission (-1 before).
        block_hashes: hashes of this request's full blocks, in order (filled by the KV cache manager).
        lora_request: its LoRA adapter (``None``: the base model).
        spec_token_ids: draft tokens to verify in the next step (speculative decoding; not yet outputs).
        structured_output_request: the constraint and its matcher, for a constrained request (else ``None``).
        reasoning: where the output stands in a reasoning model's thinking (``None``: the output does not think).
        error: why the engine failed the request (with ``FINISHED_ERROR``).
        pooling_params: set for a pooling request: it runs its prompt only and finishes with the pooled output
            once the last prompt chunk has run (``sampling_params`` is then a placeholder).
        mm_features: its images in prompt order (placeholder ranges ascending; empty for a text prompt).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_id: int | None,
        max_tokens: int,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        mm_features: list[MultiModalFeature] | None = None,
    ) -> None:
        self.request_id = request_id
        self.mm_features: list[MultiModalFeature] = sorted(mm_features or [], key=lambda f: f.placeholder.offset)
        self.pooling_params = pooling_params
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.max_tokens = max_tokens
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        # speculative decoding: draft tokens proposed for the next step (never part of all_token_ids)
        self.spec_token_ids: list[int] = []
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.events: list[EngineCoreEvent] = []
        self.error: str | None = None
        so_params = sampling_params.structured_outputs
        self.structured_output_request = StructuredOutputRequest(so_params) if so_params is not None else None
        if self.structured_output_request is not None:
            self.status = RequestStatus.WAITING_FOR_GRAMMAR
        reasoning = sampling_params.reasoning
        self.reasoning = ReasoningState(reasoning) if reasoning is not None else None

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, max_model_len: int) -> Request:
        """Build from a front-end message; ``max_tokens=None`` means up to ``max_model_len``."""
        room = max_model_len - len(req.prompt_token_ids)
        wanted = req.sampling_params.max_tokens
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            eos_token_id=req.eos_token_id,
            max_tokens=room if wanted is None else min(wanted, room),
            arrival_time=req.arrival_time,
            priority=req.priority,
            cache_salt=req.cache_salt,
            lora_request=req.lora_request,
            pooling_params=req.pooling_params,
            mm_features=req.mm_features,
        )

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, ``0`` for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def block_hash_extra_keys(self) -> tuple:
        """What besides the tokens keys this request's prefix-cache blocks: the cache salt and the LoRA
        adapter (so different adapters, or an adapter and the base model, never share KV blocks)."""
        extra: tuple = (self.cache_salt,) if self.cache_salt else ()
        if self.lora_request is not None:
            extra += (("lora", self.lora_request.lora_int_id, self.lora_request.lora_name),)
        return extra

    def block_mm_hashes(self, start: int, end: int) -> tuple[str, ...]:
        """The ``mm_hash`` of every image whose placeholder overlaps token positions ``[start, end)``: they key
        the prefix-cache block of those tokens besides the (identical) placeholder ids, so prompts with the same
        text and different images never share a block."""
        return tuple(f.mm_hash for f in self.mm_features
                     if f.placeholder.offset < end and f.placeholder.end > start)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def use_structured_output(self) -> bool:
        return self.structured_output_request is not None

    @property
    def in_reasoning(self) -> bool:
        """The output is still in the model's thinking (no grammar applies yet)."""
        return self.reasoning is not None and not self.reasoning.ended

    def record_event(self, event_type: EngineCoreEventType, timestamp: float | None = None) -> None:
        """Note a lifecycle event (``timestamp``: ``time.time()`` seconds, default now) for the next output."""
        self.events.append(EngineCoreEvent(event_type, time.time() if timestamp is None else timestamp))

    def take_events(self) -> list[EngineCoreEvent] | None:
        """The events recorded since the last call (``None`` when there are none)."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """After appending a token: set a finished status when a stop condition holds.

        Order: EOS (unless ``ignore_eos``) and ``stop_token_ids`` (both only after ``min_tokens``), then
        ``max_tokens`` and ``max_model_len`` (finish reason "length").
        """
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= self.sampling_params.min_tokens:
            if last == self.eos_token_id and not self.sampling_params.ignore_eos:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in self.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
