"""RayExecutor: the ranks of one engine core (tensor x pipeline) as Ray actors, the way past one machine.

Placement: one placement-group bundle per rank (``{"GPU": 1, "CPU": 1}`` on CUDA-like platforms, Ray then
makes that GPU the only visible one so every actor uses local device 0; ``{"CPU": n}`` on CPU), rank ``i``
in bundle ``i``. When the engine core itself runs inside a placement group (a Ray data-parallel engine
core, or a user's own Ray task) the ranks use that group; otherwise the executor creates one with the
strategy of ``TOKENMILL_RAY_PLACEMENT_STRATEGY`` (default ``PACK``: as few nodes as fit) and removes it at
shutdown. Actors are named ``tokenmill-<id>-dp<d>-rank<r>`` in the Ray namespace ``tokenmill`` (for
``ray list actors`` and ``ray.get_actor``). The cluster is joined through ``--ray-address`` / ``RAY_ADDRESS``, or a local Ray instance is
started (see :mod:`tokenmill.executor.ray_utils`).

The actors rendezvous for ``torch.distributed`` (the platform's backend: gloo on CPU, nccl on GPUs) at
rank 0's node address on a port free there. A step's scheduler output is put in Ray's object store once
and every actor reads it from there; the output rank's result (tensor rank 0 of the last stage) is the
answer. Actor calls from one caller run in submission order, so ``execute_model(..., non_block=True)``
lets the engine core keep one micro-batch per pipeline stage in flight.

Faults: results are awaited with :func:`~tokenmill.executor.ray_utils.wait_all`, so an actor that dies
(``ray.kill``, a crash, its node leaving the cluster) fails the call within about a second as
:class:`~tokenmill.executor.multiproc.WorkerDiedError`, even while the other ranks are stuck in a
collective; a deadline (``TOKENMILL_RPC_TIMEOUT_S``) gives :class:`~tokenmill.executor.multiproc.WorkerError`.
After either the executor is unusable and its actors are killed, as with the multiprocess executor.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.base import Executor, FutureOutput
from tokenmill.executor.multiproc import (
    DEFAULT_RPC_TIMEOUT_S,
    DEFAULT_START_TIMEOUT_S,
    RPC_TIMEOUT_ENV,
    START_TIMEOUT_ENV,
    THREADS_ENV,
    Method,
    WorkerDiedError,
    WorkerError,
    _env_seconds,
    _platform_path,
    get_open_port,
)
from tokenmill.executor import ray_utils

logger = logging.getLogger(__name__)


class RayWorkerWrapper:
    """The body of one rank's actor: builds the Worker lazily and runs calls on it.

    Args:
        config: the engine configuration.
        rank: this actor's global rank (tensor rank ``rank % tp`` of stage ``rank // tp``).
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

    def node_id(self) -> str:
        """Ray id of the node this actor runs on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def pid(self) -> int:
        return os.getpid()

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


class _RayFuture:
    """``result()`` of a step submitted with ``non_block=True``."""

    def __init__(self, executor: RayExecutor, refs: list[Any], rank: int) -> None:
        self._executor, self._refs, self._rank = executor, refs, rank

    def result(self) -> ModelRunnerOutput:
        return self._executor._get(self._refs, "execute_model", self._executor.rpc_timeout_s)[self._rank]


class RayExecutor(Executor):
    """Ranks as Ray actors in a placement group (see the module docstring).

    Raises (from the constructor):
        ImportError: Ray is not installed.
        RayPlacementError: the cluster cannot place one bundle per rank.
        WorkerError / WorkerDiedError: a rank failed or died while starting.
    """

    def _init_executor(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from tokenmill.platforms import get_current_platform

        self._ray = ray
        self.actors: list[Any] = []
        self._owned_pg: Any = None
        self._broken: str | None = None
        pc = self.config.parallel_config
        self.world_size = pc.world_size
        self.rpc_timeout_s = _env_seconds(RPC_TIMEOUT_ENV, DEFAULT_RPC_TIMEOUT_S)
        platform = get_current_platform()
        gpu = platform.is_cuda_alike()
        ranks_sharing_machine = self.world_size * (pc.data_parallel_size if pc.data_parallel_backend == "mp" else 1)
        cpus = 1 if gpu else ray_utils.cpus_per_worker(ranks_sharing_machine)
        self._owns_connection = ray_utils.connect_ray(pc.ray_address, num_cpus_if_local=cpus * self.world_size)
        override = os.environ.get(THREADS_ENV)
        num_threads = max(1, int(override)) if override else cpus
        try:
            pg = ray.util.get_current_placement_group()
            if pg is None or len(pg.bundle_specs) < self.world_size:
                base = {"GPU": 1.0, "CPU": 1.0} if gpu else {"CPU": float(cpus)}
                pg = self._owned_pg = ray_utils.create_placement_group(
                    ray_utils.bundle_specs(self.world_size, base), name=f"tokenmill-dp{pc.data_parallel_rank}"
                )
                first_bundle = 0
            else:
                # inside a data-parallel engine core's group: bundles [first_bundle, first_bundle + world)
                first_bundle = len(pg.bundle_specs) - self.world_size
            actor_cls = ray.remote(RayWorkerWrapper)
            path = _platform_path()
            env = {"env_vars": ray_utils.forwarded_env()}
            tag = f"tokenmill-{uuid.uuid4().hex[:8]}-dp{pc.data_parallel_rank}"
            for rank in range(self.world_size):
                bundle = pg.bundle_specs[first_bundle + rank]
                options: dict[str, Any] = {
                    "num_cpus": bundle.get("CPU", 0),
                    "num_gpus": bundle.get("GPU", 0),
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=pg,
                        placement_group_bundle_index=first_bundle + rank,
                        placement_group_capture_child_tasks=False,
                    ),
                    "runtime_env": env,
                    "max_restarts": 0,
                    "name": f"{tag}-rank{rank}",
                    "namespace": ray_utils.RAY_NAMESPACE,
                }
                self.actors.append(actor_cls.options(**options).remote(self.config, rank, path, num_threads))
            start_timeout = _env_seconds(START_TIMEOUT_ENV, DEFAULT_START_TIMEOUT_S)
            host = self._get([self.actors[0].node_ip.remote()], "node_ip", start_timeout)[0]
            port = self._get([self.actors[0].open_port.remote()], "open_port", start_timeout)[0]
            self.distributed_init_method = f"tcp://{host}:{port}"
            self._get([a.start.remote(self.distributed_init_method) for a in self.actors], "start", start_timeout)
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d Ray worker actors ready (%s)", self.world_size, self.distributed_init_method)

    # Same signature as Executor.collective_rpc: every executor implements the one interface.
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
        refs = self._submit(method, args, kwargs, reply_rank)
        name = method if isinstance(method, str) else getattr(method, "__qualname__", repr(method))
        return self._get(refs, name, self.rpc_timeout_s if timeout_s == -1.0 else timeout_s)

    def _submit(self, method: Method, args: tuple, kwargs: dict | None, reply_rank: int | None) -> list[Any]:
        if self._broken is not None:
            raise WorkerError(f"the executor's workers are unusable after an earlier failure: {self._broken}")
        packed = self._ray.put((args, kwargs or {}))  # a top-level ObjectRef argument arrives resolved
        return [a.execute_method.remote(method, packed, reply_rank) for a in self.actors]

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | FutureOutput:
        rank = self.output_rank
        future = _RayFuture(self, self._submit("execute_model", (scheduler_output,), None, rank), rank)
        return future if non_block else future.result()

    def check_health(self) -> None:
        """Raises:
        WorkerError: the executor failed earlier (a dead actor is noticed by the next call).
        """
        if self._broken is not None:
            raise WorkerError(self._broken)

    def shutdown(self) -> None:
        """Kill the actors and remove the placement group this executor created (idempotent)."""
        for actor in getattr(self, "actors", []):
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - best effort
                pass
        self.actors = []
        if getattr(self, "_owned_pg", None) is not None:
            ray_utils.remove_placement_group(self._owned_pg)
            self._owned_pg = None
        if getattr(self, "_owns_connection", False):
            self._owns_connection = False
            try:
                self._ray.shutdown()
            except Exception:  # noqa: BLE001
                pass

    def _get(self, refs: list[Any], what: str, timeout_s: float | None) -> list[Any]:
        ray = self._ray
        try:
            return ray_utils.wait_all(refs, timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            self._fail(f"{what!r} timed out")
            raise WorkerError(f"Ray worker actors did not answer {what!r} within {timeout_s} s") from exc
        except ray.exceptions.RayActorError as exc:
            self._fail(f"actor died during {what!r}")
            raise WorkerDiedError(f"a Ray worker actor died during {what!r}: {_first_line(exc)}") from exc
        except ray.exceptions.RayTaskError as exc:
            # A peer's death often surfaces first as a collective error on a live rank: prefer reporting it.
            dead = self._dead_ranks()
            self._fail(f"actor raised in {what!r}")
            if dead:
                raise WorkerDiedError(
                    f"Ray worker actor(s) of rank(s) {dead} died or stopped answering during {what!r} (a surviving rank saw: "
                    f"{_first_line(exc.cause if getattr(exc, 'cause', None) else exc)})"
                ) from exc
            raise WorkerError(f"a Ray worker actor failed in {what!r}:\n{exc}") from exc

    def _dead_ranks(self, grace_s: float = 3.0) -> list[int]:
        """Ranks whose actor does not answer a ping (dead, or on a node that left)."""
        ray = self._ray
        pings = {a.pid.remote(): rank for rank, a in enumerate(self.actors)}
        ready, not_ready = ray.wait(list(pings), num_returns=len(pings), timeout=grace_s)
        dead = [pings[r] for r in not_ready]
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                dead.append(pings[ref])
        return sorted(dead)

    def _fail(self, reason: str) -> None:
        if self._broken is None:
            self._broken = reason
            logger.error("ray executor failed: %s; stopping the actors", reason)
        self.shutdown()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
