"""tokenmill-cpu's C++ kernels (``csrc/``), compiled on first use with ``torch.utils.cpp_extension``:
``paged_decode`` and ``prefill_attention`` (``csrc/paged_attention.cpp``, below), the quantized matmuls ``q8_linear`` / ``q4_linear``
(``csrc/quant_linear.cpp``, why: ``tokenmill_cpu.quant_linear``) and the panel matmuls ``dense_gemm`` (float32)
and ``dense_gemm_bf16`` (bfloat16, few rows) (``csrc/dense_gemm.cpp``, why: its header and
``tokenmill_cpu.dense_linear``), and the state layers' decode step ``causal_conv1d_update``,
``selective_state_update`` and ``gated_delta_rule_update`` and prefill ``causal_conv1d_fn``, ``selective_scan`` and
``gated_delta_rule_scan`` (``csrc/state_update.cpp``, why: its header and ``tokenmill_cpu.state_ops``).

Why a custom attention kernel: decode attention over the paged cache is a memory-bound loop over the blocks of
every request. Neither eager torch (gather the blocks, then two batched matmuls of a few rows each) nor
TorchInductor's code for the same computation (index arithmetic and a horizontal sum per key row) comes near
the memory floor. ``csrc/paged_attention.cpp`` reads each block in place once, shares every key/value row
among the query heads of its KV head, keeps accumulators in registers and, for bfloat16, uses the AVX-512 BF16
pair dot product: a third or less of eager torch's or Inductor's time (``python benchmarks/attention_kernel.py``;
docs/benchmarks-history.md, "2026-11-30 Zen 4: decode attention kernel"; the current figures are in
docs/benchmarks.md, "Decode attention kernel").

The build (about a minute on 2 cores, once per machine, torch version, instruction-set level and checkout; cached
under torch's extension directory, ``TORCH_EXTENSIONS_DIR``) needs a C++ compiler and ``ninja``. Without them,
or with ``TOKENMILL_CPU_KERNELS=0``, :func:`load` returns ``False``: attention stays on the torch path and
``--quantization`` uses torch's packed int8/int4 ops. :func:`load_async` starts the build in a background thread
so that an engine can serve (attention on the torch path, :func:`ready` false) while it runs.

Instruction sets: the library is compiled for the level torch's own CPU kernels use here
(``torch.backends.cpu.get_cpu_capability()``, which ``ATEN_CPU_CAPABILITY=avx2|default`` lowers):
``AVX512`` builds with ``-march=native`` (AVX-512 VNNI and BF16 when the CPU has them), ``AVX2`` with AVX2, FMA
and F16C only (any x86-64-v3 CPU; on an AVX-512 machine this is how the AVX2 code is built and tested), and
``DEFAULT`` with the baseline x86-64 instruction set (the plain C++ loops). :func:`isa` says which paths the
loaded library runs.

``TOKENMILL_CPU_CFLAGS`` (split like a shell line) is appended to the compiler flags, e.g. ``-O0 -g`` to debug a
kernel; such a build gets its own build directory, so it never replaces the optimised one.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shlex
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("paged_attention.cpp", "kv_cache_write.cpp", "quant_linear.cpp", "dense_gemm.cpp", "state_update.cpp")
_CAPABILITY_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"],
    "AVX2": ["-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
}
# Target instruction set per ATen capability on x86-64 (elsewhere: -march=native). AVX2 spelled out rather than
# -march=x86-64-v3 so that older compilers accept it.
_X86_ARCH_FLAGS = {
    "AVX512": ["-march=native"],
    "AVX2": ["-march=x86-64", "-mavx", "-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mlzcnt", "-mpopcnt"],
    "DEFAULT": ["-march=x86-64"],
}

_lock = threading.Lock()  # held for a whole build
_start_lock = threading.Lock()  # guards _thread only (never waits for a build)
_loaded: bool | None = None
_thread: threading.Thread | None = None


def load() -> bool:
    """Build (first time) and load the kernels into ``torch.ops.tokenmill_cpu``; whether they are usable.

    Blocks until a build started by :func:`load_async` has finished. Never raises: a failed build is logged once
    and reported as ``False``.
    """
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _build()
        return _loaded


def load_async() -> None:
    """Start :func:`load` in a background thread (once); :func:`ready` turns true when the kernels are loaded.

    The build's time goes to the compiler subprocess, so the caller's thread keeps most of the CPU's attention
    it needs (an engine serving with the torch attention path meanwhile).
    """
    global _thread
    with _start_lock:
        if _loaded is not None or _thread is not None:
            return
        _import_build_tools()
        _thread = threading.Thread(target=_load_at_low_priority, name="tokenmill-cpu-kernels", daemon=True)
        _thread.start()


def _import_build_tools() -> None:
    """Import ``torch.utils.cpp_extension`` in the calling thread, before the build thread starts.

    It imports setuptools, whose distutils override inserts an entry at the front of ``sys.meta_path`` and
    removes it again. Done in the build thread, that could shift the list under an import running meanwhile in
    the caller's thread (the model loader's lazy imports): its loop over the finders then skipped the path finder
    and a module that exists failed with ``ModuleNotFoundError`` (seen once in a Ray worker:
    ``tokenmill.model_loader.hf_quant_config``).
    """
    if os.environ.get("TOKENMILL_CPU_KERNELS", "1") != "0":
        import torch.utils.cpp_extension  # noqa: F401


BUILD_NICENESS = 10  # nice increment of the background build thread and the compilers it starts


def _load_at_low_priority() -> None:
    """:func:`load` from a thread whose nice value is raised by :data:`BUILD_NICENESS` (Linux keeps nice values
    per thread, and the compiler processes ninja starts inherit it), so that a cold start's eager steps keep the
    CPU while the kernels compile: at equal priority the two compiler processes and a step's two OpenMP threads
    share the cores, and an 8-token first answer took 15.7 s on 2 cores (docs/benchmarks-history.md,
    "2026-12-01 Xeon (1dff90a)")."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + BUILD_NICENESS)
    except (AttributeError, OSError):  # not Linux/POSIX, or not permitted: build at normal priority
        pass
    load()


