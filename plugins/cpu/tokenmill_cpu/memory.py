"""Host memory and CPU facts from /proc (Linux), with psutil / os fallbacks elsewhere."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_MEMINFO = Path("/proc/meminfo")
_CPUINFO = Path("/proc/cpuinfo")


def _meminfo_bytes(field: str) -> int | None:
    """``field`` of /proc/meminfo in bytes, or None when the file or field is absent."""
    if not _MEMINFO.is_file():
        return None
    for line in _MEMINFO.read_text().splitlines():
        key, _, rest = line.partition(":")
        if key == field:
            parts = rest.split()
            return int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return None


def _psutil_memory() -> object | None:
    try:
        import psutil
    except ImportError:
        return None
    return psutil.virtual_memory()


def total_memory_bytes() -> int:
    """Total RAM of the machine in bytes.

    Raises:
        RuntimeError: no source (/proc/meminfo, psutil, sysconf) could tell.
    """
    value = _meminfo_bytes("MemTotal")
    if value is not None:
        return value
    vm = _psutil_memory()
    if vm is not None:
        return int(vm.total)  # type: ignore[attr-defined]
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError) as exc:
        raise RuntimeError("cannot determine total RAM: no /proc/meminfo, psutil or sysconf") from exc


def available_memory_bytes() -> int:
    """RAM available to new allocations without swapping, in bytes.

    Raises:
        RuntimeError: neither /proc/meminfo nor psutil is available; pass --kv-cache-memory instead.
    """
    value = _meminfo_bytes("MemAvailable")
    if value is not None:
        return value
    vm = _psutil_memory()
    if vm is not None:
        return int(vm.available)  # type: ignore[attr-defined]
    raise RuntimeError(
        "cannot determine available RAM (no /proc/meminfo and psutil is not installed); "
        "set the KV cache size explicitly with --kv-cache-memory (e.g. 2GiB)"
    )


def cpu_model_name() -> str:
    """The CPU model, e.g. ``"AMD EPYC 7763 64-Core Processor"``; ``"cpu"`` when unknown."""
    if _CPUINFO.is_file():
        for line in _CPUINFO.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return value.strip()
    return platform.processor() or platform.machine() or "cpu"


def lazily_zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled host tensor whose pages are zeroed by the OS on first touch, not at allocation.

    ``torch.zeros`` writes every page when it allocates: 5.1 s of a warm start-up for the default 4 GiB float32
    KV cache (cProfile of the engine core, docs/benchmarks.md). A private anonymous mapping costs neither time
    nor resident memory until a page is written, and reads as zeros before that (POSIX ``mmap`` with
    ``MAP_ANONYMOUS``), so the KV cache has the same contents either way.

    The mapping asks for transparent huge pages (``madvise(MADV_HUGEPAGE)``, Linux; where THP is off it is a
    no-op). Decode attention reads each request's blocks from scattered places of the cache, one 4 KiB-page
    TLB miss per block with ordinary pages: 2 MiB pages made the paged decode kernel 1.1-1.3x faster over float32
    and bfloat16 caches (256 requests of 192 tokens, 30 layers, two cores of an AVX-512 Xeon;
    ``python benchmarks/attention_kernel.py --dtype float32 --layers 30 [--no-huge-pages]``; docs/benchmarks.md,
    "Issue 16, ninth session").

    Args:
        shape: the tensor's shape.
        dtype: its torch dtype.

    Returns:
        a contiguous, writable, page-aligned CPU tensor of zeros; it keeps its mapping alive. Falls back to
        ``torch.zeros`` where there is no anonymous ``mmap`` (not POSIX) and for empty shapes.
    """
    import math
    import mmap

    import torch

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    flags = getattr(mmap, "MAP_PRIVATE", None), getattr(mmap, "MAP_ANONYMOUS", None)
    if nbytes == 0 or os.name != "posix" or None in flags:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=flags[0] | flags[1], prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: ordinary pages
            pass
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
