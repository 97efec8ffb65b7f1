"""Full-precision linear layers on prepacked weights: tokenmill-cpu's ``unquantized_linear`` method.

Why not plain ``F.linear``: for float32 torch calls MKL's ``sgemm`` and for bfloat16 oneDNN's matmul, and both
re-lay out (pack) the whole weight into their kernel's blocked format on every call. For the few rows of a
decode step that repacking costs as much as the multiplication. Weights are packed once instead:

* float32, where tokenmill-cpu's kernels have an AVX-512 or AVX2 build: panels for its own matmul
  (``torch.ops.tokenmill_cpu.dense_gemm``, ``csrc/dense_gemm.cpp``), which prefetches the next panel while it
  multiplies the current one. It takes the least time of the four paths (``F.linear``, oneDNN packed, MKL packed,
  panel) at every row count from 1 to 2,048 on Zen 3 (AVX2) and Zen 4 (``python benchmarks/packed_linear.py``;
  docs/benchmarks.md, "Dense matmuls").
  Until the kernels are loaded (their first build runs in the background while an engine serves) these
  weights use ``F.linear``.
  If the build fails, each such weight is repacked for MKL's packed GEMM (below) when it is first used.
* float32 otherwise (and with ``TOKENMILL_CPU_PREPACK=mkl``): MKL's packed GEMM
  (``torch.ops.mkl._mkl_reorder_linear_weight`` / ``torch.ops.mkl._mkl_linear``, the pair Inductor's CPU freezing
  pass uses). torch packs for one row count and falls back to the plain weight at
  any other; MKL's packed layout does not depend on the row count here (products at 1 to 2,048 rows with a copy
  packed for 32 equal ``F.linear`` to rounding, AVX-512 and AVX2), so one copy is packed for
  :data:`MKL_PACK_ROWS` and told the step's count. That is outside MKL's documented contract, so the first
  product of each weight shape and row count is checked against ``F.linear`` on random data, and a mismatch
  sends that shape and count to ``F.linear`` for good (with a warning).
* bfloat16, and float32 where torch has no MKL: oneDNN (``torch.ops.mkldnn._reorder_linear_weight`` /
  ``torch.ops.mkldnn._linear_pointwise``), whose packed copy serves any row count.
* bfloat16 on a CPU with AVX-512 BF16, at 1 to :data:`BF16_PANEL_MAX_ROWS` rows (a decode step of a few
  requests): a second copy in panels for tokenmill-cpu's bfloat16 matmul (``torch.ops.tokenmill_cpu.dense_gemm_bf16``,
  the float32 panel loops with the BF16 pair dot product), which keeps more of the weights in flight than
  oneDNN at those rows; above them oneDNN's copy (AMX tiles where the CPU has them) is faster (on a Xeon with AMX:
  5.8 against 9.4 ms per SmolLM2-135M step at 1 row, 11.1 against 9.5 at 8; docs/benchmarks.md, "Dense
  matmuls"). The copy doubles a bfloat16 weight's packed memory; :class:`CpuUnquantizedLinearMethod` makes such
  copies only from the first half of its budget. ``TOKENMILL_CPU_BF16_PANEL_MAX_ROWS=0`` turns it off.

Hence :func:`packed_rows`: float32 on the panel copy at 1 to :data:`PANEL_MAX_ROWS` rows (256, on AVX-512 and
AVX2). Above that CPUs have disagreed (an Intel Xeon measured ``F.linear`` as fast or faster, the EPYCs the panel
kernel in 14-37% less time), so the first larger product of a process measures both on its layer's weight
(:func:`_panel_for_rows`) and the faster serves every larger count from then on; ``TOKENMILL_CPU_PANEL_MAX_ROWS``
fixes the bound instead. Where the panel kernel is not built, float32 runs on MKL's copy at 1 to
:data:`MKL_MAX_ROWS` rows (above that MKL's copy packed for 32 rows is slower than ``F.linear``); bfloat16 on
oneDNN's at every count. oneDNN cannot pack bfloat16 without AVX-512 BW/VL/DQ or AVX-NE-CONVERT: such weights
stay on ``F.linear``.

How the graphs reach the packed copy: a packed copy is an opaque (MKLDNN-layout) tensor that torch.compile cannot
take as a graph input, so it stays out of the graph. ``torch.ops.tokenmill_cpu.dense_linear(x, weight)`` receives
the layer's ordinary weight (a graph input like every weight) and finds the packed copy in a table keyed by the
weight's storage address (an entry leaves the table when its weight is freed). A weight with no entry (not
packed, or a graph traced by the compile worker, which never packs) is multiplied with ``F.linear``, so every
graph is correct with or without packing.

Memory: one packed copy per weight (about the weight's size). :class:`CpuUnquantizedLinearMethod` packs layers
until the copies would take half of the RAM available when packing started; the rest stay on ``F.linear``.
``TOKENMILL_CPU_PREPACK=0`` turns packing off; ``TOKENMILL_CPU_PREPACK=mkl`` / ``onednn`` packs float32 weights
for MKL / oneDNN instead of the panel kernel (for comparisons).
"""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from tokenmill.plugin_api import UnquantizedLinearMethod
from tokenmill_cpu import kernels, memory

