"""CUDA graphs for tokenmill's decode steps: :class:`CudaGraphCapture` wraps ``torch.cuda.CUDAGraph``.

The device-independent logic (buckets, static buffers, padding, when to replay) is in
``tokenmill.worker.graph_runner`` (the interface: ``tokenmill.plugin_api.GraphCapture``); this class only records and replays. All buckets of one model runner
allocate from one memory pool (``torch.cuda.graph_pool_handle()``), captured largest first, so the smaller
graphs reuse the larger ones' intermediate memory; each graph's output tensor stays referenced by the graph
runner, so no later capture reuses it.

Capture runs on a side stream (``torch.cuda.graph`` does that) after a device-wide synchronisation; the warm-up
run that compiles the Triton kernels and sets up cuBLAS workspaces has already happened eagerly. Collectives
(NCCL all-reduce / all-gather under tensor parallelism) are captured too; every rank captures the same buckets
in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tokenmill.plugin_api import GraphCapture


class CudaGraphCapture(GraphCapture):
    """One ``torch.cuda.CUDAGraph`` per bucket, sharing a memory pool."""

    def __init__(self, device: torch.device, pool: Any) -> None:
        super().__init__(device, pool)
        self.graph: torch.cuda.CUDAGraph | None = None

    @classmethod
    def create_pool(cls, device: torch.device) -> Any:
        """A private CUDA graph memory pool for all buckets of one model runner."""
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record ``fn`` into a new CUDA graph; returns its output tensor (refilled by each replay)."""
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        torch.cuda.synchronize(self.device)
        self.graph = graph
        return output

    def replay(self) -> None:
        """Launch the recorded kernels on the current stream.

        Raises:
            RuntimeError: nothing was captured.
        """
        if self.graph is None:
            raise RuntimeError("CudaGraphCapture.replay() before capture()")
        self.graph.replay()
