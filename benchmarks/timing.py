"""Wall-clock timing shared by the micro-benchmark scripts in this folder (run as ``python benchmarks/X.py``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median milliseconds of ``iters`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3
