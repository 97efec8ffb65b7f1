"""torch.compile'd forward pass for decode-only steps (the CPU's answer to device graphs).

A decode step with few running requests does little arithmetic per operator, so on a CPU its time goes to
launching several hundred small eager operators (norms, rotary, the cache write, attention, conversions).
``torch.compile`` (TorchInductor) fuses the pointwise and reduction work of the whole forward pass into a few
generated C++ loops and calls the matmul kernels directly, which removes most of that overhead. Large decode
steps gain too: the fused loops make one pass over activations where eager makes one per operator (256
requests, SmolLM2-135M, bfloat16: 518 ms per step eager, 361 ms compiled, attention included).

How it runs:

* Only decode-only steps (``max_query_len == 1``) take this path (every batch size up to ``max_num_seqs``),
  and only with an attention backend that declares ``supports_compile`` (its decode path reads device
  tensors only, or calls a registered custom op). Prefill and mixed steps run eagerly.
* One compilation serves every batch size ``2 .. max_batch_size`` and every context length (dynamic shapes);
  batch size 1 is compiled separately (the compiler specialises sizes 0 and 1). The block table is padded to
  at least two columns (block 0, masked by ``seq_lens``) so that short contexts reuse the same compilation.
* Both compilations happen in :meth:`warm_up`, at engine start-up (a minute or two on a small CPU the first
  time; Inductor's on-disk cache makes later starts take seconds). Warm-up writes keys/values of a dummy token
  into slot 0 of block 0, which is harmless: a slot is always written by its owner before it is read.
* ``--enforce-eager`` turns it off, as does ``TOKENMILL_COMPILE=0`` in the environment (the test suite sets
  it so that its many short-lived engines skip compiling) and a platform without ``supports_compile``. If
  compilation fails the engine logs why and stays eager.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import types
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.forward_context import set_forward_context

if TYPE_CHECKING:
    from tokenmill.worker.input_batch import BatchInputs
    from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

def _own_forward(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``model.forward`` bound to a copy of its code object.

    torch.compile keeps its compiled graphs per code object, so every model instance of a class would share
    them; with guards skipped, a second engine in the same process could run the first one's graph.
    A private code object gives each runner its own cache.
    """
    func = type(model).forward
    private = types.FunctionType(
        func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__, func.__closure__
    )
    return types.MethodType(private, model)


class CompiledDecodeRunner:
    """Runs decode-only steps of at most ``max_batch_size`` requests through ``torch.compile(model)``.

    Args:
        model: the loaded model (``forward(input_ids, positions)``).
        max_batch_size: the largest decode step compiled.
        block_size: tokens per KV block.
    """

    def __init__(self, model: torch.nn.Module, max_batch_size: int, block_size: int) -> None:
        self.max_batch_size = max_batch_size
        self.block_size = block_size
        # One compilation for a batch of one and one for larger batches, each with its own code object (see
        # _own_forward) and without guards or size asserts: checking torch.compile's guards (thousands, on the
        # model's modules and tensors) took over a millisecond per step, the generated code's input size
        # asserts (hundreds) about 0.4 ms. That is safe because each compilation serves one model
        # and one kind of batch only, which run() chooses, and nothing replaces the model's modules or KV
        # cache tensors after warm-up (a new KV cache comes with a new runner).
        self.compiled = {
            kind: torch.compile(
                _own_forward(model),
                dynamic=True,
                fullgraph=True,
                options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe, "size_asserts": False},
            )
            for kind in ("one", "many")
        }
        self.steps = 0

    @classmethod
    def create_if_enabled(cls, runner: ModelRunner) -> CompiledDecodeRunner | None:
        """A warmed-up runner for ``runner``'s model, or ``None`` when compilation is off or fails.

        Off with ``enforce_eager`` or ``TOKENMILL_COMPILE=0``, on platforms without ``supports_compile``, with
        attention backends without ``supports_compile``, and with tensor parallelism (collectives are not
        traced).
        """
        from tokenmill.distributed import get_tp_size
        from tokenmill.platforms import get_current_platform

        config = runner.config
        if config.enforce_eager or os.environ.get("TOKENMILL_COMPILE", "1") == "0":
            return None
        if runner.model is None or get_tp_size() > 1:
            return None
        if not get_current_platform().supports_compile or not getattr(runner.attn_backend, "supports_compile", False):
            return None
        compiled = cls(runner.model, config.scheduler_config.max_num_seqs, runner.block_size)
        try:
            compiled.warm_up(runner.device)
        except Exception as exc:  # noqa: BLE001 - any compiler failure leaves the engine eager, never broken
            logger.warning("torch.compile of decode steps failed, running eagerly (%s: %s)", type(exc).__name__, exc)
            torch.compiler.reset()
            return None
        return compiled

    def can_run(self, batch: BatchInputs) -> bool:
        """Whether ``batch`` is a decode-only step of at most ``max_batch_size`` requests."""
        md = batch.attn_metadata
        return md.max_query_len == 1 and 0 < md.num_actual_tokens <= self.max_batch_size

    def run(self, batch: BatchInputs) -> torch.Tensor:
        """The compiled forward pass of ``batch``: ``[B, hidden]``."""
        md = batch.attn_metadata
        if md.block_table.shape[1] < 2:
            md = self._pad_block_table(md)
        self.steps += 1
        with set_forward_context(md):
            return self.compiled["one" if md.num_actual_tokens == 1 else "many"](batch.input_ids, batch.positions)

    def _pad_block_table(self, md: AttentionMetadata) -> AttentionMetadata:
        pad = md.block_table.new_zeros(md.block_table.shape[0], 2 - md.block_table.shape[1])
        return dataclasses.replace(md, block_table=torch.cat((md.block_table, pad), dim=1))

    @torch.inference_mode()
    def warm_up(self, device: torch.device) -> None:
        """Compile for batch size 1 and for batch sizes ``2 .. max_batch_size`` (see the module docstring)."""
        from tokenmill.worker.input_batch import BatchInputs

        start = time.perf_counter()
        # Distinct batch sizes and block-table widths: equal sizes at trace time would be tied together.
        for size in sorted({1, min(3, self.max_batch_size)}):
            ids = torch.zeros(size, dtype=torch.int64, device=device)
            md = AttentionMetadata(
                num_actual_tokens=size,
                query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=device),
                seq_lens=torch.ones(size, dtype=torch.int32, device=device),
                block_table=torch.zeros(size, size + 2, dtype=torch.int32, device=device),
                slot_mapping=torch.zeros(size, dtype=torch.int64, device=device),
                max_query_len=1,
                max_seq_len=1,
                query_start_loc_cpu=list(range(size + 1)),
                seq_lens_cpu=[1] * size,
                block_size=self.block_size,
            )
            torch._dynamo.mark_dynamic(md.block_table, 1)
            if size > 1:
                torch._dynamo.mark_dynamic(ids, 0)
            self.run(BatchInputs(ids, ids.clone(), md, ids.clone(), [True] * size))
        self.steps = 0
        logger.info(
            "compiled decode steps of 1-%d requests with torch.compile in %.1f s (--enforce-eager skips this)",
            self.max_batch_size,
            time.perf_counter() - start,
        )
