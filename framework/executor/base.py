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
        """The executor class for ``parallel_config.distributed_executor_backend``.

        ``None`` means ``"uni"`` for one rank and ``"mp"`` for more: ``"uni"`` -> UniProcExecutor (the worker
        in this process, one rank only), ``"mp"`` -> MultiprocExecutor (one local process per rank),
        ``"ray"`` -> RayExecutor (ranks as Ray actors; needs ``pip install ray``).

        Raises:
            ValueError: unknown backend, ``"uni"`` with more than one rank, or ``"ray"`` without Ray installed.
        """
        backend = config.parallel_config.distributed_executor_backend
        tp = config.parallel_config.tensor_parallel_size
        if backend is None:
            backend = "uni" if tp == 1 else "mp"
        if backend == "uni":
            if tp != 1:
                raise ValueError(
                    f"distributed_executor_backend: 'uni' runs one rank, but tensor_parallel_size={tp}; "
                    "use 'mp' (one process per rank on this machine) or 'ray'"
                )
            from tokenmill.executor.uniproc import UniProcExecutor

            return UniProcExecutor
        if backend == "mp":
            from tokenmill.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor
        if backend == "ray":
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                raise ValueError(
                    "distributed_executor_backend: 'ray' needs Ray, which is not installed; `pip install ray` "
                    "(or use 'mp' for tensor parallelism on one machine)"
                )
            from tokenmill.executor.ray import RayExecutor

            return RayExecutor
        raise ValueError(f"distributed_executor_backend: unknown backend {backend!r}; choose 'uni', 'mp' or 'ray'")

    @abstractmethod
    def _init_executor(self) -> None: ...

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Call ``method`` on every worker; returns each worker's result in rank order."""

    def determine_num_available_blocks(self) -> int:
        """KV blocks every rank can hold: the minimum over the ranks (each holds its heads' share of each block)."""
        return min(self.collective_rpc("determine_num_available_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks,))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def shutdown(self) -> None:
        """Release the workers (nothing to do in-process)."""
