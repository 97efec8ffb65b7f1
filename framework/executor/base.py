"""Executor: runs collective calls on the worker(s) of one engine core and returns the output rank's answer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput


class FutureOutput(Protocol):
    """A step submitted with ``execute_model(..., non_block=True)``: ``result()`` waits for it.

    Raises (from ``result``): whatever the blocking call would have raised.
    """

    def result(self) -> ModelRunnerOutput: ...


class DoneOutput:
    """A :class:`FutureOutput` that is already resolved."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def result(self) -> ModelRunnerOutput:
        return self._output


class Executor(ABC):
    """Owns the workers of one engine core: ``tensor_parallel_size x pipeline_parallel_size`` ranks.

    Args:
        config: the engine configuration.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None: ...

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Call ``method`` on every worker; returns each worker's result in rank order."""

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine core may keep in flight: one per pipeline stage (1 without pipeline parallelism)."""
        return self.config.parallel_config.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """The rank whose ``execute_model`` result is the step's output: tensor rank 0 of the last stage."""
        pc = self.config.parallel_config
        return (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size

    def determine_num_available_blocks(self) -> int:
        """KV blocks every rank can hold: the minimum over the ranks (each holds its heads' share of each block)."""
        return min(self.collective_rpc("determine_num_available_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks,))

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | FutureOutput:
        """Run one step on every rank; the output rank's result.

        With ``non_block=True`` the step is submitted and a :class:`FutureOutput` returned at once, so the
        engine core can submit the next micro-batch while this one is in the pipeline (executors that cannot
        overlap steps run it at once and return a resolved future).
        """
        output = self.collective_rpc("execute_model", (scheduler_output,))[self.output_rank]
        return DoneOutput(output) if non_block else output

    def check_health(self) -> None:
        """Raises an error when a worker is gone (nothing to check in-process)."""

    def shutdown(self) -> None:
        """Release the workers (nothing to do in-process)."""
