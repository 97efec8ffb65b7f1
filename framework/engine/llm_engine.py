"""LLMEngine: the synchronous front end used by ``LLM``: the EngineCore in this process (no ZMQ), or with
``data_parallel_size`` N > 1 N engine cores in their own processes (``SyncMPClient``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.engine.core_client import InprocClient, SyncMPClient
from tokenmill.engine.input_processor import InputProcessor, RequestInput
from tokenmill.engine.messages import SchedulerStats
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine_args import EngineArgs
from tokenmill.lora.request import LoRALoadError, LoRARequest
from tokenmill.outputs import PoolingRequestOutput, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.metrics import SpecDecodingStats


class LLMEngine:
    """Add requests, call :meth:`step` until :meth:`has_unfinished_requests` is false.

    Args:
        engine_config: the full configuration (the EngineCore fills in ``num_gpu_blocks``).
        tokenizer: a ``transformers`` tokenizer (default: the model's, via :func:`tokenmill.tokenizer.get_tokenizer`).
        engine_core_cls: EngineCore class or ``"module:Class"`` path (tests inject fakes here).
    """

    def __init__(
        self,
        engine_config: EngineConfig,
        *,
        tokenizer: Any = None,
        engine_core_cls: str | type | None = None,
    ) -> None:
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        if tokenizer is None:
            from tokenmill.tokenizer import get_tokenizer

            tokenizer = get_tokenizer(self.model_config)
        self.tokenizer = tokenizer
        self.engine_core: InprocClient | SyncMPClient
        if engine_config.parallel_config.data_parallel_size > 1:
            if engine_core_cls is not None and not isinstance(engine_core_cls, str):
                raise TypeError("with data_parallel_size > 1, engine_core_cls must be a 'module:Class' path (the "
                                "engine cores run in their own processes)")
            self.engine_core = SyncMPClient(engine_config, engine_core_cls)
        else:
            self.engine_core = InprocClient(engine_config, engine_core_cls)
        self.input_processor = InputProcessor(
            self.model_config, tokenizer, engine_config.cache_config, engine_config.structured_outputs_config,
            logits_processor_pattern=engine_config.logits_processor_pattern,
            speculative=engine_config.speculative_config is not None,
            mm_config=engine_config.multimodal_config,
        )
        self.output_processor = OutputProcessor(tokenizer)
        spec = engine_config.speculative_config
        # speculative decoding counters summed over every step so far (None without speculation)
        self.spec_decoding_stats = SpecDecodingStats.new(spec.num_speculative_tokens) if spec is not None else None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> LLMEngine:
        """Build the configuration from ``engine_args`` and start the engine (loads the model)."""
        return cls(engine_args.create_engine_config(), **kwargs)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | PoolingParams,
        **options: Any,
    ) -> None:
        """Validate and queue a request; with PoolingParams a pooling request, whose one output is a
        PoolingRequestOutput.

        ``options``: the keyword fields of :class:`~tokenmill.engine.input_processor.RequestInput`
        (``arrival_time``, ``priority``, ``add_special_tokens``, ``prompt_param``, ``lora_request``: its LoRA
        adapter, ``None`` for the base model; ``cache_salt``: only requests with the same salt share
        prefix-cache blocks).

        Raises:
            InvalidRequestError: bad prompt or parameters, a duplicate id, or the engine core rejected it (with
                data-parallel engine cores, in their own processes, such a rejection arrives later instead: the
                request finishes with ``finish_reason == "error"``).
        """
        processed = self.input_processor.process(
            RequestInput(request_id=request_id, prompt=prompt, params=params, **options)
        )
        self.output_processor.add_request(processed)
        added: list[str] = []
        try:
            for engine_request in processed.engine_requests:
                self.engine_core.add_request(engine_request)
                added.append(engine_request.request_id)
        except BaseException:
            self.output_processor.abort_requests([request_id])
            self.engine_core.abort_requests(added)
            raise

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter now, on every engine core (requests naming it would load it on first use anyway).

        Raises:
            LoRALoadError: it cannot be used (the reason in the message); nothing of it stays loaded.
        """
        args = (lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path)
        reasons = [r for r in self.engine_core.call_utility_all("add_lora", *args) if r is not None]
        if reasons:
            self.engine_core.call_utility_all("remove_lora", lora_request.lora_int_id)
            raise LoRALoadError(str(reasons[0]))

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter from every engine core; returns whether one had it loaded."""
        return any(self.engine_core.call_utility_all("remove_lora", lora_int_id))

    def list_loras(self) -> list[int]:
        """Ids of the loaded adapters, sorted (with data-parallel engine cores: loaded in any of them; a request
        loads its adapter only on the engine core it went to)."""
        return sorted({int(i) for ids in self.engine_core.call_utility_all("list_loras") for i in ids})

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        """Drop requests (unknown ids are ignored); they produce no further outputs."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.engine_core.abort_requests(self.output_processor.abort_requests(ids))

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Run one engine step; returns the outputs of requests that changed (per their ``output_kind``).

        A request the engine core failed comes back finished with ``finish_reason == "error"`` and the
        message in ``stop_reason``.

        Raises:
            RuntimeError: the front end waits for requests the engine core no longer has.
        """
        if not self.engine_core.has_unfinished_requests():
            if self.output_processor.has_unfinished_requests():
                raise RuntimeError(
                    f"engine core has no unfinished requests but {self.output_processor.get_num_unfinished_requests()} "
                    "are still waiting for outputs (the engine core dropped them without a finish reason)"
                )
            return []
        outputs = self.engine_core.get_output()
        stats = outputs.scheduler_stats
        if self.spec_decoding_stats is not None and stats is not None and stats.spec_decoding_stats is not None:
            self.spec_decoding_stats.add(stats.spec_decoding_stats)
        result = self.output_processor.process_outputs(outputs.outputs)
        self.engine_core.abort_requests(result.reqs_to_abort)
        return result.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        """Engine-core gauges now."""
        return self.engine_core.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