logger = logging.getLogger(__name__)

MIN_ONEDNN_ROWS_FLOAT32 = 4  # float32 without MKL: fewer rows are faster on F.linear
PACKED_DTYPES = (torch.float32, torch.bfloat16)
MEMORY_FRACTION = 0.5  # packed copies may take at most this share of the RAM available when packing starts
MKL_PACK_ROWS = 32  # the row count MKL is told at packing (its packed layout serves every count: see below)
MKL_MAX_ROWS = 64  # more rows: F.linear is as fast or faster than the copy packed for 32 rows (module docstring)
# Up to this many rows the panel kernel is used without a measurement (module docstring), per ATen capability; above
# it, whichever of the panel kernel and F.linear was faster in this process's first such product (_panel_for_rows).
_PANEL_MAX_ROWS = {"AVX512": 256, "AVX2": 256}
PANEL_ROWS_ENV = "TOKENMILL_CPU_PANEL_MAX_ROWS"  # an explicit bound: no measurement
CALIBRATION_ROWS = 1024  # rows of the measurement's random input
CALIBRATION_WARMUP_S = 0.1  # untimed products of both paths (alternating) before the timed ones, in seconds
CALIBRATION_REPEATS = 5  # timed products of each path in the measurement (alternating; the fastest of each counts)
MKL = "MKL packed sgemm"
ONEDNN = "oneDNN packed"
PANEL = "tokenmill-cpu panel sgemm"
BF16_PANEL = "tokenmill-cpu panel bf16 dot"
BF16_PANEL_ROWS_ENV = "TOKENMILL_CPU_BF16_PANEL_MAX_ROWS"
_BF16_PANEL_MAX_ROWS = 4  # bfloat16 products of 1 to this many rows use the panel copy (module docstring)
_BF16_PANEL_WIDTH = 48  # csrc/dense_gemm.cpp's kPanelBf16
_PANEL_WIDTH = {"AVX512": 48, "AVX2": 16}  # csrc/dense_gemm.cpp's kPanel per ATen capability


@dataclass
class _Packed:
    packed: torch.Tensor  # opaque (MKLDNN-layout) copy of the weight
    library: str  # MKL or ONEDNN
    shape: tuple[int, int]
    dtype: torch.dtype
    small: torch.Tensor | None = None  # bfloat16: the panel copy for 1 to BF16_PANEL_MAX_ROWS rows, where made


# read once: graphs trace packed_rows, torch.compile cannot trace these; TOKENMILL_CPU_PREPACK=onednn: no MKL
_PREPACK = os.environ.get("TOKENMILL_CPU_PREPACK", "1")
HAS_MKL = torch.backends.mkl.is_available() and _PREPACK != "onednn"


def _panel_width() -> int | None:
    """The panel width of the ``dense_gemm`` kernel this machine's build has (``csrc/dense_gemm.cpp``), or
    ``None`` where float32 weights are not packed for it: no AVX2/AVX-512 build, ``TOKENMILL_CPU_KERNELS=0``, or
    ``TOKENMILL_CPU_PREPACK=mkl|onednn`` (the libraries' packed GEMMs instead, for comparisons)."""
    if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0" or _PREPACK in ("mkl", "onednn"):
        return None
    return _PANEL_WIDTH.get(torch.backends.cpu.get_cpu_capability())


