"""Serving statistics, independent of any metrics backend.

:class:`RequestStatsTracker` turns what the front end sees into numbers:

* every engine-core step (``EngineCoreOutputs``, via ``AsyncLLM.add_stats_listener``): the scheduler's
  gauges and counters, and per tracked sequence the time to its first token, the time between its
  token batches (inter-token latency) and its generated-token count;
* every request's end (called by the server): end-to-end latency, queue / prefill / decode times from
  the engine core's events, and the finish reason.

Sinks (e.g. :class:`tokenmill.metrics.prometheus.PrometheusStatLogger`) receive the results.

Definitions (all in seconds; timestamps are ``time.time()``, shared by the front end and the engine core):

=================  ====================================================================================
time to 1st token  first token handled by the front end - the request's arrival at the server
inter-token        between two consecutive engine steps that produced tokens for the same sequence
e2e latency        the request's end (finish, abort or error) - its arrival
queue time         first SCHEDULED event - QUEUED event (engine core)
prefill time       first token handled by the front end - first SCHEDULED event
decode time        last token - first token
=================  ====================================================================================

A request with ``n > 1`` is ``n`` sequences in the engine core; each counts as one request here (as in
vLLM), with its own prompt-token count.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.engine.messages import EngineCoreEventType, EngineCoreOutputs, SchedulerStats


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes (``getrusage``: Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class IterationStats:
    """What one engine-core step produced for the tracked sequences.

    Attributes:
        num_prompt_tokens: prompt tokens of the sequences whose first token came in this step.
        num_generation_tokens: tokens generated in this step.
        time_to_first_tokens_s: one entry per sequence that got its first token.
        inter_token_latencies_s: one entry per sequence that got a later token batch.
        engine_index: the data-parallel engine core of the step (0 without data parallelism).
    """

    engine_index: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.num_prompt_tokens or self.num_generation_tokens or self.time_to_first_tokens_s
                    or self.inter_token_latencies_s)


@dataclass
class FinishedRequestStats:
    """One finished sequence. Times are ``None`` when the sequence never reached that stage.

    Attributes:
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``"error"``.
        e2e_latency_s: end - arrival.
        num_prompt_tokens: prompt length in tokens.
        num_generation_tokens: tokens generated.
        queue_time_s: first scheduled - queued (engine core).
        prefill_time_s: first token - first scheduled.
        decode_time_s: last token - first token.
        engine_index: the data-parallel engine core that ran it (the one of its first output; 0 if none).
    """

    finish_reason: str
    e2e_latency_s: float
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time_s: float | None = None
    prefill_time_s: float | None = None
    decode_time_s: float | None = None
    engine_index: int = 0


class StatsSink(Protocol):
    """Receives statistics (a metrics backend or a logger)."""

    def record_scheduler_stats(self, stats: SchedulerStats, engine_index: int = 0) -> None: ...

    def record_iteration(self, stats: IterationStats) -> None: ...

    def record_finished(self, stats: FinishedRequestStats) -> None: ...


@dataclass
class _SequenceTimes:
    arrival_time: float
    num_prompt_tokens: int
    queued_time: float | None = None
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    engine_index: int | None = None


class RequestStatsTracker:
    """Per-sequence timing state between a request's start and end (see the module docstring).

    Not thread-safe: use it from the event loop that runs the server and ``AsyncLLM``'s output handler.

    Args:
        sinks: where the statistics go.
    """

    def __init__(self, sinks: Iterable[StatsSink]) -> None:
        self.sinks = list(sinks)
        self._sequences: dict[str, _SequenceTimes] = {}

    @property
    def num_tracked(self) -> int:
        """Sequences started and not yet finished."""
        return len(self._sequences)

    def start(self, engine_request_ids: Sequence[str], arrival_time: float, num_prompt_tokens: int) -> None:
        """Track the sequences of one request (call before its engine requests are sent).

        Args:
            engine_request_ids: the engine-core ids of its sequences.
            arrival_time: ``time.time()`` when the server received the request.
            num_prompt_tokens: prompt length in tokens.
        """
        for engine_id in engine_request_ids:
            self._sequences[engine_id] = _SequenceTimes(arrival_time, num_prompt_tokens)

    def on_engine_outputs(self, outputs: EngineCoreOutputs, now: float) -> None:
        """Record one engine-core step (or stats snapshot) handled by the front end at ``now``."""
        if outputs.scheduler_stats is not None:
            for sink in self.sinks:
                sink.record_scheduler_stats(outputs.scheduler_stats, outputs.engine_index)
        if not outputs.outputs:
            return
        iteration = IterationStats(engine_index=outputs.engine_index)
        for out in outputs.outputs:
            seq = self._sequences.get(out.request_id)
            if seq is None:
                continue
            if seq.engine_index is None:
                seq.engine_index = outputs.engine_index
            for event in out.events or ():
                if event.type == EngineCoreEventType.QUEUED and seq.queued_time is None:
                    seq.queued_time = event.timestamp
                elif event.type == EngineCoreEventType.SCHEDULED and seq.scheduled_time is None:
                    seq.scheduled_time = event.timestamp
            num_new = len(out.new_token_ids)
            if not num_new:
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
                iteration.time_to_first_tokens_s.append(max(0.0, now - seq.arrival_time))
                iteration.num_prompt_tokens += seq.num_prompt_tokens
            else:
                assert seq.last_token_time is not None
                iteration.inter_token_latencies_s.append(max(0.0, now - seq.last_token_time))
            seq.last_token_time = now
            seq.num_generation_tokens += num_new
            iteration.num_generation_tokens += num_new
        if not iteration.is_empty():
            for sink in self.sinks:
                sink.record_iteration(iteration)

    def discard(self, engine_request_id: str) -> None:
        """Stop tracking a sequence without recording it (the engine refused the request)."""
        self._sequences.pop(engine_request_id, None)

    def finish(self, engine_request_id: str, finish_reason: str, now: float) -> FinishedRequestStats | None:
        """End a sequence; returns its statistics (``None`` when it was not tracked).

        Args:
            finish_reason: one of :data:`FINISH_REASONS` (anything else is recorded as ``"error"``).
            now: ``time.time()`` of the end.
        """
        seq = self._sequences.pop(engine_request_id, None)
        if seq is None:
            return None
        stats = FinishedRequestStats(
            finish_reason=finish_reason if finish_reason in FINISH_REASONS else "error",
            e2e_latency_s=max(0.0, now - seq.arrival_time),
            num_prompt_tokens=seq.num_prompt_tokens,
            num_generation_tokens=seq.num_generation_tokens,
            engine_index=seq.engine_index or 0,
        )
        if seq.queued_time is not None and seq.scheduled_time is not None:
            stats.queue_time_s = max(0.0, seq.scheduled_time - seq.queued_time)
        if seq.scheduled_time is not None and seq.first_token_time is not None:
            stats.prefill_time_s = max(0.0, seq.first_token_time - seq.scheduled_time)
        if seq.first_token_time is not None and seq.last_token_time is not None:
            stats.decode_time_s = max(0.0, seq.last_token_time - seq.first_token_time)
        for sink in self.sinks:
            sink.record_finished(stats)
        return stats
