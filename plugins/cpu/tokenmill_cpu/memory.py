"""Host memory and CPU facts from /proc (Linux), with psutil / os fallbacks elsewhere."""

from __future__ import annotations

import os
import platform
from pathlib import Path

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
