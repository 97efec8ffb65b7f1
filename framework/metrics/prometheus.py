"""Prometheus metrics of the server, in vLLM's families with the prefix ``tokenmill:`` (vLLM: ``vllm:``).

Every family carries the labels ``model_name`` and ``engine`` (the data-parallel engine core, ``"0"`` without
data parallelism; as vLLM labels its metrics), ``request_success_total`` also ``finished_reason`` (``stop``,
``length``, ``abort``, ``error``). Sum over ``engine`` for the server's totals. Families (units in the name):

* gauges: ``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc`` (a fraction, 0..1,
  as in vLLM despite the name);
* counters: ``prefix_cache_queries_total``, ``prefix_cache_hits_total`` (tokens), ``prompt_tokens_total``,
  ``generation_tokens_total``, ``request_success_total``, ``num_preemptions_total``; speculative decoding
  (tokens, see :mod:`tokenmill.spec_decode.metrics`): ``spec_decode_num_drafts_total``,
  ``spec_decode_num_draft_tokens_total``, ``spec_decode_num_accepted_tokens_total`` and
  ``spec_decode_num_accepted_tokens_per_pos_total`` (label ``position``, 0-based);
* histograms (seconds): ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
  ``e2e_request_latency_seconds``, ``request_queue_time_seconds``, ``request_prefill_time_seconds``,
  ``request_decode_time_seconds``; (tokens): ``request_prompt_tokens``, ``request_generation_tokens``.

Each logger owns a :class:`prometheus_client.CollectorRegistry` (not the global one), so several servers
or test apps in one process never clash; render it with :meth:`PrometheusStatLogger.render`.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenmill.engine.messages import SchedulerStats
from tokenmill.metrics.stats import FINISH_REASONS, FinishedRequestStats, IterationStats

PREFIX = "tokenmill:"
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

# Bucket upper bounds. Latencies span a fast GPU (milliseconds) to a loaded CPU (minutes).
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
_REQUEST_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class PrometheusStatLogger:
    """A :class:`tokenmill.metrics.stats.StatsSink` that updates Prometheus metrics.

    Args:
        model_name: value of the ``model_name`` label (the served model name).
        registry: where the metrics live (default: a new registry; with ``process_*`` metrics).
        num_engines: data-parallel engine cores; every family has a series (at 0) for each from the start.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, num_engines: int = 1) -> None:
        prometheus_client.disable_created_metrics()  # vLLM exports no *_created series either
        if registry is None:
            registry = CollectorRegistry(auto_describe=True)
            prometheus_client.ProcessCollector(registry=registry)
        self.registry = registry
        self.model_name = model_name
        labels = ["model_name", "engine"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, registry=registry, buckets=buckets)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (recomputed later).")
        self.spec_num_drafts = counter("spec_decode_num_drafts", "Speculative verification steps (per request).")
        self.spec_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by position in their step (0-based).",
                                             ("position",))
        self.request_success = counter("request_success", "Requests finished, by finish reason.",
                                       ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token (s).", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between token batches of a request (s).",
                             _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency (s).", _REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting before first scheduled (s).",
                                    _REQUEST_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token (s).",
                                      _REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token (s).",
                                     _REQUEST_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.",
                                               _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens", "Generated tokens per request.",
                                                   _TOKEN_BUCKETS)

        self._engines: dict[int, _EngineSeries] = {}
        for index in range(max(1, num_engines)):
            self._series(index)

    def _series(self, engine_index: int) -> _EngineSeries:
        """The bound children of one engine core (created at 0 on first use)."""
        series = self._engines.get(engine_index)
        if series is None:
            series = self._engines[engine_index] = _EngineSeries(self, str(engine_index))
        return series

    # -- StatsSink -------------------------------------------------------------------------------------

    def record_scheduler_stats(self, stats: SchedulerStats, engine_index: int = 0) -> None:
        e = self._series(engine_index)
        e.running.set(stats.num_running_reqs)
        e.waiting.set(stats.num_waiting_reqs)
        e.kv.set(stats.kv_cache_usage)
        if stats.prefix_cache_queries:
            e.queries.inc(stats.prefix_cache_queries)
        if stats.prefix_cache_hits:
            e.hits.inc(stats.prefix_cache_hits)
        if stats.num_preemptions:
            e.preemptions.inc(stats.num_preemptions)
        spec = stats.spec_decoding_stats
        if spec is not None and spec.num_drafts:
            e.spec_drafts.inc(spec.num_drafts)
            e.spec_draft_tokens.inc(spec.num_draft_tokens)
            e.spec_accepted.inc(spec.num_accepted_tokens)
            for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
                e.spec_per_pos(pos).inc(n)

    def record_iteration(self, stats: IterationStats) -> None:
        e = self._series(stats.engine_index)
        if stats.num_prompt_tokens:
            e.prompt.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            e.generation.inc(stats.num_generation_tokens)
        for value in stats.time_to_first_tokens_s:
            e.ttft.observe(value)
        for value in stats.inter_token_latencies_s:
            e.itl.observe(value)

    def record_finished(self, stats: FinishedRequestStats) -> None:
        e = self._series(stats.engine_index)
        e.success[stats.finish_reason].inc()
        e.e2e.observe(stats.e2e_latency_s)
        e.req_prompt.observe(stats.num_prompt_tokens)
        e.req_generation.observe(stats.num_generation_tokens)
        if stats.queue_time_s is not None:
            e.queue.observe(stats.queue_time_s)
        if stats.prefill_time_s is not None:
            e.prefill.observe(stats.prefill_time_s)
        if stats.decode_time_s is not None:
            e.decode.observe(stats.decode_time_s)

    # -- exposition ------------------------------------------------------------------------------------

    def render(self) -> bytes:
        """The registry in the Prometheus text format (content type :data:`CONTENT_TYPE`)."""
        return prometheus_client.generate_latest(self.registry)


