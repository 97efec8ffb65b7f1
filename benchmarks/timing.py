"""Wall-clock timing and result files shared by the micro-benchmark scripts in this folder (run as
``python benchmarks/X.py``)."""

from __future__ import annotations

import json
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


def write_json(path: str | None, result: dict) -> None:
    """Write ``result`` to ``path`` as indented JSON with a final newline (nothing when ``path`` is ``None``)."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