def _panel_max_rows() -> tuple[int, bool]:
    """(bound, fixed): products of up to ``bound`` rows use the panel kernel; above it, a measurement decides
    unless ``fixed`` (``TOKENMILL_CPU_PANEL_MAX_ROWS`` was set)."""
    explicit = os.environ.get(PANEL_ROWS_ENV)
    if explicit:
        try:
            return max(int(explicit), 0), True
        except ValueError:
            logger.warning("%s=%r is not a row count; ignored", PANEL_ROWS_ENV, explicit)
    return _PANEL_MAX_ROWS.get(torch.backends.cpu.get_cpu_capability(), 0), False


def _bf16_panel_max_rows() -> int:
    """Up to how many rows bfloat16 products run on ``dense_gemm_bf16``'s panel copy: :data:`_BF16_PANEL_MAX_ROWS`
    (or ``TOKENMILL_CPU_BF16_PANEL_MAX_ROWS``) where its AVX-512 BF16 build will be made (torch's capability
    ``AVX512`` and the CPU's ``avx512_bf16`` flag; the build uses ``-march=native``), else 0 (no panel copy)."""
    if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0" or _PREPACK in ("mkl", "onednn"):
        return 0
    if torch.backends.cpu.get_cpu_capability() != "AVX512" or "avx512_bf16" not in kernels.cpu_flags():
        return 0
    explicit = os.environ.get(BF16_PANEL_ROWS_ENV)
    if explicit:
        try:
            return max(int(explicit), 0)
        except ValueError:
            logger.warning("%s=%r is not a row count; ignored", BF16_PANEL_ROWS_ENV, explicit)
    return _BF16_PANEL_MAX_ROWS


PANEL_WIDTH = _panel_width()
BF16_PANEL_MAX_ROWS = _bf16_panel_max_rows()
_bf16_panel_ready: bool | None = None  # None: not checked yet (the kernels may still be building)
PANEL_MAX_ROWS, _PANEL_ROWS_FIXED = _panel_max_rows()
# Above PANEL_MAX_ROWS: None until measured, then whether the panel kernel was the faster; the measurement's
# (rows, panel ms, F.linear ms) is kept for describe().
_panel_large: bool | None = False if _PANEL_ROWS_FIXED else None
_PANEL_LARGE_FIGURES: list[tuple[int, float, float]] = []
_panel_ready = False  # the kernels are loaded and their panel width is PANEL_WIDTH
_TABLE: dict[int, _Packed] = {}  # weight storage address -> packed copy
_MKL_VERIFIED: dict[tuple[int, int, int], bool] = {}  # (N, K, rows) -> MKL's packed product matched F.linear
_refused: set[torch.dtype] = set()
_refused_libraries: set[str] = set()  # libraries whose loss was logged


def _use_mkl(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and HAS_MKL


def _library(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and PANEL_WIDTH is not None:
        return PANEL
    return MKL if _use_mkl(dtype) else ONEDNN


def packed_rows(dtype: torch.dtype) -> tuple[int, int]:
    """The row counts ``[lo, hi]`` whose products use the packed copy of a ``dtype`` weight (others: ``F.linear``),
    from the measurements in the module docstring (the panel kernel's upper bound depends on the instruction set)."""
    library = _library(dtype)
    if library == PANEL:
        return 1, PANEL_MAX_ROWS
    if library == MKL:
        return 1, MKL_MAX_ROWS
    if dtype == torch.float32:
        return MIN_ONEDNN_ROWS_FLOAT32, 1 << 30
    return 1, 1 << 30


def _mkl_matches(entry: _Packed, weight: torch.Tensor, rows: int) -> bool:
    """Whether MKL's product on ``entry`` (packed for :data:`MKL_PACK_ROWS` rows) equals ``F.linear`` at ``rows``
    rows, on random data; checked once per shape and row count (see the module docstring)."""
    key = (*entry.shape, rows)
    ok = _MKL_VERIFIED.get(key)
    if ok is None:
        g = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, entry.shape[1], generator=g)
        want = F.linear(x, weight)
        got = torch.ops.mkl._mkl_linear(x, entry.packed, weight, None, rows)
        ok = bool(torch.allclose(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max().clamp(min=1e-6))))
        _MKL_VERIFIED[key] = ok
        if not ok:
            logger.warning("MKL's packed weight [%d, %d] gives a wrong product at %d rows here; those products "
                           "use F.linear", *entry.shape, rows)
    return ok