class _EngineSeries:
    """The children of every family bound to one ``(model_name, engine)``: updates skip the label lookup."""

    def __init__(self, logger: PrometheusStatLogger, engine: str) -> None:
        labels = (logger.model_name, engine)
        self.running = logger.num_requests_running.labels(*labels)
        self.waiting = logger.num_requests_waiting.labels(*labels)
        self.kv = logger.kv_cache_usage.labels(*labels)
        self.queries = logger.prefix_cache_queries.labels(*labels)
        self.hits = logger.prefix_cache_hits.labels(*labels)
        self.prompt = logger.prompt_tokens.labels(*labels)
        self.generation = logger.generation_tokens.labels(*labels)
        self.preemptions = logger.num_preemptions.labels(*labels)
        self.spec_drafts = logger.spec_num_drafts.labels(*labels)
        self.spec_draft_tokens = logger.spec_num_draft_tokens.labels(*labels)
        self.spec_accepted = logger.spec_num_accepted_tokens.labels(*labels)
        self._labels = labels
        self._logger = logger
        self._per_pos: dict[int, object] = {}
        self.success = {reason: logger.request_success.labels(*labels, reason) for reason in FINISH_REASONS}
        self.ttft = logger.ttft.labels(*labels)
        self.itl = logger.itl.labels(*labels)
        self.e2e = logger.e2e.labels(*labels)
        self.queue = logger.queue_time.labels(*labels)
        self.prefill = logger.prefill_time.labels(*labels)
        self.decode = logger.decode_time.labels(*labels)
        self.req_prompt = logger.request_prompt_tokens.labels(*labels)
        self.req_generation = logger.request_generation_tokens.labels(*labels)

    def spec_per_pos(self, position: int):
        """The ``spec_decode_num_accepted_tokens_per_pos`` child of one draft position."""
        child = self._per_pos.get(position)
        if child is None:
            child = self._per_pos[position] = self._logger.spec_accepted_per_pos.labels(*self._labels, str(position))
        return child
