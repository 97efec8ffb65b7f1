"""Data-parallel engine cores as Ray actors (``--data-parallel-backend ray``).

Each engine core gets its own placement group: one bundle per rank of its executor (``{"CPU": n}`` on CPU,
``{"GPU": 1, "CPU": 1}`` on GPUs), extended by ``TOKENMILL_RAY_BUNDLE_RESOURCES`` (one object for every
bundle, or a list with one per bundle of all engine cores in order: engine 0's ranks first). The engine-core
actor runs in bundle 0: with one rank it also runs the model there (the in-process executor); with more,
it asks for no resources itself and its :class:`~tokenmill.executor.ray.RayExecutor` places one worker
actor per bundle of the same group. The actor connects back to the front end's ZMQ sockets over TCP and
runs the same busy loop as a local engine-core process.

Lifetime: the actors and groups belong to the front end's Ray job. ``stop`` kills the engine-core actor
(its worker actors, which it owns, die with it) and removes the group; if the front end itself dies, Ray
kills its actors and removes its groups with the job.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from tokenmill.config import EngineConfig, ParallelConfig
from tokenmill.executor import ray_utils

logger = logging.getLogger(__name__)


def front_end_address(pc: ParallelConfig) -> str:
    """Join the cluster (``--ray-address`` / ``RAY_ADDRESS``, else a local one) and return the address of
    this node, which the engine-core actors connect to."""
    import ray

    per_engine = pc.world_size * ray_utils.cpus_per_worker(pc.world_size)
    ray_utils.connect_ray(pc.ray_address, num_cpus_if_local=pc.data_parallel_size * per_engine)
    return str(ray.util.get_node_ip_address())


class EngineCoreActor:
    """Body of one engine-core actor: runs :class:`~tokenmill.engine.core_proc.EngineCoreProc` until stopped."""

    def __init__(self, num_threads: int) -> None:
        import torch

        torch.set_num_threads(num_threads)

    def run(self, config: EngineConfig, input_address: str, output_address: str, engine_core_cls: str,
            identity: bytes) -> int:
        """Serve the front end; returns the busy loop's exit status (0: stopped, 1: fatal error)."""
        from tokenmill.engine.core_proc import EngineCoreProc

        if not logging.getLogger().handlers:
            rank = config.parallel_config.data_parallel_rank
            logging.basicConfig(level=logging.INFO,
                                format=f"%(asctime)s %(levelname)s [engine core {rank}] %(message)s")
        proc = EngineCoreProc(config, input_address, output_address, engine_core_cls, parent_pid=None,
                              identity=identity, install_signal_handlers=False)
        return proc.run()


class RayEngineActor:
    """A handle on one Ray-placed engine core (what :class:`AsyncMPClient` keeps per engine).

    Attributes:
        actor: the engine-core actor.
        run_ref: the reference of its ``run`` call; ready when the engine core exits or dies.
        placement_group: its placement group.
    """

    def __init__(self, actor: Any, run_ref: Any, placement_group: Any, rank: int) -> None:
        self.actor, self.run_ref, self.placement_group, self.rank = actor, run_ref, placement_group, rank
        self._exit: tuple[int, str] | None = None

    @classmethod
    def start(cls, config: EngineConfig, input_address: str, output_address: str, engine_core_cls: str,
              identity: bytes) -> RayEngineActor:
        """Place engine core ``config.parallel_config.data_parallel_rank`` and start its busy loop.

        Raises:
            RayPlacementError: the cluster cannot place its bundles.
        """
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from tokenmill.platforms import get_current_platform

        pc = config.parallel_config
        rank = pc.data_parallel_rank
        gpu = get_current_platform().is_cuda_alike()
        cpus = 1 if gpu else ray_utils.cpus_per_worker(pc.world_size)
        base = {"GPU": 1.0, "CPU": 1.0} if gpu else {"CPU": float(cpus)}
        bundles = ray_utils.bundle_specs(pc.world_size, base, first=rank * pc.world_size,
                                         total=pc.data_parallel_size * pc.world_size)
        pg = ray_utils.create_placement_group(bundles, name=f"tokenmill-dp{rank}")
        in_process = pc.world_size == 1
        options: dict[str, Any] = {
            "num_cpus": bundles[0].get("CPU", 0) if in_process else 0,
            "num_gpus": bundles[0].get("GPU", 0) if in_process else 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
            ),
            "runtime_env": {"env_vars": ray_utils.forwarded_env()},
            "max_restarts": 0,
            "name": f"tokenmill-engine-core-{rank}-{uuid.uuid4().hex[:8]}",
            "namespace": ray_utils.RAY_NAMESPACE,
        }
        try:
            actor = ray.remote(EngineCoreActor).options(**options).remote(cpus)
            run_ref = actor.run.remote(config, input_address, output_address, engine_core_cls, identity)
        except BaseException:
            ray_utils.remove_placement_group(pg)
            raise
        logger.info("engine core %d placed as a Ray actor (%d bundle(s): %s)", rank, len(bundles), bundles)
        return cls(actor, run_ref, pg, rank)

    def _poll(self) -> None:
        import ray

        if self._exit is not None:
            return
        ready, _ = ray.wait([self.run_ref], timeout=0)
        if not ready:
            return
        try:
            status = int(ray.get(self.run_ref))
            self._exit = (status, f"Ray actor exited with status {status}")
        except ray.exceptions.RayError as exc:
            text = str(exc).strip().splitlines()
            self._exit = (-1, f"Ray actor died: {text[0] if text else type(exc).__name__}")

    @property
    def exitcode(self) -> int | None:
        self._poll()
        return None if self._exit is None else self._exit[0]

    def describe_exit(self) -> str:
        self._poll()
        return "running" if self._exit is None else self._exit[1]

    def stop(self) -> None:
        """Kill the actor (its worker actors go with it) and remove its placement group."""
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        ray_utils.remove_placement_group(self.placement_group)