def _dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    entry = _TABLE.get(weight.data_ptr())
    if entry is None or entry.shape != tuple(weight.shape) or entry.dtype != weight.dtype or x.dim() != 2 \
            or x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    lo, hi = packed_rows(weight.dtype)
    if rows < lo:
        return F.linear(x, weight, bias)
    if entry.library == PANEL:
        if _panel_ready or _check_panel_kernel():
            if rows <= hi or _panel_for_rows(entry, weight):
                return torch.ops.tokenmill_cpu.dense_gemm(x.contiguous(), entry.packed, entry.shape[0], bias)
            return F.linear(x, weight, bias)
        if not (kernels.failed() and HAS_MKL):  # the build is still running, or nothing better than F.linear
            return F.linear(x, weight, bias)
        _repack_for_mkl(entry, weight)
    elif rows > hi:
        return F.linear(x, weight, bias)
    x = x.contiguous()
    if entry.small is not None and rows <= BF16_PANEL_MAX_ROWS and _check_bf16_panel_kernel():
        y = torch.ops.tokenmill_cpu.dense_gemm_bf16(x, entry.small, entry.shape[0])
        return y if bias is None else y.add_(bias)
    if entry.library == MKL:
        if rows > MKL_MAX_ROWS or not _mkl_matches(entry, weight, rows):
            return F.linear(x, weight, bias)
        # _mkl_linear uses the packed copy when the count it is given equals the input's rows
        return torch.ops.mkl._mkl_linear(x, entry.packed, weight, bias, rows)
    return torch.ops.mkldnn._linear_pointwise(x, entry.packed, bias, "none", [], "")


def _panel_for_rows(entry: _Packed, weight: torch.Tensor) -> bool:
    """Whether a product of more than :data:`PANEL_MAX_ROWS` rows runs on the panel kernel: measured once per
    process, at the first such product, on its weight and a random input of :data:`CALIBRATION_ROWS` rows: each
    path runs :data:`CALIBRATION_REPEATS` times, alternating, and the fastest of each are compared.

    Why measured: the crossover depends on the CPU and on the BLAS torch brought: an Intel Xeon measured
    ``F.linear`` (MKL) as fast or faster from 512 rows up, the AMD EPYCs the panel kernel faster
    (``python benchmarks/packed_linear.py --rows 512,2048``; docs/benchmarks.md, "Dense matmuls"). The measurement
    takes about 0.2 s on SmolLM2-135M's first weight (:func:`_time_large_rows`: at least six products of each path,
    so about twelve times one product on a larger weight) and is logged."""
    global _panel_large
    if _panel_large is None:
        best_panel, best_linear = _time_large_rows(entry, weight)
        _panel_large = best_panel <= best_linear
        _PANEL_LARGE_FIGURES.append((CALIBRATION_ROWS, best_panel, best_linear))
        logger.info("float32 matmuls above %d rows: measured at %d rows ([%d, %d] weight) panel kernel %.2f ms, "
                    "F.linear %.2f ms: they run on %s", PANEL_MAX_ROWS, CALIBRATION_ROWS, *entry.shape, best_panel,
                    best_linear, "the panel kernel" if _panel_large else "F.linear")
    return _panel_large


def _time_large_rows(entry: _Packed, weight: torch.Tensor) -> tuple[float, float]:
    """(panel kernel ms, ``F.linear`` ms): the fastest of :data:`CALIBRATION_REPEATS` products of each, alternating,
    on a random ``[CALIBRATION_ROWS, K]`` input, after alternating untimed products for
    :data:`CALIBRATION_WARMUP_S` seconds.

    Why the warm-up: the first products of a process run slower for a while (about 1.3x for the first four or five
    on Zen 4), and the slow period hurts the panel kernel more, so a measurement without it picked the slower
    ``F.linear`` in some runs, which then lost 3.5-5.9% of their throughput (docs/benchmarks.md, "Dense matmuls").
    """
    x = torch.randn(CALIBRATION_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0))
    paths = (lambda: F.linear(x, weight),
             lambda: torch.ops.tokenmill_cpu.dense_gemm(x, entry.packed, entry.shape[0]))
    warm_until = time.perf_counter() + CALIBRATION_WARMUP_S
    while True:
        for fn in paths:
            fn()
        if time.perf_counter() >= warm_until:
            break
    linear_ms, panel_ms = [], []
    for _ in range(CALIBRATION_REPEATS):
        for times, fn in zip((linear_ms, panel_ms), paths):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return min(panel_ms), min(linear_ms)


