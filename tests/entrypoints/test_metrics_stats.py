"""RequestStatsTracker and PrometheusStatLogger without a server: the timing definitions, exactly."""

from __future__ import annotations

from tokenmill.engine.messages import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    SchedulerStats,
)
from tokenmill.metrics.prometheus import PrometheusStatLogger
from tokenmill.metrics.stats import RequestStatsTracker

from tests.entrypoints.helpers import metric

Q, S, P = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED, EngineCoreEventType.PREEMPTED


def step(*outputs: EngineCoreOutput, stats: SchedulerStats | None = None) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=list(outputs), scheduler_stats=stats)


def test_timings_follow_the_definitions() -> None:
    logger = PrometheusStatLogger("m")
    tracker = RequestStatsTracker([logger])
    tracker.start(["a"], arrival_time=100.0, num_prompt_tokens=7)
    events = [EngineCoreEvent(Q, 100.5), EngineCoreEvent(S, 101.0)]
    tracker.on_engine_outputs(step(EngineCoreOutput("a", [], events=events)), 101.2)  # partial prefill
    tracker.on_engine_outputs(step(EngineCoreOutput("a", [5])), 102.0)  # first token
    # preempted and rescheduled: the first SCHEDULED event stays the reference
    later = [EngineCoreEvent(P, 102.1), EngineCoreEvent(S, 102.5)]
    tracker.on_engine_outputs(step(EngineCoreOutput("a", [6, 7], events=later)), 103.0)
    tracker.on_engine_outputs(step(EngineCoreOutput("untracked", [1])), 103.1)  # ignored
    tracker.on_engine_outputs(step(EngineCoreOutput("a", [8])), 103.5)
    finished = tracker.finish("a", "length", 104.0)
    assert finished is not None
    assert finished.e2e_latency_s == 4.0
    assert finished.queue_time_s == 0.5
    assert finished.prefill_time_s == 1.0
    assert finished.decode_time_s == 1.5
    assert finished.num_prompt_tokens == 7 and finished.num_generation_tokens == 4
    assert tracker.num_tracked == 0 and tracker.finish("a", "stop", 105.0) is None

    text = logger.render().decode()
    assert metric(text, "tokenmill:prompt_tokens_total", "m") == 7
    assert metric(text, "tokenmill:generation_tokens_total", "m") == 4
    assert metric(text, "tokenmill:time_to_first_token_seconds_sum", "m") == 2.0
    assert metric(text, "tokenmill:inter_token_latency_seconds_count", "m") == 2
    assert metric(text, "tokenmill:inter_token_latency_seconds_sum", "m") == 1.5
    assert metric(text, "tokenmill:request_success_total", "m", finished_reason="length") == 1


def test_scheduler_stats_gauges_and_counters() -> None:
    logger = PrometheusStatLogger("m")
    tracker = RequestStatsTracker([logger])
    tracker.on_engine_outputs(step(stats=SchedulerStats(3, 2, 0.25, 100, 40, 1)), 1.0)
    tracker.on_engine_outputs(step(stats=SchedulerStats(1, 0, 0.5, 10, 10, 0)), 2.0)
    text = logger.render().decode()
    assert metric(text, "tokenmill:num_requests_running", "m") == 1
    assert metric(text, "tokenmill:num_requests_waiting", "m") == 0
    assert metric(text, "tokenmill:kv_cache_usage_perc", "m") == 0.5
    assert metric(text, "tokenmill:prefix_cache_queries_total", "m") == 110
    assert metric(text, "tokenmill:prefix_cache_hits_total", "m") == 50
    assert metric(text, "tokenmill:num_preemptions_total", "m") == 1


def test_unfinished_stages_are_not_observed() -> None:
    logger = PrometheusStatLogger("m")
    tracker = RequestStatsTracker([logger])
    tracker.start(["x"], 10.0, 3)
    finished = tracker.finish("x", "abort", 11.0)  # aborted before it was scheduled
    assert finished is not None and finished.queue_time_s is None and finished.prefill_time_s is None
    tracker.start(["y"], 10.0, 3)
    tracker.discard("y")  # refused by the engine: not a finished request
    assert tracker.finish("y", "error", 12.0) is None
    assert tracker.finish("z", "weird", 12.0) is None
    text = logger.render().decode()
    assert metric(text, "tokenmill:request_success_total", "m", finished_reason="abort") == 1
    assert metric(text, "tokenmill:request_queue_time_seconds_count", "m") == 0
    assert metric(text, "tokenmill:e2e_request_latency_seconds_count", "m") == 1