def ready() -> bool:
    """Whether the kernels are loaded now (never waits for a build)."""
    return _loaded is True


def failed() -> bool:
    """Whether loading the kernels was tried and failed (no compiler, a build error, ``TOKENMILL_CPU_KERNELS=0``)."""
    return _loaded is False


def isa() -> dict[str, str]:
    """The code paths of the loaded kernels: ``capability`` (the ATen level they were built for),
    ``quant_linear`` (``avx512_vnni``, ``avx2`` or ``scalar``), ``paged_decode`` (``avx512_bf16``,
    ``avx512``, ``avx2`` or ``scalar``), ``dense_gemm`` (``avx512``, ``avx2`` or ``scalar``), ``dense_gemm_bf16``
    (``avx512_bf16`` or ``scalar``), ``dense_gemm_prefetch`` (``l2``, ``l1`` or ``none``: where the panel matmuls
    prefetch their next panel to) and ``state_update`` (``avx512``, ``avx2`` or ``scalar``: the state layers'
    kernels);
    ``{"status": "not loaded"}`` before :func:`load` succeeded."""
    if not ready():
        return {"status": "not loaded"}
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "quant_linear": str(torch.ops.tokenmill_cpu.quant_linear_isa()),
        "paged_decode": _paged_decode_isa(),
        "dense_gemm": str(torch.ops.tokenmill_cpu.dense_gemm_isa()),
        "dense_gemm_bf16": str(torch.ops.tokenmill_cpu.dense_gemm_bf16_isa()),
        "dense_gemm_prefetch": str(torch.ops.tokenmill_cpu.dense_gemm_prefetch()),
        "state_update": str(torch.ops.tokenmill_cpu.state_update_isa()),
    }