def _check_panel_kernel() -> bool:
    """Whether ``dense_gemm`` can run the panel copies now: the kernels are loaded (a build in progress: not yet;
    until then products use ``F.linear``) and were built for :data:`PANEL_WIDTH`."""
    global _panel_ready
    if not kernels.ready():
        return False
    width = int(torch.ops.tokenmill_cpu.dense_gemm_panel())
    if width != PANEL_WIDTH:
        raise RuntimeError(f"tokenmill-cpu's dense_gemm was built for panels of {width}, the weights were packed "
                           f"for {PANEL_WIDTH}")
    _panel_ready = True
    return True


def _check_bf16_panel_kernel() -> bool:
    """Whether ``dense_gemm_bf16`` runs its AVX-512 BF16 loops now: false while the kernels build (those products
    use oneDNN meanwhile) and for good where they failed or were built without BF16 (the panel copies are then
    dropped)."""
    global _bf16_panel_ready
    if _bf16_panel_ready is None:
        if not kernels.ready() and not kernels.failed():
            return False
        _bf16_panel_ready = kernels.ready() and str(torch.ops.tokenmill_cpu.dense_gemm_bf16_isa()) == "avx512_bf16"
        if not _bf16_panel_ready:
            for entry in _TABLE.values():
                entry.small = None
            logger.info("tokenmill-cpu's bfloat16 panel matmul is unavailable here; bfloat16 products of few rows "
                        "use oneDNN")
    return _bf16_panel_ready


def _repack_for_mkl(entry: _Packed, weight: torch.Tensor) -> None:
    """The kernels could not be built: ``entry``'s panel copy is replaced by MKL's packed copy (once per weight)."""
    with torch.no_grad():
        entry.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach().contiguous(), MKL_PACK_ROWS)
    entry.library = MKL
    if PANEL not in _refused_libraries:
        _refused_libraries.add(PANEL)
        logger.warning("tokenmill-cpu's kernels are unavailable: float32 weights packed for its panel matmul are "
                       "repacked for MKL's packed GEMM as they are used")


def pack_panels(weight: torch.Tensor, width: int) -> torch.Tensor:
    """``weight [N, K]`` -> ``[ceil(N / width), K, width]``: panel ``p`` is rows ``p * width`` to
    ``(p + 1) * width`` transposed, rows past ``N`` zero (``csrc/dense_gemm.cpp``'s layout)."""
    n, k = weight.shape
    full, rest = divmod(n, width)
    # One strided copy into the result (padding first and then transposing copied every weight twice).
    out = weight.new_empty(full + (rest > 0), k, width)
    out[:full].copy_(weight[:full * width].view(full, width, k).transpose(1, 2))
    if rest:
        out[full].zero_()
        out[full, :, :rest].copy_(weight[full * width:].t())
    return out


