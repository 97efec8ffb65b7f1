"""RayExecutor: tensor-parallel ranks as Ray actors (the way past one machine).

Each rank is an actor holding the platform's Worker (the same class the other executors run). The actors
rendezvous for ``torch.distributed`` at rank 0's node address on a port that is free there. A step's
scheduler output is put in Ray's object store once and every actor reads it from there; rank 0's result is
the answer. A dead actor surfaces as :class:`~tokenmill.executor.multiproc.WorkerDiedError`, a deadline
(``TOKENMILL_RPC_TIMEOUT_S``) as :class:`~tokenmill.executor.multiproc.WorkerError`; after either the
executor is unusable, as with the multiprocess executor.

Placement: an actor asks for one GPU on CUDA-like platforms (Ray then makes that GPU the only visible one,
so every actor uses local device 0) and for its share of a node's cores on CPU. Ray is connected with
``ray.init()`` when it is not yet (an existing cluster is joined through ``RAY_ADDRESS``). Ray is imported
only when this executor is built; :meth:`Executor.get_class` names ``pip install ray`` when it is missing.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.base import Executor
from tokenmill.executor.multiproc import (
    DEFAULT_RPC_TIMEOUT_S,
    DEFAULT_START_TIMEOUT_S,
    RPC_TIMEOUT_ENV,
    START_TIMEOUT_ENV,
    Method,
    WorkerDiedError,
    WorkerError,
    _env_seconds,
    _platform_path,
    get_open_port,
    threads_per_worker,
)

logger = logging.getLogger(__name__)


class RayWorkerWrapper:
    """The body of one rank's actor: builds the Worker lazily and runs calls on it.

    Args:
        config: the engine configuration.
        rank: this actor's tensor-parallel rank.
        platform_path: ``"module:Class"`` of the platform the driver chose.
        num_threads: torch intra-op threads for this rank.
    """

    def __init__(self, config: EngineConfig, rank: int, platform_path: str, num_threads: int) -> None:
        import torch

        torch.set_num_threads(num_threads)
        self.config = config
        self.rank = rank
        self.platform_path = platform_path
        self.worker: Any = None

    def node_ip(self) -> str:
        """Address of the node this actor runs on."""
        import ray

        return str(ray.util.get_node_ip_address())

    def open_port(self) -> int:
        """A TCP port free on this actor's node."""
        return get_open_port("0.0.0.0")

    def start(self, distributed_init_method: str) -> None:
        """Build the Worker, join the process group, load this rank's weights."""
        from tokenmill.platforms import set_current_platform
        from tokenmill.plugins import resolve_qualname

        platform = set_current_platform(resolve_qualname(self.platform_path))
        worker_cls = resolve_qualname(platform.worker_cls)
        self.worker = worker_cls(
            self.config, local_rank=0, rank=self.rank, distributed_init_method=distributed_init_method
        )
        self.worker.init_device()
        self.worker.load_model()

    def execute_method(self, method: Method, packed: tuple[tuple, dict], reply_rank: int | None) -> Any:
        """Call a Worker method (by name) or ``method(worker, *args, **kwargs)``; ``packed`` is ``(args, kwargs)``."""
        args, kwargs = packed
        if isinstance(method, str):
            result = getattr(self.worker, method)(*args, **kwargs)
        else:
            result = method(self.worker, *args, **kwargs)
        return result if reply_rank is None or reply_rank == self.rank else None


class RayExecutor(Executor):
    """Ranks as Ray actors (see the module docstring).

    Raises (from the constructor):
        ImportError: Ray is not installed.
        WorkerError / WorkerDiedError: a rank failed or died while starting.
    """

    def _init_executor(self) -> None:
        import ray

        self._ray = ray
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True)
        from tokenmill.platforms import get_current_platform

        platform = get_current_platform()
        self.world_size = self.config.parallel_config.tensor_parallel_size
        self.rpc_timeout_s = _env_seconds(RPC_TIMEOUT_ENV, DEFAULT_RPC_TIMEOUT_S)
        self._broken: str | None = None
        gpu = platform.is_cuda_alike()
        num_threads = threads_per_worker(1 if gpu else self.world_size)
        options: dict[str, Any] = {"num_gpus": 1, "num_cpus": 1} if gpu else {"num_cpus": num_threads}
        actor_cls = ray.remote(RayWorkerWrapper)
        path = _platform_path()
        self.actors = [
            actor_cls.options(**options).remote(self.config, rank, path, num_threads) for rank in range(self.world_size)
        ]
        start_timeout = _env_seconds(START_TIMEOUT_ENV, DEFAULT_START_TIMEOUT_S)
        try:
            host = self._get([self.actors[0].node_ip.remote()], "node_ip", start_timeout)[0]
            port = self._get([self.actors[0].open_port.remote()], "open_port", start_timeout)[0]
            self.distributed_init_method = f"tcp://{host}:{port}"
            self._get([a.start.remote(self.distributed_init_method) for a in self.actors], "start", start_timeout)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d Ray worker actors ready (%s)", self.world_size, self.distributed_init_method)

    def collective_rpc(
        self,
        method: Method,
        args: tuple = (),
        kwargs: dict | None = None,
        *,
        reply_rank: int | None = None,
        timeout_s: float | None = -1.0,
    ) -> list[Any]:
        """Call ``method`` on every actor; same contract as ``MultiprocExecutor.collective_rpc``.

        The arguments are put in the object store once and shared by every actor.
        """
        if self._broken is not None:
            raise WorkerError(f"the executor's workers are unusable after an earlier failure: {self._broken}")
        ray = self._ray
        packed = ray.put((args, kwargs or {}))  # a top-level ObjectRef argument arrives resolved in each actor
        refs = [a.execute_method.remote(method, packed, reply_rank) for a in self.actors]
        name = method if isinstance(method, str) else getattr(method, "__qualname__", repr(method))
        return self._get(refs, name, self.rpc_timeout_s if timeout_s == -1.0 else timeout_s)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,), reply_rank=0)[0]

    def shutdown(self) -> None:
        """Kill the actors (idempotent)."""
        for actor in getattr(self, "actors", []):
            try:
                self._ray.kill(actor)
            except Exception:  # noqa: BLE001 - best effort
                pass
        self.actors = []

    def _get(self, refs: list[Any], what: str, timeout_s: float | None) -> list[Any]:
        ray = self._ray
        try:
            return list(ray.get(refs, timeout=timeout_s))
        except ray.exceptions.GetTimeoutError as exc:
            self._fail(f"{what!r} timed out")
            raise WorkerError(f"Ray worker actors did not answer {what!r} within {timeout_s} s") from exc
        except ray.exceptions.RayActorError as exc:
            self._fail(f"actor died during {what!r}")
            raise WorkerDiedError(f"a tensor-parallel Ray worker actor died during {what!r}: {exc}") from exc
        except ray.exceptions.RayTaskError as exc:
            self._fail(f"actor raised in {what!r}")
            raise WorkerError(f"a Ray worker actor failed in {what!r}:\n{exc}") from exc

    def _fail(self, reason: str) -> None:
        if self._broken is None:
            self._broken = reason
            logger.error("ray executor failed: %s; stopping the actors", reason)
        self.shutdown()

