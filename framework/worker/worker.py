"""Worker: owns one device, the model runner on it and its share of the KV cache.

With pipeline parallelism the worker also moves the activations between stages: a stage other than the first
receives the previous stage's :class:`~tokenmill.layers.pipeline.IntermediateTensors` before running its
layers, a stage other than the last sends its own to the next stage and returns ``None`` (only the last
stage samples, so only its output rank answers the executor).
"""

from __future__ import annotations

import logging
import os

import torch

from tokenmill.attention.selector import select_attn_backend
from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.distributed import get_pp_group, init_distributed_environment, initialize_model_parallel
from tokenmill.layers.pipeline import IntermediateTensors
from tokenmill.lora.request import LoRALoadError, LoRARequest
from tokenmill.platforms import get_current_platform
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
GiB = 1 << 30


class Worker:
    """One rank of an engine core (tensor-parallel rank ``rank % tp`` of pipeline stage ``rank // tp``).

    Args:
        config: the engine configuration.
        local_rank: device index on this machine.
        rank: global rank among the engine core's ``tensor x pipeline`` ranks.
        distributed_init_method: ``torch.distributed`` init URL when there is more than one rank.
    """

    def __init__(
        self, config: EngineConfig, local_rank: int = 0, rank: int = 0, distributed_init_method: str | None = None
    ) -> None:
        from tokenmill.plugins import load_general_plugins

        load_general_plugins("worker")  # a worker process or Ray actor; a no-op where the process already ran it
        self.config = config
        self.local_rank = local_rank
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.platform = get_current_platform()
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        self.device = self.platform.make_device(self.local_rank)
        self.platform.set_device(self.device)
        pc = self.config.parallel_config
        init_distributed_environment(
            pc.world_size,
            self.rank,
            self.distributed_init_method or os.environ.get("TOKENMILL_DIST_INIT", "env://"),
            self.platform.dist_backend,
        )
        initialize_model_parallel(pc.tensor_parallel_size, pc.pipeline_parallel_size, self.rank)
        self.platform.manual_seed_all(self.config.model_config.seed)
        choice = select_attn_backend(self.platform, self.config)
        if self.rank == 0:
            logger.info("attention backend: %s", choice.describe())
        self.model_runner = ModelRunner(self.config, self.device, choice.path)

    def load_model(self) -> None:
        assert self.model_runner is not None
        self.model_runner.load_model()

    def determine_num_available_blocks(self) -> int:
        """KV blocks that fit in the memory the platform grants (or ``num_gpu_blocks_override``).

        On a platform that measures device memory (``Platform.supports_memory_profiling``) a forward pass of a
        full step (``max_num_batched_tokens`` tokens) runs first, and its peak activation memory is left out of
        the cache, as vLLM does; the rest of the formula is ``Platform.determine_kv_cache_bytes``. A hybrid
        model's state slots (``cache_config.num_state_slots``, each the states of every state layer) come out
        of that budget first; the blocks get the rest.

        Raises:
            ValueError: the granted memory holds no block, or not the state slots.
        """
        assert self.model_runner is not None
        cc = self.config.cache_config
        if cc.num_gpu_blocks_override:
            return cc.num_gpu_blocks_override
        per_block = self.model_runner.kv_cache_bytes_per_block()
        state_bytes = self.model_runner.state_bytes_per_slot() * cc.num_state_slots
        if per_block == 0:
            # No layer keeps keys/values (an encoder-only or attention-free model): the blocks only count the
            # tokens the scheduler admits, and a pooling request holds its blocks for the one step that runs it.
            sc = self.config.scheduler_config
            num_blocks = -(-sc.max_num_batched_tokens // cc.block_size) + sc.max_num_seqs
            if state_bytes:
                num_blocks = max(num_blocks, -(-self.config.model_config.max_model_len // cc.block_size))
                budget = self._cache_budget()
                if budget < state_bytes:
                    raise ValueError(f"kv_cache_memory: {budget} bytes do not hold the {cc.num_state_slots} state "
                                     f"slots ({state_bytes} bytes); give the cache more memory or lower max_num_seqs")
                if self.rank == 0:
                    logger.info("state cache: %d slots, %.2f GiB (no attention layer keeps keys/values)",
                                cc.num_state_slots, state_bytes / GiB)
            elif self.rank == 0:
                logger.info("KV cache: none (no attention layer keeps keys/values); %d blocks of token accounting",
                            num_blocks)
            return num_blocks
        budget = self._cache_budget()
        num_blocks = (budget - state_bytes) // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory: {budget} bytes hold no KV block ({per_block} bytes each) after the "
                f"{state_bytes} bytes of state slots; give the cache more memory"
                if state_bytes else
                f"kv_cache_memory: {budget} bytes hold no KV block ({per_block} bytes each); give the cache more memory"
            )
        if state_bytes and self.rank == 0:
            logger.info("hybrid cache: %d state slots (%.2f GiB) and %d KV blocks", cc.num_state_slots,
                        state_bytes / GiB, num_blocks)
        if self.rank == 0:  # a quantized --kv-cache-dtype shows here as smaller blocks, so more of them
            logger.info("KV cache: %d blocks of %d bytes (%s)", num_blocks, per_block,
                        str(self.model_runner.kv_cache_dtype).removeprefix("torch."))
        return int(num_blocks)

    def _cache_budget(self) -> int:
        """Bytes the platform grants the KV (and state) cache, after a profiling pass where it measures."""
        assert self.model_runner is not None
        peak = 0
        if self.config.cache_config.kv_cache_memory is None and self.platform.supports_memory_profiling():
            peak = self.model_runner.profile_run()
        weights = self.model_runner.model_memory_bytes()
        budget = self.platform.determine_kv_cache_bytes(
            self.config, model_memory_bytes=weights, peak_activation_bytes=peak
        )
        if self.rank == 0:
            logger.info("KV cache: %.2f GiB of %s (weights %.2f GiB, profiled peak activations %.2f GiB)",
                        budget / GiB, str(self.model_runner.kv_cache_dtype).removeprefix("torch."), weights / GiB,
                        peak / GiB)
        return int(budget)

    def initialize_cache(self, num_blocks: int) -> None:
        assert self.model_runner is not None
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run this rank's part of the step.

        Returns:
            The sampled tokens on the last pipeline stage; ``None`` on the others (after sending their
            activations on). Every stage of a step sees the same scheduler output, so either all of them
            exchange activations or, for a step without tokens, none does.
        """
        assert self.model_runner is not None
        pp = get_pp_group()
        intermediate = None
        if pp.world_size > 1 and not pp.is_first_rank and scheduler_output.total_num_scheduled_tokens > 0:
            model = self.model_runner.model
            assert model is not None
            buffers = model.make_empty_intermediate_tensors(
                scheduler_output.total_num_scheduled_tokens, self.model_runner.dtype, self.device
            )
            intermediate = IntermediateTensors(pp.recv_tensor_dict(buffers.tensors))
        output = self.model_runner.execute_model(scheduler_output, intermediate)
        if isinstance(output, IntermediateTensors):
            pp.send_tensor_dict(output.tensors)
            return None
        return output if pp.is_last_rank else None

    def add_lora(self, lora_request: LoRARequest) -> str | None:
        """Load an adapter into this rank's host cache; returns why it cannot be used, or ``None``."""
        manager = self.model_runner.lora_manager if self.model_runner is not None else None
        if manager is None:
            return "LoRA is not enabled (start the engine with --enable-lora)"
        try:
            manager.add_adapter(lora_request)
        except LoRALoadError as exc:
            return str(exc)
        return None

    def remove_lora(self, lora_int_id: int) -> bool:
        manager = self.model_runner.lora_manager if self.model_runner is not None else None
        return manager is not None and manager.remove_adapter(lora_int_id)

    def list_loras(self) -> list[int]:
        manager = self.model_runner.lora_manager if self.model_runner is not None else None
        return [] if manager is None else manager.list_adapters()

    def shutdown(self) -> None:
        """Stop background work of the model runner (compilation); the model stays usable."""
        if self.model_runner is not None:
            self.model_runner.shutdown()
