"""Executor: runs collective calls on the worker(s) and returns rank 0's answer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """Owns the workers of one engine.

    Args:
        config: the engine configuration.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._init_executor()

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        """UniProcExecutor for one rank, else the configured backend.

        Raises:
            ValueError: unknown backend, or a multi-rank backend that is not available in this build.
        """
        backend = config.parallel_config.distributed_executor_backend
        tp = config.parallel_config.tensor_parallel_size
        if backend in (None, "uni") and tp == 1:
            from tokenmill.executor.uniproc import UniProcExecutor

            return UniProcExecutor
        raise ValueError(
            f"distributed_executor_backend: {backend or 'mp'!r} with tensor_parallel_size={tp} is not available yet; "
            "use --tensor-parallel-size 1"
        )

    @abstractmethod
    def _init_executor(self) -> None: ...

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Call ``method`` on every worker; returns each worker's result in rank order."""

    def determine_num_available_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_available_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks,))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def shutdown(self) -> None:
        """Release workers (nothing to do in-process)."""
