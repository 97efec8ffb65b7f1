"""Device graphs for decode-only steps: capture once per batch-size bucket, replay with new inputs.

A decode-only step (every scheduled request has exactly one query token) has a shape fixed by its batch
size alone, so the model's forward pass for it can be recorded once as a device graph (a CUDA graph on
NVIDIA) and replayed for every later step of that size, removing the per-kernel launch cost that dominates
small decode batches. This module holds the device-independent part; how a graph is recorded and replayed
comes from the platform (``Platform.graph_capture_cls()``, e.g. ``tokenmill_cuda.graphs:CudaGraphCapture``).

How a step runs on a graph:

* Buckets: batch sizes ``1, 2, 4, 8, 16, 24, 32, ... 256`` (steps of 8), cut at ``max_num_seqs`` (itself added
  when it falls between two buckets). A batch of ``n`` requests runs on the smallest bucket ``b >= n``.
* Static buffers, allocated once at the largest bucket: ``input_ids``, ``positions``, ``slot_mapping``,
  ``seq_lens``, ``block_table`` (``[max_bs, ceil(max_model_len / block_size)]``) and ``query_start_loc``
  (``0, 1, ..., max_bs``: one token per request, fixed). Each bucket's graph was recorded reading the first
  ``b`` rows of them; a replay copies the step's inputs into those rows first.
* Padding rows ``n .. b-1`` are harmless: token 0 at position 0, ``slot_mapping = -1`` (the cache write skips
  negative slots, so nothing is written), ``seq_len = 1`` over block 0 (a finite read of one slot, never a
  write), and their hidden states are not returned (so no logits are computed for them).
* The attention metadata of a graph holds only device tensors that the backend reads; its host lists
  (``query_start_loc_cpu``, ``seq_lens_cpu``) have the right lengths but placeholder values. So graphs are used
  only with a backend that declares ``AttentionBackend.supports_graph_capture`` (the Triton backend; not the
  torch backend, which plans its work from the host lists).
* Everything else runs eagerly: prefill and mixed steps, batches larger than the largest bucket, and every step
  with ``--enforce-eager``. Sampling is never captured (it runs after the forward pass, on the device).

Capture happens after the KV cache is allocated (graphs record its addresses), largest bucket first so that
smaller graphs reuse the memory of larger ones from one shared pool; each bucket is run once eagerly first
(warm-up: kernel compilation, library workspaces) on padding-only inputs, which write nothing to the cache.
With tensor parallelism every rank captures the same buckets in the same order and takes the same
graph-or-eager decision each step (they see the same scheduler output), so collectives stay matched.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.forward_context import set_forward_context

if TYPE_CHECKING:
    from tokenmill.worker.input_batch import BatchInputs
    from tokenmill.worker.runner_view import ModelRunnerView

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH_SIZE = 256


class GraphCapture(ABC):
    """A platform's way to record one device graph and replay it (one instance per bucket).

    Args:
        device: the device the graph runs on.
        pool: the shared memory pool from :meth:`create_pool` (every bucket's graph allocates from it).
    """

    def __init__(self, device: torch.device, pool: Any) -> None:
        self.device = device
        self.pool = pool

    @classmethod
    def create_pool(cls, device: torch.device) -> Any:
        """A memory pool shared by all graphs of one model runner (``None`` when the platform has none)."""
        return None

    @abstractmethod
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record ``fn`` (a forward pass on the static buffers) and return its output tensor, which every
        :meth:`replay` refills in place."""

    @abstractmethod
    def replay(self) -> None:
        """Run the recorded work again on the current contents of the static buffers."""


def graph_batch_sizes(max_num_seqs: int, max_size: int = MAX_GRAPH_BATCH_SIZE) -> list[int]:
    """Bucket sizes to capture, ascending: ``1, 2, 4, 8, 16, 24, ..., max_size`` cut at ``max_num_seqs``.

    ``max_num_seqs`` itself is included when it is below ``max_size`` and not already a bucket, so the largest
    batch the scheduler can form always has a graph.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: must be at least 1, got {max_num_seqs}")
    candidates = [1, 2, 4, *range(8, max_size + 1, 8)]
    limit = min(max_num_seqs, max_size)
    sizes = [s for s in candidates if s <= limit]
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


class GraphRunner:
    """Captures the model's decode forward pass per bucket and replays it (see the module docstring).

    Args:
        model: the loaded model (``forward(input_ids, positions)``).
        device: its device.
        capture_cls: the platform's :class:`GraphCapture` subclass.
        batch_sizes: buckets to capture (ascending).
        max_model_len: longest sequence, for the block-table width.
        block_size: tokens per KV block.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        capture_cls: type[GraphCapture],
        batch_sizes: list[int],
        max_model_len: int,
        block_size: int,
    ) -> None:
        if not batch_sizes or sorted(set(batch_sizes)) != list(batch_sizes):
            raise ValueError(f"batch_sizes: need distinct ascending sizes, got {batch_sizes}")
        self.model = model
        self.device = device
        self.capture_cls = capture_cls
        self.batch_sizes = list(batch_sizes)
        self.max_batch_size = self.batch_sizes[-1]
        self.block_size = block_size
        self.max_model_len = max_model_len
        max_blocks = -(-max_model_len // block_size)
        n = self.max_batch_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_table = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, GraphCapture] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays: Counter[int] = Counter()

    @classmethod
    def create_if_enabled(cls, runner: ModelRunnerView) -> GraphRunner | None:
        """A GraphRunner with every bucket captured for ``runner``, or ``None`` when graphs are off.

        Off when ``enforce_eager`` is set, when the platform has no graph capture
        (``supports_graph_capture`` false or ``graph_capture_cls()`` ``None``), or when the attention backend
        does not declare ``supports_graph_capture``. Call after the KV cache is allocated.

        Raises:
            RuntimeError: capture failed (the message suggests ``--enforce-eager``).
        """
        from tokenmill.platforms import get_current_platform
        from tokenmill.plugins import resolve_qualname

        config = runner.config
        if config.enforce_eager or runner.model is None:
            return None
        platform = get_current_platform()
        path = platform.graph_capture_cls() if platform.supports_graph_capture else None
        if path is None:
            return None
        if not getattr(runner.attn_backend, "supports_graph_capture", False):
            logger.info(
                "device graphs off: attention backend %s does not support graph capture",
                getattr(runner.attn_backend, "name", runner.attn_backend),
            )
            return None
        sched = config.scheduler_config
        sizes = graph_batch_sizes(min(sched.max_num_seqs, sched.max_num_batched_tokens))
        graph_runner = cls(
            runner.model,
            runner.device,
            resolve_qualname(path),
            sizes,
            config.model_config.max_model_len,
            runner.block_size,
        )
        try:
            graph_runner.capture_all()
        except Exception as exc:
            raise RuntimeError(
                f"capturing device graphs for decode steps failed ({type(exc).__name__}: {exc}); "
                "run with --enforce-eager (enforce_eager=True) to skip them"
            ) from exc
        return graph_runner

    def bucket_for(self, num_reqs: int) -> int | None:
        """The smallest captured bucket holding ``num_reqs`` requests, or ``None`` when none does."""
        for size in self.batch_sizes:
            if size >= num_reqs:
                return size
        return None

    def can_run(self, batch: BatchInputs) -> bool:
        """Whether ``batch`` is a decode-only step that fits a captured bucket."""
        md = batch.attn_metadata
        num_tokens = int(batch.input_ids.shape[0])
        return (
            md.max_query_len == 1
            and num_tokens == int(md.seq_lens.shape[0])
            and 0 < num_tokens <= self.max_batch_size
            and md.block_table.shape[1] <= self.block_table.shape[1]
            and self.bucket_for(num_tokens) in self.graphs
        )

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Warm up and capture every bucket, largest first, into one shared pool."""
        start = time.perf_counter()
        pool = self.capture_cls.create_pool(self.device)
        self._reset_padding(0, self.max_batch_size)
        for size in reversed(self.batch_sizes):
            fn = self._forward_fn(size)
            fn()  # warm-up, eager, on padding only (writes nothing to the KV cache)
            graph = self.capture_cls(self.device, pool)
            self.outputs[size] = graph.capture(fn)
            self.graphs[size] = graph
        logger.info(
            "captured %d device graphs (batch sizes %s) in %.1f s",
            len(self.graphs),
            self.batch_sizes,
            time.perf_counter() - start,
        )

    @torch.inference_mode()
    def run(self, batch: BatchInputs) -> torch.Tensor:
        """Replay the bucket's graph for ``batch`` (``can_run`` must be true); returns ``[n, hidden]``, a view
        of the graph's output valid until the next replay."""
        n = int(batch.input_ids.shape[0])
        size = self.bucket_for(n)
        assert size is not None and size in self.graphs, f"no graph for a batch of {n}"
        md = batch.attn_metadata
        width = md.block_table.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(md.slot_mapping)
        self.seq_lens[:n].copy_(md.seq_lens)
        self.block_table[:n, :width].copy_(md.block_table)
        self._reset_padding(n, size)
        self.graphs[size].replay()
        self.replays[size] += 1
        return self.outputs[size][:n]

    def _reset_padding(self, start: int, end: int) -> None:
        """Make rows ``start .. end-1`` harmless padding (see the module docstring)."""
        if end <= start:
            return
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slot_mapping[start:end].fill_(-1)
        self.seq_lens[start:end].fill_(1)
        self.block_table[start:end].zero_()

    def _forward_fn(self, size: int) -> Callable[[], torch.Tensor]:
        """The forward pass of bucket ``size`` on the first ``size`` rows of the static buffers."""
        md = AttentionMetadata(
            num_actual_tokens=size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[1] * size,  # placeholder values (see supports_graph_capture)
            block_size=self.block_size,
        )
        input_ids, positions = self.input_ids[:size], self.positions[:size]
        model = self.model

        def forward() -> torch.Tensor:
            with set_forward_context(md):
                return model(input_ids, positions)

        return forward
