"""EngineCore: the scheduler and the executor, stepped one batch at a time (no tokenizer, no I/O).

With pipeline parallelism (``N`` stages) one batch at a time would leave all stages but one idle, so the
engine core keeps up to ``N`` micro-batches in flight (a *batch queue*, as vLLM V1 does): while the queue has
room it schedules the next batch (the scheduler only picks tokens that do not depend on a batch still in
flight: a decoding request waits for its previous token, a long prompt may send its next chunk) and submits
it without waiting; when the queue is full, or nothing more can be scheduled, it waits for the oldest batch
and applies its output. Stages run the batches in submission order, so stage ``s`` works on batch ``k``
while stage ``s + 1`` works on batch ``k - 1``.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from tokenmill.config import EngineConfig
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.input_processor import check_token_ids_in_vocab
from tokenmill.engine.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from tokenmill.engine.step_log import StepLog
from tokenmill.errors import InvalidRequestError
from tokenmill.lora.request import LoRALoadError, LoRARequest
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.base import Executor, FutureOutput
from tokenmill.executor.selector import get_executor_class
from tokenmill.structured_output.manager import StructuredOutputManager
from tokenmill.structured_output.validation import resolve_structured_outputs

logger = logging.getLogger(__name__)

# Longest wait (seconds) for a compiling grammar when a step has nothing else to run.
_GRAMMAR_WAIT_S = 0.01


class EngineCore:
    """Loads the model, sizes the KV cache and runs engine steps.

    Args:
        config: the engine configuration; ``cache_config.num_gpu_blocks`` is filled in here.
        executor_class: defaults to :func:`~tokenmill.executor.selector.get_executor_class`.
    """

    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        from tokenmill.plugins import load_general_plugins

        load_general_plugins("engine_core")  # no-op when this process already ran it (offline LLM, server)
        start = time.perf_counter()
        self.config = config
        self.executor = (executor_class or get_executor_class(config))(config)
        num_blocks = self.executor.determine_num_available_blocks()
        self.executor.initialize_cache(num_blocks)
        config.cache_config.num_gpu_blocks = num_blocks
        # One per engine core (each data-parallel rank has its own): grammars, matchers and their cache.
        self.structured_output_manager = StructuredOutputManager(config)
        self.scheduler = Scheduler(config, self.structured_output_manager)
        self.max_concurrent_batches = max(1, getattr(self.executor, "max_concurrent_batches", 1))
        # in flight: (future, scheduler output, {req_id: preemption count when scheduled})
        self.batch_queue: deque[tuple[FutureOutput, SchedulerOutput, dict[str, int]]] = deque()
        self.lora_requests: dict[int, LoRARequest] = {}  # adapters loaded on the workers, by id
        self._lora_removals: set[int] = set()  # unloaded while requests still use them: dropped when they finish
        self.step_log = StepLog()  # TOKENMILL_STEP_LOG (tokenmill.engine.step_log)
        logger.info(
            "engine core ready in %.1f s: %d KV blocks of %d tokens (%d tokens)",
            time.perf_counter() - start,
            num_blocks,
            config.cache_config.block_size,
            num_blocks * config.cache_config.block_size,
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request.

        Raises:
            InvalidRequestError: ``n != 1``, a token id outside the vocabulary (prompt, ``logit_bias``,
                ``allowed_token_ids``, ``stop_token_ids``, ``bad_words_token_ids``; the front end checks these
                first, this is the backstop for requests that bypass it), an invalid structured-output
                constraint (``param="structured_outputs"``), or the request can never run (see
                ``Scheduler.add_request``).
            LoRALoadError: its LoRA adapter is not loaded and cannot be (see :meth:`add_lora`).
        """
        if request.sampling_params.n != 1:
            raise InvalidRequestError("the engine core takes n == 1 requests (the front end fans out n)", "n")
        vocab = self.config.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in request.prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        check_token_ids_in_vocab(request.sampling_params, vocab)
        so_params = request.sampling_params.structured_outputs
        if so_params is not None:
            # The front end resolved and checked it already; this is a cached look-up then.
            resolved = resolve_structured_outputs(so_params, self.config.structured_outputs_config.backend)
            if resolved is not so_params:
                request.sampling_params.structured_outputs = resolved
        lora = request.lora_request
        if lora is not None and self.lora_requests.get(lora.lora_int_id) != lora:
            reason = self.add_lora(lora.lora_name, lora.lora_int_id, lora.lora_path)
            if reason is not None:
                raise LoRALoadError(reason)
        req = Request.from_engine_core_request(request, self.config.model_config.max_model_len)
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    # -- LoRA adapters (utility calls of the front end; plain arguments so they cross msgpack as they are) --

    def add_lora(self, lora_name: str, lora_int_id: int, lora_path: str) -> str | None:
        """Load an adapter on every worker (read, check, pack into the host cache).

        Returns:
            ``None`` when it is loaded, else why it cannot be used (nothing of it stays loaded).
        """
        if self.config.lora_config is None:
            return "LoRA adapters are not enabled; start the engine with --enable-lora"
        try:
            lora = LoRARequest(lora_name, int(lora_int_id), lora_path)
        except ValueError as exc:
            return str(exc)
        reasons = [r for r in self.executor.collective_rpc("add_lora", (lora,)) if r is not None]
        if reasons:
            self.executor.collective_rpc("remove_lora", (lora.lora_int_id,))
            self.lora_requests.pop(lora.lora_int_id, None)
            return reasons[0]
        self.lora_requests[lora.lora_int_id] = lora
        return None

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter. Requests already queued or running with it finish with it: the workers drop it
        once none is left. Returns whether it was loaded."""
        lora_int_id = int(lora_int_id)
        known = self.lora_requests.pop(lora_int_id, None) is not None
        if self.config.lora_config is not None:
            self._lora_removals.add(lora_int_id)
            self._drop_unused_loras()
        return known

    def _drop_unused_loras(self) -> None:
        in_use = {r.lora_int_id for r in self.scheduler.requests.values() if r.lora_request is not None}
        for lora_int_id in sorted(self._lora_removals - in_use):
            if lora_int_id not in self.lora_requests:  # not loaded again meanwhile
                self.executor.collective_rpc("remove_lora", (lora_int_id,))
            self._lora_removals.discard(lora_int_id)

    def list_loras(self) -> list[int]:
        """Ids of the loaded adapters."""
        return sorted(self.lora_requests)

    def step(self) -> EngineCoreOutputs:
        """Schedule, run and update once. Returns no outputs (only stats) when there is nothing to run.

        With more than one pipeline stage this is :meth:`step_with_batch_queue`.
        """
        if self._lora_removals:
            self._drop_unused_loras()
        if self.max_concurrent_batches > 1:
            return self.step_with_batch_queue()
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(timestamp=time.monotonic(), scheduler_stats=self.scheduler.make_stats())
        start = time.monotonic()
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.step_log.record(start, scheduler_output)
        if scheduler_output.is_empty and not outputs.outputs:
            # Only requests whose grammars still compile: wait for one instead of spinning.
            self.structured_output_manager.wait_for_grammars(
                self.scheduler.requests_waiting_for_grammar(), _GRAMMAR_WAIT_S
            )
        return outputs

    def step_with_batch_queue(self) -> EngineCoreOutputs:
        """Submit the next micro-batch while the queue has room; otherwise finish the oldest one.

        Returns the oldest batch's outputs, or no outputs (only stats) when a batch was submitted without
        waiting or there was nothing to do.
        """
        scheduler = self.scheduler
        if len(self.batch_queue) < self.max_concurrent_batches and scheduler.has_unfinished_requests():
            scheduler_output = scheduler.schedule()
            if scheduler_output.total_num_scheduled_tokens > 0 or scheduler_output.finished_req_ids:
                future = self.executor.execute_model(scheduler_output, non_block=True)
                preemptions = {
                    req_id: scheduler.requests[req_id].num_preemptions for req_id in scheduler_output.num_scheduled_tokens
                }
                self.batch_queue.append((future, scheduler_output, preemptions))
                if scheduler_output.total_num_scheduled_tokens > 0 and len(self.batch_queue) < self.max_concurrent_batches:
                    return EngineCoreOutputs(timestamp=time.monotonic())  # room for another micro-batch
        if not self.batch_queue:
            if not scheduler.has_unfinished_requests():
                return EngineCoreOutputs(timestamp=time.monotonic(), scheduler_stats=scheduler.make_stats())
            # Nothing could run: send the outputs of requests failed outside a step (a grammar that did not
            # compile), or wait briefly for a compiling grammar instead of spinning.
            outputs = scheduler.update_from_output(scheduler_output, ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
            if not outputs.outputs:
                self.structured_output_manager.wait_for_grammars(
                    scheduler.requests_waiting_for_grammar(), _GRAMMAR_WAIT_S
                )
            return outputs
        future, scheduler_output, preemptions = self.batch_queue.popleft()
        runner_output = future.result()
        return scheduler.update_from_output(scheduler_output, self._drop_stale(runner_output, preemptions))

    def _drop_stale(self, output: ModelRunnerOutput, preemptions: dict[str, int]) -> ModelRunnerOutput:
        """Blank the samples of requests preempted (and perhaps re-admitted) since their batch was scheduled:
        those tokens belong to a computation the scheduler has already thrown away."""
        requests = self.scheduler.requests
        stale = [
            i
            for i, req_id in enumerate(output.req_ids)
            if req_id in requests and requests[req_id].num_preemptions != preemptions.get(req_id)
        ]
        for i in stale:
            output.sampled_token_ids[i] = []
        return output

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or micro-batches still in flight (their answers must be read)."""
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def kernel_info(self) -> dict[str, str]:
        """The platform's :meth:`~tokenmill.platforms.Platform.kernel_info` as this engine core's process sees it
        (``tokenmill bench`` asks the engine core: with data parallelism it runs in its own process, where the
        platform's kernels were loaded)."""
        from tokenmill.platforms import get_current_platform

        return dict(get_current_platform().kernel_info())

    def peak_rss_bytes(self) -> int:
        """Peak resident set size of this engine core's process so far, in bytes (Linux reports KiB, macOS bytes;
        ``tokenmill bench throughput`` reports it for data-parallel engine cores)."""
        from tokenmill.metrics.stats import peak_rss_bytes

        return peak_rss_bytes()

    def check_health(self) -> None:
        """Raises the executor's error when a worker is gone."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.batch_queue.clear()
        self.structured_output_manager.shutdown()
        self.executor.shutdown()
