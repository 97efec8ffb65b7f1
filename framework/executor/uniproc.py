"""UniProcExecutor: one worker inside the engine core's own process."""

from __future__ import annotations

from typing import Any

from tokenmill.executor.base import Executor
from tokenmill.plugins import resolve_qualname


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        from tokenmill.platforms import get_current_platform

        worker_cls = resolve_qualname(get_current_platform().worker_cls)
        self.worker = worker_cls(self.config, local_rank=0, rank=0)
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def shutdown(self) -> None:
        """Stop the worker's background work (a compile worker process, if any)."""
        stop = getattr(getattr(self, "worker", None), "shutdown", None)
        if stop is not None:
            stop()
