"""Where an engine core's time went, from its step log (``TOKENMILL_STEP_LOG``, see ``tokenmill.engine.step_log``).

Usage:

    TOKENMILL_STEP_LOG=/tmp/steps tokenmill bench throughput ...   # or tokenmill serve ...
    python benchmarks/step_log.py /tmp/steps.<pid> [--since START] [--until END]

Prints the span of the logged steps, the time in steps that prefilled (prompt tokens, ms per token) and, for
decode-only steps, the count, median and total per batch size (in bands of 32 requests). ``--since`` /
``--until`` (``time.monotonic()`` seconds, as in the log) cut one run out of a longer log. With no bounds the
log is cut after its last gap of more than 2 s (a warm-up run before the timed one).
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log")
    p.add_argument("--since", type=float, default=None)
    p.add_argument("--until", type=float, default=None)
    args = p.parse_args()
    rows = [tuple(float(x) for x in line.split()) for line in open(args.log, encoding="utf-8") if line.strip()]
    if args.since is None and args.until is None:
        gaps = [i for i in range(1, len(rows)) if rows[i][0] - (rows[i - 1][0] + rows[i - 1][1] / 1000) > 2.0]
        rows = rows[gaps[-1]:] if gaps else rows
    rows = [r for r in rows if (args.since is None or r[0] >= args.since) and (args.until is None or r[0] < args.until)]
    if not rows:
        raise SystemExit("no steps in that window")
    span = rows[-1][0] + rows[-1][1] / 1000 - rows[0][0]
    busy = sum(r[1] for r in rows) / 1000
    prefill = [r for r in rows if r[4] > 0]
    tokens = sum(r[2] - (r[3] - r[4]) for r in prefill)  # prompt tokens: all but one per decoding request
    t = sum(r[1] for r in prefill) / 1000
    print(f"{len(rows)} steps over {span:.1f} s, {busy:.1f} s in steps")
    if prefill:
        print(f"steps with prefill: {len(prefill)}, {t:.1f} s, {tokens:.0f} prompt tokens ({1000 * t / tokens:.2f} ms per token)")
    bands: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        if r[4] == 0:
            bands[int(r[3] - 1) // 32].append(r[1])
    for band in sorted(bands):
        v = bands[band]
        print(f"decode steps of {32 * band + 1}-{32 * band + 32} requests: {len(v)}, median {statistics.median(v):.1f} ms, "
              f"total {sum(v) / 1000:.1f} s")


if __name__ == "__main__":
    main()