def pack_panels_bf16(weight: torch.Tensor, width: int = _BF16_PANEL_WIDTH) -> torch.Tensor:
    """``weight [N, K]`` (bfloat16, K even) -> ``[ceil(N / width), K / 2, 2 * width]``: element ``(p, c, 2 j + t)``
    is ``weight[p * width + j, 2 c + t]``, rows past ``N`` zero (``csrc/dense_gemm.cpp``'s bfloat16 layout).

    Raises:
        ValueError: ``K`` is odd.
    """
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"the bfloat16 panel layout needs an even input size, got {k}")
    panels = -(-n // width)
    padded = F.pad(weight, (0, 0, 0, panels * width - n))
    return padded.view(panels, width, k // 2, 2).permute(0, 2, 1, 3).contiguous().view(panels, k // 2, 2 * width)


def _dense_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_lib = torch.library.Library("tokenmill_cpu", "FRAGMENT")  # the C++ kernels (tokenmill_cpu.kernels) share it
_lib.define("dense_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")
_lib.impl("dense_linear", _dense_linear, "CPU")
torch.library.register_fake("tokenmill_cpu::dense_linear", _dense_linear_fake, lib=_lib)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight [N, K]^T (+ bias [N])`` -> ``[..., N]`` in ``weight``'s dtype, on the packed copy of
    ``weight`` when :func:`pack` made one and the row count is within :func:`packed_rows`, else with ``F.linear``.
    The bias is added inside the product (the panel kernel's epilogue, oneDNN's and MKL's bias argument, or
    ``addmm``), except on the bfloat16 panel path for few rows (added in place after it)."""
    return torch.ops.tokenmill_cpu.dense_linear(x, weight, bias)


def pack(weight: torch.Tensor, small: bool = True) -> bool:
    """Make (once) the packed copy :func:`dense_linear` uses for ``weight`` (2-D, float32 or bfloat16, CPU):
    for float32 the panels of tokenmill-cpu's ``dense_gemm`` where it has an AVX2 or AVX-512 build, else MKL's
    where torch has MKL, else oneDNN's; oneDNN's for bfloat16, and with ``small`` the bfloat16 panel copy for few
    rows as well where :func:`small_copy_wanted`; whether there is one. Never raises: a library
    refusing the weight (oneDNN and bfloat16 without AVX-512) is logged once and the weight stays on
    ``F.linear``."""
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES:
        return False
    key = weight.data_ptr()
    if key in _TABLE:
        return True
    library = _library(weight.dtype)
    try:
        with torch.no_grad():
            w = weight.detach().contiguous()
            if library == PANEL:
                kernels.load_async()  # usually started already by the attention backend
                packed = pack_panels(w, PANEL_WIDTH)
            elif library == MKL:
                packed = torch.ops.mkl._mkl_reorder_linear_weight(w, MKL_PACK_ROWS)
            else:
                packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    except RuntimeError as exc:
        if weight.dtype not in _refused:
            _refused.add(weight.dtype)
            logger.info("%s: cannot prepack %s weights here (%s); they use F.linear", library, weight.dtype,
                        str(exc).splitlines()[0])
        return False
    panels = None
    if small and small_copy_wanted(weight) and not kernels.failed():
        kernels.load_async()
        try:
            with torch.no_grad():
                panels = pack_panels_bf16(weight.detach().contiguous())
        except RuntimeError:  # out of memory for the second copy: the main copy serves every row count
            pass
    _TABLE[key] = _Packed(packed, library, tuple(weight.shape), weight.dtype, panels)
    weakref.finalize(weight, _TABLE.pop, key, None)
    if weight.dtype == torch.float32:
        _log_amx_hint()
    return True


def small_copy_wanted(weight: torch.Tensor) -> bool:
    """Whether :func:`pack` makes ``weight`` a bfloat16 panel copy for products of few rows as well (module
    docstring): bfloat16, an even input size, and a CPU and build where :data:`BF16_PANEL_MAX_ROWS` is above 0."""
    return weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[1] % 2 == 0 \
        and BF16_PANEL_MAX_ROWS > 0 and _bf16_panel_ready is not False


def packed_bytes(weight: torch.Tensor) -> int:
    """Bytes :func:`pack` allocates for ``weight``'s packed copies (two for a bfloat16 weight with a panel copy)."""
    nbytes = weight.numel() * weight.element_size()
    return 2 * nbytes if small_copy_wanted(weight) else nbytes


@functools.cache
def has_amx_bf16() -> bool:
    """Whether oneDNN can run bfloat16 products on AMX tiles here: the CPU has them (Linux flag ``amx_bf16``: Intel
    Xeon from Sapphire Rapids on), the OS lets this process use them (torch's check, where this torch has one), and
    ``ONEDNN_MAX_CPU_ISA`` does not cap oneDNN below AMX. Read once per process."""
    if "amx_bf16" not in kernels.cpu_flags():
        return False
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if cap and cap != "ALL" and "AMX" not in cap:
        return False
    os_allows = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(os_allows()) if os_allows is not None else True


@functools.cache
def _log_amx_hint() -> None:
    """Once per process, where float32 weights are packed on a CPU with AMX: say that ``--dtype bfloat16`` is
    several times faster here (2.7x the offline throughput of float32 on a Xeon with AMX; docs/benchmarks.md,
    "Offline throughput against the matmul ceiling"). float32 stays the default: outputs differ from it at
    bfloat16 precision."""
    if has_amx_bf16():
        logger.info("this CPU has AMX for bfloat16 matmuls: --dtype bfloat16 runs them several times faster than "
                    "float32 (outputs then differ from float32's at bfloat16 precision)")


def packed_count() -> int:
    """How many weights have a packed copy now."""
    return len(_TABLE)


def prepack_enabled() -> bool:
    """Whether ``TOKENMILL_CPU_PREPACK`` allows packing (default on; ``0`` turns it off) and torch has oneDNN
    (which it has wherever it has MKL)."""
    return os.environ.get("TOKENMILL_CPU_PREPACK", "1") != "0" and torch.backends.mkldnn.is_available()


class CpuUnquantizedLinearMethod(UnquantizedLinearMethod):
    """Linear layers on packed copies of their weights (for float32 the panel kernel's, MKL's or oneDNN's; for
    bfloat16 oneDNN's, plus the bfloat16 panel kernel's for few rows where both fit the budget; module docstring);
    one instance per model.

    Attributes:
        budget_bytes: RAM the packed copies may still take (set by the first layer: :data:`MEMORY_FRACTION` of
            the RAM available then).
    """

    def __init__(self) -> None:
        self.budget_bytes: int | None = None
        self.panel_floor = 0  # bfloat16 panel copies only while the budget stays above this (half of it)

    def process_weights_after_loading(self, layer: nn.Module) -> int:
        weight = layer.weight
        if not prepack_enabled() or weight.dtype not in PACKED_DTYPES:
            return 0
        if self.budget_bytes is None:
            self.budget_bytes = int(memory.available_memory_bytes() * MEMORY_FRACTION)
            self.panel_floor = self.budget_bytes // 2
        if weight.numel() * weight.element_size() > self.budget_bytes:
            return 0
        if weight.data_ptr() in _TABLE:  # a tied weight packed through another layer
            return 0
        # the bfloat16 panel copy only from the first half of the budget, so that later layers' main copies (which
        # serve every row count) are not crowded out by earlier layers' panel copies
        if not pack(weight, small=self.budget_bytes - packed_bytes(weight) >= self.panel_floor):
            return 0
        entry = _TABLE[weight.data_ptr()]
        nbytes = weight.numel() * weight.element_size() * (2 if entry.small is not None else 1)
        self.budget_bytes -= nbytes
        return nbytes

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.apply_with_bias(layer, x, None)

    def apply_with_bias(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # Only a row count known without guards picks F.linear here (eager steps; the one-request graph, whose
        # row count is the constant 1). A graph with a symbolic row count calls the op, which chooses at run time:
        # a plain Python test would bake the traced dummy step's choice into the graph.
        if statically_known_true(x.shape[0] < packed_rows(layer.weight.dtype)[0]):
            return F.linear(x, layer.weight, bias)
        return dense_linear(x, layer.weight, bias)

    def cache_key_facts(self) -> dict[str, Any]:
        # below these row counts a graph of a known row count (the one-request graph) calls F.linear directly; the
        # bounds follow TOKENMILL_CPU_PREPACK and whether the kernels have a panel build
        return {"packed_rows_min": {str(d).removeprefix("torch."): packed_rows(d)[0] for d in PACKED_DTYPES}}


def describe() -> str:
    """What float32 / bfloat16 linear layers run on here, for ``Platform.kernel_info``."""
    base = "MKL sgemm (float32), oneDNN (bfloat16), through torch"
    if not prepack_enabled():
        return f"{base}; weights not prepacked"
    lo, hi = packed_rows(torch.float32)
    library = _library(torch.float32)
    f32 = f"{library} for {lo}" + ("+ rows" if hi >= 1 << 30 else f"-{hi} rows")
    if library == PANEL and _panel_large is None:
        f32 += " (above: whichever of it and F.linear is faster, measured at first use)"
    elif library == PANEL and _PANEL_LARGE_FIGURES:
        rows, panel_ms, linear_ms = _PANEL_LARGE_FIGURES[-1]
        f32 += (f" and above (measured faster at {rows} rows: {panel_ms:.1f} vs {linear_ms:.1f} ms)" if _panel_large
                else f" (above: F.linear, measured faster at {rows} rows: {linear_ms:.1f} vs {panel_ms:.1f} ms)")
    if library == PANEL and kernels.failed():
        f32 += f" (kernels unavailable: {MKL if HAS_MKL else 'F.linear'} instead)"
    elif library == PANEL and not kernels.ready():
        f32 += " (F.linear until the kernels are loaded)"
    bf16 = f"{ONEDNN} (AMX)" if has_amx_bf16() else ONEDNN
    if BF16_PANEL_MAX_ROWS > 0 and _bf16_panel_ready is not False:
        bf16 = f"{BF16_PANEL} for 1-{BF16_PANEL_MAX_ROWS} rows, {bf16} above"
        if _bf16_panel_ready is None and not kernels.ready():
            bf16 += " (oneDNN for all rows until the kernels are loaded)"
    return f"prepacked weights: float32 {f32}, bfloat16 {bf16} where oneDNN can pack it; otherwise {base}"
