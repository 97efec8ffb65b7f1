"""EngineCore: the scheduler and the executor, stepped one batch at a time (no tokenizer, no I/O)."""

from __future__ import annotations

import logging
import time

from tokenmill.config import EngineConfig
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.input_processor import check_token_ids_in_vocab
from tokenmill.engine.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from tokenmill.errors import InvalidRequestError
from tokenmill.executor.base import Executor

logger = logging.getLogger(__name__)


class EngineCore:
    """Loads the model, sizes the KV cache and runs engine steps.

    Args:
        config: the engine configuration; ``cache_config.num_gpu_blocks`` is filled in here.
        executor_class: defaults to :meth:`Executor.get_class`.
    """

    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        from tokenmill.plugins import load_general_plugins

        load_general_plugins("engine_core")  # no-op when this process already ran it (offline LLM, server)
        start = time.perf_counter()
        self.config = config
        self.executor = (executor_class or Executor.get_class(config))(config)
        num_blocks = self.executor.determine_num_available_blocks()
        self.executor.initialize_cache(num_blocks)
        config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(config)
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
                first, this is the backstop for requests that bypass it), or the request can never run (see
                ``Scheduler.add_request``).
        """
        if request.sampling_params.n != 1:
            raise InvalidRequestError("the engine core takes n == 1 requests (the front end fans out n)", "n")
        vocab = self.config.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in request.prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        check_token_ids_in_vocab(request.sampling_params, vocab)
        req = Request.from_engine_core_request(request, self.config.model_config.max_model_len)
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def step(self) -> EngineCoreOutputs:
        """Schedule, run and update once. Returns no outputs (only stats) when there is nothing to run."""
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(timestamp=time.monotonic(), scheduler_stats=self.scheduler.make_stats())
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
