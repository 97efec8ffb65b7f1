"""Which :class:`~tokenmill.executor.base.Executor` runs an engine core's workers.

Kept apart from the base class so that the base never imports its subclasses; each backend's module is
imported only when chosen (``ray`` is heavy and optional).
"""

from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.executor.base import Executor


def get_executor_class(config: EngineConfig) -> type[Executor]:
    """The executor class for ``parallel_config.distributed_executor_backend``.

    ``None`` means ``"uni"`` for one rank and ``"mp"`` for more: ``"uni"`` -> UniProcExecutor (the worker
    in this process, one rank only), ``"mp"`` -> MultiprocExecutor (one local process per rank),
    ``"ray"`` -> RayExecutor (ranks as Ray actors; needs ``pip install 'tokenmill[ray]'``).

    Raises:
        ValueError: unknown backend, ``"uni"`` with more than one rank, or ``"ray"`` without Ray installed.
    """
    pc = config.parallel_config
    backend = pc.distributed_executor_backend
    tp = pc.tensor_parallel_size
    world = tp * getattr(pc, "pipeline_parallel_size", 1)
    if backend is None:
        backend = "uni" if world == 1 else "mp"
    if backend == "uni":
        if world != 1:
            raise ValueError(
                f"distributed_executor_backend: 'uni' runs one rank, but tensor_parallel_size={tp} x "
                f"pipeline_parallel_size={world // tp}; use 'mp' (one process per rank on this machine) or 'ray'"
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
                "distributed_executor_backend: 'ray' needs Ray, which is not installed; "
                "`pip install 'tokenmill[ray]'` (or use 'mp' for the ranks of one machine)"
            )
        from tokenmill.executor.ray import RayExecutor

        return RayExecutor
    raise ValueError(f"distributed_executor_backend: unknown backend {backend!r}; choose 'uni', 'mp' or 'ray'")
