"""Plot a ``tokenmill bench sweep`` JSON: throughput against batch size, step time against running requests.

Usage::

    python benchmarks/plot.py benchmarks/results/<date>_<machine>_sweep.json [--out-dir benchmarks/results] [--prefix <date>_<machine>_sweep]

Writes ``<prefix>_throughput_vs_batch.png`` (output tokens/s against batch size) and
``<prefix>_step_time_vs_running.png`` (mean decode step time in milliseconds against the number of running
requests; the whole ``LLMEngine.step()`` and the engine core alone). Needs matplotlib
(``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any


def _title(record: dict[str, Any]) -> str:
    machine = record.get("machine", {})
    return (f"{record.get('model')} ({record.get('dtype')}), I={record.get('input_len')} O={record.get('output_len')}"
            f"\n{machine.get('cpu_model', '?')}, {machine.get('torch_threads', '?')} threads")


def plot(record: dict[str, Any], out_dir: str, prefix: str = "sweep") -> list[str]:
    """Write the two PNGs for a sweep record; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = sorted(record["sweep"], key=lambda p: p["batch_size"])
    batch = [p["batch_size"] for p in points]
    os.makedirs(out_dir, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(batch, [p["output_tokens_per_s"] for p in points], marker="o", label="tokenmill")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batch, [str(b) for b in batch])
    ax.set_xlabel("batch size (requests submitted at once)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(_title(record), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(out_dir, f"{prefix}_throughput_vs_batch.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    timed = [p for p in points if p.get("mean_step_s") is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    running = [p["batch_size"] for p in timed]
    ax.plot(running, [p["mean_step_s"] * 1000 for p in timed], marker="o", label="LLMEngine.step() (whole step)")
    core = [p for p in timed if p.get("mean_core_step_s") is not None]
    if core:
        ax.plot([p["batch_size"] for p in core], [p["mean_core_step_s"] * 1000 for p in core], marker="s",
                linestyle="--", label="engine core only")
    ax.set_xscale("log", base=2)
    ax.set_xticks(running, [str(b) for b in running])
    ax.set_xlabel("running requests (all decoding)")
    ax.set_ylabel("mean decode step time (ms)")
    ax.set_title(_title(record), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(out_dir, f"{prefix}_step_time_vs_running.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sweep_json", help="JSON written by tokenmill bench sweep --json FILE")
    parser.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                        help="Folder for the PNGs (default benchmarks/results).")
    parser.add_argument("--prefix", default="sweep", help="File name prefix of the PNGs (default sweep).")
    args = parser.parse_args(argv)
    with open(args.sweep_json, encoding="utf-8") as f:
        record = json.load(f)
    if record.get("benchmark") != "sweep" or "sweep" not in record:
        print(f"{args.sweep_json}: not a tokenmill bench sweep result", file=sys.stderr)
        return 2
    for path in plot(record, args.out_dir, args.prefix):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
