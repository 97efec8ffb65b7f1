"""Host memory and CPU facts from /proc (Linux), with psutil / os fallbacks elsewhere."""

from __future__ import annotations

import logging
import mmap
import os
import platform
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

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

    ``torch.zeros`` writes every page when it allocates: 5.1 s of a warm start-up for the default 4 GiB float32 KV
    cache (cProfile of the engine core; docs/benchmarks-history.md, "2026-12-01 Xeon (1dff90a)"). A private
    anonymous mapping costs neither time nor resident memory until a page is written, and reads as zeros before that
    (POSIX ``mmap`` with ``MAP_ANONYMOUS``), so the KV cache has the same contents either way.

    The mapping asks for transparent huge pages (``madvise(MADV_HUGEPAGE)``, Linux; where THP is off it is a
    no-op). Decode attention reads each request's blocks from scattered places of the cache, one 4 KiB-page
    TLB miss per block with ordinary pages: 2 MiB pages made the paged decode kernel 1.1-1.3x faster over float32
    and bfloat16 caches (``python benchmarks/attention_kernel.py --dtype float32 --layers 30 [--no-huge-pages]``;
    docs/benchmarks-history.md, "2026-12-02 Xeon (bcbd1f9)").

    Args:
        shape: the tensor's shape.
        dtype: its torch dtype.

    Returns:
        a contiguous, writable, page-aligned CPU tensor of zeros; it keeps its mapping alive. Falls back to
        ``torch.zeros`` where there is no anonymous ``mmap`` (not POSIX) and for empty shapes.
    """
    import math

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


MADV_POPULATE_WRITE = 23  # Linux 5.14+ (include/uapi/asm-generic/mman-common.h); Python's mmap module lacks it
PREFAULT_CHUNK_BYTES = 2 << 20  # one madvise call: one huge page (a few milliseconds of the kernel's page zeroing)
PREFAULT_NICENESS = 10  # nice increment of the prefault thread where SCHED_IDLE is refused (Linux: per thread)

_prefault_lock = threading.Lock()
_prefault_queue: list[tuple[weakref.ref, int, int, int]] = []  # (tensor, next address, end, urgent below this)
_prefault_thread: threading.Thread | None = None
_prefault_next = 0  # queue index of the range whose chunk comes next (round-robin)
_prefault_failed = False  # madvise refused once (an older kernel): not tried again in this process


def prefault_async(tensor: torch.Tensor, regions: int = 1) -> bool:
    """Fault in the pages of a :func:`lazily_zeroed_tensor` from a background thread, without changing its
    contents; whether that was started (Linux with ``MADV_POPULATE_WRITE``; off with ``TOKENMILL_CPU_PREFAULT=0``).

    Args:
        tensor: a :func:`lazily_zeroed_tensor`.
        regions: the tensor is this many equal consecutive ranges that fill up front to back together (a KV
            cache ``[2, Hkv, num_blocks, ...]``: ``2 * Hkv`` ranges indexed by block id, and the block pool hands
            out the lowest ids first). Each range is its own queue entry, so the round-robin below reaches the
            start of every range first. At most one range per :data:`PREFAULT_CHUNK_BYTES` of the tensor.

    Order and priority: the thread takes one chunk from each queued range in turn, and the first
    :data:`PREFAULT_CHUNK_BYTES` of every range (the pages that the first requests write; one or two chunks, as
    the range starts on a chunk boundary or not) at normal priority; then it drops to ``SCHED_IDLE`` for the rest.
    It cannot rise again: ranges queued after that, while it still runs (a second engine in the process), start
    at ``SCHED_IDLE`` too. Why the start of every range first: a server's first request, arriving while the engine
    still loads saved graphs, writes its first token of every layer and KV head, and the first write of a huge
    page costs milliseconds; with the walk idle from the start in address order, those faults made a warm start's
    first step take 0.8-1.5 s instead of 0.08-0.22 s, about 1 s of its first answer (``benchmarks/startup.py``;
    docs/benchmarks-history.md, "2026-12-03 Xeon (da0fb6b)").

    Why: a lazily zeroed KV cache is faulted in by the engine itself, block by block, the first time each block is
    written, and a fresh server keeps meeting untouched blocks until it has used every block once (freed blocks go
    to the back of the free queue). Where the first write of a 2 MiB page costs about 2.7 ms (4 GiB in 5.6 s), that
    is about 1 s of every 64-prompt concurrency-32 run of a fresh server and 12% of a prefill profile
    (docs/benchmarks-history.md, "2026-12-02 Xeon (538f577)"). ``madvise(MADV_POPULATE_WRITE)`` faults pages in
    writable as a write would, but never writes them (Linux ``madvise(2)``), so it is safe while the engine writes
    the same cache; ctypes releases the GIL for the call. After the first pages the thread runs under ``SCHED_IDLE``
    (:func:`_lower_thread_priority`), so it fills idle time and gives way to the engine's steps; it drops a tensor
    that was freed. The steps are one 2 MiB huge page each: 16 MiB calls nearly doubled a warm start's first answer
    (probably the low-priority thread, preempted inside a long call, held up the engine's own page faults; same
    section).
    """
    if os.environ.get("TOKENMILL_CPU_PREFAULT", "1") == "0" or platform.system() != "Linux" or tensor.numel() == 0 \
            or _prefault_failed:
        return False
    global _prefault_thread, _prefault_next
    start = tensor.data_ptr()
    if start % mmap.PAGESIZE:  # madvise takes page-aligned ranges: not a lazily_zeroed_tensor
        return False
    nbytes = tensor.numel() * tensor.element_size()
    regions = max(1, min(regions, nbytes // PREFAULT_CHUNK_BYTES))
    ref = weakref.ref(tensor)
    # Range r starts on the page that holds its first byte (so range r - 1 ends there).
    bounds = [start + (nbytes * r // regions) // mmap.PAGESIZE * mmap.PAGESIZE for r in range(regions)]
    with _prefault_lock:
        if not _prefault_queue:
            _prefault_next = 0
        _prefault_queue.extend((ref, a, b, a + PREFAULT_CHUNK_BYTES) for a, b in zip(bounds, bounds[1:] + [start + nbytes]))
        if _prefault_thread is None:
            _prefault_thread = threading.Thread(target=_prefault_worker, name="tokenmill-cpu-prefault", daemon=True)
            _prefault_thread.start()
    return True


def wait_for_prefault() -> None:
    """Return once :func:`prefault_async` has nothing left to fault in (at once when idle), faulting the rest in
    from the calling thread at its own priority: the background thread, under ``SCHED_IDLE``, makes no progress
    while the caller keeps the cores busy. Logs the time spent waiting when there was work left."""
    if not prefault_pending_bytes():
        return
    start = time.perf_counter()
    pending = prefault_pending_bytes()
    logger.info("faulting in the rest of the KV cache before the first step (%.2f GiB)", pending / 2**30)
    _prefault_loop(background=False)
    while (thread := _prefault_thread) is not None and thread.is_alive():  # the background thread's last call
        time.sleep(0.005)
    logger.info("KV cache faulted in (%.1f s waited)", time.perf_counter() - start)


def prefault_pending_bytes() -> int:
    """Bytes that :func:`prefault_async` has still to fault in (0 when idle)."""
    with _prefault_lock:
        return sum(end - addr for _, addr, end, _ in _prefault_queue)


def _prefault_worker() -> None:
    global _prefault_thread, _prefault_failed
    try:
        _prefault_loop()
    except Exception:  # noqa: BLE001 - never let the queue wait for a thread that is gone
        logger.exception("KV cache prefault failed; pages are faulted in on first write")
        with _prefault_lock:
            _prefault_queue.clear()
            _prefault_thread, _prefault_failed = None, True


def _claim_chunk() -> tuple[torch.Tensor, int, int, bool] | None:
    """Under the lock, take the next chunk off the queue: ``(tensor, address, bytes, urgent)``, or ``None`` when
    the queue is empty. Chunks come round-robin over the queued ranges, each ending on a multiple of
    :data:`PREFAULT_CHUNK_BYTES` or at its range's end; ``urgent`` while this chunk or one still queued begins
    within the first :data:`PREFAULT_CHUNK_BYTES` of its range. The tensor is returned so that its mapping stays
    alive until the caller's ``madvise`` call is done."""
    global _prefault_next
    while _prefault_queue:
        i = _prefault_next % len(_prefault_queue)
        ref, addr, end, urgent_below = _prefault_queue[i]
        tensor = ref()
        if tensor is None:  # freed: dropped, not touched
            _prefault_queue.pop(i)
            continue
        n = min(PREFAULT_CHUNK_BYTES - addr % PREFAULT_CHUNK_BYTES, end - addr)
        if addr + n >= end:
            _prefault_queue.pop(i)
        else:
            _prefault_queue[i] = (ref, addr + n, end, urgent_below)
            i += 1
        _prefault_next = i
        return tensor, addr, n, addr < urgent_below or any(a < u for _, a, _, u in _prefault_queue)
    return None


