"""torch.compile'd forward pass for every kind of step (the CPU's answer to device graphs).

A decode step with few running requests does little arithmetic per operator, so on a CPU its time goes to
launching several hundred small eager operators (norms, rotary, the cache write, attention, conversions).
``torch.compile`` (TorchInductor) fuses the pointwise and reduction work of the whole forward pass into a few
generated C++ loops and calls the matmul kernels directly, which removes most of that overhead. Large decode
steps gain too: the fused loops make one pass over activations where eager makes one per operator (256
requests, SmolLM2-135M, bfloat16: 518 ms per step eager, 361 ms compiled, attention included).

How it runs:

* Decode-only steps (``max_query_len == 1``, up to ``max_num_seqs`` requests) trace attention too, with an
  attention backend that declares ``supports_compile`` (its decode path reads device tensors only, or calls
  a registered custom op), so the whole step is one graph.
* Prefill and mixed steps run the ``mixed`` compilation: every attention layer is one opaque custom op
  (``tokenmill::attention``, see ``tokenmill.layers.attention``) that runs the backend eagerly, and the
  compiler fuses everything between them (norms, rotary, activation, residual adds): 128-token prefills of
  SmolLM2-135M spend about a sixth of their time in those operators eagerly.
* Kinds, each one guard-free compilation with dynamic shapes: ``one`` (decode of one request; the compiler
  specialises sizes 0 and 1), ``many`` (decode of 2 or more), ``large`` (decode of more than the quantized
  layers' row limit, only when the model has quantized layers: a compilation bakes in the branch its
  trace took, and the dense matmul is the right one for large batches) and ``mixed``. The block table is
  padded to at least two columns (block 0, masked by ``seq_lens``) so that short contexts reuse the decode
  compilations.
* Every compilation happens in :meth:`warm_up`, at engine start-up (one to two minutes on 2 cores the first
  time; about 40 s, 55 s with ``--quantization``, once Inductor's on-disk caches hold the graphs: most of it
  is Dynamo tracing, and each decode kind's first Dynamo analysis restarts once per start and misses
  AOTAutograd's cache, about 8 s each, not yet understood). Warm-up writes keys/values of dummy tokens into
  block 0, which is harmless: a slot is always written by its owner before it is read, and no request
  exists yet.
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


class CompiledRunner:
    """Runs model forward passes through ``torch.compile(model)``: decode steps of at most ``max_batch_size``
    requests with attention traced, other steps with attention as an opaque op.

    Args:
        model: the loaded model (``forward(input_ids, positions)``).
        max_batch_size: the largest decode step compiled.
        block_size: tokens per KV block.
    """

    def __init__(self, model: torch.nn.Module, max_batch_size: int, block_size: int) -> None:
        self.max_batch_size = max_batch_size
        self.block_size = block_size
        # Quantized layers switch to their dense weight above this many rows (0: no quantized layer).
        self.quant_max_rows = max(
            (getattr(m, "quant_max_tokens", 0) for m in model.modules() if getattr(m, "quant", None) is not None),
            default=0,
        )
        kinds = ["one", "many", "mixed"]
        if 0 < self.quant_max_rows < max_batch_size:
            kinds.append("large")
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
            for kind in kinds
        }
        self.kind_steps = dict.fromkeys(self.compiled, 0)  # steps run per kind since warm-up

    @classmethod
    def create_if_enabled(cls, runner: ModelRunner) -> CompiledRunner | None:
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
        """Whether ``batch`` has a compiled kind: any step with tokens, decode steps up to ``max_batch_size``."""
        md = batch.attn_metadata
        if md.max_query_len == 1:
            return 0 < md.num_actual_tokens <= self.max_batch_size
        return md.num_actual_tokens > 1

    def kind(self, md: AttentionMetadata) -> str:
        """The compilation that runs a step with metadata ``md``."""
        if md.max_query_len > 1:
            return "mixed"
        if md.num_actual_tokens == 1:
            return "one"
        return "large" if "large" in self.compiled and md.num_actual_tokens > self.quant_max_rows else "many"

    def run(self, batch: BatchInputs) -> torch.Tensor:
        """The compiled forward pass of ``batch``: ``[T, hidden]``."""
        md = batch.attn_metadata
        kind = self.kind(md)
        if kind != "mixed" and md.block_table.shape[1] < 2:
            md = self._pad_block_table(md)
        self.kind_steps[kind] += 1
        with set_forward_context(md, opaque_attention=kind == "mixed"):
            return self.compiled[kind](batch.input_ids, batch.positions)

    def _pad_block_table(self, md: AttentionMetadata) -> AttentionMetadata:
        pad = md.block_table.new_zeros(md.block_table.shape[0], 2 - md.block_table.shape[1])
        return dataclasses.replace(md, block_table=torch.cat((md.block_table, pad), dim=1))

    @torch.inference_mode()
    def warm_up(self, device: torch.device) -> None:
        """Compile every kind (see the module docstring), tracing each with a step of its own kind."""
        start = time.perf_counter()
        # Distinct sizes per trace: equal sizes at trace time would be tied together. "large" and "mixed"
        # trace above the quantized row limit so that they take the dense matmuls.
        above = max(self.quant_max_rows, 3) + 5
        for kind, size in (("one", 1), ("many", 3), ("large", above), ("mixed", above)):
            if kind in self.compiled:
                kind_start = time.perf_counter()
                self.run(self._dummy_batch(kind, size, device))
                logger.debug("compiled %s steps in %.1f s", kind, time.perf_counter() - kind_start)
        self.kind_steps = dict.fromkeys(self.compiled, 0)
        logger.info(
            "compiled forward passes with torch.compile in %.1f s: decode steps of 1-%d requests, prefill and "
            "mixed steps (--enforce-eager skips this)",
            time.perf_counter() - start,
            self.max_batch_size,
        )

    def _dummy_batch(self, kind: str, size: int, device: torch.device) -> BatchInputs:
        """Decode of ``size`` requests, or (``mixed``) one fresh prefill of ``size`` tokens; writes go to block 0."""
        from tokenmill.worker.input_batch import BatchInputs

        ids = torch.zeros(size, dtype=torch.int64, device=device)
        if kind == "mixed":
            num_reqs, seq_lens, qsl = 1, [size], [0, size]
        else:
            num_reqs, seq_lens, qsl = size, [1] * size, list(range(size + 1))
        md = AttentionMetadata(
            num_actual_tokens=size,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_table=torch.zeros(num_reqs, size + 2, dtype=torch.int32, device=device),
            slot_mapping=torch.zeros(size, dtype=torch.int64, device=device),
            max_query_len=size if kind == "mixed" else 1,
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            block_size=self.block_size,
        )
        torch._dynamo.mark_dynamic(md.block_table, 1)
        if size > 1:
            torch._dynamo.mark_dynamic(ids, 0)
        logits_indices = torch.tensor([size - 1] if kind == "mixed" else list(range(size)), device=device)
        return BatchInputs(ids, ids.clone(), md, logits_indices, [True] * num_reqs)
