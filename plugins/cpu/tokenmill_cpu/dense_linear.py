"""Full-precision linear layers on prepacked weights: tokenmill-cpu's ``unquantized_linear`` method.

Why not plain ``F.linear``: for float32 torch calls MKL's ``sgemm`` and for bfloat16 oneDNN's matmul, and both
re-lay out (pack) the whole weight into their kernel's blocked format on every call. For the few rows of a
decode step that repacking costs as much as the multiplication. oneDNN can pack a weight once
(``torch.ops.mkldnn._reorder_linear_weight``) and multiply any number of rows by the packed copy
(``torch.ops.mkldnn._linear_pointwise``), the pair Inductor's CPU weight-prepacking pass uses.

``python benchmarks/packed_linear.py`` (SmolLM2-135M's shapes, 2 cores, AVX-512 Xeon, 2026-12-01; sum of one
decoder step's 30 layers plus the LM head):

==========  =========================  ==========================
rows        float32 F.linear / packed  bfloat16 F.linear / packed
==========  =========================  ==========================
1           13.0 / 15.3 ms             22.3 / 11.2 ms
4           22.5 / 14.5 ms             13.1 / 7.9 ms
32          63.2 / 42.3 ms             21.5 / 15.2 ms
256         381 / 341 ms               48.2 / 40.3 ms
==========  =========================  ==========================

With oneDNN limited to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``) float32 at 32 rows is 73.4 / 66.0 ms, and oneDNN
cannot pack bfloat16 there (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT): such weights stay on ``F.linear``.
So float32 uses the packed copy from :data:`MIN_PACKED_ROWS_FLOAT32` rows up, bfloat16 always.

How the graphs reach the packed copy: oneDNN's packed tensor is an opaque (MKLDNN-layout) tensor that
torch.compile cannot take as a graph input, so it stays out of the graph. ``torch.ops.tokenmill_cpu.dense_linear
(x, weight)`` receives the layer's ordinary weight (a graph input like every weight) and finds the packed copy
in a table keyed by the weight's storage address (an entry leaves the table when its weight is freed). A weight
with no entry (not packed, or a graph traced by the compile worker, which never packs) is multiplied with
``F.linear``, so every graph is correct with or without packing.

Memory: one packed copy per weight (same size as the weight). :class:`CpuUnquantizedLinearMethod` packs layers
until the copies would take half of the RAM available when packing started; the rest stay on ``F.linear``.
``TOKENMILL_CPU_PREPACK=0`` turns packing off.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.plugin_api import UnquantizedLinearMethod
from tokenmill_cpu import memory

logger = logging.getLogger(__name__)

MIN_PACKED_ROWS_FLOAT32 = 4  # fewer rows: F.linear (MKL) is faster than oneDNN's packed path (table above)
PACKED_DTYPES = (torch.float32, torch.bfloat16)
MEMORY_FRACTION = 0.5  # packed copies may take at most this share of the RAM available when packing starts


@dataclass
class _Packed:
    packed: torch.Tensor  # MKLDNN-layout copy of the weight
    shape: tuple[int, int]
    dtype: torch.dtype


_TABLE: dict[int, _Packed] = {}  # weight storage address -> packed copy


def min_packed_rows(dtype: torch.dtype) -> int:
    """Rows from which the packed copy is used (below: ``F.linear``)."""
    return MIN_PACKED_ROWS_FLOAT32 if dtype == torch.float32 else 1


def _dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    entry = _TABLE.get(weight.data_ptr())
    if (entry is None or entry.shape != tuple(weight.shape) or entry.dtype != weight.dtype
            or x.dim() != 2 or x.shape[0] < min_packed_rows(weight.dtype) or x.dtype != weight.dtype):
        return F.linear(x, weight)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), entry.packed, None, "none", [], "")


def _dense_linear_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_lib = torch.library.Library("tokenmill_cpu", "FRAGMENT")  # the C++ kernels (tokenmill_cpu.kernels) share it
_lib.define("dense_linear(Tensor x, Tensor weight) -> Tensor")
_lib.impl("dense_linear", _dense_linear, "CPU")
torch.library.register_fake("tokenmill_cpu::dense_linear", _dense_linear_fake, lib=_lib)


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ weight [N, K]^T`` -> ``[..., N]`` in ``weight``'s dtype, on the packed copy of ``weight`` when
    :func:`pack` made one and ``T`` is at least :func:`min_packed_rows`, else with ``F.linear``."""
    return torch.ops.tokenmill_cpu.dense_linear(x, weight)


def pack(weight: torch.Tensor) -> bool:
    """Make (once) the packed copy :func:`dense_linear` uses for ``weight`` (2-D, float32 or bfloat16, CPU);
    whether there is one. Never raises: oneDNN refusing the weight (e.g. bfloat16 without AVX-512) is logged
    once and the weight stays on ``F.linear``."""
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES:
        return False
    key = weight.data_ptr()
    if key in _TABLE:
        return True
    try:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    except RuntimeError as exc:
        if weight.dtype not in _refused:
            _refused.add(weight.dtype)
            logger.info("oneDNN cannot prepack %s weights here (%s); they use F.linear", weight.dtype,
                        str(exc).splitlines()[0])
        return False
    _TABLE[key] = _Packed(packed, tuple(weight.shape), weight.dtype)
    weakref.finalize(weight, _TABLE.pop, key, None)
    return True


_refused: set[torch.dtype] = set()


def packed_count() -> int:
    """How many weights have a packed copy now."""
    return len(_TABLE)


def prepack_enabled() -> bool:
    """Whether ``TOKENMILL_CPU_PREPACK`` allows packing (default on; ``0`` turns it off) and torch has oneDNN."""
    return os.environ.get("TOKENMILL_CPU_PREPACK", "1") != "0" and torch.backends.mkldnn.is_available()


class CpuUnquantizedLinearMethod(UnquantizedLinearMethod):
    """Linear layers on oneDNN-packed copies of their weights (module docstring); one instance per model.

    Attributes:
        budget_bytes: RAM the packed copies may still take (set by the first layer: :data:`MEMORY_FRACTION` of
            the RAM available then).
    """

    def __init__(self) -> None:
        self.budget_bytes: int | None = None

    def process_weights_after_loading(self, layer: nn.Module) -> int:
        weight = layer.weight
        if not prepack_enabled() or weight.dtype not in PACKED_DTYPES:
            return 0
        nbytes = weight.numel() * weight.element_size()
        if self.budget_bytes is None:
            self.budget_bytes = int(memory.available_memory_bytes() * MEMORY_FRACTION)
        if nbytes > self.budget_bytes:
            return 0
        if weight.data_ptr() in _TABLE:  # a tied weight packed through another layer
            return 0
        if not pack(weight):
            return 0
        self.budget_bytes -= nbytes
        return nbytes

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # A graph always calls the op, which chooses at run time: torch.compile would bake a Python test of the
        # row count into a graph with a symbolic one (the dummy step it traces has 2 rows).
        if not torch.compiler.is_compiling() and x.shape[0] < min_packed_rows(layer.weight.dtype):
            return F.linear(x, layer.weight)
        return dense_linear(x, layer.weight)


def describe() -> str:
    """What float32 / bfloat16 linear layers run on here, for ``Platform.kernel_info``."""
    base = "MKL sgemm (float32), oneDNN (bfloat16), through torch"
    if not prepack_enabled():
        return f"{base}; weights not prepacked"
    return (f"oneDNN on prepacked weights (float32 from {MIN_PACKED_ROWS_FLOAT32} rows, bfloat16 where oneDNN can "
            f"pack it); otherwise {base}")