def _prefault_loop(background: bool = True) -> None:
    """Fault in queued ranges until the queue is empty: the background thread's loop (which drops to
    ``SCHED_IDLE`` once no range's first pages are left), or (``background=False``) the caller's in
    :func:`wait_for_prefault`. Each chunk is claimed under the lock before its ``madvise`` call, so both can run at
    once."""
    import ctypes

    global _prefault_thread, _prefault_failed
    policy = ""
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    started, done = time.perf_counter(), 0
    while True:
        with _prefault_lock:
            chunk = _claim_chunk()
            if chunk is None:
                if background:
                    _prefault_thread = None  # under the lock: a tensor queued from now on starts a new thread
                break
        tensor, addr, n, urgent = chunk
        if background and not urgent and not policy:
            policy = _lower_thread_priority()
        failed = madvise(addr, n, MADV_POPULATE_WRITE) != 0
        del tensor, chunk
        if failed:  # EINVAL: a kernel before 5.14; ENOMEM: out of memory; the engine faults pages itself
            err = ctypes.get_errno()
            with _prefault_lock:
                _prefault_queue.clear()
                _prefault_failed = True
                if background:
                    _prefault_thread = None
            logger.info("KV cache prefault stopped (madvise: %s); pages are faulted in on first write",
                        os.strerror(err))
            return
        done += n
    if background and done:
        rest = f"then {policy}" if policy else "nothing left after them"
        logger.info("KV cache pages faulted in ahead of use: %.2f GiB in %.1f s (background, first pages at normal "
                    "priority, %s)", done / 2**30, time.perf_counter() - started, rest)


def _lower_thread_priority() -> str:
    """Put the calling thread under ``SCHED_IDLE`` (Linux: it runs only on cores nothing else wants), or else
    raise its nice value by :data:`PREFAULT_NICENESS`; returns which, for the log.

    Why idle rather than nice: a step's OpenMP threads wait for each other, so a nice +10 thread that takes a
    core from one of them for a moment holds up the whole step: at nice +10 the prefault slowed the prefill steps
    of an offline run it overlapped by about 20% (docs/benchmarks-history.md, "2026-12-02 Zen 4 (c3bc8e1)")."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return "SCHED_IDLE"
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + PREFAULT_NICENESS)
        return f"nice +{PREFAULT_NICENESS}"
    except (AttributeError, OSError):
        return "normal priority"
