"""AsyncLLM: the asyncio front end used by the OpenAI server (EngineCore in its own process)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.core_client import AsyncMPClient
from tokenmill.engine.input_processor import InputProcessor, RequestInput
from tokenmill.engine.messages import EngineCoreOutputs, SchedulerStats, merge_scheduler_stats
from tokenmill.engine.output_processor import OutputProcessor, RequestOutputCollector
from tokenmill.engine_args import EngineArgs
from tokenmill.errors import EngineDeadError, ServerShuttingDownError
from tokenmill.lora.request import LoRALoadError, LoRARequest
from tokenmill.outputs import PoolingRequestOutput, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Called with every EngineCoreOutputs the engine core sends (and every stats snapshot pulled by
# ``refresh_stats``) and the front end's ``time.time()`` when it was handled.
StatsListener = Callable[[EngineCoreOutputs, float], None]


class AsyncLLM:
    """Serve many concurrent ``generate`` calls from one engine-core process.

    One background task (started by the first request) reads the engine core's outputs, runs the
    OutputProcessor and hands each request's outputs to its ``generate`` call.

    Args:
        engine_config: the full configuration; the READY handshake fills ``num_gpu_blocks`` and
            ``max_model_len``.
        tokenizer: a ``transformers`` tokenizer (default: the model's; it loads while the engine starts).
        engine_core_cls: ``"module:Class"`` of the EngineCore the child process builds (tests use fakes).
        startup_timeout_s: give up waiting for READY after this long (default: wait while the process lives).

    Raises:
        RuntimeError: the engine core failed to start; the message carries its error.
    """

    def __init__(
        self,
        engine_config: EngineConfig,
        *,
        tokenizer: Any = None,
        engine_core_cls: str | None = None,
        startup_timeout_s: float | None = None,
    ) -> None:
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        self.engine_core = AsyncMPClient(engine_config, engine_core_cls)
        try:
            if tokenizer is None:
                from tokenmill.tokenizer import get_tokenizer

                tokenizer = get_tokenizer(self.model_config)
            self.engine_core.wait_for_ready(startup_timeout_s)
        except BaseException:
            self.engine_core.shutdown()
            raise
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(
            self.model_config, tokenizer, engine_config.cache_config, engine_config.structured_outputs_config,
            logits_processor_pattern=engine_config.logits_processor_pattern,
            speculative=engine_config.speculative_config is not None,
            mm_config=engine_config.multimodal_config,
        )
        self.output_processor = OutputProcessor(tokenizer)
        self._output_handler: asyncio.Task[None] | None = None
        self._dead_error: EngineDeadError | None = None
        self._stop_error: ServerShuttingDownError | None = None
        self._last_stats: dict[int, SchedulerStats] = {}  # per data-parallel engine core
        self._stats_listeners: list[StatsListener] = []

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        """Build the configuration, start the engine-core process and wait until it is READY.

        Raises:
            RuntimeError: the engine core failed to start (its error in the message).
            ValueError / FileNotFoundError: from the configuration.
        """
        return cls(engine_args.create_engine_config(), **kwargs)

    # -- requests --------------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams,
        request_id: str,
        **options: Any,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Run one request; yields RequestOutputs per ``sampling_params.output_kind``, the last finished.

        ``options``: the keyword fields of :class:`~tokenmill.engine.input_processor.RequestInput`
        (``arrival_time``, ``priority``, ``add_special_tokens``, ``prompt_param``, ``lora_request``: the LoRA
        adapter to use, ``None`` for the base model; ``cache_salt``: only requests with the same salt share
        prefix-cache blocks).

        Stopping the iteration early (``aclose``, cancellation, a client disconnect) aborts the request.

        Raises:
            InvalidRequestError: bad prompt or parameters (before anything is yielded).
            EngineDeadError: the engine core is dead or dies meanwhile.
            EngineGenerateError: the engine core failed this request.
        """
        self._check_alive()
        processed = self.input_processor.process(
            RequestInput(request_id=request_id, prompt=prompt, params=sampling_params, **options)
        )
        collector = RequestOutputCollector(sampling_params.output_kind)
        self.output_processor.add_request(processed, collector)
        finished = False
        try:
            self._ensure_output_handler()
            for engine_request in processed.engine_requests:
                await self.engine_core.add_request_async(engine_request)
            while not finished:
                output = collector.get_nowait() or await collector.get()
                finished = output.finished
                yield output
        except BaseException:
            if not finished:
                self._abort_now(request_id)
            raise

    async def encode(
        self,
        prompt: str | Sequence[int],
        pooling_params: PoolingParams,
        request_id: str,
        *,
        priority: int = 0,
        add_special_tokens: bool = True,
        prompt_param: str = "input",
        lora_request: LoRARequest | None = None,
    ) -> PoolingRequestOutput:
        """Run one pooling request (embedding, classification, score) to its one output.

        Cancellation aborts the request (its KV blocks are freed).

        Raises:
            InvalidRequestError: the engine does not pool, or bad prompt or parameters.
            EngineDeadError: the engine core is dead or dies meanwhile.
            EngineGenerateError: the engine core failed this request.
        """
        self._check_alive()
        processed = self.input_processor.process_pooling(RequestInput(
            request_id=request_id, prompt=prompt, params=pooling_params, priority=priority,
            add_special_tokens=add_special_tokens, prompt_param=prompt_param, lora_request=lora_request,
        ))
        collector = RequestOutputCollector(processed.params.output_kind)
        self.output_processor.add_request(processed, collector)
        try:
            self._ensure_output_handler()
            await self.engine_core.add_request_async(processed.engine_requests[0])
            output = collector.get_nowait() or await collector.get()
        except BaseException:
            self._abort_now(request_id)
            raise
        assert isinstance(output, PoolingRequestOutput)
        return output

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter on every engine core.

        Raises:
            LoRALoadError: it cannot be used (the reason in the message); nothing of it stays loaded.
            EngineDeadError: the engine core is dead.
        """
        self._check_alive()
        args = (lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path)
        reasons = [r for r in await self.engine_core.call_utility_all_async("add_lora", *args) if r is not None]
        if reasons:
            await self.engine_core.call_utility_all_async("remove_lora", lora_request.lora_int_id)
            raise LoRALoadError(str(reasons[0]))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter from every engine core; returns whether one had it loaded."""
        self._check_alive()
        return any(await self.engine_core.call_utility_all_async("remove_lora", lora_int_id))

    async def abort(self, request_id: str) -> None:
        """Stop a request; its ``generate`` ends with ``finish_reason="abort"``. Unknown ids are ignored."""
        self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> None:
        self.engine_core.abort_requests(self.output_processor.abort_requests([request_id]))

    def fail_all_requests(self, error: ServerShuttingDownError) -> None:
        """Stop serving: every request in flight raises ``error`` from its ``generate`` (and is aborted in the
        engine core, freeing its KV blocks); so does every later ``generate`` call. The server calls this
        on SIGINT/SIGTERM so that clients get an error response instead of a cut connection."""
        self._stop_error = error
        self.engine_core.abort_requests(self.output_processor.propagate_error(error))

    # -- output handling -------------------------------------------------------------------------------

    def _ensure_output_handler(self) -> None:
        if self._output_handler is None:
            self._output_handler = asyncio.get_running_loop().create_task(
                self._handle_outputs(), name="async-llm-output-handler"
            )

    async def _handle_outputs(self) -> None:
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                if outputs.scheduler_stats is not None:
                    self._last_stats[outputs.engine_index] = outputs.scheduler_stats
                self._notify_stats(outputs)
                result = self.output_processor.process_outputs(outputs.outputs)
                self.engine_core.abort_requests(result.reqs_to_abort)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as exc:
            self._dead_error = exc
            self.output_processor.propagate_error(exc)
        except Exception as exc:
            logger.exception("AsyncLLM output handler failed")
            self._dead_error = EngineDeadError(f"AsyncLLM output handler failed: {exc!r}")
            self.output_processor.propagate_error(self._dead_error)

    # -- health and stats ------------------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine cannot serve requests, or ``None`` while it can."""
        return self._dead_error or self.engine_core.dead_error

    def _check_alive(self) -> None:
        error = self.dead_error or self._stop_error
        if error is not None:
            raise error

    async def check_health(self) -> None:
        """Raises EngineDeadError when the engine core is dead."""
        self._check_alive()

    @property
    def num_engines(self) -> int:
        """Data-parallel engine cores behind this front end."""
        return self.engine_core.num_engines

    async def get_stats(self) -> SchedulerStats | None:
        """The scheduler stats of the last engine step seen (``None`` before the first); with several
        engine cores, their sum (KV-cache usage: the mean)."""
        stats = list(self._last_stats.values())
        return merge_scheduler_stats(stats) if stats else None

    def add_stats_listener(self, listener: StatsListener) -> None:
        """Call ``listener(outputs, now)`` for every engine-core step (before its outputs reach the requests)
        and every snapshot taken by :meth:`refresh_stats`. A listener that raises is logged and kept."""
        self._stats_listeners.append(listener)

    def _notify_stats(self, outputs: EngineCoreOutputs) -> None:
        if not self._stats_listeners:
            return
        now = time.time()
        for listener in self._stats_listeners:
            try:
                listener(outputs, now)
            except Exception:
                logger.exception("stats listener failed")

    async def refresh_stats(self) -> SchedulerStats | None:
        """Ask every engine core for its stats now (an idle engine core sends none, e.g. after aborts).

        Each snapshot also goes to the stats listeners (tagged with its engine index). Returns the stats as
        :meth:`get_stats` does, or ``None`` when the engine cores cannot answer.
        """
        import msgspec

        try:
            raws = await self.engine_core.call_utility_all_async("get_stats")
            snapshots = [msgspec.convert(raw, SchedulerStats) for raw in raws]
        except (EngineDeadError, RuntimeError, msgspec.ValidationError):
            return None
        for index, stats in enumerate(snapshots):
            self._last_stats[index] = stats
            self._notify_stats(EngineCoreOutputs(scheduler_stats=stats, engine_index=index))
        return await self.get_stats()

    async def reset_prefix_cache(self) -> bool:
        """Reset every engine core's prefix cache; ``True`` when all of them did."""
        self._check_alive()
        return all(bool(r) for r in await self.engine_core.call_utility_all_async("reset_prefix_cache"))

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def shutdown(self) -> None:
        """Stop the output handler and the engine-core process (terminate, wait up to 5 s, kill)."""
        handler = self._output_handler
        if handler is not None and not handler.done() and not handler.get_loop().is_closed():
            handler.cancel()
        self.engine_core.shutdown()