def _paged_decode_isa() -> str:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        return "avx512_bf16" if "avx512_bf16" in cpu_flags() else "avx512"
    return {"AVX2": "avx2"}.get(capability, "scalar")


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (``/proc/cpuinfo``); empty where unknown."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compile_flags(capability: str) -> list[str]:
    """Compiler flags for ATen capability ``capability`` (``AVX512``, ``AVX2``, ``DEFAULT``, ...)."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        arch = _X86_ARCH_FLAGS.get(capability, ["-march=native"])
    else:
        arch = ["-march=native"]
    return ["-O3", *arch, "-fopenmp", *_CAPABILITY_FLAGS.get(capability, []), *extra_compile_flags()]


def extra_compile_flags() -> list[str]:
    """The flags ``TOKENMILL_CPU_CFLAGS`` adds after the defaults (a later ``-O`` wins); ``[]`` when unset."""
    return shlex.split(os.environ.get("TOKENMILL_CPU_CFLAGS", ""))


def _build() -> bool:
    if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0":
        logger.info("TOKENMILL_CPU_KERNELS=0: CPU attention kernels off, using the torch path")
        return False
    if hasattr(torch.ops.tokenmill_cpu, "paged_decode"):  # already in this process (another loader)
        return True
    from torch.utils.cpp_extension import load as load_extension

    capability = torch.backends.cpu.get_cpu_capability()
    flags = compile_flags(capability)
    start = time.perf_counter()
    logger.info("loading tokenmill-cpu's C++ kernels for %s (compiled on first use, about a minute on 2 cores; "
                "cached afterwards)", capability)
    try:
        ext_name, build_dir = build_directory(capability)
        build_dir.mkdir(parents=True, exist_ok=True)
        with _build_dir_lock(build_dir):
            load_extension(
                name=ext_name,
                sources=[str(CSRC / source) for source in SOURCES],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, build error: fall back, never fail
        # The message starts with the compiler command line; its reason is at the end.
        reason = " | ".join(line.strip() for line in str(exc).strip().splitlines()[-3:])
        logger.warning("could not build tokenmill-cpu's C++ kernels, using the torch paths (%s: %s)",
                       type(exc).__name__, reason)
        return False
    _register_fake()
    logger.info("tokenmill-cpu kernels ready in %.1f s (%s; quantized matmuls: %s)", time.perf_counter() - start,
                capability, torch.ops.tokenmill_cpu.quant_linear_isa())
    return True


def build_directory(capability: str) -> tuple[str, Path]:
    """``(extension name, build directory)`` for ATen capability ``capability``, where torch itself would build
    it: ``$TORCH_EXTENSIONS_DIR/<name>`` when that is set, else ``<user cache>/torch_extensions/py<version>_cpu/
    <name>``; one directory per source location and ``TOKENMILL_CPU_CFLAGS`` (checkouts sharing one, or builds
    with different flags, would rebuild each other's copy)."""
    from torch.utils.cpp_extension import get_default_build_root

    key = str(CSRC.resolve()) + "".join(f" {flag}" for flag in extra_compile_flags())
    where = hashlib.sha1(key.encode()).hexdigest()[:8]
    name = f"tokenmill_cpu_kernels_{capability.lower()}_{where}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return name, Path(root) / name
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    return name, Path(get_default_build_root()) / tag / name


@contextlib.contextmanager
def _build_dir_lock(build_dir: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the build directory while torch builds or loads the extension.

    torch serialises builds with a plain ``lock`` file that the builder deletes when done; a build that was
    killed (Ctrl-C during a first start) leaves it behind, and every later start then waits for it forever.
    Every tokenmill process builds under this ``flock``, which the kernel releases when its holder dies, so a
    ``lock`` file found while holding it belongs to no running build: it is removed.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock file only
        yield
        return
    with open(build_dir / "tokenmill.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing %s, left by an interrupted build of tokenmill-cpu's kernels", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _register_fake() -> None:
    """Output shapes for torch.compile's tracing (the op itself stays opaque to the compiler)."""

    @torch.library.register_fake("tokenmill_cpu::paged_decode")
    def _(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
          scale: float, sliding_window: int = 0, soft_cap: float = 0.0) -> torch.Tensor:
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

    @torch.library.register_fake("tokenmill_cpu::write_kv_cache")
    def _(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        return None

    @torch.library.register_fake("tokenmill_cpu::prefill_attention_varlen")
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranges: torch.Tensor, scale: float, sliding_window: int,
          out: torch.Tensor, causal: bool = True) -> None:
        return None

    @torch.library.register_fake("tokenmill_cpu::prefill_attention")
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int = 0) -> torch.Tensor:
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

    @torch.library.register_fake("tokenmill_cpu::q8_linear")
    def _(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape[0], packed.shape[0] * 16)

    @torch.library.register_fake("tokenmill_cpu::dense_gemm")
    def _(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("tokenmill_cpu::dense_gemm_bf16")
    def _(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("tokenmill_cpu::causal_conv1d_update")
    def _(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
        return x.new_empty(x.shape), weight.new_empty(conv_state.shape)

    @torch.library.register_fake("tokenmill_cpu::selective_state_update")
    def _(state: torch.Tensor, x: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        return x.new_empty(x.shape), state.new_empty(state.shape, dtype=torch.float32)

    @torch.library.register_fake("tokenmill_cpu::gated_delta_rule_update")
    def _(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: object
          ) -> tuple[torch.Tensor, torch.Tensor]:
        return v.new_empty(v.shape), state.new_empty(state.shape, dtype=torch.float32)

    @torch.library.register_fake("tokenmill_cpu::causal_conv1d_fn")
    def _(x: torch.Tensor, weight: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        return x.new_empty(x.shape), weight.new_empty(weight.shape[0], weight.shape[1] - 1)

    @torch.library.register_fake("tokenmill_cpu::selective_scan")
    def _(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, *args: object
          ) -> tuple[torch.Tensor, torch.Tensor]:
        return x.new_empty(x.shape), x.new_empty(x.shape[1], x.shape[2], B.shape[2], dtype=torch.float32)

    @torch.library.register_fake("tokenmill_cpu::gated_delta_rule_scan")
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        return v.new_empty(v.shape), v.new_empty(q.shape[1], q.shape[2], v.shape[2], dtype=torch.float32)

    @torch.library.register_fake("tokenmill_cpu::q4_linear")
    def _(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
          super_scales: torch.Tensor | None = None) -> torch.Tensor:
        return x.new_empty(x.shape[0], packed.shape[0] * 16)


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per request over its cached context, read from the paged cache in place.

    Args:
        q: ``[B, Hq, D]`` float32, bfloat16 or float16 (rows contiguous), already rotated.
        kv_cache: ``[2, Hkv, num_blocks, block_size, R]`` contiguous (keys, then values), ``q``'s dtype, or
            bfloat16 / float16 under float32 ``q`` (rows widened to float32 as they are read), or a quantized cache
            under float32 ``q``: int8 (``R = kv_cache_row_size(D, int8)``, each row's scale applied to its score and
            probability), float8_e4m3fn or float8_e5m2 (scale 1.0); ``R = D`` but for int8
            (``tokenmill.plugin_api.kv_cache_row_size``).
        block_table: ``[B, nb]`` int32; request ``i`` reads blocks ``block_table[i, :ceil(seq_lens[i] / block_size)]``.
        seq_lens: ``[B]`` int32, tokens of context per request (the new token's key/value already written).
        scale: softmax scale (usually ``D ** -0.5``).
        sliding_window: attend to the last ``sliding_window`` positions only (blocks before them are not read);
            ``None``: the whole context.
        soft_cap: scaled scores become ``soft_cap * tanh(s / soft_cap)`` (Gemma 2); ``None``: off.

    Returns:
        ``[B, Hq * D]`` in ``q``'s dtype; a request with ``seq_lens <= 0`` gets zeros.

    Raises:
        RuntimeError: shapes, dtypes or layouts are not as above, a block id is out of range, or a request's
            ``seq_lens`` needs more blocks than its block-table row has.
    """
    return torch.ops.tokenmill_cpu.paged_decode(q, kv_cache, block_table, seq_lens, scale, sliding_window or 0,
                                                soft_cap or 0.0)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int | None = None
) -> torch.Tensor:
    """Causal attention of a prompt chunk whose ``L`` queries are the last ``L`` positions of an ``S``-row context
    (``S == L`` for a fresh prompt): query ``t`` sits at position ``p = S - L + t`` and attends to positions
    ``0 .. p``, or the last ``sliding_window`` of them.

    How: when a KV head's rows of ``k`` and ``v`` lie apart (views of a fused projection, as a fresh prompt's are),
    tiles of query rows (about 24 query vectors: rows x the query heads that share a KV head) pass over the keys and
    values in blocks of 64 rows with a running softmax, so each block is read from memory once per tile; key blocks
    lie on a fixed grid, so a query row's result has the same bits whichever chunk or batch it is in. Contiguous
    rows (a context gathered from the cache) are streamed once per query row, which measured faster for them.

    Why not torch's ``scaled_dot_product_attention``: its CPU flash kernel spends about as long on a 128-token
    prompt with grouped-query heads as on the full square of scores, and a chunk after a cached prefix needs an
    explicit mask, which takes its slower path. Per layer of SmolLM2-135M (``python
    benchmarks/prefill_attention.py``): 15 prompts of 128 tokens 2.5-3.7 ms against SDPA's 8.2-12.8 ms, one of
    4,096 tokens 135-177 ms against 900-1,180 ms (docs/benchmarks.md, "Prefill attention kernel").

    Args:
        q: ``[L, Hq, D]`` float32, bfloat16 or float16, rows contiguous (any row and head stride), already rotated.
        k: ``[S, Hkv, D]``, ``q``'s dtype, likewise, ``S >= L`` (``Hq`` a multiple of ``Hkv``).
        v: ``[S, Hkv, D]``, likewise.
        scale: softmax scale (usually ``D ** -0.5``).
        sliding_window: attend to the last ``sliding_window`` positions only; ``None``: all earlier ones.

    Returns:
        ``[L, Hq * D]`` in ``q``'s dtype (scores, softmax and sums in float32).

    Raises:
        RuntimeError: shapes, dtypes or layouts are not as above.
    """
    return torch.ops.tokenmill_cpu.prefill_attention(q, k, v, scale, sliding_window or 0)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each token's keys and values in its cache slot, in place (the torch backend's
    :func:`tokenmill.plugin_api.write_kv_cache`, one parallel copy per row instead of a stack and a scatter).

    Why not torch's indexed assignment: it stacks the keys and values first, and under torch.compile becomes a
    serial copy and a scatter split between two threads at most; this kernel copies each row once, straight from
    the projection output: 0.28-0.32 ms per layer of a 1,968-token mixed step of SmolLM2-135M against 0.65-0.76 ms
    compiled and 1.13-1.25 ms eager (``python benchmarks/prefill_attention.py``; docs/benchmarks-history.md,
    "2026-12-03 Xeon (89db59a)"); no measurable difference in the engine's 256-request decode steps.

    Args:
        k: ``[T, Hkv, D]`` float32, bfloat16 or float16, rows contiguous (any row and head stride).
        v: ``[T, Hkv, D]``, ``k``'s dtype, likewise.
        kv_cache: ``[2, Hkv, num_blocks, block_size, R]`` contiguous, ``k``'s dtype, or bfloat16 / float16 under
            float32 ``k`` (rows rounded as they are stored), or int8 / float8_e4m3fn / float8_e5m2 under any float
            ``k`` (rows quantized as ``tokenmill.plugin_api.quantize_kv`` does, bit for bit; ``R`` as in
            :func:`paged_decode`); written in place.
        slot_mapping: ``[T]`` int64 (contiguous), one slot per row of ``k``: token ``t`` goes to slot
            ``slot_mapping[t]`` (block ``slot // block_size``, row ``slot % block_size``); a negative slot writes
            nothing (graph padding).

    Raises:
        RuntimeError: shapes, dtypes or layouts are not as above, or a slot is past the cache's
            ``num_blocks * block_size`` (checked before anything is written).
    """
    torch.ops.tokenmill_cpu.write_kv_cache(k, v, kv_cache, slot_mapping)


def prefill_attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranges: torch.Tensor, scale: float,
    sliding_window: int | None, out: torch.Tensor, causal: bool = True,
) -> None:
    """Causal attention of several fresh prompts of one step (nothing cached before them) in one call, into
    ``out``: :func:`prefill_attention` of each prompt, with the work of all of them split between the threads at
    once (one parallel region, not one per prompt and layer, and no per-prompt Python), split by the key rows each
    query reads so that a long prompt among short ones is shared between threads too. With ``causal=False``
    (an encoder step's whole sequences) every query of a prompt attends to all of that prompt's rows.

    Args:
        q: ``[T, Hq, D]`` float32, bfloat16 or float16, rows contiguous (any row and head stride), already rotated.
        k: ``[T, Hkv, D]``, ``q``'s dtype, likewise.
        v: ``[T, Hkv, D]``, likewise.
        ranges: ``[N, 2]`` int32 (contiguous), in order and disjoint: prompt ``i`` is rows
            ``ranges[i, 0] .. ranges[i, 1] - 1`` of ``q``, ``k`` and ``v`` (its keys and values are its whole
            context; query ``j`` of it sees its rows ``0 .. j``, or the last ``sliding_window`` of them).
        scale: softmax scale (usually ``D ** -0.5``).
        sliding_window: attend to the last ``sliding_window`` positions only; ``None``: all earlier ones.
        out: ``[T, Hq * D]`` in ``q``'s dtype, rows contiguous; the rows of the ranges are written, the others
            are left as they are.
        causal: ``False``: bidirectional attention within each prompt (no sliding window then).

    Raises:
        RuntimeError: shapes, dtypes or layouts are not as above, a range is empty, outside ``q``'s rows or
            overlaps the one before it, or a sliding window is asked for without ``causal``.
    """
    torch.ops.tokenmill_cpu.prefill_attention_varlen(q, k, v, ranges, scale, sliding_window or 0, out, causal)
